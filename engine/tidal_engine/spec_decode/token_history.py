"""A request's tokens as a growing int64 array, for the proposer.

Proposers read each row's whole sequence (prompt + output so far) every step. Converting the
request's token list to numpy each time costs O(length) a row a step; this mirror copies only
the tokens appended since the last read into a buffer that doubles when full, so a read is
O(new tokens) and returns a view (valid until the next read).
"""

from __future__ import annotations

import numpy as np


class TokenHistory:
    def __init__(self, capacity: int = 256) -> None:
        self._buf = np.empty(max(1, capacity), dtype=np.int64)
        self._len = 0

    def view(self, tokens: list[int]) -> np.ndarray:
        """``tokens`` as an int64 array. ``tokens`` only grows between calls (the array keeps
        what it copied before; ``replace`` corrects a token replaced in place)."""
        n = len(tokens)
        synced = self._len
        if n < synced:
            raise ValueError(f"the token list shrank from {synced} to {n}")
        if n > synced:
            if n > self._buf.shape[0]:
                grown = np.empty(max(n, 2 * self._buf.shape[0]), dtype=np.int64)
                grown[:synced] = self._buf[:synced]
                self._buf = grown
            self._buf[synced:n] = tokens[synced:n]
            self._len = n
        return self._buf[:n]

    def replace(self, index: int, token_id: int) -> None:
        """Token ``index`` of the list was replaced (a placeholder filled): mirror it if copied."""
        if index < self._len:
            self._buf[index] = token_id
