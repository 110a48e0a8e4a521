"""Speculative decoding: the typed config, the proposer interface, proposers and the verifier's
rejection sampler (docs/speculative-decoding.md); the engine core proposes, runner/verify.py verifies."""

from tidal_engine.spec_decode.config import SpeculativeConfig
from tidal_engine.spec_decode.ngram_proposer import NgramProposer
from tidal_engine.spec_decode.proposer import Proposer
from tidal_engine.spec_decode.rejection_sampler import rejection_sample

__all__ = ["SpeculativeConfig", "NgramProposer", "Proposer", "rejection_sample"]
