"""The per-step plan: what the engine core tells the workers, serializable (msgspec).

Workers never see live scheduler objects. A request reaches them once, as ``NewRequest``
(its prompt, sampling options and blocks); after that each step carries only diffs:
which requests run, how many tokens each computes from where, the blocks appended since
the last step, and which requests are gone. Workers keep each request's token history
themselves (prompt plus the tokens they sampled), so the core never sends tokens back;
the one exception is pipeline parallelism, where the stages before the last, which do not
sample, get each request's new ids with its next scheduled chunk (``new_token_ids``).
"""

from __future__ import annotations

import msgspec

from tidal_engine.kv_transfer.base import KVTransferPlan, KVTransferReport


class SamplingOptions(msgspec.Struct, frozen=True):
    """What a worker's sampler needs of one request's ``SamplingParams``."""

    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None  # None: the engine's shared generator
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    # Tokens masked while fewer than min_tokens were sampled (EOS unless ignore_eos, plus stop_token_ids).
    min_tokens_banned: tuple[int, ...] = ()
    logprobs: int | None = None  # top alternatives besides the sampled token; None: no logprobs
    has_grammar: bool = False  # the core sends this request's bitmask in every step that samples it
    # Top alternatives at each prompt position (vLLM's prompt_logprobs); None: none asked.
    prompt_logprobs: int | None = None


class NewRequest(msgspec.Struct, frozen=True):
    req_id: str
    prompt_token_ids: list[int]
    sampling: SamplingOptions
    block_ids: list[int]
    num_computed_tokens: int  # prefix-cache hits: the first chunk starts here
    lora_name: str | None = None
    # Tokens sampled before the worker first saw the request (none today; kept for resumes).
    output_token_ids: list[int] = []


class ScheduledRequest(msgspec.Struct, frozen=True, array_like=True):
    """One request's share of a step. Tokens ``history[num_computed_tokens : +num_new_tokens]``
    are computed; the worker samples after it when ``samples`` (the chunk reaches the end
    of the request's known tokens). Async scheduling: the chunk may end one token past the
    worker's history (normally one token at position ``len(history)``); that last token is
    the one the request sampled last, not yet taken into the history, and the worker feeds
    it on the device. Any other chunk past the history is an error."""

    req_id: str
    num_computed_tokens: int
    num_new_tokens: int
    new_block_ids: list[int]  # appended to the request's block table
    samples: bool
    # True after a preemption: ``new_block_ids`` replace the table, computation restarts.
    resumed: bool = False
    # Speculative decoding: the chunk's last len(draft_token_ids) tokens are these drafts (not in
    # the history); the worker verifies them and returns 1..len+1 tokens.
    draft_token_ids: list[int] = []
    # Pipeline parallelism: the tokens the request sampled since the core last scheduled it.
    # Only the last stage samples; the stages before it learn the ids here, from the core,
    # so no stage waits for another's sampling (several micro-batches in flight). The last
    # stage, which recorded them itself, ignores them.
    new_token_ids: list[int] = []


class StepPlan(msgspec.Struct, frozen=True):
    step_id: int
    new_requests: list[NewRequest]  # first appearance; each is also in ``scheduled``
    scheduled: list[ScheduledRequest]  # batch order
    finished_req_ids: list[str]  # forget these (finished, aborted); sent once
    # Structured outputs: req_id → packed int32 bitmask words (xgrammar layout) for this step.
    grammar_bitmasks: dict[str, bytes] = {}
    # KV connector loads and saves to start before this step's forward (kv_transfer/).
    kv_transfer: KVTransferPlan | None = None


class SampledLogprobs(msgspec.Struct, frozen=True, array_like=True):
    """One position's logprobs: the sampled token's, its rank (1 = most likely), then the top-k."""

    sampled_logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


class StepResult(msgspec.Struct, frozen=True):
    """A step's sampled tokens (one per sampling request, in ``scheduled`` order)."""

    step_id: int
    req_ids: list[str]
    token_ids: list[int]
    logprobs: list[SampledLogprobs | None] = []  # parallel to token_ids when any row asked; else empty
    # Steps that verified drafts: each request's emitted tokens (token_ids holds the last of each).
    token_lists: list[list[int]] = []
    kv_transfer: KVTransferReport | None = None  # KV connector transfers finished since the last result
    # prompt_logprobs: each asking request's prompt positions this step computed, in order.
    prompt_logprobs: dict[str, list[SampledLogprobs]] = {}
