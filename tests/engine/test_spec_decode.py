"""Speculative decoding pieces: the typed --speculative-config, the n-gram proposer, and the
exact rejection sampler (greedy = argmax chain; sampled = the target distribution, chi-square)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tidal_engine.spec_decode import NgramProposer, SpeculativeConfig, rejection_sample
from tidal_engine.spec_decode.rejection_sampler import accept_greedy

# chi-square critical values at p = 0.001 (df = V - 1); the seeds are fixed, so no flakes.
CHI2_999 = {5: 20.515}


# ---- config ------------------------------------------------------------------------------
def test_ngram_config_with_vllm_keys() -> None:
    cfg = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4, '
                                  '"prompt_lookup_min": 2, "prompt_lookup_max": 5}')
    assert (cfg.method, cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max) == ("ngram", 4, 2, 5)
    only_max = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (4, 4)


def test_draft_model_config() -> None:
    cfg = SpeculativeConfig.parse('{"model": "smollm2-135m", "num_speculative_tokens": 3}')
    assert (cfg.method, cfg.model, cfg.num_speculative_tokens) == ("draft_model", "smollm2-135m", 3)


@pytest.mark.parametrize("text, message", [
    ("{not json", "not valid JSON"),
    ("[1]", "JSON object"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "bogus": 1}', "unknown key"),
    ('{"method": "eagle9", "num_speculative_tokens": 2}', "method must be"),
    ('{"method": "ngram"}', "needs num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', ">= 1"),
    ('{"method": "ngram", "num_speculative_tokens": "4"}', "integer"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}', "<="),
    ('{"method": "draft_model", "num_speculative_tokens": 2}', "needs \"model\""),
])
def test_bad_configs_are_refused_clearly(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(text)


# ---- n-gram proposer ---------------------------------------------------------------------
def naive_ngram(tokens: list[int], k: int, lo: int, hi: int, cap: int) -> list[int]:
    """One row, plainly: the longest suffix n-gram found earlier, its latest occurrence."""
    for n in range(hi, lo - 1, -1):
        if len(tokens) <= n:
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + min(k, cap)]
    return []


def test_ngram_proposes_the_continuation_of_the_last_match() -> None:
    proposer = NgramProposer(3, 1, 3)
    drafts = proposer.propose([np.array([5, 6, 7, 8, 9, 1, 5, 6, 7]), np.array([1, 2, 3]), np.array([4, 4])])
    assert drafts[0].tolist() == [8, 9, 1]  # "5 6 7" seen before, followed by 8 9 1
    assert drafts[1].tolist() == []  # nothing repeats
    assert drafts[2].tolist() == [4]  # "4" followed by 4 (only one token follows it)


def test_ngram_batch_equals_rows_one_by_one() -> None:
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, 4, size=int(rng.integers(1, 40))) for _ in range(64)]
    caps = rng.integers(0, 6, size=64).tolist()
    for k, lo, hi in [(4, 1, 3), (2, 2, 2), (5, 1, 1)]:
        got = NgramProposer(k, lo, hi).propose(rows, caps)
        want = [naive_ngram(r.tolist(), k, lo, hi, c) for r, c in zip(rows, caps)]
        assert [g.tolist() for g in got] == want


# ---- rejection sampler -------------------------------------------------------------------
@pytest.mark.parametrize("all_greedy", [False, True, "host"], ids=["general", "greedy-only", "host"])
def test_greedy_rows_emit_the_argmax_chain(all_greedy: bool | str) -> None:
    gen = torch.Generator().manual_seed(0)
    rows, k, vocab = 200, 4, 7
    logits = torch.randn(rows, k + 1, vocab, generator=gen)
    argmax = logits.argmax(dim=2)
    # Drafts: the argmax with random corruption, so every acceptance length occurs.
    drafts = torch.where(torch.rand(rows, k, generator=gen) < 0.8, argmax[:, :k], torch.randint(0, vocab, (rows, k), generator=gen))
    num_drafts = torch.randint(0, k + 1, (rows,), generator=gen)
    # The greedy-only path reads raw logits (only their argmax matters).
    target = logits if all_greedy else logits.softmax(-1)
    if all_greedy == "host":  # the verify step's greedy path: per row on the host
        emitted_rows = [accept_greedy(argmax[r, : int(num_drafts[r]) + 1].tolist(), drafts[r, : int(num_drafts[r])].tolist())
                        for r in range(rows)]
        emitted = torch.tensor([len(e) for e in emitted_rows])
        tokens = torch.tensor([e + [-1] * (k + 1 - len(e)) for e in emitted_rows])
    else:
        tokens, emitted = rejection_sample(target, drafts, num_drafts, torch.ones(rows, dtype=torch.bool),
                                           generator=gen, all_greedy=bool(all_greedy))
    for r in range(rows):
        expected = []
        for j in range(int(num_drafts[r]) + 1):  # what decoding without speculation emits
            expected.append(int(argmax[r, j]))
            if j == int(num_drafts[r]) or int(drafts[r, j]) != expected[-1]:
                break
        assert tokens[r, : int(emitted[r])].tolist() == expected
        assert (tokens[r, int(emitted[r]):] == -1).all()


def test_verify_index_matches_a_per_row_layout() -> None:
    # runner/verify.py builds a step's index arrays without a per-row loop: compare with the
    # per-row definition on a batch mixing rows without drafts, with fewer than k and with k.
    from tidal_engine.runner.verify import _VerifyIndex

    drafts = [[], [7, 8, 9, 10], [3], [], [4, 5], [11, 12, 13, 14]]
    lens = [3, 9, 2, 1, 6, 5]  # tokens of each sampling sequence in the flat batch
    sample_rows = np.cumsum(lens) - 1
    index = _VerifyIndex(sample_rows, drafts)
    k = 4
    rows, plain, spec, ids, nd = [], [], [], [], []
    for end, d in zip(sample_rows, drafts):
        start = len(rows)
        rows += list(range(end - len(d), end + 1))
        if d:
            spec += [start + min(j, len(d)) for j in range(k + 1)]
            ids.append(d + [0] * (k - len(d)))
            nd.append(len(d))
        else:
            plain.append(start)
    assert index.k == k
    assert index.logit_rows.tolist() == rows and index.plain_index.tolist() == plain
    assert index.spec_index.tolist() == spec and index.draft_ids.tolist() == ids and index.num_drafts.tolist() == nd
    assert index.plain_pos.tolist() == [0, 3] and index.spec_pos.tolist() == [1, 2, 4, 5]
    up = index.upload(torch.device("cpu"))
    assert [t.tolist() for t in up] == [rows, plain, spec, ids, nd]


@pytest.mark.parametrize("pad_to,pad_tokens_to", [(None, None), (1, 5), (2, 10)])
def test_one_sequence_verify_layout(pad_to: int | None, pad_tokens_to: int | None) -> None:
    # A single stream's verify step (one sequence, its token and 4 drafts across a block
    # boundary) takes fill_step's one-sequence path: the same arrays as the per-token definition.
    from tidal_engine.runner.input_buffers import StepInput, fill_step, plan_step
    from tidal_engine.runner.persistent_batch import PersistentBatch

    bs = 4
    batch = PersistentBatch(4, 64, bs, torch.device("cpu"))
    tokens = list(range(100, 110))
    row = batch.add("r", tokens, [7, 3, 9, 2])
    batch.token_ids[row, 10:14] = [50, 51, 52, 53]  # drafts sit past the known tokens
    step = StepInput(rows=np.array([row]), starts=np.array([9]), q_lens=np.array([5]), samples=np.array([True]),
                     fed=np.array([False]), num_drafts=np.array([4]))
    index, value = batch.take_block_updates()
    layout = plan_step(step, 4, pad_to, pad_tokens_to, num_bt_updates=int(index.shape[0]))
    buf = np.full(layout.total + 8, -99, dtype=np.int64)
    fill_step(buf, layout, step, batch.token_ids, batch.block_table, bs, index, value)
    got = {name: buf[a:b].tolist() for name, (a, b) in layout.offsets().items()}
    pad = (pad_tokens_to or 5) - 5
    positions = list(range(9, 14))
    assert got["positions"] == positions + [0] * pad
    assert got["input_ids"] == [109, 50, 51, 52, 53] + [0] * pad
    assert got["slot_mapping"] == [[7, 3, 9, 2][p // bs] * bs + p % bs for p in positions] + [-1] * pad
    seqs = pad_to or 1
    assert got["seq_lens"] == [14] + [0] * (seqs - 1) and layout.seq_lens == got["seq_lens"]
    assert got["query_start_loc"] == [0] + [5] * seqs and layout.query_start_loc == got["query_start_loc"]
    assert got["sample_rows"] == [4] and got["sampled_rows"] == [row]
    assert got["batch_rows"] == [row] + [0] * (seqs - 1)
    assert (buf[layout.total:] == -99).all()  # nothing written past the step


def test_token_history_mirrors_a_growing_list() -> None:
    from tidal_engine.spec_decode.token_history import TokenHistory

    tokens = [5, 6, 7]
    history = TokenHistory(capacity=2)
    assert history.view(tokens).tolist() == [5, 6, 7]
    for t in range(8, 40):  # grows past its capacity several times
        tokens.append(t)
        assert history.view(tokens).tolist() == tokens
    tokens[-1] = 99  # a placeholder filled in place
    history.replace(len(tokens) - 1, 99)
    assert history.view(tokens).tolist() == tokens and history.view(tokens).dtype == np.int64
    with pytest.raises(ValueError, match="shrank"):
        history.view(tokens[:-1])


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


P = torch.tensor([[0.40, 0.25, 0.15, 0.10, 0.06, 0.04],
                  [0.05, 0.10, 0.50, 0.05, 0.20, 0.10],
                  [0.30, 0.05, 0.05, 0.20, 0.20, 0.20]])
DRAFTS = {
    "uniform": torch.full((2, 6), 1 / 6),
    "skewed": torch.tensor([[0.05, 0.05, 0.05, 0.05, 0.30, 0.50], [0.60, 0.10, 0.05, 0.05, 0.10, 0.10]]),
    "equal_to_target": P[:2].clone(),
    "one_hot_likely": None,  # n-gram style: deterministic drafts
    "one_hot_unlikely": None,
}


@pytest.mark.parametrize("name", list(DRAFTS))
def test_sampled_rows_follow_the_target_distribution(name: str) -> None:
    gen = torch.Generator().manual_seed(1234)
    rows, k, vocab = 30000, 2, 6
    q = DRAFTS[name]
    if q is None:
        fixed = torch.tensor([0, 2]) if name == "one_hot_likely" else torch.tensor([5, 3])
        drafts = fixed.expand(rows, k).clone()
        draft_probs = None
    else:
        drafts = torch.stack([torch.multinomial(q[j], rows, replacement=True, generator=gen) for j in range(k)], 1)
        draft_probs = q.expand(rows, k, vocab)
    tokens, emitted = rejection_sample(P.expand(rows, k + 1, vocab), drafts, torch.full((rows,), k),
                                       torch.zeros(rows, dtype=torch.bool), draft_probs, generator=gen)
    for pos in range(k + 1):
        present = emitted > pos
        counts = torch.bincount(tokens[present, pos], minlength=vocab).double()
        if counts.sum() < 500:  # unlikely one-hot drafts rarely reach the bonus; too few to test
            assert name == "one_hot_unlikely" and pos == k
            continue
        assert chi_square(counts, P[pos].double()) < CHI2_999[vocab - 1], (name, pos, counts)
    if draft_probs is None:  # one-hot drafts are accepted with probability p(d)
        rate = float((emitted > 1).double().mean())
        assert abs(rate - float(P[0, drafts[0, 0]])) < 0.01


def test_mixed_greedy_and_sampled_rows_in_one_batch() -> None:
    gen = torch.Generator().manual_seed(7)
    rows, k, vocab = 20000, 2, 6
    greedy = torch.arange(rows) % 2 == 0
    drafts = torch.tensor([0, 4]).expand(rows, k).clone()  # argmax of P[0], then not P[1]'s
    tokens, emitted = rejection_sample(P.expand(rows, k + 1, vocab), drafts, torch.full((rows,), k), greedy,
                                       generator=gen)
    assert (tokens[greedy, :2] == torch.tensor([0, 2])).all() and (emitted[greedy] == 2).all()
    sampled = ~greedy
    counts = torch.bincount(tokens[sampled, 0], minlength=vocab).double()
    assert chi_square(counts, P[0].double()) < CHI2_999[vocab - 1]


# ---- verification shape in the reference attention -----------------------------------------
def test_reference_attention_verifies_several_queries_per_decode_row() -> None:
    """A verify row (k+1 query tokens at the end of its context), next to a plain decode and a
    prefill chunk in one batch, equals attending its queries one position at a time."""
    from tidal_engine.layers.attention import AttentionMetadata, TorchAttentionBackend

    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, dim, block, num_blocks = 4, 2, 8, 4, 40
    cache = torch.randn(2, num_blocks, block, kv_heads, dim, generator=gen)
    tables = torch.randperm(num_blocks, generator=gen)[:30].view(3, 10)
    seq_lens, q_lens = [20, 37, 8], [1, 5, 8]  # decode, verify (k = 4), prefill chunk
    query = torch.randn(14, heads, dim, generator=gen)
    backend = TorchAttentionBackend()

    def meta(rows: list[int], lens: list[int], qlens: list[int]) -> AttentionMetadata:
        starts = [0]
        for q in qlens:
            starts.append(starts[-1] + q)
        return AttentionMetadata(
            slot_mapping=torch.full((starts[-1],), -1), query_start_loc=torch.tensor(starts),
            seq_lens=torch.tensor(lens), block_tables=tables[rows], max_query_len=max(qlens),
            max_seq_len=max(lens), query_start_loc_cpu=starts, seq_lens_cpu=lens)

    mixed = backend.forward(query, cache, meta([0, 1, 2], seq_lens, q_lens), 0.3)
    for j in range(5):  # the verify row's query j sees the keys up to position 32 + j
        alone = backend.forward(query[1 + j : 2 + j], cache, meta([1], [33 + j], [1]), 0.3)
        torch.testing.assert_close(mixed[1 + j], alone[0])


def test_verify_graph_buckets() -> None:
    # One graph per decode batch size B, of B * (k + 1) tokens; a step fits the smallest B that
    # holds its rows when no row has more than k + 1 tokens (else the mixed graphs or eager).
    from tidal_engine.runner.mixed_graphs import VerifyGraphs

    graphs = VerifyGraphs(None, [], [1, 2, 4, 8], 5, 16, torch.device("cpu"))  # type: ignore[arg-type]
    assert graphs.token_sizes == [5, 10, 20, 40]
    assert [graphs.seqs_for(t) for t in graphs.token_sizes] == [1, 2, 4, 8]
    assert graphs.max_query_len(40) == 5
    assert graphs.bucket_for_step(5, 1, 3) == 5
    assert graphs.bucket_for_step(1, 3, 3) == 20  # plain decodes fit too
    assert graphs.bucket_for_step(5, 8, 16) == 40
    assert graphs.bucket_for_step(6, 1, 3) is None  # a longer chunk
    assert graphs.bucket_for_step(5, 9, 3) is None  # more rows than the largest graph
    assert graphs.bucket_for_step(5, 2, 17) is None  # a wider block table than captured
    with pytest.raises(ValueError, match="at least 2"):
        VerifyGraphs(None, [], [1], 1, 16, torch.device("cpu"))  # type: ignore[arg-type]
