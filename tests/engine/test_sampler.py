"""Sampler with per-request device state: exact filters (against a sort-based reference),
chi-square goodness of fit (with a negative control), seeded determinism, greedy/random mixes,
penalties and min_tokens tracked on the device, logprobs, grammar bitmasks."""

from __future__ import annotations

import math
import random

import pytest
import torch

import tidal_engine.runner.sampler as sampler_module
from tidal_engine.executor.plan import SampledLogprobs, SamplingOptions
from tidal_engine.runner.sampler import Sampler, filtered_probs

O = SamplingOptions


# ---------------------------------------------------------------- references (plain torch, per row)


def reference_filtered(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float,
                       top_p_off_by: int = 0) -> torch.Tensor:
    """One row's sampling distribution: stable descending sort, top-k by position, top-p on the
    renormalised top-k distribution (smallest head reaching top_p), min-p against the max.
    ``top_p_off_by`` keeps that many more (or fewer) tokens than top-p should: a wrong filter."""
    vocab = logits.shape[0]
    x = logits.double() / temperature
    values, order = x.sort(descending=True, stable=True)
    keep = vocab if top_k <= 0 or top_k >= vocab else top_k
    values[keep:] = float("-inf")
    probs = values.softmax(-1)
    if top_p < 1.0:
        mass, n_keep = 0.0, 0
        for p in probs.tolist():
            if n_keep > 0 and mass >= top_p:
                break
            mass += p
            n_keep += 1
        n_keep = max(1, min(keep, n_keep + top_p_off_by))
        probs[n_keep:] = 0.0
        probs = probs / probs.sum()
    if min_p > 0.0:
        probs[probs < min_p * probs.max()] = 0.0
        probs = probs / probs.sum()
    out = torch.zeros(vocab, dtype=torch.float64)
    out[order] = probs
    return out


def reference_processed(logits: torch.Tensor, options: SamplingOptions, prompt: list[int], outputs: list[int],
                        grammar_row: bool = False) -> torch.Tensor:
    """One row's logits after penalties and min_tokens, from the token lists."""
    x = logits.double().clone()
    if options.repetition_penalty != 1.0:
        for t in set(prompt) | set(outputs):
            x[t] = x[t] / options.repetition_penalty if x[t] > 0 else x[t] * options.repetition_penalty
    for t in set(outputs):
        x[t] -= options.frequency_penalty * outputs.count(t) + options.presence_penalty
    if len(outputs) < options.min_tokens and not grammar_row:
        for t in options.min_tokens_banned:
            x[t] = float("-inf")
    return x


def chi_square_critical(df: int, z: float = 5.0) -> float:
    """Wilson–Hilferty upper quantile of chi-square(df) at normal z = 5 (p ≈ 3e-7): never flakes."""
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + z * math.sqrt(h)) ** 3


def fits(counts: torch.Tensor, probs: torch.Tensor) -> bool:
    """Chi-square goodness of fit: no draw outside the support, statistic below the critical value."""
    support = probs > 0
    if counts[~support].sum() > 0:
        return False
    expected = probs[support] * counts.sum()
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    return int(support.sum()) == 1 or stat < chi_square_critical(int(support.sum()) - 1)


def make(vocab: int, slots: int = 64, seed: int | None = 0) -> Sampler:
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return Sampler(vocab, slots, torch.device("cpu"), generator)


def random_options(rng: random.Random, vocab: int) -> tuple[float, int, float, float]:
    temperature = rng.choice([0.3, 0.7, 1.0, 1.5])
    top_k = rng.choice([0, -1, 1, 2, 5, 17, vocab, vocab + 3])
    top_p = rng.choice([1.0, 1.0, 0.05, 0.3, 0.62, 0.9, 0.99])
    min_p = rng.choice([0.0, 0.0, 0.01, 0.1, 0.5])
    return temperature, top_k, top_p, min_p


# ---------------------------------------------------------------- exact filters


