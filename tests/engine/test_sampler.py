"""Sampler: penalties, min_tokens, greedy/top-k/top-p/min-p, seeded reproducibility, logprobs, statistics."""

from __future__ import annotations

import math

import pytest
import torch

from tidal_engine.runner.sampler import (
    Sampler,
    SamplingRow,
    _apply_penalties,
    make_generator,
)
from tidal_engine.sampling_params import SamplingParams


def row(
    params: SamplingParams,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    eos: set[int] | None = None,
) -> SamplingRow:
    generator = make_generator(params.seed, "cpu") if params.seed is not None else None
    return SamplingRow(
        params=params,
        prompt_token_ids=prompt or [],
        output_token_ids=output or [],
        generator=generator,
        eos_token_ids=eos or set(),
    )


def logits_from_probs(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float32).log()


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_greedy_is_argmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 300)
    out = Sampler()(logits, [row(SamplingParams(temperature=0.0)) for _ in range(6)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 6
    # Without logprobs nothing is computed for them (cumulative_logprob stays None, as in vLLM V1).
    assert out.sampled_logprob == [None] * 6
    with_lp = Sampler()(logits, [row(SamplingParams(temperature=0.0, logprobs=0)) for _ in range(6)])
    assert with_lp.token_ids == out.token_ids
    expected = torch.log_softmax(logits, -1).gather(1, logits.argmax(-1, keepdim=True)).squeeze(1)
    assert with_lp.sampled_logprob == pytest.approx(expected.tolist())


def test_logits_not_modified() -> None:
    torch.manual_seed(1)
    logits = torch.randn(2, 50)
    before = logits.clone()
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1, repetition_penalty=1.3,
                            frequency_penalty=0.5, presence_penalty=0.5, min_tokens=2)
    Sampler()(logits, [row(params, [1, 2], [3], eos={4}), row(SamplingParams(temperature=0.0), [5], [])])
    assert torch.equal(logits, before)


def test_top_k_one_is_greedy() -> None:
    torch.manual_seed(2)
    logits = torch.randn(5, 400)
    out = Sampler()(logits, [row(SamplingParams(temperature=1.3, top_k=1)) for _ in range(5)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_tiny_top_p_is_argmax() -> None:
    torch.manual_seed(3)
    logits = torch.randn(5, 400)
    out = Sampler()(logits, [row(SamplingParams(temperature=1.0, top_p=1e-6)) for _ in range(5)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_top_k_and_top_p_restrict_support() -> None:
    probs = [0.5, 0.3, 0.15, 0.05]
    logits = logits_from_probs(probs).repeat(2000, 1)
    sampler = Sampler(generator=make_generator(11, "cpu"))
    # top_p=0.75: the mass before token 2 is 0.8 >= 0.75, so only tokens 0 and 1 remain.
    out = sampler(logits, [row(SamplingParams(top_p=0.75)) for _ in range(2000)])
    assert set(out.token_ids) == {0, 1}
    out = sampler(logits, [row(SamplingParams(top_k=3)) for _ in range(2000)])
    assert set(out.token_ids) == {0, 1, 2}


def test_min_p() -> None:
    probs = [0.5, 0.3, 0.15, 0.05]
    logits = logits_from_probs(probs).repeat(2000, 1)
    sampler = Sampler(generator=make_generator(5, "cpu"))
    # Threshold 0.5 * 0.5 = 0.25: tokens 2 and 3 are cut.
    out = sampler(logits, [row(SamplingParams(min_p=0.5)) for _ in range(2000)])
    assert set(out.token_ids) == {0, 1}
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=2).float()
    # Renormalised 0.5:0.3 -> 0.625:0.375; chi-square with 1 dof, 99.9% quantile 10.83.
    assert chi_square(counts, torch.tensor([0.625, 0.375])) < 10.83


def test_seeded_reproducible_across_batches() -> None:
    torch.manual_seed(4)
    vocab = 1000
    target = torch.randn(vocab)
    others = torch.randn(3, vocab)
    sampler = Sampler()

    def run(batch_kind: str) -> list[int]:
        seeded = row(SamplingParams(temperature=1.0, seed=1234, top_p=0.95))
        tokens = []
        for step in range(12):
            if batch_kind == "alone":
                logits, rows, pos = target.unsqueeze(0), [seeded], 0
            else:
                # Other rows around it: unseeded, another seed, greedy.
                companions = [
                    row(SamplingParams(temperature=0.8)),
                    row(SamplingParams(temperature=1.0, seed=step)),
                    row(SamplingParams(temperature=0.0)),
                ]
                logits = torch.cat([others[:2], target.unsqueeze(0), others[2:]])
                rows, pos = companions[:2] + [seeded] + companions[2:], 2
            tokens.append(sampler(logits, rows).token_ids[pos])
        return tokens

    alone = run("alone")
    assert run("mixed") == alone
    assert len(set(alone)) > 1  # it really sampled


def test_different_seeds_differ() -> None:
    torch.manual_seed(5)
    logits = torch.randn(1, 1000)
    sampler = Sampler()

    def draws(seed: int) -> list[int]:
        r = row(SamplingParams(temperature=1.0, seed=seed))
        return [sampler(logits, [r]).token_ids[0] for _ in range(10)]

    assert draws(1) == draws(1)
    assert draws(1) != draws(2)


def test_penalties_match_hand_computation() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 1.0]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    r = row(params, prompt=[0], output=[1, 2, 2])
    _apply_penalties(logits, [r])
    # repetition on {0, 1, 2}: 2/2=1, -1*2=-2, 0.5/2=0.25.
    # frequency/presence on output only: token 1 (count 1): -2-0.5-0.25; token 2 (count 2): 0.25-1-0.25.
    expected = torch.tensor([[1.0, -2.75, -1.0, -0.5, 1.0]])
    assert torch.allclose(logits, expected)


def test_penalties_affect_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    plain = Sampler()(logits, [row(SamplingParams(temperature=0.0), output=[0])])
    assert plain.token_ids == [0]
    for params in (
        SamplingParams(temperature=0.0, repetition_penalty=1.2),
        SamplingParams(temperature=0.0, frequency_penalty=0.2),
        SamplingParams(temperature=0.0, presence_penalty=0.2),
    ):
        assert Sampler()(logits, [row(params, output=[0])]).token_ids == [1]
    # Repetition also counts the prompt; frequency/presence do not.
    assert Sampler()(logits, [row(SamplingParams(temperature=0.0, repetition_penalty=1.2), prompt=[0])]).token_ids == [1]
    assert Sampler()(logits, [row(SamplingParams(temperature=0.0, presence_penalty=0.2), prompt=[0])]).token_ids == [0]


def test_min_tokens_blocks_eos_and_stop_ids() -> None:
    logits = torch.tensor([[0.0, 0.0, 10.0, 9.0, 1.0]])
    eos = {2}
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[3])
    sampler = Sampler()
    assert sampler(logits, [row(params, output=[0, 0], eos=eos)]).token_ids == [4]
    assert sampler(logits, [row(params, output=[0, 0, 0], eos=eos)]).token_ids == [2]
    # ignore_eos: EOS does not end the request, so it is not held back (vLLM semantics); stop ids are.
    ignore = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[3], ignore_eos=True)
    assert sampler(logits, [row(ignore, output=[], eos=eos)]).token_ids == [2]
    # Random sampling respects it too.
    random_rows = [row(SamplingParams(min_tokens=1, stop_token_ids=[3]), eos=eos) for _ in range(200)]
    out = sampler(logits.repeat(200, 1), random_rows)
    assert not set(out.token_ids) & {2, 3}


def test_logprobs_from_raw_logits() -> None:
    torch.manual_seed(6)
    logits = torch.randn(2, 64)
    raw_lp = torch.log_softmax(logits, -1)
    order = raw_lp[0].argsort(descending=True).tolist()
    # Masking the best token as EOS under min_tokens forces the second best: rank 2.
    params = SamplingParams(temperature=0.0, logprobs=3, min_tokens=1, repetition_penalty=1.5)
    rows = [row(params, prompt=[order[5]], eos={order[0]}), row(SamplingParams(temperature=0.0, logprobs=0))]
    out = Sampler()(logits, rows)
    lp0 = out.logprobs[0]
    assert lp0 is not None
    sampled = out.token_ids[0]
    assert sampled == order[1]
    assert list(lp0)[0] == sampled  # sampled token first
    assert set(lp0) == set(order[:3])
    for rank, token in enumerate(order[:3], start=1):
        assert lp0[token].rank == rank
        assert lp0[token].logprob == pytest.approx(raw_lp[0, token].item(), abs=1e-6)
    assert out.sampled_logprob[0] == pytest.approx(raw_lp[0, sampled].item(), abs=1e-6)
    # logprobs=0: only the sampled token.
    lp1 = out.logprobs[1]
    assert lp1 is not None and list(lp1) == [out.token_ids[1]]
    assert lp1[out.token_ids[1]].rank == 1


def test_logprobs_rank_of_unlikely_sample() -> None:
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    logits = probs.log().unsqueeze(0)
    # Only token 3 allowed through min_tokens masking of the others as stop ids.
    params = SamplingParams(temperature=1.0, logprobs=2, min_tokens=1, stop_token_ids=[0, 1, 2])
    out = Sampler()(logits, [row(params)])
    assert out.token_ids == [3]
    lp = out.logprobs[0]
    assert lp is not None
    assert lp[3].rank == 4
    assert lp[3].logprob == pytest.approx(math.log(0.1), abs=1e-6)
    assert lp[0].rank == 1 and lp[1].rank == 2 and 2 not in lp


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_temperature_sampling_follows_distribution(temperature: float) -> None:
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    draws = 2000
    sampler = Sampler(generator=make_generator(2024, "cpu"))
    out = sampler(base.repeat(draws, 1), [row(SamplingParams(temperature=temperature)) for _ in range(draws)])
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=5).float()
    expected = torch.softmax(base / temperature, -1)
    # 4 dof; 99.9% quantile of chi-square is 18.47. Deterministic by seed.
    assert chi_square(counts, expected) < 18.47


def test_seeded_rows_follow_distribution() -> None:
    base = torch.tensor([1.0, 0.0, -0.5, 0.5])
    expected = torch.softmax(base, -1)
    r = row(SamplingParams(temperature=1.0, seed=99))
    sampler = Sampler()
    tokens = [sampler(base.unsqueeze(0), [r]).token_ids[0] for _ in range(2000)]
    counts = torch.bincount(torch.tensor(tokens), minlength=4).float()
    assert chi_square(counts, expected) < 16.27  # 3 dof, 99.9%


def test_empty_batch() -> None:
    out = Sampler()(torch.empty(0, 10), [])
    assert out.token_ids == [] and out.logprobs == [] and out.sampled_logprob == []
