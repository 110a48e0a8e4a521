"""The split-KV ("flash-decoding") path of the Triton paged-attention kernel.

Checked against ``TorchAttentionBackend``. CPU cases run under the Triton interpreter (the
root conftest.py sets TRITON_INTERPRET=1 before any kernel is defined), in fp32 and fp16
only (bf16 tl.dot is wrong in the interpreter), on small shapes: the interpreter is slow.
GPU cases (marked ``gpu``) run compiled kernels in bf16 on serving-sized shapes; run them
with ``TRITON_INTERPRET=0 pytest tests/engine/test_split_kv_attention.py -m gpu``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("triton")

from tidal_engine.kernels.triton import paged_attention as pa  # noqa: E402
from tidal_engine.kernels.triton.paged_attention import (  # noqa: E402
    MAX_SPLITS,
    cache_offsets_fit_i32,
    choose_num_splits,
    combine_splits,
    paged_attention,
)
from tidal_engine.layers.attention import AttentionMetadata, TorchAttentionBackend  # noqa: E402

# Same reading as Triton's own knob ("0"/unset: compiled).
INTERPRETING = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")

cpu_only = pytest.mark.skipif(not INTERPRETING, reason="CPU kernels need TRITON_INTERPRET=1")


def gpu_only(test: Callable[..., None]) -> Callable[..., None]:
    """Mark a test ``gpu``: it runs compiled on CUDA, and is skipped elsewhere."""
    test = pytest.mark.skipif(INTERPRETING, reason="GPU tests run compiled: set TRITON_INTERPRET=0")(test)
    test = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")(test)
    return pytest.mark.gpu(test)


CPU_DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16")]
from kernel_tolerances import assert_close  # noqa: E402


# ---------------------------------------------------------------------------------------
# Batches


@dataclass
class Batch:
    query: torch.Tensor  # [T, H, D], T = sum(q_lens) + pad_tokens
    kv_cache: torch.Tensor  # [2, blocks, block_size, Hkv, D]
    block_tables: torch.Tensor  # [S, max_blocks] int32
    seq_lens: torch.Tensor  # [S] int32
    query_start_loc: torch.Tensor  # [S+1] int32
    q_lens: list[int]
    seq_lens_list: list[int]
    num_real_tokens: int

    def run(self, scale: float, **kwargs: object) -> torch.Tensor:
        """paged_attention into an ``out`` pre-filled with 7.0 (to spot untouched rows)."""
        out = torch.full_like(self.query, 7.0)
        return paged_attention(
            self.query, self.kv_cache, self.block_tables, self.seq_lens, self.query_start_loc, scale,
            max(self.q_lens), out=out, **kwargs,
        )

    def reference(self, scale: float) -> torch.Tensor:
        """TorchAttentionBackend over the real tokens (sequences with queries only, as its
        decode path wants exactly one query per sequence): ``[num_real_tokens, H, D]``."""
        keep = [i for i, q in enumerate(self.q_lens) if q > 0]
        q_lens = [self.q_lens[i] for i in keep]
        seq_lens = [self.seq_lens_list[i] for i in keep]
        starts = [0]
        for n in q_lens:
            starts.append(starts[-1] + n)
        device = self.query.device
        meta = AttentionMetadata(
            slot_mapping=torch.zeros(0, dtype=torch.int64, device=device),  # unused by forward
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=self.block_tables[keep],
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=starts,
            seq_lens_cpu=seq_lens,
        )
        return TorchAttentionBackend().forward(self.query[: self.num_real_tokens], self.kv_cache, meta, scale)


def make_batch(
    q_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str = "cpu",
    seed: int = 0,
    pad_tokens: int = 0,
    poison_unused: bool = False,
) -> Batch:
    """Random query and cache; each sequence's blocks are a random permutation of the pool.

    ``pad_tokens`` query rows follow the real ones (as in a padded CUDA-graph step);
    ``poison_unused`` fills every cache slot outside the contexts with NaN."""
    assert len(q_lens) == len(seq_lens) and all(q <= s for q, s in zip(q_lens, seq_lens))
    g = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = [(s + block_size - 1) // block_size for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # a few unused blocks, full of noise too
    perm = torch.randperm(num_blocks, generator=g, device=device)
    block_tables = torch.zeros(len(seq_lens), max(1, max(blocks_per_seq)), dtype=torch.int32, device=device)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = perm[used : used + n]
        used += n
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g, device=device)
    if poison_unused:
        live = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=device)
        for i, s in enumerate(seq_lens):
            pos = torch.arange(s, device=device)
            live[block_tables[i, pos // block_size].long() * block_size + pos % block_size] = True
        kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)[:, ~live] = float("nan")
    num_real = sum(q_lens)
    query = torch.randn(num_real + pad_tokens, num_heads, head_dim, generator=g, device=device)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    return Batch(
        query=query.to(dtype),
        kv_cache=kv_cache.to(dtype),
        block_tables=block_tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        q_lens=list(q_lens),
        seq_lens_list=list(seq_lens),
        num_real_tokens=num_real,
    )


def check(b: Batch, scale: float, dtype: torch.dtype, **kwargs: object) -> torch.Tensor:
    """Real rows match the reference; padding rows (past query_start_loc[-1]) stay 7.0."""
    out = b.run(scale, **kwargs)
    assert out.shape == b.query.shape and out.dtype == dtype
    assert_close(out[: b.num_real_tokens], b.reference(scale), dtype)
    assert bool((out[b.num_real_tokens :] == 7.0).all()), "padding rows were written"
    return out


# ---------------------------------------------------------------------------------------
# choose_num_splits: a pure function of static launch facts


@pytest.mark.parametrize(
    ("args", "kwargs", "expected"),
    [
        # Decodes, 8 KV heads (Qwen3-0.6B), H200 (132 SMs): ~2 programs per SM, capped at 32.
        ((1, 8, 1), {}, 32),
        ((2, 8, 1), {}, 16),
        ((4, 8, 1), {}, 8),
        ((8, 8, 1), {}, 4),
        ((16, 8, 1), {}, 2),
        ((32, 8, 1), {}, 1),
        ((64, 8, 1), {}, 1),
        ((256, 8, 1), {}, 1),
        ((4, 2, 1), {}, 32),  # 2 KV heads: 8 programs
        ((64, 2, 1), {}, 2),
        ((1, 8, 1, 16), {}, 4),  # a smaller GPU
        # A prefix-cache hit: 16 queries of one sequence make one tile.
        ((1, 8, 16), {"num_tokens": 16}, 32),
        # A mixed-graph bucket of 16 tokens over 16 slots: the fewest tiles is still 1.
        ((16, 8, 16), {"num_tokens": 16}, 32),
        # Without num_tokens, every sequence is taken to have max_query_len queries.
        ((16, 8, 16), {}, 2),
        # Long prefill chunks fill the GPU on their own.
        ((1, 8, 1024), {"num_tokens": 1024, "block_q": 32}, 1),
        ((1, 8, 512), {"num_tokens": 512, "block_q": 32}, 2),
        ((1, 8, 128), {"num_tokens": 128, "block_q": 32}, 8),
        # max_seq_len hint: at least 64 keys a split.
        ((1, 8, 1), {"max_seq_len": 100}, 2),
        ((1, 8, 1), {"max_seq_len": 1}, 1),
        ((1, 8, 1), {"max_seq_len": 100_000}, 32),
    ],
)
def test_choose_num_splits_table(args: tuple[int, ...], kwargs: dict[str, int], expected: int) -> None:
    assert choose_num_splits(*args, **kwargs) == expected


def test_choose_num_splits_bounds_and_monotone() -> None:
    for kv_heads in (1, 2, 4, 8, 16):
        prev = MAX_SPLITS
        for num_seqs in range(1, 300):
            n = choose_num_splits(num_seqs, kv_heads, 1)
            assert 1 <= n <= prev, (kv_heads, num_seqs)  # never grows with the batch
            prev = n
        assert prev == 1  # a big batch fills the GPU without splits
    assert choose_num_splits(1, 1, 1) == MAX_SPLITS
    assert choose_num_splits(3, 8, 0) == choose_num_splits(3, 8, 1)  # max_query_len 0 counts as 1
    with pytest.raises(ValueError):
        choose_num_splits(0, 8, 1)
    with pytest.raises(ValueError):
        choose_num_splits(1, 0, 1)


# ---------------------------------------------------------------------------------------
# The split kernel and the combine, on CPU (interpreter)


@cpu_only
@pytest.mark.parametrize(
    ("dtype", "block_size"), [(torch.float32, 16), (torch.float16, 32)], ids=["fp32-bs16", "fp16-bs32"]
)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (4, 2), (8, 2)], ids=["g1", "g2", "g4"])
@pytest.mark.parametrize("num_splits", [1, 2, 3, 7])
def test_split_decode(num_splits: int, num_heads: int, num_kv_heads: int, dtype: torch.dtype, block_size: int) -> None:
    # BLOCK_N 16: the 97-token context has 7 key steps (every split busy at 7 splits), the
    # 5- and 40-token ones fewer steps than splits (empty splits).
    b = make_batch([1, 1, 1], [5, 40, 97], num_heads, num_kv_heads, 64, block_size, dtype, seed=num_splits)
    check(b, 0.125, dtype, num_splits=num_splits, block_n=16)


@cpu_only
@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_split_decode_head_dim_128_default_tiles(dtype: torch.dtype) -> None:
    # Default BLOCK_N (64): a 1-token context, one of exactly 64, and one just past it.
    b = make_batch([1, 1, 1], [1, 64, 65], 4, 2, 128, 16, dtype, seed=11)
    check(b, 128**-0.5, dtype, num_splits=3)


@cpu_only
@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize(("block_m", "num_splits"), [(16, 2), (32, 3), (64, 7), (None, None)])
def test_split_mixed_batch(block_m: int | None, num_splits: int | None, dtype: torch.dtype) -> None:
    # Prefill chunks and decodes in one launch, GQA group 2, several query tiles per chunk:
    # a decode; a 19-token chunk over 18 cached tokens; a prompt from scratch (its early rows
    # see no key of the later splits: the causal case of an empty part); a decode; and a
    # prefix-cache hit (16 queries over 80 cached keys).
    b = make_batch([1, 19, 40, 1, 16], [33, 37, 40, 16, 96], 4, 2, 64, 16, dtype, seed=3)
    check(b, 0.125, dtype, num_splits=num_splits, block_m=block_m, block_n=16)


@cpu_only
@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("num_splits", [3, None])
def test_split_padding_rows_untouched(num_splits: int | None, dtype: torch.dtype) -> None:
    # As under CUDA graphs: sequence slots with no queries and no context (mid-batch and at
    # the end), and query rows past query_start_loc[-1]; the latter must stay untouched.
    b = make_batch([1, 0, 9, 1, 0, 0], [30, 0, 41, 2, 0, 0], 8, 2, 64, 16, dtype, seed=4, pad_tokens=5)
    check(b, 0.125, dtype, num_splits=num_splits, block_n=16)


@cpu_only
@pytest.mark.parametrize("num_splits", [2, 7])
def test_split_never_reads_outside_the_context(num_splits: int) -> None:
    # NaN in every unused cache slot (other blocks, the tails of last blocks): a split may
    # only touch its own keys, and empty splits nothing at all.
    b = make_batch([1, 1, 12], [3, 50, 60], 4, 2, 64, 16, torch.float32, seed=5, poison_unused=True)
    out = check(b, 0.125, torch.float32, num_splits=num_splits, block_n=16)
    assert bool(torch.isfinite(out).all())


@cpu_only
@pytest.mark.parametrize(("dtype", "num_splits"), [(torch.float32, 3), (torch.float16, 1)], ids=["fp32-split3", "fp16"])
def test_offsets_i64(num_splits: int, dtype: torch.dtype) -> None:
    # The 64-bit address arithmetic (a cache past int32 offsets; these small caches default to
    # 32-bit): NaN in every unused slot shows it reads only its own keys; decodes, a chunk over a
    # cached prefix, a prompt from scratch, an empty sequence slot and padding rows.
    b = make_batch([1, 19, 0, 40, 1], [33, 37, 0, 40, 70], 4, 2, 64, 16, dtype, seed=8, pad_tokens=3,
                   poison_unused=True)
    out = check(b, 0.125, dtype, num_splits=num_splits, block_n=16, offsets_i32=False)
    assert bool(torch.isfinite(out[: b.num_real_tokens]).all())


def test_cache_offsets_fit_i32() -> None:
    assert cache_offsets_fit_i32(torch.empty(2, 100, 16, 8, 128, device="meta"))
    # One half of the cache: 2**31 elements end at offset 2**31 - 1, the largest int32; a block more
    # does not fit.
    assert cache_offsets_fit_i32(torch.empty(2, 2**31 // (16 * 8 * 128), 16, 8, 128, device="meta"))
    assert not cache_offsets_fit_i32(torch.empty(2, 2**31 // (16 * 8 * 128) + 1, 16, 8, 128, device="meta"))
    # Strides count, not sizes: a narrow view of a wide cache.
    wide = torch.empty(2, 2**21, 16, 8, 128, device="meta")
    assert not cache_offsets_fit_i32(wide[:, :, :, :1])


@cpu_only
def test_split_sharp_softmax_is_stable() -> None:
    # Scores in the hundreds (log2 units): the combine must subtract the max lse.
    b = make_batch([1, 1, 7], [20, 90, 70], 4, 2, 64, 16, torch.float32, seed=6)
    out = check(b, 3.0, torch.float32, num_splits=7, block_n=16)
    assert bool(torch.isfinite(out).all())


@cpu_only
def test_combine_splits_weights_and_empty_parts() -> None:
    # Direct check of the reduce: -inf parts weigh 0 and their (NaN) outputs are never
    # read, lse values far apart don't overflow, padding rows stay untouched.
    g = torch.Generator().manual_seed(7)
    splits, tokens, heads, dim = 5, 4, 3, 80
    part = torch.randn(splits, tokens, heads, dim, generator=g)
    lse = torch.randn(splits, tokens, heads, generator=g) * 300.0  # log2 units
    lse[1:, 0] = float("-inf")  # token 0: only split 0 has keys
    lse[[0, 2, 4], 1, 1] = float("-inf")  # token 1, head 1: splits 1 and 3 only
    part[lse == float("-inf")] = float("nan")
    query_start_loc = torch.tensor([0, 2, 3], dtype=torch.int32)  # token 3 is padding
    out = torch.full((tokens, heads, dim), 7.0)
    combine_splits(part, lse, query_start_loc, out)

    w = torch.softmax(lse * torch.log(torch.tensor(2.0)), dim=0)  # exp2 weights, normalised
    expected = (w[..., None] * torch.nan_to_num(part, nan=0.0)).sum(0)
    torch.testing.assert_close(out[:3], expected[:3], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[0], part[0, 0])
    assert bool((out[3] == 7.0).all())


@cpu_only
def test_one_split_uses_no_scratch_or_reduce(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = pa.combine_splits

    def spy(partial_out: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
        calls.append(partial_out.shape[0])
        return real(partial_out, *args)

    monkeypatch.setattr(pa, "combine_splits", spy)
    b = make_batch([1] * 8, [3, 9, 17, 33, 5, 20, 40, 2], 4, 4, 64, 16, torch.float32, seed=8)
    check(b, 0.125, torch.float32, num_splits=1)
    assert calls == []
    # 8 decodes x 4 KV heads = 32 programs: already 2 per (stand-in) CPU SM, so no split.
    assert choose_num_splits(8, 4, 1, pa._CPU_NUM_SMS, num_tokens=8) == 1
    check(b, 0.125, torch.float32)
    assert calls == []
    # A small batch splits by default, into what choose_num_splits says.
    small = make_batch([1, 1], [50, 70], 4, 2, 64, 16, torch.float32, seed=9)
    check(small, 0.125, torch.float32, block_n=16)
    assert calls == [choose_num_splits(2, 2, 1, pa._CPU_NUM_SMS, num_tokens=2)] and calls[0] > 1


def test_rejects_bad_num_splits() -> None:
    b = make_batch([1], [5], 4, 2, 64, 16, torch.float32)
    for bad in (0, -1, MAX_SPLITS + 1):
        with pytest.raises(ValueError, match="num_splits"):
            b.run(1.0, num_splits=bad)


# ---------------------------------------------------------------------------------------
# GPU: compiled kernels, bf16, serving shapes (8 KV heads, head_dim 128, contexts to 4096)


def _contexts(batch: int) -> list[int]:
    if batch == 1:
        return [4096]
    if batch == 4:
        return [1, 300, 2049, 4096]
    return [1 + (4095 * i) // (batch - 1) for i in range(batch)]


@pytest.mark.parametrize("num_splits", [None, 1, 5, MAX_SPLITS])
@pytest.mark.parametrize("batch", [1, 4, 64])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(16, 8), (32, 8)], ids=["g2", "g4"])
@gpu_only
def test_split_decode_gpu(num_heads: int, num_kv_heads: int, batch: int, num_splits: int | None) -> None:
    dtype = torch.bfloat16
    seq_lens = _contexts(batch)
    b = make_batch([1] * batch, seq_lens, num_heads, num_kv_heads, 128, 16, dtype, "cuda", seed=batch)
    check(b, 128**-0.5, dtype, num_splits=num_splits)


@pytest.mark.parametrize(("block_n", "num_warps", "num_stages", "maxnreg", "offsets_i32"),
                         [(None, None, None, None, None), (None, None, None, None, False), (128, 4, 2, None, False),
                          (64, 4, 2, None, None), (64, 4, 3, None, None), (32, 4, 3, None, None),
                          (128, 8, None, None, None), (128, 4, 2, 128, None)])
@gpu_only
def test_decode_launches_gpu(block_n: int | None, num_warps: int | None, num_stages: int | None, maxnreg: int | None,
                             offsets_i32: bool | None) -> None:
    # The bf16 decode launches the benchmark sweeps, at the 8B shape: 64 contexts of 1..4096 keys.
    b = make_batch([1] * 64, _contexts(64), 32, 8, 128, 16, torch.bfloat16, "cuda", seed=9)
    check(b, 128**-0.5, torch.bfloat16, num_splits=1, block_n=block_n, num_warps=num_warps,
          num_stages=num_stages, maxnreg=maxnreg, offsets_i32=offsets_i32)


@pytest.mark.parametrize(("num_stages", "num_splits"), [(3, 1), (3, 5)])
@gpu_only
def test_decode_block_ids_ahead_gpu(num_stages: int, num_splits: int) -> None:
    # The block ids a tile ahead over a bf16 cache, at the 8B shape, with padding rows.
    b = make_batch([1] * 64, _contexts(64), 32, 8, 128, 16, torch.bfloat16, "cuda", seed=9, pad_tokens=3)
    check(b, 128**-0.5, torch.bfloat16, num_splits=num_splits, num_stages=num_stages, bt_ahead=True)


@pytest.mark.parametrize("num_splits", [None, 1, 3, 16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(16, 8), (32, 8)], ids=["g2", "g4"])
@gpu_only
def test_split_mixed_gpu(num_heads: int, num_kv_heads: int, num_splits: int | None) -> None:
    dtype = torch.bfloat16
    # A prefix-cache hit (16 queries over 3,200 cached keys) alone, then with a prompt from
    # scratch, a chunk over a cached prefix, decodes and padding (as in a mixed graph).
    hit = make_batch([16], [3216], num_heads, num_kv_heads, 128, 16, dtype, "cuda", seed=20)
    check(hit, 128**-0.5, dtype, num_splits=num_splits)
    q_lens = [16, 1, 300, 1, 97, 1, 0, 0]
    seq_lens = [3216, 4096, 300, 1, 1500, 777, 0, 0]
    mixed = make_batch(q_lens, seq_lens, num_heads, num_kv_heads, 128, 16, dtype, "cuda", seed=21, pad_tokens=9)
    check(mixed, 128**-0.5, dtype, num_splits=num_splits)


@gpu_only
def test_split_under_cuda_graph_gpu() -> None:
    # One capture, replayed for other contexts: the split count and the scratch are fixed at
    # capture, the split ranges follow seq_lens on the device.
    dtype, num_heads, num_kv_heads, bs = torch.bfloat16, 16, 8, 16
    assert choose_num_splits(1, num_kv_heads, 1, pa._num_sms(torch.device("cuda")), num_tokens=1) > 1
    short = make_batch([1], [10], num_heads, num_kv_heads, 128, bs, dtype, "cuda", seed=30)
    long = make_batch([1], [4000], num_heads, num_kv_heads, 128, bs, dtype, "cuda", seed=31)
    kv_cache = long.kv_cache.clone()
    block_tables = torch.zeros_like(long.block_tables)
    block_tables[:, : short.block_tables.shape[1]] = short.block_tables
    kv_cache[:, : short.kv_cache.shape[1]] = short.kv_cache  # short's blocks are 0..n-1 too
    query = short.query.clone()
    seq_lens = short.seq_lens.clone()
    qsl = short.query_start_loc.clone()
    out = torch.empty_like(query)

    def launch() -> None:
        paged_attention(query, kv_cache, block_tables, seq_lens, qsl, 128**-0.5, 1, out=out)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        launch()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()

    graph.replay()
    torch.cuda.synchronize()
    assert_close(out, short.reference(128**-0.5), dtype)

    query.copy_(long.query)
    seq_lens.copy_(long.seq_lens)
    block_tables.copy_(long.block_tables)
    kv_cache.copy_(long.kv_cache)
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out, long.reference(128**-0.5), dtype)


@cpu_only
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_launch_one_program_per_sequence(num_splits: int) -> None:
    # max_query_len 1: no tile search, program i serves sequence i. Slots with no query (mid-batch
    # and at the end), padding rows, NaN outside the contexts; one split takes the decode tiles
    # (128 keys), three the split path.
    b = make_batch([1, 0, 1, 1, 0], [1, 0, 200, 129, 0], 4, 2, 128, 16, torch.float32, seed=6, pad_tokens=3,
                   poison_unused=True)
    check(b, 128**-0.5, torch.float32, num_splits=num_splits)


@cpu_only
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_block_ids_ahead(num_splits: int) -> None:
    # The block ids loaded a tile ahead, over a float cache: slots with no query, padding rows,
    # NaN outside the contexts, a context ending mid-tile.
    b = make_batch([1, 0, 1, 1, 0], [1, 0, 200, 129, 0], 4, 2, 64, 16, torch.float32, seed=6, pad_tokens=3,
                   poison_unused=True)
    out = check(b, 64**-0.5, torch.float32, num_splits=num_splits, block_n=32, bt_ahead=True)
    assert bool(torch.isfinite(out[: b.num_real_tokens]).all())


@cpu_only
def test_bt_ahead_mixed_batch() -> None:
    # Block ids a tile ahead in the searching launch: decodes, a chunk over a cached prefix, a
    # prompt from scratch, an empty slot, padding rows; a split ends some parts mid-sequence.
    b = make_batch([1, 19, 0, 40, 1], [33, 37, 0, 40, 70], 4, 2, 64, 16, torch.float16, seed=8, pad_tokens=3,
                   poison_unused=True)
    check(b, 0.125, torch.float16, num_splits=3, block_n=16, bt_ahead=True)


class _GridSpy:
    """Stands in for the attention kernel: records each launch's grid, then launches."""

    def __init__(self, kernel: object) -> None:
        self.kernel = kernel
        self.grids: list[tuple[int, ...]] = []

    def __getitem__(self, grid: tuple[int, ...]) -> object:
        self.grids.append(tuple(grid))
        return self.kernel[grid]  # type: ignore[index]


