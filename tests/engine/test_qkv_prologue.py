"""The fused QKV prologue (q/k norm + rotary + KV store in one kernel) vs what it replaces.

Two references: the torch composition ``kernels.reference.qkv_prologue_ref`` (close), and the
separate Triton kernels in the order the unfused layer runs them, ``rms_norm_heads`` →
``rotary_embedding`` → ``write_kv`` (bit-identical: the fused kernel keeps their rounding
points and their norm reduction tile). CPU cases run under the Triton interpreter (fp32/fp16,
small shapes: it is slow); ``gpu`` cases run compiled in bf16 with serving-sized shapes, with
``TRITON_INTERPRET=0 pytest tests/engine/test_qkv_prologue.py -m gpu`` on a CUDA machine.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from tidal_engine.kernels import reference as ref  # noqa: E402
from tidal_engine.kernels.fused import reset_fused_kernels_cache  # noqa: E402
from tidal_engine.kernels.triton import qkv_prologue as prologue_module  # noqa: E402
from tidal_engine.kernels.triton.kv_write import write_kv  # noqa: E402
from tidal_engine.kernels.triton.qkv_prologue import qkv_prologue  # noqa: E402
from tidal_engine.kernels.triton.rms_norm import rms_norm_heads  # noqa: E402
from tidal_engine.kernels.triton.rotary import rotary_embedding  # noqa: E402
from tidal_engine.kernels.triton_backend import TritonAttentionBackend  # noqa: E402
from tidal_engine.layers.attention import TorchAttentionBackend, set_attention_backend  # noqa: E402
from tidal_engine.layers.rotary import RotaryEmbedding  # noqa: E402
from tidal_engine.models import llama  # noqa: E402
from tidal_engine.models.loader import load_model, resolve_model  # noqa: E402
from tiny_models import SeqStep, allocate_kv_caches, build_metadata, make_tiny_model  # noqa: E402

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")
_cpu = pytest.mark.skipif(not INTERPRETING, reason="CPU kernels need TRITON_INTERPRET=1")
gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or INTERPRETING, reason="needs CUDA and TRITON_INTERPRET=0"
)
CPU_DTYPES = [
    pytest.param(torch.float32, marks=_cpu, id="cpu-fp32"),
    pytest.param(torch.float16, marks=_cpu, id="cpu-fp16"),
]
TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    # A norm statistic summed in another order can flip one rounding: one ulp, relative.
    torch.float16: dict(atol=2e-2, rtol=2e-2),
    torch.bfloat16: dict(atol=4e-2, rtol=4e-2),
}
LLAMA3_SCALING: dict[str, Any] = dict(
    rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
)
EPS = 1e-6


def layer_cos_sin(rotary: RotaryEmbedding) -> torch.Tensor:
    """The kernel table a layer passes: ``cos_sin_cache`` on CUDA; on CPU (where the layer
    doesn't build it) the same numbers from the halves of its cos/sin caches."""
    if rotary.cos_sin_cache is not None:
        return rotary.cos_sin_cache
    half = rotary.head_dim // 2
    return torch.cat((rotary.cos_cache[:, :half], rotary.sin_cache[:, :half]), dim=-1)


@dataclass
class Case:
    qkv: torch.Tensor  # [T, (H + 2*Hkv) * D], a slice of a wider buffer unless contiguous=True
    positions: torch.Tensor
    cos_sin: torch.Tensor
    q_norm_weight: torch.Tensor | None
    k_norm_weight: torch.Tensor | None
    kv_cache: torch.Tensor  # random noise everywhere, so untouched slots are checkable
    slots: torch.Tensor
    num_heads: int
    num_kv_heads: int
    head_dim: int

    def args(self, kv_cache: torch.Tensor) -> tuple[Any, ...]:
        return (
            self.qkv, self.positions, self.cos_sin, self.q_norm_weight, self.k_norm_weight, EPS,
            kv_cache, self.slots, self.num_heads, self.num_kv_heads, self.head_dim,
        )


def make_case(
    num_tokens: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str,
    *,
    norm: bool,
    contiguous: bool = False,
    num_padding: int = 2,
    max_position: int = 256,
    block_size: int = 16,
    seed: int = 0,
) -> Case:
    g = torch.Generator().manual_seed(seed)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if contiguous:
        qkv = 2 * torch.randn(num_tokens, width, generator=g)
    else:  # a GEMM output slice: token stride > row width, not starting at column 0
        qkv = (2 * torch.randn(num_tokens, width + 24, generator=g))[:, 8 : 8 + width]
    qkv = qkv.to(device=device, dtype=dtype)
    rotary = RotaryEmbedding(head_dim, max_position, 500000.0, LLAMA3_SCALING)
    cos_sin = layer_cos_sin(rotary).to(device)
    # Positions across the whole scaled table (low, blended and high frequencies all matter).
    positions = torch.randint(0, max_position, (num_tokens,), generator=g)
    positions[0] = max_position - 1
    num_blocks = -(-num_tokens // block_size) + 3
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    pad = torch.randperm(num_tokens, generator=g)[: min(num_padding, num_tokens - 1)]
    slots[pad] = -1  # padding tokens: q rows still computed, nothing stored
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    kv_cache = kv_cache.to(device=device, dtype=dtype)
    weights: list[torch.Tensor | None] = [None, None]
    if norm:
        weights = [(1 + 0.3 * torch.randn(head_dim, generator=g)).to(device=device, dtype=dtype) for _ in range(2)]
    return Case(
        qkv, positions.to(device), cos_sin, weights[0], weights[1], kv_cache, slots.to(device),
        num_heads, num_kv_heads, head_dim,
    )


def separate_kernels(c: Case, kv_cache: torch.Tensor) -> torch.Tensor:
    """What the unfused GPU layer runs: norm (if any) → rotary → write_kv, each its own launch."""
    t, h, hkv, d = c.qkv.shape[0], c.num_heads, c.num_kv_heads, c.head_dim
    q, k, v = c.qkv.split([h * d, hkv * d, hkv * d], dim=-1)
    if c.q_norm_weight is not None and c.k_norm_weight is not None:
        q = rms_norm_heads(q.reshape(t, h, d), c.q_norm_weight, EPS).reshape(t, -1)
        k = rms_norm_heads(k.reshape(t, hkv, d), c.k_norm_weight, EPS).reshape(t, -1)
    q, k_rot = rotary_embedding(c.positions, q.contiguous(), k.contiguous(), c.cos_sin, d, inplace=True)
    assert k_rot is not None
    write_kv(k_rot.view(t, hkv, d), v.contiguous().view(t, hkv, d), kv_cache, c.slots)
    return q.view(t, h, d)


def check_against_both(c: Case, dtype: torch.dtype) -> None:
    caches = {name: c.kv_cache.clone() for name in ("fused", "separate", "ref")}
    qkv_before = c.qkv.clone()
    q = qkv_prologue(*c.args(caches["fused"]))
    assert torch.equal(c.qkv, qkv_before), "the prologue must not write its input"
    q_ref = ref.qkv_prologue_ref(*c.args(caches["ref"]))
    # Last: with one token, q.contiguous() of a [1, N] slice is the slice itself, so the
    # separate path's in-place rotary may write into qkv (harmless in the layer, not here).
    q_sep = separate_kernels(c, caches["separate"])

    assert q.shape == (c.qkv.shape[0], c.num_heads, c.head_dim) and q.dtype == dtype and q.is_contiguous()
    # (b) bit-identical to the kernels it replaces, q and every byte of the cache.
    assert torch.equal(q, q_sep)
    assert torch.equal(caches["fused"], caches["separate"])
    # (a) close to the torch composition.
    torch.testing.assert_close(q.float(), q_ref.float(), **TOL[dtype])
    torch.testing.assert_close(caches["fused"].float(), caches["ref"].float(), **TOL[dtype])
    # Slots -1 (and slots no token maps to) keep their old contents exactly.
    flat = caches["fused"].view(2, -1, c.num_kv_heads, c.head_dim)
    written = torch.zeros(flat.shape[1], dtype=torch.bool, device=flat.device)
    written[c.slots[c.slots >= 0]] = True
    assert torch.equal(flat[:, ~written], c.kv_cache.view(2, -1, c.num_kv_heads, c.head_dim)[:, ~written])
    # v is stored as is.
    hd = c.num_heads * c.head_dim
    kvd = c.num_kv_heads * c.head_dim
    keep = c.slots >= 0
    v_in = c.qkv[keep, hd + kvd :].reshape(-1, c.num_kv_heads, c.head_dim)
    assert torch.equal(flat[1, c.slots[keep]], v_in)


# ---------------------------------------------------------------------------------------
# CPU (interpreter)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("norm", [True, False], ids=["qk_norm", "no_norm"])
def test_matches_reference_and_separate_kernels(
    norm: bool, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    c = make_case(6, num_heads, num_kv_heads, head_dim, dtype, "cpu", norm=norm, seed=head_dim + num_kv_heads)
    check_against_both(c, dtype)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_odd_shapes(dtype: torch.dtype) -> None:
    # Padded tiles: 3 q heads / 1 kv head (group 3), head_dim 80 (halves of 40 padded to 64),
    # a contiguous qkv, int32 indices, block size 4.
    c = make_case(5, 3, 1, 80, dtype, "cpu", norm=True, contiguous=True, block_size=4, seed=11)
    c.positions, c.slots = c.positions.int(), c.slots.int()
    check_against_both(c, dtype)


@_cpu
def test_all_padding_and_empty() -> None:
    # A batch of padding only (e.g. a CUDA graph's spare rows): q rows come out, the cache
    # doesn't change. An empty batch launches nothing.
    c = make_case(3, 4, 2, 64, torch.float32, "cpu", norm=True, seed=3)
    c.slots = torch.full_like(c.slots, -1)
    cache = c.kv_cache.clone()
    q = qkv_prologue(*c.args(cache))
    assert torch.equal(cache, c.kv_cache)
    assert torch.equal(q, separate_kernels(c, c.kv_cache.clone()))
    empty = qkv_prologue(
        c.qkv[:0], c.positions[:0], c.cos_sin, None, None, EPS, cache, c.slots[:0], 4, 2, 64
    )
    assert empty.shape == (0, 4, 64)


@_cpu
def test_casts_to_cache_dtype() -> None:
    # An fp16 cache under an fp32 model: k is rounded like the unfused path (to the model
    # dtype, then the cache's), v cast once.
    c = make_case(4, 4, 2, 64, torch.float32, "cpu", norm=True, seed=5)
    fused, separate = c.kv_cache.half(), c.kv_cache.half()
    qkv_prologue(*c.args(fused))
    separate_kernels(c, separate)
    assert torch.equal(fused, separate)


def test_rejects_bad_inputs() -> None:
    c = make_case(2, 4, 2, 64, torch.float32, "cpu", norm=True, seed=7)
    args = list(c.args(c.kv_cache))
    with pytest.raises(ValueError, match="qkv must be"):
        qkv_prologue(c.qkv[:, :-64], *args[1:])
    with pytest.raises(ValueError, match="together"):
        qkv_prologue(*args[:4], None, *args[5:])
    with pytest.raises(ValueError, match="cos_sin_cache"):
        qkv_prologue(args[0], args[1], c.cos_sin[:, :32], *args[3:])
    with pytest.raises(ValueError, match="slot_mapping"):
        qkv_prologue(*args[:7], c.slots[:1], *args[8:])
    with pytest.raises(ValueError, match="kv_cache"):
        qkv_prologue(*args[:6], c.kv_cache[:, :, :, :1], *args[7:])


@pytest.fixture
def fused_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """Lets a test flip TIDAL_FUSED_KERNELS (call reset_fused_kernels_cache after each flip)."""
    reset_fused_kernels_cache()
    yield monkeypatch
    monkeypatch.undo()
    reset_fused_kernels_cache()


def _count_prologue_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]
    real = prologue_module.qkv_prologue

    def counting(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(prologue_module, "qkv_prologue", counting)
    return calls


def _run_tiny_qwen3(model: Any, ids: list[int], device: str) -> torch.Tensor:
    """A 9-token prefill (plus a padding row) then one decode step, on a paged cache."""
    block_size = 4
    table = [5, 1, 3]
    caches = [c.to(device) for c in allocate_kv_caches(model, num_blocks=8, block_size=block_size)]
    outs = []
    for step in (SeqStep(ids[:9], 0, table), SeqStep(ids[9:10], 9, table)):
        input_ids, positions, meta = build_metadata([step], block_size)
        num_real = input_ids.shape[0]
        if num_real > 1:  # (the torch backend's decode path takes no padding rows)
            # A padding row at the end, as a CUDA graph adds: slot -1, nothing stored.
            input_ids = torch.cat([input_ids, input_ids[-1:]])
            positions = torch.cat([positions, torch.zeros(1, dtype=torch.int64)])
            meta.slot_mapping = torch.cat([meta.slot_mapping, torch.full((1,), -1, dtype=torch.int64)])
        for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
            setattr(meta, name, getattr(meta, name).to(device))
        with torch.no_grad():
            hidden = model(input_ids.to(device), positions.to(device), caches, meta)
            outs.append(model.compute_logits(hidden[:num_real]).cpu())
    return torch.cat(outs)


@_cpu
def test_layer_wiring_on_cpu(tmp_path: Path, fused_env: pytest.MonkeyPatch) -> None:
    # use_fused is CUDA-only, so force the layer's decision here to drive the fused branch
    # (prologue + Triton attention, interpreted) through a tiny Qwen3, against the torch path.
    make_tiny_model("qwen3", tmp_path)
    model = load_model(resolve_model(str(tmp_path)), torch.float32, torch.device("cpu"))
    ids = torch.randint(0, model.config.vocab_size, (10,), generator=torch.Generator().manual_seed(0)).tolist()
    expected = _run_tiny_qwen3(model, ids, "cpu")

    calls = _count_prologue_calls(fused_env)
    fused_env.setattr(llama, "use_fused", lambda x: True)
    model.rotary_emb.cos_sin_cache = layer_cos_sin(model.rotary_emb)
    set_attention_backend(model, TritonAttentionBackend())
    actual = _run_tiny_qwen3(model, ids, "cpu")
    assert calls[0] == 2 * model.config.num_hidden_layers
    assert (actual - expected).abs().max().item() <= 1e-4


# ---------------------------------------------------------------------------------------
# GPU (compiled)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("num_tokens", [1, 7, 256, 2048])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(16, 8), (32, 8)])
@pytest.mark.parametrize("norm", [True, False], ids=["qk_norm", "no_norm"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_realistic_gpu(num_tokens: int, num_heads: int, num_kv_heads: int, norm: bool, dtype: torch.dtype) -> None:
    c = make_case(
        num_tokens, num_heads, num_kv_heads, 128, dtype, "cuda", norm=norm,
        num_padding=max(1, num_tokens // 8), max_position=8192, seed=num_tokens,
    )
    check_against_both(c, dtype)


@pytest.mark.gpu
@gpu
def test_layer_cos_sin_on_cuda_is_the_kernel_table() -> None:
    # The CPU tests rebuild the table from cos/sin halves; on CUDA the layer's own must match.
    with torch.device("cuda"):
        rotary = RotaryEmbedding(128, 4096, 500000.0, LLAMA3_SCALING)
    assert rotary.cos_sin_cache is not None
    half = 64
    rebuilt = torch.cat((rotary.cos_cache[:, :half], rotary.sin_cache[:, :half]), dim=-1)
    assert torch.equal(rotary.cos_sin_cache, rebuilt)


@pytest.mark.gpu
@gpu
def test_tiny_qwen3_fused_vs_torch_gpu(tmp_path: Path, fused_env: pytest.MonkeyPatch) -> None:
    make_tiny_model("qwen3", tmp_path)
    model = load_model(resolve_model(str(tmp_path)), torch.float32, torch.device("cuda"))
    assert model.rotary_emb.cos_sin_cache is not None
    ids = torch.randint(0, model.config.vocab_size, (10,), generator=torch.Generator().manual_seed(0)).tolist()
    calls = _count_prologue_calls(fused_env)

    fused_env.setenv("TIDAL_FUSED_KERNELS", "0")
    reset_fused_kernels_cache()
    set_attention_backend(model, TorchAttentionBackend())
    expected = _run_tiny_qwen3(model, ids, "cuda")
    assert calls[0] == 0

    fused_env.setenv("TIDAL_FUSED_KERNELS", "1")
    reset_fused_kernels_cache()
    set_attention_backend(model, TritonAttentionBackend())
    actual = _run_tiny_qwen3(model, ids, "cuda")
    assert calls[0] == 2 * model.config.num_hidden_layers
    assert (actual - expected).abs().max().item() <= 1e-4
