"""The Triton kernels of the quantized linears (kernels/triton/quant_fp8.py, quant_int4.py) against
the torch reference, the routing of few-row inputs to them, and their start-up choice.

CPU tests run the kernels in Triton's interpreter in float32 on tiny shapes; the gpu-marked ones
run them compiled in bf16 at the Qwen3-8B shapes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from tidal_engine.kernels.gemv_choice import load_choices, save_choices  # noqa: E402
from tidal_engine.kernels.triton.gemv import GEMV_CONFIGS, GemvConfig  # noqa: E402
from tidal_engine.kernels.triton.quant_fp8 import (  # noqa: E402
    FP8_GEMV_CONFIGS,
    Fp8GemvConfig,
    fp8_gemv,
    quantize_rows_fp8,
)
from tidal_engine.kernels.triton.quant_int4 import _split_workspaces  # noqa: E402
from tidal_engine.kernels.triton.quant_int4 import (  # noqa: E402
    INT4_GEMV_CONFIGS,
    GroupGemvConfig,
    PackedGemvConfig,
    TcGemvConfig,
    gemm_tiles,
    int4_gemm,
    int4_gemv,
    int4_tile_folds_silu_and_mul,
)
from tidal_engine.kernels.triton.activation import silu_and_mul  # noqa: E402
from tidal_engine.layers.activation import SiluAndMul  # noqa: E402
from tidal_engine.layers.linear import Linear, LinearBase  # noqa: E402
from tidal_engine.quantization.base import GEMV_MAX_ROWS  # noqa: E402
from tidal_engine.quantization.fp8 import FP8, Fp8LinearMethod, quantize_rows, quantize_tokens  # noqa: E402
from tidal_engine.quantization.int4 import Int4LinearMethod, dequantize  # noqa: E402
from tidal_engine.quantization.quantizer import quantize_tensor  # noqa: E402

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
_cpu = pytest.mark.skipif(not INTERPRETING, reason="CPU kernels need TRITON_INTERPRET=1")
_compiled_gpu = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETING,
                                   reason="needs a CUDA device, kernels compiled (TRITON_INTERPRET=0)")


def _int4_layer(fmt: str, n: int, k: int, group: int, symmetric: bool, seed: int = 0,
                device: str = "cpu", dtype: torch.dtype = torch.float32) -> tuple[Linear, torch.Tensor]:
    """A Linear on ``device`` loaded from ``fmt``'s on-disk tensors (Tidal's quantizer) and
    repacked, with the float32 weight those tensors stand for."""
    generator = torch.Generator(device).manual_seed(seed)
    w = torch.randn(n, k, generator=generator, device=device) * 0.05
    tensors, deq = quantize_tensor(fmt, w, group, symmetric=symmetric)
    has_zeros = not (fmt == "awq" and symmetric)
    method = Int4LinearMethod(fmt, group, zero_offset=1 if fmt == "gptq" else 0, has_zeros=has_zeros)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            layer = Linear(k, n, bias=False, method=method)
    finally:
        torch.set_default_dtype(prev)
    for name, t in tensors.items():
        param = getattr(layer, name)
        param.weight_loader(param, t)
    if fmt == "gptq":
        layer.g_idx.weight_loader(layer.g_idx, torch.arange(k, dtype=torch.int32, device=device) // group)
    method.process_weights_after_loading(layer)
    return layer, deq


def _fp8_layer(n: int, k: int, seed: int = 0, device: str = "cpu") -> Linear:
    torch.manual_seed(seed)
    layer = Linear(k, n, bias=False, method=Fp8LinearMethod(online=False))
    q, scale = quantize_rows(torch.randn(n, k) * 0.05)
    layer.weight.data.copy_(q)
    layer.weight_scale.data.copy_(scale)
    return layer.to(device)


# ---- CPU: the interpreter, float32 -------------------------------------------------------
@_cpu
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_gemv_matches_the_dequantized_weights(rows: int, bias: bool) -> None:
    # N and K not multiples of the tile: the masked edges must add nothing.
    torch.manual_seed(0)
    q, scale = quantize_rows(torch.randn(45, 300))
    b = torch.randn(45) if bias else None
    x = torch.randn(rows, 300)
    expected = torch.nn.functional.linear(x, q.float() * scale[:, None], b)
    # The plain loop, and the K loop software-pipelined (three K tiles: prologue, steady state, drain).
    for config in (GemvConfig(2, 64, 1), Fp8GemvConfig(8, 128, 2, 2)):
        got = fp8_gemv(x, q, scale, b, config)
        assert got.shape == (rows, 45) and got.dtype == torch.float32
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


@_cpu
def test_fp8_gemv_activates_gate_up_pairs_exactly_as_the_activation_kernel() -> None:
    # A gate_up projection's GEMV computes gate row i next to up row I + i and writes
    # silu(gate) * up: bit for bit the plain GEMV then the activation kernel (same sums, same
    # roundings), at one row and at several. I = 23: the last tile is partly empty.
    torch.manual_seed(0)
    q, scale = quantize_rows(torch.randn(46, 300))
    b = torch.randn(46)
    for rows in (1, 3):
        x = torch.randn(rows, 300)
        for config in (GemvConfig(16, 64, 1), Fp8GemvConfig(16, 128, 2, 2)):
            got = fp8_gemv(x, q, scale, b, config, silu_and_mul=True)
            assert got.shape == (rows, 23) and torch.equal(got, silu_and_mul(fp8_gemv(x, q, scale, b, config)))
    with pytest.raises(ValueError, match="even"):
        fp8_gemv(x, q, scale, b, GemvConfig(1, 64, 1), silu_and_mul=True)


@_cpu
def test_fp8_gate_up_folds_the_activation_only_into_its_small_batch_kernel(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import tidal_engine.kernels.triton.quant_fp8 as kernels

    layer = _fp8_layer(48, 64)
    act = SiluAndMul()
    calls: list[tuple[int, bool]] = []
    original = kernels.fp8_gemv
    monkeypatch.setattr(kernels, "fp8_gemv", lambda x, *a, **k: calls.append((x.shape[0], k.get("silu_and_mul", False)))
                        or original(x, *a, **k))
    inputs = {rows: torch.randn(rows, 64) for rows in (1, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1)}
    # No choice made: the reference path, then SiluAndMul, as without output_activation.
    assert all(torch.equal(layer(x, output_activation=act), act(layer(x))) for x in inputs.values())
    assert calls == []
    layer.gemv_config, layer.gemv_config_few = GemvConfig(8, 32, 1), GemvConfig(4, 64, 1)
    for x in inputs.values():  # the CPU SiluAndMul is torch's silu: the last bit may differ
        torch.testing.assert_close(layer(x, output_activation=act), act(layer(x)), rtol=1e-5, atol=1e-5)
    assert calls == [(1, True), (1, False), (GEMV_MAX_ROWS, True), (GEMV_MAX_ROWS, False)]
    # The start-up choice launches the folded kernel once per row count that folds.
    calls.clear()
    layer.output_activation_name = act.name
    layer.launch_folded(torch.float32, GEMV_MAX_ROWS + 2)
    assert calls == [(rows, True) for rows in range(1, GEMV_MAX_ROWS + 1)]


@_cpu
def test_tiny_fp8_model_decodes_the_same_logits_with_the_activation_in_the_gate_up_gemv(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A decode step (one row) of a tiny FP8 model with every quantized linear on the GEMV: the
    # gate_up projections fold SiLU-and-mul in, and the logits are those of the unfolded step.
    import tidal_engine.kernels.triton.quant_fp8 as kernels
    from tidal_engine.models.loader import load_model, resolve_model

    from tiny_models import SeqStep, allocate_kv_caches, forward_batch, make_tiny_model

    make_tiny_model("qwen3", tmp_path)
    model = load_model(resolve_model(str(tmp_path)), torch.float32, "cpu", quantization="fp8")
    for module in model.modules():
        if isinstance(module, LinearBase) and isinstance(module.method, Fp8LinearMethod):
            module.gemv_config = Fp8GemvConfig(64, 64, 1, 2)  # few programs: the interpreter is slow
    folded: list[bool] = []
    original = kernels.fp8_gemv
    monkeypatch.setattr(kernels, "fp8_gemv", lambda *a, **k: folded.append(k.get("silu_and_mul", False))
                        or original(*a, **k))
    prompt = list(range(3, 23))

    def decode_logits() -> torch.Tensor:
        caches = allocate_kv_caches(model, num_blocks=4, block_size=16)
        forward_batch(model, caches, [SeqStep(prompt, 0, [2, 0])], 16)  # prefill: the general path
        folded.clear()
        return forward_batch(model, caches, [SeqStep([7], len(prompt), [2, 0])], 16)[0]

    fused = decode_logits()
    assert folded.count(True) == model.config.num_hidden_layers and len(folded) == 4 * model.config.num_hidden_layers
    monkeypatch.setattr(Fp8LinearMethod, "folds_activation", lambda *args: False)
    unfused = decode_logits()
    assert folded.count(True) == 0 and len(folded) == 4 * model.config.num_hidden_layers
    torch.testing.assert_close(fused, unfused, rtol=1e-5, atol=1e-5 * unfused.abs().max().item())


@_cpu
def test_activation_quantization_kernel_matches_quantize_tokens() -> None:
    torch.manual_seed(0)
    x = torch.randn(5, 300) * torch.tensor([1.0, 1e-3, 0.0, 50.0, 1.0])[:, None]  # a zero row too
    x[4, 7] = 1e4  # an outlier sets its row's scale
    q_ref, s_ref = quantize_tokens(x)
    # The interpreter's own e4m3 conversion mis-rounds values that round up to a power of two,
    # so here the kernel stores the scaled, clamped values and torch rounds them (the GPU test
    # checks the e4m3 output itself).
    scaled, s = quantize_rows_fp8(x, out_dtype=torch.float32)
    assert s.shape == (5, 1)
    torch.testing.assert_close(s, s_ref, rtol=0, atol=0)
    assert scaled.abs().max() <= 448.0
    assert torch.equal(scaled.to(FP8).float(), q_ref.float())


@_cpu
@pytest.mark.parametrize("fmt,group,symmetric", [("awq", 128, False), ("awq", 64, True), ("gptq", 64, False),
                                                 ("gptq", 128, True)])
def test_int4_kernels_match_the_reference_for_both_layouts(fmt: str, group: int, symmetric: bool) -> None:
    layer, deq = _int4_layer(fmt, 40, 256, group, symmetric)
    weights = (layer.qweight, layer.scales, layer.zeros)
    torch.testing.assert_close(dequantize(*weights, group, torch.float32), deq, rtol=0, atol=0)
    for rows in (1, 3):
        x = torch.randn(rows, 256)
        b = torch.randn(40)
        expected = torch.nn.functional.linear(x, deq, b)
        got = int4_gemv(x, *weights, group, b, GemvConfig(8, 128, 2))
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
        got = int4_gemv(x, *weights, group, None, GemvConfig(32, 64, 1))  # BLOCK_N past N: masked rows
        torch.testing.assert_close(got, expected - b, rtol=1e-5, atol=1e-4)
    # By groups (x: the 3 rows): whole tiles; then rows and groups past the edges (16 ∤ 40, 4 groups a step).
    got = int4_gemv(x, *weights, group, b, GroupGemvConfig(8, 2 * group, 2))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
    got = int4_gemv(x, *weights, group, None, GroupGemvConfig(16, 4 * group, 1))
    torch.testing.assert_close(got, expected - b, rtol=1e-5, atol=1e-4)
    # On tensor cores (a dot of the integers q - z, scaled per group after it), whole and split
    # over K (fp32 partial sums in a shared workspace the last program empties); the split one
    # twice, so the second call finds the workspace and counters the first one left clean.
    for config in (TcGemvConfig(32, 64, 1, 1, 1), TcGemvConfig(32, 64, 1, 4, 2), TcGemvConfig(32, 64, 1, 4, 2)):
        got = int4_gemv(x, *weights, group, b, config)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
    workspace, counters = _split_workspaces[(x.device, 40)]
    assert not workspace.any() and not counters.any()
    x = torch.randn(20, 256)  # two row tiles of 16, one of them partial
    b = torch.randn(40)
    got = int4_gemm(x, *weights, group, None, tiles=(16, 16, 32, 1, 1))
    torch.testing.assert_close(got, torch.nn.functional.linear(x, deq), rtol=1e-5, atol=1e-4)
    # A step of a whole group (the GPU's tiles), column tiles past N, a bias.
    got = int4_gemm(x, *weights, group, b, tiles=(16, 32, group, 2, 1))
    torch.testing.assert_close(got, torch.nn.functional.linear(x, deq, b), rtol=1e-5, atol=1e-4)


@_cpu
def test_gemm_tiles_keep_a_step_inside_one_group() -> None:
    for group in (16, 32, 64, 128, 256, 48):
        for rows in (1, 16, 17, 256, 257, 8192):
            block_m, block_n, block_k, _, _ = gemm_tiles(rows, group)
            assert group % block_k == 0 and block_k % 16 == 0
        assert gemm_tiles(1, group)[:2] == (16, 32)
    assert gemm_tiles(128, 128)[:3] == (64, 64, 128)
    assert gemm_tiles(4096, 128)[:3] == (128, 128, 64)
    with pytest.raises(ValueError, match="multiple of 16"):
        gemm_tiles(4, 8)


@_cpu
def test_int4_kernels_refuse_what_they_cannot_read() -> None:
    layer, _ = _int4_layer("gptq", 16, 128, 64, False)
    weights = (layer.qweight, layer.scales, layer.zeros)
    with pytest.raises(ValueError, match="features"):
        int4_gemv(torch.randn(1, 120), *weights, 64, None, GemvConfig(8, 128, 2))
    with pytest.raises(ValueError, match="group size"):
        int4_gemm(torch.randn(2, 128), *weights, 48, None)
    with pytest.raises(ValueError, match="whole number of words"):
        int4_gemv(torch.randn(1, 128), *weights, 64, None, GemvConfig(8, 12, 2))
    with pytest.raises(ValueError, match="power-of-two number of groups"):
        int4_gemv(torch.randn(1, 128), *weights, 64, None, GroupGemvConfig(8, 192, 2))
    with pytest.raises(ValueError, match="does not tile"):  # 128 inputs, steps of 64, 4 ways
        int4_gemv(torch.randn(1, 128), *weights, 64, None, TcGemvConfig(64, 64, 4, 4))
    with pytest.raises(ValueError, match="does not tile"):  # a step across two groups
        int4_gemv(torch.randn(1, 128), *weights, 64, None, TcGemvConfig(64, 128, 4, 1))
    with pytest.raises(ValueError, match="up to 16 rows"):
        int4_gemv(torch.randn(17, 128), *weights, 64, None, TcGemvConfig(64, 64, 4, 1))


@_cpu
def test_int4_by_groups_gemv_activates_gate_up_pairs_exactly_as_the_activation_kernel() -> None:
    # gate row i next to up row I + i, then silu(gate) * up: bit for bit the plain by-groups GEMV
    # followed by the activation kernel (each row's sum is the same, rounded the same), at one
    # row and at several, with a bias. I = 20 in tiles of 8 pairs: the last tile is partly empty.
    layer, _ = _int4_layer("awq", 40, 256, 64, False)
    weights = (layer.qweight, layer.scales, layer.zeros)
    b = torch.randn(40)
    for rows in (1, 3):
        x = torch.randn(rows, 256)
        for config in (GroupGemvConfig(16, 128, 1), GroupGemvConfig(4, 256, 1)):
            got = int4_gemv(x, *weights, 64, b, config, silu_and_mul=True)
            assert got.shape == (rows, 20)
            assert torch.equal(got, silu_and_mul(int4_gemv(x, *weights, 64, b, config)))
    # Only the by-groups kernels fold, and only whole gate/up pairs a tile.
    assert int4_tile_folds_silu_and_mul(GroupGemvConfig(16, 128, 1), 40)
    assert int4_tile_folds_silu_and_mul(PackedGemvConfig(16, 1024, 4, 2), 24576)
    for config in (GemvConfig(8, 128, 2), TcGemvConfig(64, 64, 4, 1), None):
        assert not int4_tile_folds_silu_and_mul(config, 40)
    assert not int4_tile_folds_silu_and_mul(GroupGemvConfig(16, 128, 1), 41)
    with pytest.raises(ValueError, match="by-groups"):
        int4_gemv(x, *weights, 64, b, GemvConfig(8, 128, 2), silu_and_mul=True)
    with pytest.raises(ValueError, match="even"):
        int4_gemv(x, *weights, 64, b, GroupGemvConfig(1, 128, 1), silu_and_mul=True)


@_cpu
def test_int4_gate_up_folds_the_activation_only_into_its_by_groups_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    import tidal_engine.kernels.triton.quant_int4 as kernels

    layer, _ = _int4_layer("gptq", 48, 128, 64, False)
    act = SiluAndMul()
    calls: list[tuple[int, bool]] = []
    original = kernels.int4_gemv
    monkeypatch.setattr(kernels, "int4_gemv", lambda x, *a, **k: calls.append((x.shape[0], k.get("silu_and_mul", False)))
                        or original(x, *a, **k))
    inputs = {rows: torch.randn(rows, 128) for rows in (1, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1)}
    # No choice made: the reference path, then SiluAndMul, as without output_activation.
    assert all(torch.equal(layer(x, output_activation=act), act(layer(x))) for x in inputs.values())
    assert calls == []
    # A by-groups tile at one row folds; the by-words tile at a few rows runs plain, then SiluAndMul.
    layer.gemv_config, layer.gemv_config_few = GroupGemvConfig(8, 128, 1), GemvConfig(4, 64, 1)
    for x in inputs.values():  # the CPU SiluAndMul is torch's silu: the last bit may differ
        torch.testing.assert_close(layer(x, output_activation=act), act(layer(x)), rtol=1e-5, atol=1e-5)
    assert calls == [(1, True), (1, False), (GEMV_MAX_ROWS, False), (GEMV_MAX_ROWS, False)]
    # The start-up choice launches the folded kernel once per row count that folds (before any capture).
    calls.clear()
    layer.output_activation_name = act.name
    layer.launch_folded(torch.float32, GEMV_MAX_ROWS + 2)
    assert calls == [(1, True)]
    layer.gemv_config_few = GroupGemvConfig(16, 128, 1)
    calls.clear()
    layer.launch_folded(torch.float32, GEMV_MAX_ROWS + 2)
    assert calls == [(rows, True) for rows in range(1, GEMV_MAX_ROWS + 1)]


@_cpu
def test_choice_times_an_int4_gate_up_as_the_decode_step_runs_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A gate|up INT4 linear's candidates are timed with SiLU-and-mul: folded into a by-groups
    tile, after a tile that cannot fold and after the general path, so a tile that cannot fold
    pays for the activation kernel as it does in the step; a folded tile that disagrees with its
    plain form is not a candidate."""
    import tidal_engine.kernels.gemv_choice as choice
    import tidal_engine.kernels.triton.activation as activation_kernels
    from tidal_engine.quantization.int4 import Int4LinearMethod as Int4

    folds, plain_only, folds_wrong = GroupGemvConfig(8, 64, 1), GemvConfig(8, 64, 1), GroupGemvConfig(4, 64, 1)
    monkeypatch.setattr(Int4, "gemv_candidates", (folds, plain_only, folds_wrong))
    original = Int4.run_gemv_activated

    def broken(self, layer, x, weights, bias, config, activation):
        y = original(self, layer, x, weights, bias, config, activation)
        return y + 100.0 if config == folds_wrong else y

    monkeypatch.setattr(Int4, "run_gemv_activated", broken)
    activations: list[int] = []
    original_activation = activation_kernels.silu_and_mul
    monkeypatch.setattr(activation_kernels, "silu_and_mul", lambda y: activations.append(y.shape[-1])
                        or original_activation(y))
    outputs: dict = {}

    def fake_time(fns: dict, weights: list) -> dict:
        for candidate, fn in fns.items():
            activations.clear()
            outputs[candidate] = (fn(weights[0]), list(activations))
        return {candidate: {None: 10.0, folds: 5.0, plain_only: 4.0, folds_wrong: 1.0}[candidate] for candidate in fns}

    monkeypatch.setattr(choice, "time_in_graphs", fake_time)
    gate_up, _ = _int4_layer("gptq", 16, 64, 32, False)
    gate_up.output_activation_name = "silu_and_mul"
    cache: dict = {}
    choice.choose_gemv(torch.nn.ModuleList([gate_up]), cache, dtype=torch.float32)
    assert set(outputs) == {None, folds, plain_only}  # the wrong folded tile was never timed
    x = torch.randn(1, 64)
    for candidate, (out, activated) in outputs.items():
        assert out.shape[-1] == 8  # every candidate timed with the activation
        assert activated == ([] if candidate == folds else [16])  # folded: no activation kernel
    assert cache[(16, 64, "int4g32r1", False)] == plain_only and gate_up.gemv_config == plain_only
    torch.testing.assert_close(gate_up(x, output_activation=SiluAndMul()), silu_and_mul(gate_up(x)))


