"""Programmatic dependent launch (kernels/triton/_common.py, ``pdl_launch`` / ``pdl_wait``).

On Hopper the decode-step kernels launch so that each one's programs start while the kernel
before it finishes; each waits (griddepcontrol.wait) before it reads what an earlier kernel
wrote. A kernel that read too early would see the previous replay's values, so the GPU test
runs one decoder layer's chain of kernels (norm, bf16 GEMV, the q/k/v prologue, split-KV
attention and its combine, packed INT4 GEMVs plain and split-K, the FP8 GEMV, the few-row GEMV), every stage
reading the one before, in a CUDA graph with PDL and compares each replay, bit for bit, with the
same chain run eagerly without PDL (TIDAL_PDL=0)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from tidal_engine.kernels.triton import _common  # noqa: E402
from tidal_engine.kernels.triton._common import pdl_launch  # noqa: E402

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


def test_pdl_is_used_on_hopper_cuda_devices_only_and_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_common, "_capability", lambda index: {0: (9, 0), 1: (8, 9)}[index])
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.delenv("TIDAL_PDL", raising=False)
    assert pdl_launch(torch.device("cuda", 0))
    assert not pdl_launch(torch.device("cuda", 1))  # Ampere: no grid dependency control
    assert not pdl_launch(torch.device("cpu"))
    monkeypatch.setenv("TIDAL_PDL", "0")
    assert not pdl_launch(torch.device("cuda", 0))
    monkeypatch.setenv("TIDAL_PDL", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter runs no PTX
    assert not pdl_launch(torch.device("cuda", 0))


def _layer_chain(x: torch.Tensor, t: dict[str, torch.Tensor]) -> torch.Tensor:
    """One decoder layer's kernels at one token (Qwen3-8B's attention shape), each reading the
    previous one's output."""
    from tidal_engine.kernels.triton.gemv import GemvConfig, gemv, gemv_rows
    from tidal_engine.kernels.triton.paged_attention import paged_attention
    from tidal_engine.kernels.triton.qkv_prologue import qkv_prologue
    from tidal_engine.kernels.triton.quant_fp8 import Fp8GemvConfig, fp8_gemv
    from tidal_engine.kernels.triton.quant_int4 import PackedGemvConfig, int4_gemv
    from tidal_engine.kernels.triton.rms_norm import fused_add_rms_norm

    normed, residual = fused_add_rms_norm(x, t["residual"], t["norm"], 1e-6)
    qkv = gemv(normed, t["w_qkv"], None, GemvConfig(8, 1024, 8))
    q = qkv_prologue(qkv, t["positions"], t["cos_sin"], t["q_norm"], t["k_norm"], 1e-6, t["kv_cache"],
                     t["slots"], 32, 8, 128)
    attn = paged_attention(q, t["kv_cache"], t["block_tables"], t["seq_lens"], t["query_start_loc"], 128**-0.5, 1,
                           num_splits=8)
    o = int4_gemv(attn.view(1, 4096), *t["w_o"], 128, None, PackedGemvConfig(16, 1024, 4, 2))
    o = int4_gemv(o + residual, *t["w_o"], 128, None, PackedGemvConfig(16, 1024, 4, 2, split_k=2))
    o = fp8_gemv(o, *t["w_fp8"], None, Fp8GemvConfig(8, 512, 4, 4))
    return gemv_rows(torch.cat([o, normed]), t["w_qkv"][:4096], None, GemvConfig(16, 256, 4))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETING, reason="needs a CUDA device, kernels compiled")
def test_a_layers_kernels_in_a_cuda_graph_with_pdl_equal_the_chain_without_it(monkeypatch: pytest.MonkeyPatch) -> None:
    if not pdl_launch(torch.device("cuda")):
        pytest.skip("no programmatic dependent launch on this device")
    from tidal_engine.quantization.int4 import pack_rows
    from tidal_engine.quantization.quantizer import quantize_int4

    gen = torch.Generator("cuda").manual_seed(0)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(torch.bfloat16)

    q4, s4, z4 = quantize_int4(torch.randn(4096, 4096, generator=gen, device="cuda") * 0.02, 128, symmetric=False)
    blocks, context = 64, 700  # 44 cache blocks of 16 slots in use, in a shuffled order
    order = torch.randperm(blocks, generator=gen, device="cuda").to(torch.int32)
    positions = torch.tensor([context - 1], device="cuda")
    tensors = {
        "residual": randn(1, 4096), "norm": randn(4096, scale=0.1) + 1, "w_qkv": randn(6144, 4096, scale=0.02),
        "positions": positions, "cos_sin": torch.randn(4096, 128, generator=gen, device="cuda"),
        "q_norm": randn(128, scale=0.1) + 1, "k_norm": randn(128, scale=0.1) + 1,
        "kv_cache": randn(2, blocks, 16, 8, 128), "block_tables": order[None, :],
        "slots": (order[(context - 1) // 16] * 16 + (context - 1) % 16).long().view(1),
        "seq_lens": torch.tensor([context], device="cuda", dtype=torch.int32),
        "query_start_loc": torch.tensor([0, 1], device="cuda", dtype=torch.int32),
        "w_o": (pack_rows(q4), s4.to(torch.bfloat16), z4.to(torch.bfloat16)),
        "w_fp8": ((torch.randn(4096, 4096, generator=gen, device="cuda") * 8).to(torch.float8_e4m3fn),
                  torch.full((4096,), 0.003, device="cuda")),
    }
    static = torch.zeros(1, 4096, **bf16)
    _layer_chain(static, tensors)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _layer_chain(static, tensors)
    for seed in (1, 2, 3):
        static.copy_(torch.randn(1, 4096, generator=gen, device="cuda") * seed)
        graph.replay()
        torch.cuda.synchronize()
        got = out.clone()
        monkeypatch.setenv("TIDAL_PDL", "0")
        want = _layer_chain(static, tensors)
        monkeypatch.delenv("TIDAL_PDL")
        torch.cuda.synchronize()
        assert torch.isfinite(want).all()
        torch.testing.assert_close(got, want, rtol=0, atol=0)
