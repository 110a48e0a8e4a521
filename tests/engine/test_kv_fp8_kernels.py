"""The Triton kernels with an fp8 (e4m3fn) KV cache against the torch reference.

Reading (paged attention) is checked on random fp8 caches. Writing (``write_kv``, the QKV
prologue) is checked bit for bit; on the CPU with values that are exact in e4m3 after the
scale, because the Triton interpreter's own fp32 -> fp8 rounding is not the hardware's (it
rounds ties away from zero and drops the carry into the exponent, so 1.97 becomes 1.0):
there the test covers the scale, the clamp and the slots, and the ``gpu`` cases cover the
rounding (``TRITON_INTERPRET=0 pytest tests/engine/test_kv_fp8_kernels.py -m gpu``).
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from tidal_engine.kernels import reference as ref  # noqa: E402
from tidal_engine.kernels.triton.kv_write import write_kv  # noqa: E402
from tidal_engine.kernels.triton.paged_attention import (  # noqa: E402
    FP8_DECODE_PRESETS,
    choose_fp8_decode,
    paged_attention,
)
from tidal_engine.kernels.triton.qkv_prologue import qkv_prologue  # noqa: E402
from tidal_engine.kernels.triton_backend import TritonAttentionBackend  # noqa: E402
from tidal_engine.layers.attention import TorchAttentionBackend  # noqa: E402
from tidal_engine.layers.kv_cache_dtype import FP8_E4M3_MAX, FP8_KV_DTYPE  # noqa: E402

from kernel_tolerances import assert_close  # noqa: E402
from test_kernels import make_batch  # noqa: E402

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")
_cpu = pytest.mark.skipif(not INTERPRETING, reason="CPU kernels need TRITON_INTERPRET=1")
_needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETING, reason="needs CUDA and TRITON_INTERPRET=0")
K_SCALE, V_SCALE = 0.5, 2.0  # powers of two: x / scale stays exact on the e4m3 grid


def fp8_cache(shape: tuple[int, ...], seed: int, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(shape, generator=g)).to(FP8_KV_DTYPE).to(device)


def on_fp8_grid(shape: tuple[int, ...], scale: float, g: torch.Generator) -> torch.Tensor:
    """Values whose ``x / scale`` is exactly an e4m3 number, a few beyond its range (clamped)."""
    x = (3 * torch.randn(shape, generator=g)).to(FP8_KV_DTYPE).float() * scale
    flat = x.view(-1)
    flat[::17] = 1000.0 * scale
    flat[5::23] = -1000.0 * scale
    return x


@pytest.mark.parametrize(
    ("device", "dtype"),
    [pytest.param("cpu", torch.float32, marks=_cpu, id="cpu-fp32"),
     pytest.param("cpu", torch.float16, marks=_cpu, id="cpu-fp16"),
     # A bf16 query over an fp8 cache runs both dots in fp16, so the interpreter can take it.
     pytest.param("cpu", torch.bfloat16, marks=_cpu, id="cpu-bf16")],
)
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize(("q_lens", "seq_lens"), [([1, 1, 1], [5, 17, 40]), ([1, 19, 1], [33, 37, 16])],
                         ids=["decode", "mixed"])
def test_paged_attention_reads_fp8_cache(
    q_lens: list[int], seq_lens: list[int], num_splits: int, device: str, dtype: torch.dtype
) -> None:
    b = make_batch(q_lens, seq_lens, 8, 2, 32, 16, dtype, device, seed=7)
    cache = fp8_cache(tuple(b.kv_cache.shape), 8, device)
    expected = TorchAttentionBackend().forward(b.query, cache, b.meta, 0.2, K_SCALE, V_SCALE)
    actual = paged_attention(
        b.query, cache, b.meta.block_tables, b.meta.seq_lens, b.meta.query_start_loc, 0.2, b.meta.max_query_len,
        block_n=16, num_splits=num_splits, k_scale=K_SCALE, v_scale=V_SCALE,
    )
    assert actual.dtype == dtype
    assert_close(actual, expected, dtype)


@_cpu
@pytest.mark.parametrize(("dtype", "q_lens", "seq_lens", "num_splits"),
                         [(torch.float32, [1, 1, 1], [5, 17, 40], 1), (torch.float16, [1, 19, 1], [33, 37, 16], 3)],
                         ids=["fp32-decode", "fp16-mixed-split"])
def test_paged_attention_fp8_offsets_i64(dtype: torch.dtype, q_lens: list[int], seq_lens: list[int],
                                         num_splits: int) -> None:
    """The 64-bit address arithmetic (a cache past int32 offsets; the small caches above take
    the 32-bit one) over an fp8 cache."""
    b = make_batch(q_lens, seq_lens, 8, 2, 32, 16, dtype, "cpu", seed=7)
    cache = fp8_cache(tuple(b.kv_cache.shape), 8, "cpu")
    expected = TorchAttentionBackend().forward(b.query, cache, b.meta, 0.2, K_SCALE, V_SCALE)
    actual = paged_attention(
        b.query, cache, b.meta.block_tables, b.meta.seq_lens, b.meta.query_start_loc, 0.2, b.meta.max_query_len,
        block_n=16, num_splits=num_splits, k_scale=K_SCALE, v_scale=V_SCALE, offsets_i32=False,
    )
    assert_close(actual, expected, dtype)


@pytest.mark.parametrize(
    ("device", "dtype"),
    [pytest.param("cpu", torch.float32, marks=_cpu, id="cpu-fp32"),
     pytest.param("cpu", torch.bfloat16, marks=_cpu, id="cpu-bf16")],
)
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize(("bt_ahead", "slot_sums"), [(False, False), (True, False), (True, True)],
                         ids=["rows", "bt", "bt-slot-sums"])
def test_paged_attention_fp8_decode_block_ids_ahead(bt_ahead: bool, slot_sums: bool, num_splits: int, device: str,
                                                    dtype: torch.dtype) -> None:
    """The one-query decode over an fp8 cache with its block ids loaded a tile ahead and without,
    and with the softmax row sums per key slot (all explicit, whatever choose_fp8_decode would
    pick); 3 splits leave the first sequence's second and third parts empty (rows without keys:
    their slot sums stay 0)."""
    b = make_batch([1, 1, 1], [5, 17, 40], 8, 2, 32, 16, dtype, device, seed=7)
    cache = fp8_cache(tuple(b.kv_cache.shape), 8, device)
    expected = TorchAttentionBackend().forward(b.query, cache, b.meta, 0.2, K_SCALE, V_SCALE)
    actual = paged_attention(b.query, cache, b.meta.block_tables, b.meta.seq_lens, b.meta.query_start_loc, 0.2, 1,
                             block_n=16, num_splits=num_splits, k_scale=K_SCALE, v_scale=V_SCALE, bt_ahead=bt_ahead,
                             slot_sums=slot_sums)
    assert actual.dtype == dtype
    assert_close(actual, expected, dtype)


@_cpu
def test_paged_attention_slot_sums_mixed_batch() -> None:
    """Row sums per key slot outside the decode launch: prefill rows with their causal masks
    (rows that see only part of a tile) and decodes, over an fp32 cache, split in 3."""
    b = make_batch([1, 19, 1], [33, 37, 16], 8, 2, 32, 16, torch.float32, "cpu", seed=7)
    expected = TorchAttentionBackend().forward(b.query, b.kv_cache, b.meta, 0.2)
    actual = paged_attention(b.query, b.kv_cache, b.meta.block_tables, b.meta.seq_lens, b.meta.query_start_loc, 0.2,
                             b.meta.max_query_len, block_n=16, num_splits=3, slot_sums=True)
    assert_close(actual, expected, torch.float32)


def test_choose_fp8_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset: block ids ahead, V widened by PTX and row sums per key slot (rows_bt_v_ss) for an
    unsplit launch of one wave (4 programs per SM), the plain rows launch for splits or more
    waves; set, the named preset."""
    monkeypatch.delenv("TIDAL_FP8_DECODE", raising=False)
    assert choose_fp8_decode(64, 8, 1, 132) == "rows_bt_v_ss"  # 512 programs <= 528
    assert choose_fp8_decode(66, 8, 1, 132) == "rows_bt_v_ss"
    assert choose_fp8_decode(67, 8, 1, 132) == "rows"
    assert choose_fp8_decode(256, 8, 1, 132) == "rows"
    assert choose_fp8_decode(1, 8, 32, 132) == "rows"
    monkeypatch.setenv("TIDAL_FP8_DECODE", "rows_bt")
    assert choose_fp8_decode(64, 8, 1, 132) == "rows_bt"
    monkeypatch.setenv("TIDAL_FP8_DECODE", "nope")
    with pytest.raises(ValueError, match="TIDAL_FP8_DECODE"):
        choose_fp8_decode(64, 8, 1, 132)


