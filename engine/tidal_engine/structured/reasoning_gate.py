"""Structured outputs after the reasoning: with a reasoning parser, a request's grammar (JSON
schema, tool_choice required or named, ...) starts once the model has written the end of its
reasoning (``</think>``), as vLLM does. Until then every token is allowed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tidal_engine.structured.token_rules import TokenMatcher


def reasoning_ended(token_ids: Sequence[int], end_ids: Sequence[int], start_ids: Sequence[int] = ()) -> bool:
    """Whether `token_ids` hold the end marker after the last start marker (e.g. a prompt whose
    template closed the reasoning already, as Qwen3's does with enable_thinking false)."""
    ids = list(token_ids)
    start = _last_index(ids, list(start_ids)) if start_ids else -1
    return _last_index(ids, list(end_ids)) > start


def _last_index(ids: list[int], marker: list[int]) -> int:
    for i in range(len(ids) - len(marker), -1, -1):
        if ids[i:i + len(marker)] == marker:
            return i
    return -1


class ReasoningGate:
    def __init__(self, grammar: TokenMatcher, end_ids: Sequence[int], vocab_size: int) -> None:
        self.grammar = grammar
        self.end_ids = list(end_ids)
        self.open = False
        self.recent: list[int] = []
        self._all = np.full(-(-vocab_size // 32), -1, dtype=np.int32).tobytes()

    def bitmask_bytes(self) -> bytes:
        return self.grammar.bitmask_bytes() if self.open else self._all

    def accept_token(self, token_id: int) -> bool:
        if self.open:
            return self.grammar.accept_token(token_id)
        self.recent = (self.recent + [token_id])[-len(self.end_ids):]
        self.open = self.recent == self.end_ids
        return True

    def is_terminated(self) -> bool:
        return self.open and self.grammar.is_terminated()
