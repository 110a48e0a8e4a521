"""Triton kernels vs their torch references.

CPU cases run under the Triton interpreter (the root conftest.py sets TRITON_INTERPRET=1
before any kernel is defined), in fp32 and fp16 only: bf16 tl.dot is wrong in the
interpreter. GPU cases (marked ``gpu``) run compiled kernels in bf16/fp16; run them with
``TRITON_INTERPRET=0 pytest tests/engine/test_kernels.py -m gpu`` on a CUDA machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("triton")

from tidal_engine.kernels import reference as ref  # noqa: E402
from tidal_engine.kernels.triton.activation import silu_and_mul  # noqa: E402
from tidal_engine.kernels.triton.kv_write import write_kv  # noqa: E402
from tidal_engine.kernels.triton.paged_attention import paged_attention  # noqa: E402
from tidal_engine.kernels.triton.rms_norm import fused_add_rms_norm, rms_norm  # noqa: E402
from tidal_engine.kernels.triton.rotary import rotary_embedding  # noqa: E402
from tidal_engine.kernels.triton_backend import TritonAttentionBackend  # noqa: E402
from tidal_engine.layers.attention import AttentionMetadata, TorchAttentionBackend  # noqa: E402

# Same reading as Triton's own knob ("0"/unset: compiled).
INTERPRETING = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")

# (device, dtype) cases. Interpreted kernels take CPU tensors; compiled ones need CUDA.
_cpu = pytest.mark.skipif(not INTERPRETING, reason="CPU kernels need TRITON_INTERPRET=1")
_gpu = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(INTERPRETING, reason="GPU tests run compiled: set TRITON_INTERPRET=0"),
]
DEVICE_DTYPES = [
    pytest.param("cpu", torch.float32, marks=_cpu, id="cpu-fp32"),
    pytest.param("cpu", torch.float16, marks=_cpu, id="cpu-fp16"),
    pytest.param("cuda", torch.bfloat16, marks=_gpu, id="cuda-bf16"),
    pytest.param("cuda", torch.float16, marks=_gpu, id="cuda-fp16"),
]
from kernel_tolerances import assert_close  # noqa: E402


# ---------------------------------------------------------------------------------------
# Attention


@dataclass
class Batch:
    query: torch.Tensor  # [T, H, D]
    kv_cache: torch.Tensor  # [2, blocks, block_size, Hkv, D], random everywhere
    meta: AttentionMetadata


def make_batch(
    q_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
) -> Batch:
    """Random query and cache; each sequence's blocks are a random permutation of the pool."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [(s + block_size - 1) // block_size for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # a few unused blocks, full of noise too
    perm = torch.randperm(num_blocks, generator=g)
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = perm[used : used + n]
        used += n
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=g)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    slots = []
    for i, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        for pos in range(seq_len - q_len, seq_len):
            slots.append(int(block_tables[i, pos // block_size]) * block_size + pos % block_size)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=list(seq_lens),
    )
    return Batch(query.to(device=device, dtype=dtype), kv_cache.to(device=device, dtype=dtype), meta)


# (q_lens, seq_lens). Lengths cross block boundaries (16, 32) and are not tile multiples.
BATCHES = {
    "decode": ([1, 1, 1], [5, 17, 40]),
    "prefill": ([7, 33, 20], [7, 33, 20]),
    # A 19-token chunk whose first 18 tokens are cached (straddling blocks), plus decodes.
    "mixed": ([1, 19, 1], [33, 37, 16]),
}


@pytest.mark.parametrize(("device", "dtype"), DEVICE_DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 2)], ids=["mha", "gqa4"])
@pytest.mark.parametrize("kind", list(BATCHES))
def test_paged_attention_matches_torch(
    kind: str, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, device: str, dtype: torch.dtype
) -> None:
    q_lens, seq_lens = BATCHES[kind]
    b = make_batch(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device)
    expected = TorchAttentionBackend().forward(b.query, b.kv_cache, b.meta, head_dim**-0.5)
    # BLOCK_N=16 so every sequence takes several inner iterations, some ending mid-block.
    actual = TritonAttentionBackend(block_n=16).forward(b.query, b.kv_cache, b.meta, head_dim**-0.5)
    assert actual.shape == b.query.shape and actual.dtype == dtype
    assert_close(actual, expected, dtype)


@pytest.mark.parametrize(("device", "dtype"), DEVICE_DTYPES)
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "q_lens", "seq_lens"),
    [
        (14, 2, 64, [1, 12, 1], [9, 30, 33]),  # GQA group of 7 (Qwen2-0.5B), not a power of two
        (4, 1, 80, [3, 1], [21, 1]),  # head_dim 80 (padded to 128), a 1-token sequence
        (4, 4, 16, [1, 1, 1, 1, 1], [1, 2, 16, 17, 32]),  # smallest head_dim, many decodes
        (8, 8, 32, [0, 5, 0, 2], [4, 9, 3, 2]),  # sequences without queries this step
    ],
    ids=["group7", "hd80", "hd16-decodes", "empty-queries"],
)
def test_paged_attention_odd_shapes(
    num_heads: int, num_kv_heads: int, head_dim: int, q_lens: list[int], seq_lens: list[int], device: str,
    dtype: torch.dtype,
) -> None:
    b = make_batch(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, 16, dtype, device, seed=1)
    expected = TorchAttentionBackend().forward(b.query, b.kv_cache, b.meta, 0.3)
    actual = TritonAttentionBackend().forward(b.query, b.kv_cache, b.meta, 0.3)  # default tiles
    assert_close(actual, expected, dtype)


