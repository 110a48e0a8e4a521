"""The proposer interface: anything that guesses the next tokens of a batch of sequences.

The verifier (one target forward over ``1 + len(drafts)`` positions per row, then
``rejection_sample``) only sees draft ids and, for proposers that sample, their
distributions; n-gram lookup, a draft model, EAGLE or MTP heads all plug in here
(``build_proposer`` picks one from the config).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch

from tidal_engine.spec_decode.config import SpeculativeConfig


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


def build_proposer(spec: SpeculativeConfig, *, target_vocab_size: int, target_tokenizer: Any, dtype: torch.dtype,
                   device: torch.device, block_size: int, max_num_seqs: int, max_model_len: int,
                   cache_dir: str | None = None) -> Proposer:
    """The proposer a --speculative-config names (ValueError on a draft model that does not fit)."""
    if spec.method == "ngram":
        from tidal_engine.spec_decode.ngram_proposer import NgramProposer

        return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
    from tidal_engine.spec_decode.draft_model_proposer import DraftModelProposer

    assert spec.model is not None  # SpeculativeConfig.parse guarantees it
    return DraftModelProposer(spec.model, spec.num_speculative_tokens, target_vocab_size=target_vocab_size,
                              target_tokenizer=target_tokenizer, dtype=dtype, device=device, block_size=block_size,
                              max_num_seqs=max_num_seqs, max_model_len=max_model_len, cache_dir=cache_dir)