@pytest.mark.parametrize("trial", range(4))
def test_filtered_probs_equal_sort_reference(trial: int) -> None:
    rng = random.Random(trial)
    vocab = 97
    torch.manual_seed(trial)
    n = 96
    logits = torch.randn(n, vocab) * rng.choice([0.5, 2.0, 5.0])
    opts = [random_options(rng, vocab) for _ in range(n)]
    if trial == 1:  # every row with top_k: the topk-only path
        opts = [(t, rng.choice([1, 3, 10, 40]), p, m) for t, _, p, m in opts]
    if trial == 2:  # no top_k: sort and plain paths only
        opts = [(t, 0, p, m) for t, _, p, m in opts]
    got = filtered_probs(logits, *[list(c) for c in zip(*opts)]).double()
    for i, (t, k, p, m) in enumerate(opts):
        want = reference_filtered(logits[i], t, k, p, m)
        assert torch.equal(got[i] > 0, want > 0), (i, opts[i])
        torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-6)


def test_top_k_one_and_tiny_top_p_are_argmax() -> None:
    torch.manual_seed(2)
    logits = torch.randn(6, 400)
    sampler = make(400)
    for i in range(3):
        sampler.add_request(f"k{i}", O(temperature=1.3, top_k=1), [])
        sampler.add_request(f"p{i}", O(temperature=1.0, top_p=1e-6), [])
    ids, lps = sampler.sample(logits, ["k0", "p0", "k1", "p1", "k2", "p2"]).result()
    assert ids == logits.argmax(-1).tolist()
    assert lps == []