@_cpu
@pytest.mark.parametrize("preset", sorted(FP8_DECODE_PRESETS))
def test_fp8_decode_preset_from_environment(preset: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """TIDAL_FP8_DECODE forces the fp8 one-query decode's launch at the default tiles (64 keys
    over contexts of 9 and 70: one partial tile, then two); an unknown name is refused, where
    an explicit block_n or a float cache never reads it. (V's widening by inline PTX, v_ptx, is
    left out in the interpreter: there rows_bt_v_ss runs with its slot sums only; the gpu cases
    below run it.)"""
    monkeypatch.setenv("TIDAL_FP8_DECODE", preset)
    b = make_batch([1, 1], [9, 70], 8, 2, 16, 16, torch.float32, "cpu", seed=11)
    cache = fp8_cache(tuple(b.kv_cache.shape), 12, "cpu")
    args = (b.meta.block_tables, b.meta.seq_lens, b.meta.query_start_loc, 0.3, 1)
    actual = paged_attention(b.query, cache, *args, num_splits=1, k_scale=K_SCALE, v_scale=V_SCALE)
    assert_close(actual, TorchAttentionBackend().forward(b.query, cache, b.meta, 0.3, K_SCALE, V_SCALE), torch.float32)
    monkeypatch.setenv("TIDAL_FP8_DECODE", "nope")
    with pytest.raises(ValueError, match="TIDAL_FP8_DECODE"):
        paged_attention(b.query, cache, *args, num_splits=1)
    paged_attention(b.query, cache, *args, block_n=16, num_splits=1)
    paged_attention(b.query, b.kv_cache, *args, num_splits=1)


@_cpu
def test_fp8_cache_query_past_fp16_range_saturates() -> None:
    """A bf16 query beyond fp16's range (the fp8 path's dots run in fp16) is clamped, not
    turned into inf: a row of +-1e5 keeps its direction, so the softmax still picks the
    reference's key."""
    b = make_batch([1, 1], [20, 9], 4, 2, 16, 16, torch.bfloat16, "cpu", seed=3)
    g = torch.Generator().manual_seed(4)
    query = torch.where(torch.rand(b.query.shape, generator=g) < 0.5, -1.0e5, 1.0e5).to(torch.bfloat16)
    cache = fp8_cache(tuple(b.kv_cache.shape), 5, "cpu")
    expected = TorchAttentionBackend().forward(query, cache, b.meta, 0.25, K_SCALE, V_SCALE)
    actual = paged_attention(query, cache, b.meta.block_tables, b.meta.seq_lens, b.meta.query_start_loc, 0.25,
                             1, block_n=16, num_splits=1, k_scale=K_SCALE, v_scale=V_SCALE)
    assert torch.isfinite(actual).all()
    assert_close(actual, expected, torch.bfloat16)


@_cpu
def test_write_kv_stores_scaled_clamped_fp8() -> None:
    g = torch.Generator().manual_seed(9)
    key, value = on_fp8_grid((10, 2, 32), K_SCALE, g), on_fp8_grid((10, 2, 32), V_SCALE, g)
    slots = torch.randperm(64, generator=g)[:10]
    slots[3] = -1
    cache = fp8_cache((2, 4, 16, 2, 32), 10, "cpu")
    expected = cache.clone()
    ref.write_kv_ref(key, value, expected, slots, K_SCALE, V_SCALE)
    write_kv(key, value, cache, slots, K_SCALE, V_SCALE)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
    stored = expected.view(2, 64, 2, 32)[0, slots[0]].float()
    assert stored.abs().max() == FP8_E4M3_MAX  # the ±1000 entries saturate instead of turning NaN
    assert torch.equal(stored[stored.abs() < FP8_E4M3_MAX], (key[0] / K_SCALE)[stored.abs() < FP8_E4M3_MAX])


@_cpu
def test_backend_write_then_attend_fp8() -> None:
    # The protocol end to end with an fp8 cache: scatter this step's K/V, then attend.
    b = make_batch([1, 19, 1], [33, 37, 16], 8, 2, 32, 16, torch.float32, "cpu", seed=11)
    g = torch.Generator().manual_seed(12)
    t = b.query.shape[0]
    key, value = on_fp8_grid((t, 2, 32), K_SCALE, g), on_fp8_grid((t, 2, 32), V_SCALE, g)
    base = fp8_cache(tuple(b.kv_cache.shape), 13, "cpu")
    caches = {name: base.clone() for name in ("torch", "triton")}
    outs = {}
    for backend in (TorchAttentionBackend(), TritonAttentionBackend(block_n=16)):
        backend.write_kv(key, value, caches[backend.name], b.meta.slot_mapping, K_SCALE, V_SCALE)
        outs[backend.name] = backend.forward(b.query, caches[backend.name], b.meta, 0.125, K_SCALE, V_SCALE)
    assert torch.equal(caches["triton"].view(torch.uint8), caches["torch"].view(torch.uint8))
    assert_close(outs["triton"], outs["torch"], torch.float32)


@_cpu
def test_qkv_prologue_stores_fp8() -> None:
    # Position 0 rotates by nothing (cos 1, sin 0), so k and v reach the store unchanged and
    # stay on the e4m3 grid; q comes back in qkv's dtype as before.
    g = torch.Generator().manual_seed(14)
    heads, kv_heads, dim, tokens = 4, 2, 32, 6
    q = torch.randn(tokens, heads * dim, generator=g)
    k = on_fp8_grid((tokens, kv_heads * dim), K_SCALE, g)
    v = on_fp8_grid((tokens, kv_heads * dim), V_SCALE, g)
    qkv = torch.cat([q, k, v], dim=1)
    positions = torch.zeros(tokens, dtype=torch.int64)
    cos_sin = ref.build_cos_sin_cache(dim, 8)
    slots = torch.tensor([3, 40, -1, 17, 0, 63])
    cache = fp8_cache((2, 4, 16, kv_heads, dim), 15, "cpu")
    expected = cache.clone()
    args = (qkv, positions, cos_sin, None, None, 0.0)
    tail = (slots, heads, kv_heads, dim, K_SCALE, V_SCALE)
    q_ref = ref.qkv_prologue_ref(*args, expected, *tail)
    q_out = qkv_prologue(*args, cache, *tail)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
    torch.testing.assert_close(q_out, q_ref, atol=1e-6, rtol=1e-6)


def test_fp8_cache_checks() -> None:
    b = make_batch([1], [5], 4, 2, 32, 16, torch.float32, "cpu")
    half_cache = b.kv_cache.half()
    with pytest.raises(TypeError, match="neither"):
        paged_attention(b.query, half_cache, b.meta.block_tables, b.meta.seq_lens, b.meta.query_start_loc, 1.0, 1)
    with pytest.raises(TypeError, match="dtype"):
        write_kv(torch.zeros(1, 2, 32), torch.zeros(1, 2, 32), b.kv_cache.to(torch.int8), torch.zeros(1, dtype=torch.int64))


# ---------------------------------------------------------------------------------------
# GPU: compiled kernels, random bf16 values, the hardware's rounding.


@pytest.mark.gpu
@_needs_cuda
@pytest.mark.parametrize("with_norm", [False, True])
def test_fp8_writes_match_reference_gpu(with_norm: bool) -> None:
    g = torch.Generator().manual_seed(16)
    heads, kv_heads, dim, tokens = 32, 8, 128, 77
    qkv = (3 * torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g)).to("cuda", torch.bfloat16)
    positions = torch.randint(0, 4096, (tokens,), generator=g).cuda()
    cos_sin = ref.build_cos_sin_cache(dim, 4096, 1e6, device="cuda")
    slots = torch.randperm(10 * 16, generator=g)[:tokens].cuda()
    norms = [(1 + 0.2 * torch.randn(dim, generator=g)).to("cuda", torch.bfloat16) for _ in range(2)]
    weights = norms if with_norm else [None, None]
    cache = fp8_cache((2, 10, 16, kv_heads, dim), 17, "cuda")
    expected = cache.clone()
    tail = (slots, heads, kv_heads, dim, 0.37, 1.9)
    q_ref = ref.qkv_prologue_ref(qkv, positions, cos_sin, *weights, 1e-6, expected, *tail)
    q = qkv_prologue(qkv, positions, cos_sin, *weights, 1e-6, cache, *tail)
    # k's norm and rotation may round differently in the last bf16 bit (reduction order, fused
    # multiply-adds), which can move a value across an e4m3 rounding boundary: a sliver of
    # the stored bytes may then be one e4m3 step off, no more.
    differ = cache.view(torch.uint8) != expected.view(torch.uint8)
    assert differ.float().mean().item() <= 1e-2
    got, want = cache.float()[differ], expected.float()[differ]
    assert torch.all((got - want).abs() <= want.abs() / 8 + 2**-9)
    torch.testing.assert_close(q.float(), q_ref.float(), atol=4e-2, rtol=4e-2)
    key, value = qkv[:, :kv_heads * dim].view(tokens, kv_heads, dim), qkv[:, -kv_heads * dim:].view(tokens, kv_heads, dim)
    cache2 = fp8_cache((2, 10, 16, kv_heads, dim), 18, "cuda")
    expected2 = cache2.clone()
    ref.write_kv_ref(key, value, expected2, slots, 0.37, 1.9)
    write_kv(key, value, cache2, slots, 0.37, 1.9)
    assert torch.equal(cache2.view(torch.uint8), expected2.view(torch.uint8))