@_cpu
@pytest.mark.parametrize("kind", ["fp8", "gptq"])
def test_few_rows_go_to_the_chosen_small_batch_kernel(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if kind == "fp8":
        layer = _fp8_layer(24, 64)
        module, name = "tidal_engine.kernels.triton.quant_fp8", "fp8_gemv"
    else:
        layer, _ = _int4_layer("gptq", 24, 128, 64, False)
        module, name = "tidal_engine.kernels.triton.quant_int4", "int4_gemv"
    import importlib

    kernels = importlib.import_module(module)
    calls: list[int] = []
    original = getattr(kernels, name)
    monkeypatch.setattr(kernels, name, lambda x, *a, **k: calls.append(x.shape[0]) or original(x, *a, **k))
    inputs = {rows: torch.randn(rows, layer.in_features) for rows in (1, 2, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1)}
    general = {rows: layer(x) for rows, x in inputs.items()}  # no choice made: the reference everywhere
    assert calls == []
    layer.gemv_config = GemvConfig(8, 32, 1)
    assert layer(inputs[1]).shape == (1, 24) and calls == [1]
    assert layer(inputs[2]).shape == (2, 24) and calls == [1]  # no few-row choice yet
    layer.gemv_config_few = GemvConfig(4, 64, 1)
    out = {rows: layer(x) for rows, x in inputs.items()}
    assert calls == [1, 1, 2, GEMV_MAX_ROWS]  # past GEMV_MAX_ROWS: the general path
    torch.testing.assert_close(out[GEMV_MAX_ROWS + 1], general[GEMV_MAX_ROWS + 1], rtol=0, atol=0)
    # FP8's GEMV keeps the activations in full precision where the reference quantizes them.
    tolerance = {"rtol": 0.05, "atol": 0.05} if kind == "fp8" else {"rtol": 1e-5, "atol": 1e-4}
    for rows in (1, 2, GEMV_MAX_ROWS):
        torch.testing.assert_close(out[rows], general[rows], **tolerance)


def test_quantized_choices_survive_the_disk(tmp_path: Path) -> None:
    path = tmp_path / "choices.json"
    choices = {
        (4096, 1024, torch.bfloat16, False): GEMV_CONFIGS[1],
        (6144, 4096, "fp8r1", False): FP8_GEMV_CONFIGS[2],
        (4096, 4096, "fp8r1", False): Fp8GemvConfig(8, 512, 4, 4),  # its 3- and 6-stage twins are candidates too
        (4096, 4096, "fp8r4", False): Fp8GemvConfig(8, 512, 4, 6),
        (4096, 12288, "fp8r4", False): Fp8GemvConfig(8, 1024, 4, 4),
        (6144, 4096, "fp8r4", False): None,
        (4096, 12288, "int4g128r1", True): INT4_GEMV_CONFIGS[3],
    }
    save_choices(path, choices)
    assert load_choices(path, GEMV_CONFIGS) == choices
    # Every INT4 candidate has its own stored form (kernel, tile, split and stages tell them apart).
    choices = {(4096, 4096 + i, "int4g128r1", False): config for i, config in enumerate(INT4_GEMV_CONFIGS)}
    save_choices(path, choices)
    assert load_choices(path, GEMV_CONFIGS) == choices
    # A stored tile that is no longer a candidate is dropped (it gets timed again).
    save_choices(path, {(8, 8, "int4g64r1", False): GemvConfig(3, 24, 1), (8, 8, "unknownr1", False): None})
    assert load_choices(path, GEMV_CONFIGS) == {}


# ---- GPU: compiled, bf16, the Qwen3-8B shapes -------------------------------------------
QWEN3_8B_LINEARS = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]


