"""The proposer interface: anything that guesses the next tokens of a batch of sequences.

The verifier (one target forward over ``1 + len(drafts)`` positions per row, then
``rejection_sample``) only sees draft ids and, for proposers that sample, their
distributions; n-gram lookup, a draft model, EAGLE or MTP heads all plug in here
(``build_proposer`` picks one from the config). A proposer whose drafts are made on the
device only (``device_only``: the draft model) gives the host draft slots to reserve instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from tidal_engine.spec_decode.config import DEVICE_DRAFT_SLOT, SpeculativeConfig


class Proposer(Protocol):
    num_speculative_tokens: int

    def propose(self, token_ids: Sequence[np.ndarray], max_drafts: Sequence[int],
                request_ids: Sequence[str]) -> list[np.ndarray]:
        """Drafts for each sequence (prompt + output so far, int64), at most ``max_drafts[i]``
        tokens (and at most ``num_speculative_tokens``); an empty array for no guess.
        Deterministic proposers have a one-hot draft distribution (the verifier's default).
        ``request_ids`` name the sequences, for proposers that keep state (a draft model's KV)."""
        ...

    def release(self, request_id: str) -> None:
        """The request ended (finished or aborted): drop any state kept for it."""
        ...


class DraftSlots:
    """The host side of a proposer whose drafts are all made on the device (the draft model, on
    the workers: spec_decode/draft_model.py): the engine core only reserves each row's draft
    slots, ``DEVICE_DRAFT_SLOT`` ids that the runner overwrites with the draft model's guesses
    before the step's target forward."""

    device_only = True

    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_speculative_tokens = num_speculative_tokens

    def propose(self, token_ids: Sequence[np.ndarray], max_drafts: Sequence[int],
                request_ids: Sequence[str]) -> list[np.ndarray]:
        return [np.full(min(int(cap), self.num_speculative_tokens), DEVICE_DRAFT_SLOT, dtype=np.int64)
                for cap in max_drafts]

    def release(self, request_id: str) -> None:
        pass


def build_proposer(spec: SpeculativeConfig, *, target_vocab_size: int, target_tokenizer: Any, max_model_len: int,
                   cache_dir: str | None = None) -> Proposer:
    """The engine core's proposer for a --speculative-config: the n-gram lookup, or a draft
    model's slots (the model is checked here, before the workers start, and loaded by them;
    ValueError on one that does not fit)."""
    if spec.method == "ngram":
        from tidal_engine.spec_decode.ngram_proposer import NgramProposer

        return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
    from tidal_engine.spec_decode.draft_model import check_draft_model

    assert spec.model is not None  # SpeculativeConfig.parse guarantees it
    check_draft_model(spec.model, target_vocab_size=target_vocab_size, target_tokenizer=target_tokenizer,
                      max_model_len=max_model_len, cache_dir=cache_dir)
    return DraftSlots(spec.num_speculative_tokens)