@cpu_only
@pytest.mark.parametrize("num_splits", [1, 3])
def test_multi_query_decode_launch(num_splits: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # Verify rows of speculative decoding: up to k + 1 = 5 queries per sequence, causal among
    # themselves, over a cached context; slots with no query and padding rows as in a verify
    # graph. Five queries x GQA group 4 fit one 32-row tile (8 queries), so the launch is one
    # program per sequence, and it equals both the reference and the searching launch with
    # the same tiles, bit for bit.
    spy = _GridSpy(pa._paged_attention_kernel)
    monkeypatch.setattr(pa, "_paged_attention_kernel", spy)
    q_lens, seq_lens = [5, 0, 3, 5, 1], [37, 0, 150, 5, 20]
    b = make_batch(q_lens, seq_lens, 8, 2, 32, 16, torch.float32, seed=12, pad_tokens=4, poison_unused=True)
    out = check(b, 32**-0.5, torch.float32, block_m=32, num_splits=num_splits)
    assert spy.grids == [(len(q_lens), 2, num_splits)]
    searched = torch.full_like(b.query, 7.0)
    paged_attention(b.query, b.kv_cache, b.block_tables, b.seq_lens, b.query_start_loc, 32**-0.5, 9, out=searched,
                    block_m=32, num_splits=num_splits)  # 9 queries > one tile: the tile search
    assert spy.grids[-1] == (b.query.shape[0] // 8 + len(q_lens), 2, num_splits)
    assert torch.equal(out, searched)


@pytest.mark.parametrize("batch", [1, 64])
@gpu_only
def test_multi_query_decode_gpu(batch: int) -> None:
    # The verify step of the 8B shape (32 heads over 8 KV heads, head_dim 128, k = 4), at the
    # default tiles and splits, against the reference.
    dtype = torch.bfloat16
    seq_lens = [s + 5 for s in _contexts(batch)]
    q_lens = [5 - (i % 3 == 2) * 2 for i in range(batch)]  # some rows with fewer drafts
    b = make_batch(q_lens, seq_lens, 32, 8, 128, 16, dtype, "cuda", seed=40 + batch, pad_tokens=5)
    check(b, 128**-0.5, dtype)