def test_sample_draws_from_filter_candidates(monkeypatch: pytest.MonkeyPatch) -> None:
    """sample() takes its distribution from _filter_candidates (the function the exactness test checks)."""
    calls: list[str] = []
    original = sampler_module._filter_candidates

    def forced(x, group, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(group)
        weights, ids = original(x, group, *args, **kwargs)
        forced_weights = torch.zeros_like(weights)
        forced_weights[:, -1] = 1.0  # the least likely candidate only
        return forced_weights, ids

    monkeypatch.setattr(sampler_module, "_filter_candidates", forced)
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    sampler = make(50)
    sampler.add_request("k", O(top_k=5), [])
    sampler.add_request("p", O(top_p=0.9), [])
    sampler.add_request("plain", O(temperature=0.5), [])
    ids, _ = sampler.sample(logits, ["k", "p", "plain"]).result()
    assert sorted(calls) == ["plain", "sort", "top_k"]
    assert ids[0] == logits[0].topk(5).indices[-1].item()
    assert ids[1] == logits[1].argmin().item()
    assert ids[2] == 49


# ---------------------------------------------------------------- goodness of fit

PROBS = [0.30, 0.22, 0.16, 0.12, 0.08, 0.05, 0.04, 0.02, 0.01]
CONFIGS = [
    dict(temperature=1.0),
    dict(temperature=0.7, top_p=0.8),
    dict(temperature=1.0, top_p=0.62),
    dict(temperature=1.3, top_k=6, top_p=0.9),
    dict(temperature=1.0, top_k=4, min_p=0.3),
    dict(temperature=0.8, min_p=0.1),
]


def draw_counts(config: dict, seeded: bool, rows: int = 2000, steps: int = 10) -> torch.Tensor:
    vocab = len(PROBS)
    logits = torch.tensor(PROBS).log().expand(rows, vocab).contiguous()
    sampler = make(vocab, slots=rows, seed=1234)
    ids = [f"r{i}" for i in range(rows)]
    for i, req in enumerate(ids):
        sampler.add_request(req, O(seed=(7919 * i + 1) if seeded else None, **config), [])
    counts = torch.zeros(vocab, dtype=torch.float64)
    for _ in range(steps):
        drawn, _ = sampler.sample(logits, ids).result()
        counts += torch.bincount(torch.tensor(drawn), minlength=vocab).double()
    return counts


@pytest.mark.parametrize("seeded", [False, True], ids=["shared", "seeded"])
@pytest.mark.parametrize("config", CONFIGS, ids=[str(i) for i in range(len(CONFIGS))])
def test_chi_square_fit(config: dict, seeded: bool) -> None:
    counts = draw_counts(config, seeded)
    logits = torch.tensor(PROBS).log()
    want = reference_filtered(logits, config["temperature"], config.get("top_k", 0),
                              config.get("top_p", 1.0), config.get("min_p", 0.0))
    assert fits(counts, want)
    if config.get("top_p", 1.0) < 1.0:
        # Negative control: the same draws reject a top-p that keeps one token more or one fewer.
        for off_by in (1, -1):
            wrong = reference_filtered(logits, config["temperature"], config.get("top_k", 0),
                                       config["top_p"], config.get("min_p", 0.0), top_p_off_by=off_by)
            if not torch.equal(wrong, want):
                assert not fits(counts, wrong), off_by


def test_negative_control_detects_off_by_one_top_p() -> None:
    """An off-by-one top-p gives a distribution that the chi-square test rejects."""
    logits = torch.tensor(PROBS).log()
    right = reference_filtered(logits, 1.0, 0, 0.62, 0.0)
    wrong = reference_filtered(logits, 1.0, 0, 0.62, 0.0, top_p_off_by=1)
    assert int((right > 0).sum()) + 1 == int((wrong > 0).sum())
    counts = draw_counts(dict(temperature=1.0, top_p=0.62), seeded=False)
    assert fits(counts, right) and not fits(counts, wrong)


# ---------------------------------------------------------------- seeds


def run_seeded(seed: int, steps: int, others: bool, position: int = 0, opts: dict | None = None) -> list[int]:
    vocab = 1000
    gen = torch.Generator().manual_seed(99)
    step_logits = [torch.randn(vocab, generator=gen) * 0.3 for _ in range(steps)]
    sampler = make(vocab, seed=seed + 17)
    kwargs = opts or dict(temperature=1.0)
    sampler.add_request("me", O(seed=seed, **kwargs), [5])
    req_ids = ["me"]
    if others:
        sampler.add_request("g", O(temperature=0.0), [1])
        sampler.add_request("u", O(temperature=1.0, top_p=0.7), [1])
        sampler.add_request("s", O(temperature=0.9, seed=seed + 1, top_k=30), [1])
        sampler.add_request("pen", O(temperature=1.0, seed=3, frequency_penalty=0.5), [2])
        req_ids = ["g", "u", "s", "pen"]
        req_ids.insert(position, "me")
    tokens = []
    for t in range(steps):
        noise = torch.randn(len(req_ids), vocab)
        noise[req_ids.index("me")] = step_logits[t]
        ids, _ = sampler.sample(noise, req_ids).result()
        tokens.append(ids[req_ids.index("me")])
    return tokens


@pytest.mark.parametrize("opts", [dict(temperature=1.0), dict(temperature=0.8, top_k=200, top_p=0.95),
                                  dict(temperature=1.1, top_p=0.9), dict(temperature=1.0, min_p=0.2)])
def test_seed_gives_same_tokens_alone_and_in_mixed_batches(opts: dict) -> None:
    alone = run_seeded(42, 12, others=False, opts=opts)
    assert len(set(alone)) > 3  # the counter advances: not one token over and over
    assert run_seeded(42, 12, others=True, position=0, opts=opts) == alone
    assert run_seeded(42, 12, others=True, position=3, opts=opts) == alone
    assert run_seeded(42, 12, others=False, opts=opts) == alone  # a new Sampler instance
    assert run_seeded(43, 12, others=False, opts=opts) != alone


def test_seeded_request_continues_from_its_output_count() -> None:
    """A request re-added with its sampled tokens continues the same sequence."""
    vocab = 500
    logits = torch.zeros(1, vocab)
    a = make(vocab)
    a.add_request("r", O(seed=5), [1])
    full = [a.sample(logits, ["r"]).result()[0][0] for _ in range(6)]
    b = make(vocab)
    b.add_request("r", O(seed=5), [1], full[:3])
    assert [b.sample(logits, ["r"]).result()[0][0] for _ in range(3)] == full[3:]


def test_large_and_negative_seeds() -> None:
    logits = torch.zeros(3, 1000)
    s = make(1000)
    for name, seed in [("a", 2**63 - 1), ("b", -5), ("c", 2**40 + 3)]:
        s.add_request(name, O(seed=seed), [])
    ids, _ = s.sample(logits, ["a", "b", "c"]).result()
    assert all(0 <= t < 1000 for t in ids) and len(set(ids)) == 3


def test_unseeded_rows_follow_the_generator() -> None:
    logits = torch.zeros(4, 1000)

    def draw() -> list[int]:
        s = make(1000, seed=77)
        for i in range(4):
            s.add_request(str(i), O(), [])
        return s.sample(logits, ["0", "1", "2", "3"]).result()[0]

    assert draw() == draw()


# ---------------------------------------------------------------- greedy, penalties, min_tokens


def test_greedy_fast_path_is_one_argmax(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 300)
    sampler = make(300)
    for i in range(6):
        sampler.add_request(str(i), O(temperature=0.0, min_tokens=0), [1, 2])

    def no_copy(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("the pure-greedy path must not copy anything to the device")

    monkeypatch.setattr(sampler, "_to_device", no_copy)
    out = sampler.sample(logits, [str(i) for i in range(6)])
    assert out.result() == (logits.argmax(-1).tolist(), [])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_record_into_holds_each_rows_sampled_id(temperature: float) -> None:
    # The runner's per-row last sampled ids: the greedy fast path and the general path both fill them.
    torch.manual_seed(4)
    logits = torch.randn(3, 100)
    sampler = make(100)
    for i in range(3):
        sampler.add_request(str(i), O(temperature=temperature), [1])
    last = torch.full((5,), -1, dtype=torch.int64)
    ids, _ = sampler.sample(logits, ["0", "1", "2"], record_into=(last, torch.tensor([2, 4, 0]))).result()
    assert last.tolist() == [ids[2], -1, ids[0], -1, ids[1]]


def test_greedy_and_random_rows_mix() -> None:
    torch.manual_seed(1)
    vocab = 200
    logits = torch.randn(8, vocab)
    sampler = make(vocab)
    names = []
    for i in range(8):
        greedy = i % 2 == 0
        sampler.add_request(str(i), O(temperature=0.0 if greedy else 1.0, top_k=3 if i % 4 == 1 else 0), [])
        names.append(str(i))
    ids, _ = sampler.sample(logits, names).result()
    for i in range(8):
        if i % 2 == 0:
            assert ids[i] == logits[i].argmax().item()
        elif i % 4 == 1:
            assert ids[i] in logits[i].topk(3).indices.tolist()


def test_logits_not_modified() -> None:
    torch.manual_seed(1)
    logits = torch.randn(2, 50)
    before = logits.clone()
    s = make(50)
    s.add_request("a", O(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1, repetition_penalty=1.3,
                         frequency_penalty=0.5, presence_penalty=0.5, min_tokens=2, min_tokens_banned=(4,)), [1, 2], [3])
    s.add_request("b", O(temperature=0.0, logprobs=2), [5])
    s.sample(logits, ["a", "b"], {"a": b"\x0f\x00\x00\x00\xff\xff\xff\xff"}).result()
    assert torch.equal(logits, before)


PENALTY_OPTIONS = [
    O(temperature=0.0, repetition_penalty=1.8),
    O(temperature=0.0, frequency_penalty=0.9),
    O(temperature=0.0, presence_penalty=1.2),
    O(temperature=0.0, repetition_penalty=0.7, frequency_penalty=-0.4, presence_penalty=0.3),
    O(temperature=0.0, repetition_penalty=1.3, min_tokens=4, min_tokens_banned=(0, 7)),
    O(temperature=0.0, min_tokens=3, min_tokens_banned=(1,)),
    O(temperature=0.0),
    O(temperature=0.9, top_k=4, frequency_penalty=2.0, seed=1),
]


def test_penalties_and_min_tokens_tracked_on_device() -> None:
    """Several steps without telling the sampler any token: its device state matches the lists."""
    vocab = 24
    rng = torch.Generator().manual_seed(5)
    sampler = make(vocab)
    prompts = {str(i): torch.randint(0, vocab, (5,), generator=rng).tolist() for i in range(len(PENALTY_OPTIONS))}
    outputs = {str(i): ([2, 2, 9] if i % 3 == 0 else []) for i in range(len(PENALTY_OPTIONS))}
    for i, options in enumerate(PENALTY_OPTIONS):
        sampler.add_request(str(i), options, prompts[str(i)], outputs[str(i)])
    names = list(prompts)
    for step in range(8):
        logits = torch.randn(len(names), vocab, generator=rng) * 1.5
        logits[:, 0] += 4.0  # a favourite that min_tokens bans for some rows
        logits[:, 1] += 3.0
        order = names[step % 3:] + names[: step % 3]  # batch order changes
        rows = torch.stack([logits[names.index(n)] for n in order])
        ids, _ = sampler.sample(rows, order).result()
        for j, name in enumerate(order):
            options = PENALTY_OPTIONS[int(name)]
            want = reference_processed(rows[j], options, prompts[name], outputs[name])
            if options.temperature == 0.0:
                assert ids[j] == want.argmax().item(), (step, name)
            else:
                assert ids[j] in want.topk(4).indices.tolist()
            outputs[name].append(ids[j])
    for i, name in enumerate(names):
        slot = sampler._requests[name].slot
        assert sampler._iparams[slot, sampler_module._NUM_SAMPLED].item() == len(outputs[name])
        if sampler._requests[name].penalties:
            want_counts = torch.bincount(torch.tensor(outputs[name]), minlength=vocab)
            assert torch.equal(sampler._counts[slot].long(), want_counts)


def test_min_tokens_masks_banned_until_reached_except_with_grammar() -> None:
    vocab = 10
    sampler = make(vocab)
    banned = O(temperature=0.0, min_tokens=3, min_tokens_banned=(3, 4))
    sampler.add_request("a", banned, [1])
    sampler.add_request("g", O(temperature=0.0, min_tokens=3, min_tokens_banned=(3,), has_grammar=True), [1])
    sampler.add_request("late", banned, [1], [5, 5])  # one token to go
    logits = torch.zeros(3, vocab)
    logits[:, 3] = 10.0
    logits[:, 4] = 9.0
    all_ones = b"\xff" * 4
    seen = []
    for _ in range(4):
        ids, _ = sampler.sample(logits, ["a", "g", "late"], {"g": all_ones}).result()
        seen.append(ids)
    assert [s[0] for s in seen] == [0, 0, 0, 3]
    assert [s[1] for s in seen] == [3, 3, 3, 3]
    assert [s[2] for s in seen] == [0, 3, 3, 3]


def test_removed_slot_is_reused_clean() -> None:
    vocab = 12
    sampler = make(vocab, slots=2)
    sampler.add_request("keep", O(temperature=0.0), [])
    sampler.add_request("old", O(temperature=0.0, frequency_penalty=5.0, repetition_penalty=2.0), [3])
    logits = torch.zeros(1, vocab)
    logits[0, 3] = 1.0
    logits[0, 5] = 0.9
    logits[0, 6] = 0.8
    assert sampler.sample(logits, ["old"]).result()[0] == [5]  # 3 is in the prompt: 1.0 / 2 = 0.5
    assert sampler.sample(logits, ["old"]).result()[0] == [6]  # 5 was sampled: 0.9 / 2 - 5
    slot = sampler._requests["old"].slot
    sampler.remove_request("old")
    sampler.remove_request("old")  # unknown ids: no-op
    sampler.add_request("new", O(temperature=0.0, frequency_penalty=5.0, repetition_penalty=2.0), [6])
    assert sampler._requests["new"].slot == slot
    assert sampler.sample(logits, ["new"]).result()[0] == [3]  # nothing of the old request remains
    with pytest.raises(ValueError, match="unknown request"):
        sampler.sample(logits, ["old"])


def test_slots_grow_keeping_state() -> None:
    """More requests than max_num_seqs at once (finished ones are forgotten a step late): the
    slot tensors grow and the earlier requests' device state survives."""
    vocab = 12
    sampler = make(vocab, slots=1)
    sampler.add_request("a", O(temperature=0.0, frequency_penalty=5.0), [])
    logits = torch.zeros(1, vocab)
    logits[0, 3] = 1.0
    logits[0, 5] = 0.9
    assert sampler.sample(logits, ["a"]).result()[0] == [3]
    for i in range(5):
        sampler.add_request(f"x{i}", O(temperature=0.0, repetition_penalty=3.0), [5])
    assert sampler.num_slots >= 6
    ids, _ = sampler.sample(logits.expand(6, vocab), ["a"] + [f"x{i}" for i in range(5)]).result()
    assert ids == [5, 3, 3, 3, 3, 3]  # a: 3 was penalised; x: the prompt's 5 was
    assert sampler.sample(logits, ["a"]).result()[0] == [0]  # 3 and 5 both penalised now


def test_bf16_logits() -> None:
    torch.manual_seed(6)
    vocab = 300
    logits = (torch.randn(4, vocab) * 3).bfloat16()
    sampler = make(vocab)
    sampler.allocate_penalty_state()
    opts = [O(temperature=0.0), O(temperature=0.8, top_k=5, top_p=0.9), O(top_p=0.5, seed=3), O(presence_penalty=0.5)]
    for i, o in enumerate(opts):
        sampler.add_request(str(i), o, [1])
    for _ in range(3):
        ids, _ = sampler.sample(logits, ["0", "1", "2", "3"]).result()
        assert ids[0] == logits[0].float().argmax().item()
        assert logits[1, ids[1]] >= logits[1].float().topk(5).values[-1]
        assert filtered_probs(logits[2:3], [1.0], [0], [0.5], [0.0])[0, ids[2]] > 0


def test_sample_reads_nothing_back_from_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """sample() never converts a tensor to a Python value (on CUDA that would wait for the device)."""
    vocab = 64
    sampler = make(vocab)
    opts = [O(temperature=0.0, logprobs=2), O(top_k=5, top_p=0.8, min_p=0.1, seed=1),
            O(top_p=0.7, repetition_penalty=1.2, frequency_penalty=0.1, presence_penalty=0.1),
            O(min_p=0.2, min_tokens=3, min_tokens_banned=(1,)), O(temperature=0.0, has_grammar=True)]
    names = [str(i) for i in range(len(opts))]
    for name, o in zip(names, opts):
        sampler.add_request(name, o, [1, 2], [3])
    logits = torch.randn(len(opts), vocab)
    masks = {"4": bitmask_bytes([5, 6], vocab)}

    def forbidden(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("a device value was read on the host inside sample()")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    out = [sampler.sample(logits, names, masks) for _ in range(3)]
    monkeypatch.undo()
    for step in out:
        ids, lps = step.result()
        assert ids[4] in (5, 6) and lps[0] is not None


def test_empty_batch() -> None:
    sampler = make(10)
    out = sampler.sample(torch.empty(0, 10), [])
    assert out.device_ids.shape == (0,)
    assert out.result() == ([], [])


# ---------------------------------------------------------------- logprobs


def test_logprobs_from_raw_logits() -> None:
    torch.manual_seed(3)
    vocab = 40
    logits = torch.randn(5, vocab) * 2
    logits[2, [7, 8, 9]] = 10.0  # a three-way tie at the top
    sampler = make(vocab)
    opts = [O(temperature=0.0, logprobs=3, repetition_penalty=1.5), O(temperature=1.0, logprobs=None),
            O(temperature=0.0, logprobs=0, min_tokens=5, min_tokens_banned=(7, 8)),
            O(temperature=0.8, top_p=0.9, logprobs=5, seed=4), O(temperature=1.0, logprobs=vocab + 10)]
    names = [str(i) for i in range(5)]
    for name, o in zip(names, opts):
        sampler.add_request(name, o, [1, 2, 3])
    ids, lps = sampler.sample(logits, names).result()
    raw = torch.log_softmax(logits.double(), -1)
    assert lps[1] is None
    for i in (0, 2, 3, 4):
        lp = lps[i]
        assert isinstance(lp, SampledLogprobs)
        assert lp.sampled_logprob == pytest.approx(raw[i, ids[i]].item(), abs=1e-5)
        assert lp.rank == int((raw[i] > raw[i, ids[i]] + 1e-9).sum()) + 1
        n_top = min(opts[i].logprobs, vocab)
        assert len(lp.top_ids) == len(lp.top_logprobs) == n_top
        want_values = raw[i].sort(descending=True).values[:n_top]
        assert lp.top_logprobs == pytest.approx(want_values.tolist(), abs=1e-5)
        assert lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)
        for t, v in zip(lp.top_ids, lp.top_logprobs):
            assert raw[i, t].item() == pytest.approx(v, abs=1e-5)
    assert ids[2] == 9 and lps[2].rank == 1  # ties with the banned 7, 8 share rank 1
    assert lps[2].top_ids == []


def test_no_logprobs_gives_empty_list() -> None:
    sampler = make(20)
    sampler.add_request("a", O(temperature=1.0), [])
    ids, lps = sampler.sample(torch.randn(1, 20), ["a"]).result()
    assert len(ids) == 1 and lps == []


# ---------------------------------------------------------------- grammar bitmasks


def bitmask_bytes(allowed: list[int], vocab: int) -> bytes:
    words = [0] * ((vocab + 31) // 32)
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32).numpy().tobytes()


def test_grammar_rows_sample_only_allowed_tokens() -> None:
    vocab = 70
    torch.manual_seed(4)
    sampler = make(vocab)
    sampler.add_request("free", O(temperature=0.0), [])
    sampler.add_request("g_greedy", O(temperature=0.0, has_grammar=True), [])
    sampler.add_request("g_random", O(temperature=1.0, has_grammar=True, seed=2), [])
    sampler.add_request("g_topk", O(temperature=1.0, top_k=3, has_grammar=True), [])
    allowed = [3, 33, 64, 69]
    masks = {name: bitmask_bytes(allowed, vocab) for name in ("g_greedy", "g_random", "g_topk")}
    names = ["free", "g_greedy", "g_random", "g_topk"]
    for _ in range(20):
        logits = torch.randn(4, vocab)
        ids, _ = sampler.sample(logits, names, masks).result()
        assert ids[0] == logits[0].argmax().item()
        assert ids[1] == allowed[int(logits[1, allowed].argmax())]
        assert ids[2] in allowed and ids[3] in allowed


def test_tokens_beyond_bitmask_width_stay_allowed() -> None:
    vocab = 70
    sampler = make(vocab)
    sampler.add_request("g", O(temperature=0.0, has_grammar=True), [])
    logits = torch.zeros(1, vocab)
    logits[0, 66] = 5.0
    two_words = bitmask_bytes([1], 64)  # covers tokens 0..63 only
    assert sampler.sample(logits, ["g"], {"g": two_words}).result()[0] == [66]


def test_top_k_candidates_prefilter_is_exact() -> None:
    # The chunk prefilter (only the k chunks with the largest maxima are searched) returns
    # torch.topk's values, sorted, under ids that hold them; with ties and -inf too.
    from tidal_engine.runner.sampler import top_k_candidates

    g = torch.Generator().manual_seed(0)
    for trial in range(12):
        x = torch.randn(5, 1024, generator=g)
        if trial % 3 == 0:
            x = x.round()  # many ties
        if trial % 4 == 1:
            x[:, ::3] = float("-inf")
        if trial % 2:
            x = x.to(torch.bfloat16)
        k = (1, 5, 17, 50)[trial % 4]
        values, ids = top_k_candidates(x, k, chunk=4)
        assert torch.equal(values, x.topk(k, dim=-1).values)
        assert torch.equal(x.gather(1, ids), values)
        assert all(len(set(row.tolist())) == k for row in ids)
    wide = torch.randn(2, 64, generator=g)  # k * chunk too large for the vocabulary: plain topk
    assert torch.equal(top_k_candidates(wide, 10, chunk=4)[1], wide.topk(10, dim=-1).indices)
