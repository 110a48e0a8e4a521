"""One sequence as the scheduler sees it: token ids, progress and status. Pure Python.

A ``Request`` is one *sample*: the engine turns a vLLM request with ``n > 1`` into n of these.
Engine-side state (detokenizer, generator, logprobs) stays out of here; the engine keeps it in
its own dict keyed by ``request_id`` (``extra`` is a free slot for anything small).
"""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Any

from tidal_engine.core.block_pool import BlockHash, hash_block_tokens
from tidal_engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tidal_engine.pooling.params import PoolingParams


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()  # waiting again, to recompute its KV from scratch
    WAITING_FOR_REMOTE_KV = enum.auto()  # holds blocks while a KV connector loads into them
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset(
    {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED}
)

# Async scheduling appends this in place of a token still being sampled on the device; the
# engine fills in the real id before anything reads it on the host (no real id is negative).
PLACEHOLDER_TOKEN = -1


class Request:
    """Token ids plus scheduling progress.

    Invariant: tokens ``all_token_ids[:num_computed_tokens]`` have their KV in the cache; the
    next chunk covers ``all_token_ids[num_computed_tokens:]``. A chunk that reaches
    ``num_tokens`` produces one new token.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        lora_key: str | None = None,
        pooling_params: PoolingParams | None = None,
        token_type_ids: list[int] | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.sampling_params = sampling_params if sampling_params is not None else SamplingParams()
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.cache_salt = cache_salt
        self.lora_name = lora_name
        # The adapter in KV cache keys: name plus load generation (LoRAManager.cache_key); default the name.
        self.lora_key = lora_key if lora_key is not None else lora_name
        # Pooling: one prefill-only forward that yields a pooled vector, samples nothing and
        # keeps no KV (the scheduler gives it no blocks); BERT pairs carry their segment ids.
        self.pooling_params = pooling_params
        self.token_type_ids = token_type_ids
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.num_cached_tokens = -1  # prefix-cache hit (tokens) at the first schedule; -1 before
        self.num_preemptions = 0
        # Hashes of the full blocks of all_token_ids, extended lazily (see update_block_hashes).
        self.block_hashes: list[BlockHash] = []
        self.extra: dict[str, Any] = {}
        self.spec_token_ids: list[int] = []  # drafts to verify in the next step (speculative decoding)
        # Async scheduling with speculation: drafts of the step in flight, which the scheduler
        # advanced as if none were accepted; the next step's KV slots cover them all.
        self.num_lookahead_tokens = 0
        # prompt + outputs kept as one list so all_token_ids is O(1), not a fresh concatenation.
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        self._hash_block_size: int | None = None

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by outputs. The live list: read it, don't mutate it."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def skips_prefix_cache(self) -> bool:
        """prompt_logprobs need every prompt position computed: no cached prefix (as in vLLM)."""
        return self.sampling_params.prompt_logprobs is not None

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def is_pooling(self) -> bool:
        return self.pooling_params is not None

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)

    @property
    def has_placeholder(self) -> bool:
        """The last token is a placeholder for one still being sampled (async scheduling)."""
        return self._all_token_ids[-1] == PLACEHOLDER_TOKEN

    def fill_placeholder(self, token_id: int) -> None:
        """Put the sampled id where ``append_output_token(PLACEHOLDER_TOKEN)`` held its place."""
        if not self.has_placeholder:
            raise ValueError(f"request {self.request_id!r} has no placeholder token to fill")
        self.output_token_ids[-1] = token_id
        self._all_token_ids[-1] = token_id

    def update_block_hashes(self, block_size: int, num_tokens: int | None = None) -> list[BlockHash]:
        """Extend ``block_hashes`` to cover every full block of the first ``num_tokens``
        tokens (default: all) and return it.

        Tokens are append-only, so hashes already computed stay valid (also across
        preemption); each call hashes only blocks that became full since the last one. A
        placeholder token (async scheduling) is never hashed: callers bound ``num_tokens``
        by what is computed.
        """
        if self._hash_block_size is None:
            self._hash_block_size = block_size
        elif self._hash_block_size != block_size:
            raise ValueError(f"block size changed from {self._hash_block_size} to {block_size}")
        num_full_blocks = (self.num_tokens if num_tokens is None else min(num_tokens, self.num_tokens)) // block_size
        while len(self.block_hashes) < num_full_blocks:
            index = len(self.block_hashes)
            parent = self.block_hashes[-1] if index else None
            tokens = self._all_token_ids[index * block_size : (index + 1) * block_size]
            self.block_hashes.append(hash_block_tokens(parent, tokens, self._extra_keys(index)))
        return self.block_hashes

    def _extra_keys(self, block_index: int) -> tuple[str, ...]:
        # LoRA changes the KV of every block; the salt only needs to enter the first hash
        # because every later hash chains through it.
        keys: list[str] = []
        if self.lora_key is not None:
            keys.append(f"lora={self.lora_key}")
        if block_index == 0 and self.cache_salt is not None:
            keys.append(f"salt={self.cache_salt}")
        return tuple(keys)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