@pytest.mark.gpu
@_compiled_gpu
@pytest.mark.parametrize("shape", QWEN3_8B_LINEARS)
@pytest.mark.parametrize("rows", [1, GEMV_MAX_ROWS])
def test_fp8_gemv_matches_gpu(shape: tuple[int, int], rows: int) -> None:
    n, k = shape
    torch.manual_seed(0)
    q, scale = quantize_rows(torch.randn(n, k, device="cuda") * 0.02)
    x = torch.randn(rows, k, device="cuda").to(torch.bfloat16)
    expected = torch.nn.functional.linear(x.float(), q.float() * scale[:, None])
    for config in FP8_GEMV_CONFIGS:
        got = fp8_gemv(x, q, scale, None, config).float()
        torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())



@pytest.mark.gpu
@_compiled_gpu
@pytest.mark.parametrize("rows", [1, GEMV_MAX_ROWS])
def test_fp8_gemv_with_silu_and_mul_matches_the_activation_kernel_gpu(rows: int) -> None:
    # The 8B gate_up projection, every candidate: the GEMV that activates gate/up pairs in its
    # epilogue gives the plain GEMV then the activation kernel to within one bf16 ulp of the
    # largest output, eagerly and replayed in a CUDA graph with a new input.
    n, k = 24576, 4096
    torch.manual_seed(0)
    q, scale = quantize_rows(torch.randn(n, k, device="cuda") * 0.02)
    x = torch.randn(rows, k, device="cuda").to(torch.bfloat16)
    for config in FP8_GEMV_CONFIGS:
        want = silu_and_mul(fp8_gemv(x, q, scale, None, config)).float()
        got = fp8_gemv(x, q, scale, None, config, silu_and_mul=True).float()
        torch.testing.assert_close(got, want, rtol=0, atol=2**-7 * want.abs().max().item())
    static = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_gemv(static, q, scale, None, FP8_GEMV_CONFIGS[0], silu_and_mul=True)
    static.copy_(torch.randn_like(static))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fp8_gemv(static, q, scale, None, FP8_GEMV_CONFIGS[0], silu_and_mul=True))