@pytest.mark.gpu
@_needs_cuda
def test_paged_attention_fp8_realistic_gpu() -> None:
    q_lens = [1] * 12 + [512, 97, 1]
    seq_lens = [300 + 97 * i for i in range(12)] + [1500, 97, 4000]
    b = make_batch(q_lens, seq_lens, 32, 8, 128, 16, torch.bfloat16, "cuda", seed=19)
    cache = fp8_cache(tuple(b.kv_cache.shape), 20, "cuda")
    expected = TorchAttentionBackend().forward(b.query, cache, b.meta, 128**-0.5, 0.8, 1.5)
    actual = TritonAttentionBackend().forward(b.query, cache, b.meta, 128**-0.5, 0.8, 1.5)
    assert_close(actual, expected, torch.bfloat16)


@pytest.mark.gpu
@_needs_cuda
@pytest.mark.parametrize("preset", sorted(FP8_DECODE_PRESETS))
@pytest.mark.parametrize("batch", [1, 64])
def test_fp8_decode_presets_gpu(batch: int, preset: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each TIDAL_FP8_DECODE launch at the 8B shape with the engine's split choice (batch 1
    splits, 64 does not), contexts of 1..4096 keys and padding rows, against the reference."""
    monkeypatch.setenv("TIDAL_FP8_DECODE", preset)
    seq_lens = [4096] if batch == 1 else [1 + (4095 * i) // (batch - 1) for i in range(batch)]
    b = make_batch([1] * batch, seq_lens, 32, 8, 128, 16, torch.bfloat16, "cuda", seed=23 + batch)
    cache = fp8_cache(tuple(b.kv_cache.shape), 24, "cuda")
    expected = TorchAttentionBackend().forward(b.query, cache, b.meta, 128**-0.5, 0.8, 1.5)
    query = torch.cat([b.query, torch.randn_like(b.query[:3])])
    out = torch.full_like(query, 7.0)
    paged_attention(query, cache, b.meta.block_tables, b.meta.seq_lens, b.meta.query_start_loc, 128**-0.5, 1,
                    out=out, k_scale=0.8, v_scale=1.5)
    assert_close(out[:batch], expected, torch.bfloat16)
    assert bool((out[batch:] == 7.0).all()), "padding rows were written"


@pytest.mark.gpu
@_needs_cuda
@pytest.mark.parametrize(("block_n", "num_warps", "maxnreg", "offsets_i32"),
                         [(None, None, None, None), (64, None, None, None), (128, None, None, None),
                          (256, None, None, None), (128, None, None, False), (128, 8, None, None),
                          (128, None, 168, None)])
def test_paged_attention_fp8_decode_tiles_gpu(block_n: int | None, num_warps: int | None, maxnreg: int | None,
                                              offsets_i32: bool | None) -> None:
    """The decode launch at the 8B shape with one split (the engine's pick at batch 64: 64-key
    tiles at a 128-register cap by default) and the other launches the benchmark sweeps: key
    tiles, warps, register caps, 64-bit address arithmetic."""
    seq_lens = [1 + 523 * i for i in range(1, 17)]
    b = make_batch([1] * 16, seq_lens, 32, 8, 128, 16, torch.bfloat16, "cuda", seed=21)
    cache = fp8_cache(tuple(b.kv_cache.shape), 22, "cuda")
    expected = TorchAttentionBackend().forward(b.query, cache, b.meta, 128**-0.5, 0.8, 1.5)
    actual = paged_attention(b.query, cache, b.meta.block_tables, b.meta.seq_lens, b.meta.query_start_loc,
                             128**-0.5, 1, block_n=block_n, num_splits=1, k_scale=0.8, v_scale=1.5,
                             num_warps=num_warps, maxnreg=maxnreg, offsets_i32=offsets_i32)
    assert_close(actual, expected, torch.bfloat16)