@pytest.mark.parametrize(("device", "dtype"), DEVICE_DTYPES)
@pytest.mark.parametrize("block_m", [16, 32])
def test_paged_attention_tile_sizes_and_padding(block_m: int, device: str, dtype: torch.dtype) -> None:
    # Several query tiles per sequence; extra padded query rows (as under CUDA graphs) are
    # left untouched.
    b = make_batch([1, 26, 9], [30, 26, 40], 8, 2, 64, 16, dtype, device, seed=2)
    expected = TorchAttentionBackend().forward(b.query, b.kv_cache, b.meta, 0.125)
    padded = torch.cat([b.query, torch.zeros(3, 8, 64, dtype=dtype, device=device)])
    out = torch.full_like(padded, 7.0)
    paged_attention(
        padded, b.kv_cache, b.meta.block_tables, b.meta.seq_lens, b.meta.query_start_loc, 0.125,
        b.meta.max_query_len, out=out, block_m=block_m, block_n=32,
    )
    assert_close(out[: b.query.shape[0]], expected, dtype)
    assert bool((out[b.query.shape[0] :] == 7.0).all())


@pytest.mark.parametrize(("device", "dtype"), DEVICE_DTYPES)
def test_backend_write_then_attend(device: str, dtype: torch.dtype) -> None:
    # The protocol end to end: scatter this step's K/V, then attend, vs the torch backend.
    b = make_batch([1, 19, 1], [33, 37, 16], 8, 2, 64, 16, dtype, device, seed=3)
    t = b.query.shape[0]
    g = torch.Generator().manual_seed(4)
    key = torch.randn(t, 2, 64, generator=g).to(device=device, dtype=dtype)
    value = torch.randn(t, 2, 64, generator=g).to(device=device, dtype=dtype)
    caches = {name: b.kv_cache.clone() for name in ("torch", "triton")}
    outs = {}
    for backend in (TorchAttentionBackend(), TritonAttentionBackend()):
        backend.write_kv(key, value, caches[backend.name], b.meta.slot_mapping)
        outs[backend.name] = backend.forward(b.query, caches[backend.name], b.meta, 0.125)
    assert torch.equal(caches["triton"], caches["torch"])
    assert_close(outs["triton"], outs["torch"], dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETING, reason="needs CUDA and TRITON_INTERPRET=0")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(32, 8), (14, 2), (16, 16)])
def test_paged_attention_realistic_gpu(num_heads: int, num_kv_heads: int, dtype: torch.dtype) -> None:
    # Serving-sized mix: long decodes, a long prefill chunk over a cached prefix, short prompts.
    q_lens = [1] * 12 + [512, 97, 1]
    seq_lens = [300 + 97 * i for i in range(12)] + [1500, 97, 4000]
    b = make_batch(q_lens, seq_lens, num_heads, num_kv_heads, 128, 16, dtype, "cuda", seed=5)
    expected = TorchAttentionBackend().forward(b.query, b.kv_cache, b.meta, 128**-0.5)
    actual = TritonAttentionBackend().forward(b.query, b.kv_cache, b.meta, 128**-0.5)
    assert_close(actual, expected, dtype)


def test_paged_attention_rejects_bad_inputs() -> None:
    b = make_batch([1], [5], 4, 2, 64, 16, torch.float32, "cpu")
    args = (b.meta.block_tables, b.meta.seq_lens, b.meta.query_start_loc, 1.0, 1)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_attention(torch.zeros(1, 3, 64), b.kv_cache, *args)
    with pytest.raises(TypeError, match="dtype"):
        paged_attention(b.query.half(), b.kv_cache, *args)
    with pytest.raises(ValueError, match="query must be"):
        paged_attention(b.query[0], b.kv_cache, *args)


# ---------------------------------------------------------------------------------------
# KV write