@pytest.mark.gpu
@_compiled_gpu
def test_activation_quantization_kernel_gpu() -> None:
    torch.manual_seed(0)
    x = (torch.randn(300, 12288, device="cuda") * 3).to(torch.bfloat16)
    x[7] = 0
    _, s_ref = quantize_tokens(x)
    q, s = quantize_rows_fp8(x)
    assert q.dtype == FP8
    # The kernel divides absmax by 448 exactly; torch on CUDA multiplies by 1/448, which is
    # one ulp off in about 2 rows of 3 (seen on the H200, 2026-12-01): scales agree to 1 ulp,
    # and the e4m3 values are exactly those of x divided by the kernel's scales.
    torch.testing.assert_close(s, s_ref, rtol=2.5e-7, atol=0)
    expected = (x.float() / s).clamp(-448.0, 448.0).to(FP8)
    assert torch.equal(q.float(), expected.float())


@pytest.mark.gpu
@_compiled_gpu
@pytest.mark.parametrize("fmt,group,symmetric", [("awq", 128, False), ("gptq", 128, True), ("gptq", 64, False)])
@pytest.mark.parametrize("shape", [(6144, 4096), (4096, 12288)])
def test_int4_kernels_match_gpu(fmt: str, group: int, symmetric: bool, shape: tuple[int, int]) -> None:
    n, k = shape
    layer, deq = _int4_layer(fmt, n, k, group, symmetric, device="cuda", dtype=torch.bfloat16)
    weights = (layer.qweight, layer.scales, layer.zeros)
    for rows in (1, GEMV_MAX_ROWS, 16, 128, 300):  # the GEMM's three tile classes
        x = torch.randn(rows, k, device="cuda").to(torch.bfloat16)
        expected = torch.nn.functional.linear(x.float(), deq)
        tol = {"rtol": 2e-2, "atol": 2e-2 * expected.abs().max().item()}
        torch.testing.assert_close(int4_gemm(x, *weights, group, None).float(), expected, **tol)
        if rows <= GEMV_MAX_ROWS:
            # Every candidate at groups of 128 (the benchmark's); one of each kernel at 64 (compiling costs).
            configs = INT4_GEMV_CONFIGS if group == 128 else (GroupGemvConfig(8, 1024, 4), GemvConfig(8, 512, 4),
                                                              TcGemvConfig(64, 64, 4, 4))
            for config in configs:
                try:
                    got = int4_gemv(x, *weights, group, None, config)
                except ValueError:  # the tile does not fit this shape (the choice skips it too)
                    continue
                torch.testing.assert_close(got.float(), expected, **tol)


