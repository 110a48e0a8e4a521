"""Per-request token rules enforced through the grammar-bitmask path: vLLM's
``allowed_token_ids`` (only these may be sampled) and ``bad_words`` (a word's last token is
banned right after the output ends with the rest of it; one-token words always).

`TokenRules` has GrammarMatcher's interface (``bitmask_bytes``, ``accept_token``,
``is_terminated``), so the core, the workers and the sampler treat it like a grammar; with a
real grammar as well, `CombinedMatcher` allows only what both allow.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np


class TokenMatcher(Protocol):
    def bitmask_bytes(self) -> bytes: ...
    def accept_token(self, token_id: int) -> bool: ...
    def is_terminated(self) -> bool: ...


def _words(vocab_size: int) -> int:
    return -(-vocab_size // 32)


def _set_bits(mask: np.ndarray, token_ids: Sequence[int], value: bool) -> None:
    bits = mask.view(np.uint32)
    for token in token_ids:
        word, bit = divmod(int(token), 32)
        if word < len(bits):
            if value:
                bits[word] |= np.uint32(1 << bit)
            else:
                bits[word] &= np.uint32(~(1 << bit) & 0xFFFFFFFF)


def bad_word_token_ids(tokenizer: Any, words: Sequence[str]) -> list[list[int]]:
    """Each word's token ids, alone and after a space (how it appears mid-sentence), as vLLM does."""
    sequences: list[list[int]] = []
    for word in words:
        for text in (word, " " + word):
            ids = list(tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in sequences:
                sequences.append(ids)
    return sequences


class TokenRules:
    def __init__(
        self,
        vocab_size: int,
        allowed_token_ids: Sequence[int] | None = None,
        bad_words: Sequence[Sequence[int]] = (),
        min_tokens: int = 0,
        min_tokens_banned: Sequence[int] = (),
    ) -> None:
        words = _words(vocab_size)
        if allowed_token_ids is None:
            self.base = np.full(words, -1, dtype=np.int32)
            if vocab_size % 32:  # bits past the vocabulary stay clear, as xgrammar leaves them
                self.base.view(np.uint32)[-1] = np.uint32((1 << (vocab_size % 32)) - 1)
        else:
            self.base = np.zeros(words, dtype=np.int32)
            _set_bits(self.base, allowed_token_ids, True)
        self.sequences = [list(s) for s in bad_words if len(s) > 1]
        _set_bits(self.base, [s[0] for s in bad_words if len(s) == 1], False)
        self.min_tokens = min_tokens
        self.min_tokens_banned = list(min_tokens_banned)
        self.output: list[int] = []

    def banned_now(self) -> list[int]:
        """Tokens banned for the next position by the output so far."""
        banned = [s[-1] for s in self.sequences
                  if len(self.output) >= len(s) - 1 and self.output[len(self.output) - len(s) + 1:] == s[:-1]]
        if len(self.output) < self.min_tokens:
            banned += self.min_tokens_banned
        return banned

    def bitmask(self) -> np.ndarray:
        mask = self.base.copy()
        _set_bits(mask, self.banned_now(), False)
        return mask

    def bitmask_bytes(self) -> bytes:
        return self.bitmask().tobytes()

    def accept_token(self, token_id: int) -> bool:
        allowed = bool(self.bitmask().view(np.uint32)[token_id // 32] >> np.uint32(token_id % 32) & 1) \
            if token_id // 32 < len(self.base) else True
        self.output.append(token_id)
        return allowed

    def is_terminated(self) -> bool:
        return False  # rules never end an answer; EOS and the limits do


class CombinedMatcher:
    """A grammar and token rules: a token must pass both."""

    def __init__(self, grammar: TokenMatcher, rules: TokenRules) -> None:
        self.grammar = grammar
        self.rules = rules

    def bitmask_bytes(self) -> bytes:
        grammar = np.frombuffer(self.grammar.bitmask_bytes(), dtype=np.int32)
        rules = self.rules.bitmask()
        width = max(len(grammar), len(rules))
        both = np.full(width, -1, dtype=np.int32)  # words past either mask stay allowed by it
        both[: len(grammar)] &= grammar
        both[: len(rules)] &= rules
        return both.tobytes()

    def accept_token(self, token_id: int) -> bool:
        allowed = self.rules.accept_token(token_id)
        return self.grammar.accept_token(token_id) and allowed

    def is_terminated(self) -> bool:
        return self.grammar.is_terminated()