@pytest.mark.parametrize(("device", "dtype"), DEVICE_DTYPES)
@pytest.mark.parametrize(("num_kv_heads", "head_dim"), [(2, 64), (3, 80)])
def test_write_kv_matches_reference(num_kv_heads: int, head_dim: int, device: str, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(6)
    t, num_blocks, block_size = 10, 5, 16
    # key/value as strided slices of one fused buffer, as a QKV projection would give them.
    fused = torch.randn(t, 2 * num_kv_heads + 1, head_dim, generator=g).to(device=device, dtype=dtype)
    key, value = fused[:, :num_kv_heads], fused[:, num_kv_heads : 2 * num_kv_heads]
    slots = torch.randperm(num_blocks * block_size, generator=g)[:t]
    slots[[2, 7]] = -1  # not stored
    slots = slots.to(device)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(device=device, dtype=dtype)
    expected = cache.clone()
    ref.write_kv_ref(key, value, expected, slots)
    write_kv(key, value, cache, slots)
    assert torch.equal(cache, expected)


@_cpu
def test_write_kv_casts_to_cache_dtype() -> None:
    key = torch.randn(4, 2, 32)
    value = torch.randn(4, 2, 32)
    cache = torch.zeros(2, 2, 16, 2, 32, dtype=torch.float16)
    expected = cache.clone()
    slots = torch.tensor([0, 17, -1, 31])
    ref.write_kv_ref(key, value, expected, slots)
    write_kv(key, value, cache, slots)
    assert torch.equal(cache, expected)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv(key, value, cache, slots[:3])


# ---------------------------------------------------------------------------------------
# RMSNorm, rotary, SiLU-and-mul


@pytest.mark.parametrize(("device", "dtype"), DEVICE_DTYPES)
@pytest.mark.parametrize("shape", [(5, 64), (3, 4, 48)], ids=["2d", "per-head-3d"])
def test_rms_norm(shape: tuple[int, ...], device: str, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(7)
    x = (3 * torch.randn(*shape, generator=g)).to(device=device, dtype=dtype)
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(device=device, dtype=dtype)
    assert_close(rms_norm(x, weight, 1e-6), ref.rms_norm_ref(x, weight, 1e-6), dtype)

    residual = torch.randn(*shape, generator=g).to(device=device, dtype=dtype)
    out, new_residual = fused_add_rms_norm(x, residual, weight, 1e-6)
    exp_out, exp_residual = ref.fused_add_rms_norm_ref(x, residual, weight, 1e-6)
    assert_close(out, exp_out, dtype)
    assert torch.equal(new_residual, exp_residual)
    assert out.shape == x.shape and new_residual.shape == x.shape


def test_rms_norm_rejects_bad_weight() -> None:
    with pytest.raises(ValueError, match="weight"):
        rms_norm(torch.randn(2, 8), torch.ones(4), 1e-6)


@pytest.mark.parametrize(("device", "dtype"), DEVICE_DTYPES)
@pytest.mark.parametrize("rotary_dim", [64, 32], ids=["full", "partial"])
@pytest.mark.parametrize("inplace", [True, False], ids=["inplace", "copy"])
def test_rotary_embedding(rotary_dim: int, inplace: bool, device: str, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(8)
    t, h, hkv, d = 6, 4, 2, 64
    qkv = torch.randn(t, (h + 2 * hkv) * d, generator=g).to(device=device, dtype=dtype)
    q, k = qkv[:, : h * d], qkv[:, h * d : (h + hkv) * d]  # strided 2-D views
    positions = torch.tensor([0, 1, 5, 17, 100, 3], device=device)
    cache = ref.build_cos_sin_cache(rotary_dim, 128, base=10000.0, device=device)
    exp_q, exp_k = ref.rotary_embedding_ref(positions, q, k, cache, d)
    before = qkv.clone()
    out_q, out_k = rotary_embedding(positions, q, k, cache, d, inplace=inplace)
    assert out_k is not None
    assert_close(out_q, exp_q, dtype)
    assert_close(out_k, exp_k, dtype)
    if inplace:
        assert out_q.data_ptr() == q.data_ptr()
        assert torch.equal(qkv[:, (h + hkv) * d :], before[:, (h + hkv) * d :])  # v untouched
    else:
        assert torch.equal(qkv, before)
    # 3-D [T, H, D] query alone.
    q3 = before[:, : h * d].reshape(t, h, d).clone()
    out3, none = rotary_embedding(positions, q3, None, cache, d)
    assert none is None
    assert_close(out3, exp_q.reshape(t, h, d), dtype)


@pytest.mark.parametrize(("device", "dtype"), DEVICE_DTYPES)
@pytest.mark.parametrize("shape", [(7, 192), (2, 3, 128)])
def test_silu_and_mul(shape: tuple[int, ...], device: str, dtype: torch.dtype) -> None:
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(9)).to(device=device, dtype=dtype)
    out = silu_and_mul(x)
    assert out.shape == (*shape[:-1], shape[-1] // 2)
    assert_close(out, ref.silu_and_mul_ref(x), dtype)


def test_silu_and_mul_rejects_odd_width() -> None:
    with pytest.raises(ValueError, match="2 \\* I"):
        silu_and_mul(torch.randn(2, 5))


# ---------------------------------------------------------------------------------------
# Import hygiene


def test_engine_imports_without_triton() -> None:
    # With triton unimportable, the package, the references and the backend class still import;
    # only constructing the backend fails, with an ImportError.
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import tidal_engine, tidal_engine.kernels.reference, tidal_engine.kernels.triton\n"
        "from tidal_engine.kernels.triton_backend import TritonAttentionBackend\n"
        "assert not tidal_engine.kernels.triton.triton_available()\n"
        "try:\n    TritonAttentionBackend()\nexcept ImportError:\n    print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"