@pytest.mark.gpu
@_compiled_gpu
def test_choice_sets_small_batch_kernels_and_they_replay_in_a_cuda_graph() -> None:
    from tidal_engine.kernels.gemv_choice import choose_gemv

    fp8 = _fp8_layer(6144, 4096, device="cuda")
    int4, _ = _int4_layer("awq", 4096, 4096, 128, False, device="cuda", dtype=torch.bfloat16)
    model = torch.nn.ModuleList([fp8, int4, torch.nn.Embedding(4, 8, dtype=torch.bfloat16, device="cuda")])
    cache: dict = {}
    counts = choose_gemv(model, cache)
    assert sum(counts.values()) == 2
    assert {key[2] for key in cache} == {"fp8r1", f"fp8r{GEMV_MAX_ROWS}", "int4g128r1", f"int4g128r{GEMV_MAX_ROWS}"}
    for layer in (fp8, int4):
        for rows in (1, GEMV_MAX_ROWS):
            x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
            eager = layer(x)
            static = x.clone()
            layer(static)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = layer(static)
            graph.replay()
            torch.cuda.synchronize()
            torch.testing.assert_close(out, eager, rtol=0, atol=0)
    # The INT4 GEMM (rows past the small-batch kernels) in a graph, each tile class compiled by the
    # choice's warm-up before any capture.
    for rows in (16, 128, 300):
        x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
        eager = int4(x)
        static = x.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = int4(static)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, eager, rtol=0, atol=0)


