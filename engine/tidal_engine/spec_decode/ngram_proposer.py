"""Prompt-lookup (n-gram) proposer: find the sequence's last n tokens earlier in its prompt or
output, and propose the tokens that followed them there.

Vectorised across the batch with numpy: the sequences sit in one padded [B, L] array, and for
each n (longest first) one pass of column comparisons finds every row's matches at once.
A row takes the longest n that matches, and among those the latest occurrence (on copy tasks
the most recent context is the best guess).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_PAD = -1  # never a token id


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int = 1, prompt_lookup_max: int = 1) -> None:
        if num_speculative_tokens < 1 or prompt_lookup_min < 1 or prompt_lookup_max < prompt_lookup_min:
            raise ValueError("need k >= 1 and 1 <= prompt_lookup_min <= prompt_lookup_max")
        self.num_speculative_tokens = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def release(self, request_id: str) -> None:
        """Stateless: nothing to drop."""

    def propose(self, token_ids: Sequence[np.ndarray], max_drafts: Sequence[int] | None = None,
                request_ids: Sequence[str] | None = None) -> list[np.ndarray]:
        batch = len(token_ids)
        if batch == 0:
            return []
        lens = np.fromiter((len(t) for t in token_ids), dtype=np.int64, count=batch)
        width = int(lens.max())
        tokens = np.full((batch, width + self.num_speculative_tokens), _PAD, dtype=np.int64)
        for i, t in enumerate(token_ids):
            tokens[i, : lens[i]] = t
        start = np.full(batch, -1, dtype=np.int64)  # where each row's draft begins; -1: none yet
        rows = np.arange(batch)
        for n in range(self.max_n, self.min_n - 1, -1):
            todo = (start < 0) & (lens > n)  # the n-gram must occur before the suffix itself
            if not todo.any() or width - n < 1:
                continue
            windows = width - n  # candidate starts 0 .. width-n-1 (followed by >= 1 token)
            match = np.ones((batch, windows), dtype=bool)
            for j in range(n):
                suffix_j = tokens[rows, np.maximum(lens - n + j, 0)]
                match &= tokens[:, j : j + windows] == suffix_j[:, None]
            # Only starts whose n-gram ends before the row's last token (so something follows it).
            match &= np.arange(windows)[None, :] < (lens - n)[:, None]
            match &= todo[:, None]
            found = match.any(axis=1)
            latest = windows - 1 - np.argmax(match[:, ::-1], axis=1)
            start = np.where(found, latest + n, start)
        k = self.num_speculative_tokens
        caps = np.full(batch, k) if max_drafts is None else np.minimum(np.asarray(max_drafts, dtype=np.int64), k)
        out: list[np.ndarray] = []
        for i in range(batch):
            if start[i] < 0 or caps[i] <= 0:
                out.append(np.zeros(0, dtype=np.int64))
                continue
            end = min(int(start[i]) + int(caps[i]), int(lens[i]))
            out.append(tokens[i, start[i] : end].copy())
        return out
