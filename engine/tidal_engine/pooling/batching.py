"""Which waiting pooling requests form the next step (a pure function)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class _Sized(Protocol):
    @property
    def num_tokens(self) -> int: ...


def take_batch(waiting: Sequence[_Sized], max_tokens: int, max_seqs: int) -> int:
    """How many requests from the front of ``waiting`` fit one step: first come, first served,
    within the token and sequence budgets. A request longer than the token budget runs
    alone (prompts are never chunked: an encoder must see the whole text at once)."""
    count, tokens = 0, 0
    for item in waiting:
        if count == max_seqs or (count and tokens + item.num_tokens > max_tokens):
            break
        count += 1
        tokens += item.num_tokens
    return count