@pytest.mark.gpu
@_compiled_gpu
def test_split_k_gemvs_replay_in_a_cuda_graph() -> None:
    """The split-K GEMVs leave their shared workspace clean after every call, so replays of one
    graph holding several of them (two layers of one width, as a decode step has) keep giving
    the eager results."""
    layers = [_int4_layer("gptq", 4096, 4096, 128, False, seed=seed, device="cuda", dtype=torch.bfloat16)[0]
              for seed in (0, 1)]
    configs = (TcGemvConfig(64, 128, 4, 4), TcGemvConfig(64, 64, 4, 4), TcGemvConfig(128, 128, 8, 2))
    for rows in (1, GEMV_MAX_ROWS):
        static = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)

        def step() -> list[torch.Tensor]:
            return [int4_gemv(static, layer.qweight, layer.scales, layer.zeros, 128, None, config)
                    for layer in layers for config in configs]

        eager = step()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = step()
        for _ in range(3):
            static.copy_(torch.randn_like(static))
            graph.replay()
            torch.cuda.synchronize()
            eager = step()
            for out, ref in zip(outs, eager):
                torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())
        workspace, counters = _split_workspaces[(static.device, 4096)]
        assert not workspace.any() and not counters.any()


@_cpu
def test_choice_times_quantized_layers_at_one_and_few_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """The start-up choice (CPU: the interpreter, timings replaced by a fixed table) sets each
    quantized layer's one-row and few-row kernels, keys them by format and rows, reuses a
    stored choice, and skips a candidate whose numbers are wrong."""
    import tidal_engine.kernels.gemv_choice as choice
    from tidal_engine.quantization.fp8 import Fp8LinearMethod as Fp8
    from tidal_engine.quantization.int4 import Int4LinearMethod as Int4

    good, fast_but_wrong = GemvConfig(8, 64, 1), GemvConfig(4, 64, 1)
    monkeypatch.setattr(Fp8, "gemv_candidates", (good, fast_but_wrong))
    monkeypatch.setattr(Int4, "gemv_candidates", (good, fast_but_wrong))
    original_fp8, original_int4 = Fp8.run_gemv, Int4.run_gemv

    def broken(original):  # the (4, 64) tile returns garbage
        def run(self, layer, x, weights, bias, config):
            y = original(self, layer, x, weights, bias, config)
            return y + 100.0 if config == fast_but_wrong else y
        return run

    monkeypatch.setattr(Fp8, "run_gemv", broken(original_fp8))
    monkeypatch.setattr(Int4, "run_gemv", broken(original_int4))
    timed: list[GemvConfig | None] = []

    def fake_time(fns: dict, weights: object) -> dict:
        timed.extend(fns)
        return {candidate: {None: 10.0, good: 5.0, fast_but_wrong: 1.0}[candidate] for candidate in fns}

    monkeypatch.setattr(choice, "time_in_graphs", fake_time)
    fp8 = _fp8_layer(24, 64)
    int4, _ = _int4_layer("gptq", 16, 128, 64, False)
    model = torch.nn.ModuleList([fp8, int4])
    cache: dict = {}
    counts = choice.choose_gemv(model, cache, dtype=torch.float32)
    assert counts == {"cublas": 0, "gemv": 2}
    assert cache == {(24, 64, "fp8r1", False): good, (24, 64, f"fp8r{GEMV_MAX_ROWS}", False): good,
                     (16, 128, "int4g64r1", False): good, (16, 128, f"int4g64r{GEMV_MAX_ROWS}", False): good}
    for layer in (fp8, int4):
        assert layer.gemv_config == good and layer.gemv_config_few == good
    # The wrong tile was never timed: 4 keys × (general path + the good tile).
    assert timed == [None, good] * 4
    # A second engine with the stored choices times nothing.
    fresh = _fp8_layer(24, 64, seed=1)
    choice.choose_gemv(torch.nn.ModuleList([fresh]), cache, dtype=torch.float32)
    assert len(timed) == 8 and fresh.gemv_config == good


def test_a_device_fault_is_not_mistaken_for_a_bad_tile() -> None:
    """A tile that Triton cannot build here is skipped; a fault on the device is not: the CUDA
    context is broken after it, so the choice must stop rather than go on as if nothing happened."""
    from tidal_engine.kernels.gemv_choice import is_device_fault

    assert is_device_fault(torch.AcceleratorError("CUDA error: an illegal memory access was encountered"))
    assert is_device_fault(RuntimeError("CUDA error: misaligned address"))
    assert not is_device_fault(RuntimeError("out of resource: shared memory, Required: 264192"))
    assert not is_device_fault(ValueError("the tile does not fit this shape"))
