"""The device n-gram proposer gives the host NgramProposer's drafts (async speculation's drafts)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tidal_engine.spec_decode import NgramProposer
from tidal_engine.spec_decode.device_ngram import propose_ngram


@pytest.mark.parametrize("min_n,max_n", [(1, 1), (1, 3), (2, 4)])
def test_device_ngram_equals_the_host_proposer(min_n: int, max_n: int) -> None:
    rng = np.random.default_rng(min_n * 10 + max_n)
    k = 4
    host = NgramProposer(k, min_n, max_n)
    rows = []
    for _ in range(40):  # small vocabularies repeat, so matches of every length occur
        length = int(rng.integers(1, 30))
        rows.append(rng.integers(0, int(rng.integers(2, 6)), length).astype(np.int64))
    caps = rng.integers(0, k + 2, len(rows))
    want = host.propose(rows, caps.tolist())
    width = max(len(r) for r in rows) + 3
    tokens = torch.full((len(rows), width), 7, dtype=torch.int64)  # junk past each row's end
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = torch.from_numpy(r)
    lens = torch.tensor([len(r) for r in rows])
    drafts, num = propose_ngram(tokens, lens, k, min_n, max_n, torch.from_numpy(caps))
    got = [drafts[i, : int(num[i])].tolist() for i in range(len(rows))]
    assert got == [w.tolist() for w in want]
    assert any(len(w) for w in want) and any(not len(w) for w in want)
