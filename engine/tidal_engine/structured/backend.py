"""xgrammar backend: one compiler per engine (tokenizer info built once), a matcher per sample."""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch

from tidal_engine.structured.params import StructuredOutputsParams, xgrammar

if TYPE_CHECKING:
    import xgrammar as xgr


logger = logging.getLogger(__name__)


class GrammarCompilerCache:
    """Compiles constraints for one tokenizer and keeps the most recent ones (LRU by key)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], max_entries: int = 256) -> None:
        # The model's vocabulary may be wider than the tokenizer's (padded embeddings): the bitmask
        # must cover every logit, so the info is built with the model's size.
        self.tokenizer_info = xgrammar().TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids)
        )
        self.vocab_size = vocab_size
        self._compiler = xgrammar().GrammarCompiler(self.tokenizer_info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[tuple[str, str], xgr.CompiledGrammar] = OrderedDict()
        self._max_entries = max_entries

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        key = params.cache_key()
        compiled = self._cache.get(key)
        if compiled is not None:
            self._cache.move_to_end(key)
            return compiled
        try:
            compiled = self._compiler.compile_grammar(params.parsed_grammar)
        except RuntimeError as exc:  # params already parsed it, so this is rare
            raise ValueError(f"could not compile the {params.kind} constraint: {exc}") from None
        self._cache[key] = compiled
        if len(self._cache) > self._max_entries:
            self._cache.popitem(last=False)
        return compiled

    def __len__(self) -> int:
        return len(self._cache)


class GrammarMatcher:
    """One sample's position in its grammar."""

    def __init__(self, compiled: xgr.CompiledGrammar, vocab_size: int) -> None:
        self._matcher = xgrammar().GrammarMatcher(compiled)
        self.vocab_size = vocab_size

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32 words, bit set = allowed)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def bitmask_bytes(self) -> bytes:
        """The allowed next tokens as one packed int32 row (xgrammar's layout), for a worker."""
        bitmask = xgrammar().allocate_token_bitmask(1, self.vocab_size)
        self._matcher.fill_next_token_bitmask(bitmask, 0)
        return bitmask.numpy().tobytes()

    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar forbids it (the matcher is unchanged)."""
        return self._matcher.accept_token(token_id)

    def is_terminated(self) -> bool:
        """The grammar finished and a stop token (EOS) was accepted."""
        return self._matcher.is_terminated()


def apply_bitmasks(logits: torch.Tensor, matchers: list[tuple[int, GrammarMatcher]]) -> None:
    """Set the logits of disallowed tokens to -inf, in place, for the given (row, matcher) pairs."""
    num_rows, vocab = logits.shape
    bitmask = xgrammar().allocate_token_bitmask(num_rows, max(vocab, max(m.vocab_size for _, m in matchers)))
    for row, matcher in matchers:
        matcher.fill_bitmask(bitmask, row)
    indices = [row for row, _ in matchers]
    if logits.device.type == "cpu":
        xgrammar().apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=indices)
    else:
        apply_bitmask_torch(logits, bitmask, indices)


def apply_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor, indices: list[int]) -> None:
    """Plain-torch unpacking of a host bitmask on the logits' device: no kernel build, any backend."""
    vocab = logits.shape[1]
    idx = torch.tensor(indices, dtype=torch.long)
    words = bitmask[idx].to(logits.device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab]
    dev_idx = idx.to(logits.device)
    logits[dev_idx] = logits[dev_idx].masked_fill(~allowed, float("-inf"))
