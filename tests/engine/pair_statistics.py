"""Whether sampled (t1, t2) pairs follow a model's exact top-k joint distribution: the check
the speculative-decoding tests share (t2 comes from a verify step, so the pairs show whether
rejection sampling keeps the target's distribution)."""

from __future__ import annotations

from typing import Any

import torch


def chi_square_critical_999(df: int) -> float:
    """The chi-square critical value at p = 0.001 (Wilson-Hilferty; within 1% for df >= 3)."""
    h = 2 / (9 * df)
    return df * (1 - h + 3.090 * h ** 0.5) ** 3


def top_k_distribution(hf_model: Any, ids: list[int], top_k: int) -> torch.Tensor:
    """The next-token distribution of top-k sampling at temperature 1 after ``ids``."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0, -1]
    top = logits.topk(top_k)
    return torch.zeros_like(logits).index_put_((top.indices,), top.values.softmax(0))


def expected_pairs(hf_model: Any, prompt: list[int], top_k: int, samples: int) -> dict[tuple[int, int], float]:
    """Expected count of each (t1, t2) among ``samples`` draws."""
    p1 = top_k_distribution(hf_model, prompt, top_k)
    return {(a, b): samples * float(p1[a]) * float(pb)
            for a in p1.nonzero().flatten().tolist()
            for b, pb in enumerate(top_k_distribution(hf_model, prompt + [a], top_k)) if pb > 0}


def assert_pairs_follow(outputs: list[Any], expected: dict[tuple[int, int], float], samples: int) -> None:
    """The outputs' first two tokens: nothing outside the support, and a chi-square test at
    p = 0.001 (cells expecting fewer than 5 are pooled into one)."""
    counts: dict[tuple[int, int], int] = {}
    for o in outputs:
        pair = tuple(o.outputs[0].token_ids[:2])
        counts[pair] = counts.get(pair, 0) + 1
    assert set(counts) <= set(expected)
    big = [c for c, e in expected.items() if e >= 5]
    observed = [counts.get(c, 0) for c in big] + [samples - sum(counts.get(c, 0) for c in big)]
    wanted = [expected[c] for c in big] + [samples - sum(expected[c] for c in big)]
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, wanted) if e > 0)
    assert stat < chi_square_critical_999(len(big)), (stat, len(big))
