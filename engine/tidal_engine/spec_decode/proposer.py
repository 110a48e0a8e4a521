"""The proposer interface: anything that guesses the next tokens of a batch of sequences.

The verifier (one target forward over ``1 + len(drafts)`` positions per row, then
``rejection_sample``) only sees draft ids and, for proposers that sample, their
distributions; n-gram lookup, a draft model, EAGLE or MTP heads all plug in here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np


class Proposer(Protocol):
    num_speculative_tokens: int

    def propose(self, token_ids: Sequence[np.ndarray], max_drafts: Sequence[int]) -> list[np.ndarray]:
        """Drafts for each sequence (prompt + output so far, int64), at most ``max_drafts[i]``
        tokens (and at most ``num_speculative_tokens``); an empty array for no guess.
        Deterministic proposers have a one-hot draft distribution (the verifier's default)."""
        ...
