"""The packed-halves INT4 GEMV (kernels/triton/quant_int4.py, ``PackedGemvConfig``): its word math
is inline PTX in fp16 pairs, which Triton's interpreter cannot run. So the CPU tests check a torch
emulation of exactly that arithmetic (fp16 lanes, the kernel's order of roundings) against the
exact product and the dequantized reference, with activations up to 3e4; the gpu-marked tests
check the compiled kernel against the emulation (to fp32 summation order and the output's
rounding) and the reference, at the Qwen3-8B shapes and inside a CUDA graph. A gate|up weight's
kernel with SiLU-and-mul in its epilogue (``silu_and_mul=True``) is checked the same way: the
emulation then the activation on CPU, the compiled kernel against the plain kernel followed by
the activation kernel on the GPU, eager and in a CUDA graph."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from tidal_engine.kernels.triton.quant_int4 import (  # noqa: E402
    EXPONENT_FLOOR,
    INT4_GEMV_CONFIGS,
    X_TOP,
    GroupGemvConfig,
    PackedGemvConfig,
    PairedPackedGemvConfig,
    int4_gemv,
    int4_tile_folds_silu_and_mul,
)
from tidal_engine.kernels.triton.activation import silu_and_mul  # noqa: E402
from tidal_engine.quantization.int4 import dequantize, pack_rows, unpack_words  # noqa: E402
from tidal_engine.quantization.quantizer import quantize_int4  # noqa: E402

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
_compiled_gpu = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETING,
                                   reason="needs a CUDA device, kernels compiled (TRITON_INTERPRET=0)")


def packed_gemv_emulation(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                          group_size: int, paired: bool = False) -> torch.Tensor:
    """``_int4_packed_gemv_kernel``'s arithmetic in torch, fp32 ``[M, N]`` (before the output's
    rounding): per group, x scaled by 2^(X_TOP - E) and rounded to fp16; per word and lane
    (inputs 0-3 low, 4-7 high), one fp16 product and three fp16 multiply-adds; the lanes added in
    fp16; the words' sums times scale * 2^(E - X_TOP) in fp32. Each fp16 operation is computed
    exactly in fp64, then rounded once, as the hardware does. ``paired`` (``PairedPackedGemvConfig``):
    x scaled by 2^(X_TOP - 1 - E), and each lane sums the products of two words (word 2j's four
    steps, then word 2j + 1's) before the lanes are added."""
    m, k = x.shape
    n = qweight.shape[0]
    groups = k // group_size
    xf = x.float().view(m, groups, group_size)
    biased = (xf.abs().amax(-1).view(torch.int32) >> 23) & 0xFF
    biased = biased.clamp(min=EXPONENT_FLOOR.value)
    x_top = X_TOP.value - int(paired)
    down = ((254 + x_top - biased) << 23).view(torch.float32)
    up = ((biased - x_top) << 23).view(torch.float32)
    per_sum = 2 if paired else 1  # words a lane sum
    # [m, 1, sum, word of the sum, lane, step]
    xs = (xf * down[..., None]).half().view(m, 1, k // 8 // per_sum, per_sum, 2, 4).double()
    q = unpack_words(qweight).view(n, groups, group_size).double()
    d = (q - zeros.double()[..., None]).view(1, n, k // 8 // per_sum, per_sum, 2, 4)
    lanes = (d[..., 0, :, 0] * xs[..., 0, :, 0]).half()
    for word in range(per_sum):
        for step in range(1 if word == 0 else 0, 4):
            lanes = (d[..., word, :, step] * xs[..., word, :, step] + lanes.double()).half()
    sums = (lanes[..., 0].double() + lanes[..., 1].double()).half().float()  # [m, n, sum]
    group_sums = sums.view(m, n, groups, group_size // 8 // per_sum).sum(-1)
    return (group_sums * (scales.float()[None] * up[:, None, :])).sum(-1)


def _weights(fmt: str, n: int, k: int, group: int, symmetric: bool, seed: int = 0, device: str = "cpu",
             dtype: torch.dtype = torch.float32) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """The repacked layout of a random ``[n, k]`` weight quantized as ``fmt`` would store it (GPTQ
    v1's zero of 16 included: a zero stored as -1), and its exact float64 weights."""
    generator = torch.Generator(device).manual_seed(seed)
    w = torch.randn(n, k, generator=generator, device=device) * 0.05
    q, scale, zero = quantize_int4(w, group, symmetric=symmetric)
    if fmt == "gptq" and not symmetric:
        zero[0, 0] = 16  # the v1 format's wrap of a zero of 0 (stored -1, read 15 + 1)
    weights = (pack_rows(q), scale.to(dtype), zero.to(dtype))
    exact = ((q.double().view(n, k // group, group) - zero.double()[..., None]) * scale.double()[..., None])
    return weights, exact.view(n, k)


def _activations(m: int, k: int, seed: int, device: str = "cpu") -> torch.Tensor:
    """Normal activations with a few outliers up to 3e4 (a down_proj input can reach thousands),
    one all-zero group and one of tiny values, rounded to bf16 as the model's would be."""
    generator = torch.Generator(device).manual_seed(seed)
    x = torch.randn(m, k, generator=generator, device=device)
    x[:, 5] = 3.0e4
    x[0, k // 2 + 3] = -2.9e4
    x[:, 64:96] = 0.0  # part of a group
    if k >= 256:
        x[:, 128:160] = 0.0
        x[:, 160:192] *= 1e-30
        x[:, 192:256] = 0.0  # with the lines above: a group of 64 with nothing but zeros
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("fmt,group,symmetric,paired", [("awq", 128, False, False), ("awq", 64, True, False),
                                                        ("gptq", 64, False, False), ("gptq", 128, True, False),
                                                        ("awq", 128, False, True), ("gptq", 64, False, True)])
def test_emulated_packed_arithmetic_is_within_its_bound(fmt: str, group: int, symmetric: bool, paired: bool) -> None:
    """The emulation is finite with activations up to 3e4 (no fp16 overflow) and within the
    kernel comment's bound of the exact product: 5 fp16 roundings (9 for two words a sum) of
    2^-11 of each sum's |(q - z) x|, plus fp32 slack; it also agrees with the dequantized bf16
    reference."""
    n, k = 48, 512
    weights, exact_w = _weights(fmt, n, k, group, symmetric)
    x = _activations(3, k, seed=1)
    got = packed_gemv_emulation(x, *weights, group, paired)
    assert torch.isfinite(got).all()
    exact = x.double() @ exact_w.T
    magnitude = x.double().abs() @ exact_w.abs().T  # sum of |w x| per output
    bound = (9 if paired else 5) * 2.0**-11 * magnitude + 1e-5 * magnitude.amax()
    assert ((got.double() - exact).abs() <= bound).all()
    # Tighter in practice than the worst case: the roundings are independent.
    assert (got.double() - exact).abs().amax() <= 2.0**-9 * magnitude.amax()
    reference = torch.nn.functional.linear(x.float(), dequantize(*weights, group, torch.bfloat16).float())
    torch.testing.assert_close(got, reference, rtol=2e-2, atol=2e-2 * reference.abs().max().item())


@pytest.mark.parametrize("paired", [False, True])
def test_emulated_packed_arithmetic_stays_finite_where_unscaled_fp16_would_not(paired: bool) -> None:
    """A whole group at 3e4 (an unscaled fp16 lane of four such products would pass 65504) and
    at the largest bf16 below fp16's limit, with every q - z at its largest, 15 or 16 (the
    worst case of the overflow bound: a lane of eight products of 16 * 127.x): the group's power
    of two keeps every lane finite."""
    weights, exact_w = _weights("awq", 16, 256, 128, False)
    x = torch.cat([torch.full((1, 128), 3.0e4), torch.full((1, 128), -6.0e4)], dim=1).to(torch.bfloat16)
    got = packed_gemv_emulation(x, *weights, 128, paired)
    exact = x.double() @ exact_w.T
    magnitude = x.double().abs() @ exact_w.abs().T
    assert torch.isfinite(got).all()
    assert ((got.double() - exact).abs() <= (9 if paired else 5) * 2.0**-11 * magnitude).all()
    # The extreme weights: q = 15 against a zero of 0, and q = 0 against GPTQ v1's zero of 16.
    q_words = torch.full((16, 32), -1, dtype=torch.int32)  # every nibble 15
    q_words[8:] = 0
    scales = torch.full((16, 2), 1e-3)
    zeros = torch.cat([torch.zeros(8, 2), torch.full((8, 2), 16.0)])
    x = torch.full((1, 256), -6.0e4).to(torch.bfloat16)
    extreme = packed_gemv_emulation(x, q_words, scales, zeros, 128, paired)
    exact = (x.double() @ dequantize(q_words, scales.double(), zeros.double(), 128, torch.float64).T)
    assert torch.isfinite(extreme).all()
    torch.testing.assert_close(extreme.double(), exact, rtol=(9 if paired else 5) * 2.0**-11, atol=0)


def test_emulated_packed_gate_up_then_activation_is_within_the_references_tolerance() -> None:
    """What the folded kernel writes: the emulated gate and up sums rounded to bf16 (as the plain
    store rounds them), then silu(gate) * up in fp32, rounded once. Against the activation of
    the dequantized bf16 reference, with activations up to 3e4: within 2e-2 of the largest output
    (the plain kernel's tolerance; SiLU's slope is at most 1.1, so an error in gate or up of e
    moves the product by at most about 1.1 e |up| + e |silu(gate)|)."""
    inter, k = 24, 512
    weights, exact_w = _weights("gptq", 2 * inter, k, 128, False)
    x = _activations(2, k, seed=2)
    sums = packed_gemv_emulation(x, *weights, 128).to(torch.bfloat16).float()
    gate, up = sums[:, :inter], sums[:, inter:]
    got = (gate * torch.sigmoid(gate) * up).to(torch.bfloat16).float()
    reference = torch.nn.functional.linear(x.float(), dequantize(*weights, 128, torch.bfloat16).float())
    expected = torch.nn.functional.silu(reference[:, :inter]) * reference[:, inter:]
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())
    assert int4_tile_folds_silu_and_mul(PackedGemvConfig(16, 1024, 4, 2), 2 * inter)
    with pytest.raises(ValueError, match="CUDA only"):
        int4_gemv(x, *weights, 128, None, PackedGemvConfig(16, 256, 4), silu_and_mul=True)


def test_packed_gemv_is_refused_off_cuda() -> None:
    """The kernel is inline PTX: on the CPU (where the choice never runs) it refuses with a
    ValueError, which the start-up choice reads as "not a candidate here"."""
    weights, _ = _weights("gptq", 16, 256, 128, False)
    with pytest.raises(ValueError, match="CUDA only"):
        int4_gemv(torch.randn(1, 256), *weights, 128, None, PackedGemvConfig(16, 256, 4))
    with pytest.raises(ValueError, match="power-of-two number of groups"):
        int4_gemv(torch.randn(1, 256), *weights, 128, None, PackedGemvConfig(16, 384, 4))


def test_packed_candidates_have_their_own_stored_form() -> None:
    from tidal_engine.kernels.compile_cache import decode_choice, encode_choice

    packed = [c for c in INT4_GEMV_CONFIGS if isinstance(c, PackedGemvConfig)]
    assert packed, "the packed-halves GEMV is a start-up candidate"
    for config in packed:
        twin = GroupGemvConfig(config.block_n, config.block_k, config.num_warps)
        assert encode_choice(config) != encode_choice(twin)
        assert decode_choice(encode_choice(config), (twin, config)) == (True, config)
        assert decode_choice(encode_choice(twin), (config,)) == (False, None)
    # The two-words-a-sum kernel's tiles are not the one-word kernel's (it is not a candidate:
    # slower on the H200, but a stored choice must never read as its twin).
    paired = PairedPackedGemvConfig(16, 1024, 4, 2)
    assert paired not in INT4_GEMV_CONFIGS and encode_choice(paired) != encode_choice(PackedGemvConfig(16, 1024, 4, 2))
    assert decode_choice(encode_choice(paired), (PackedGemvConfig(16, 1024, 4, 2), paired)) == (True, paired)


# The split-K candidates, and the other split tiles (split 4, 8 rows) that were candidates in
# the H200 run of h200-2026-12-02-int4c, slower there, kept tested.
SPLIT_CONFIGS = [c for c in INT4_GEMV_CONFIGS if isinstance(c, PackedGemvConfig) and c.split_k > 1] + [
    PackedGemvConfig(16, 1024, 4, 2, split_k=4), PackedGemvConfig(8, 1024, 4, 2, split_k=2),
    PackedGemvConfig(8, 1024, 4, 2, split_k=4)]


def test_split_packed_candidates_have_their_own_stored_form() -> None:
    """A split-K packed tile stores its split: it never reads as its unsplit twin or another split."""
    from tidal_engine.kernels.compile_cache import decode_choice, encode_choice

    assert any(isinstance(c, PackedGemvConfig) and c.split_k == 2 for c in INT4_GEMV_CONFIGS), \
        "split 2 is a start-up candidate"
    for config in SPLIT_CONFIGS:
        twin = PackedGemvConfig(config.block_n, config.block_k, config.num_warps, config.num_stages)
        assert encode_choice(config)["split_k"] == config.split_k and "split_k" not in encode_choice(twin)
        assert decode_choice(encode_choice(config), (twin, *SPLIT_CONFIGS)) == (True, config)
        assert decode_choice(encode_choice(twin), tuple(SPLIT_CONFIGS)) == (False, None)
    assert len({str(encode_choice(c)) for c in INT4_GEMV_CONFIGS}) == len(INT4_GEMV_CONFIGS)


@pytest.mark.parametrize("split,rows,k,message", [
    (2, 17, 4096, "up to 16 rows"),  # more rows than the workspace holds
    (4, 1, 2048, "do not split"),  # 16 groups: not 4 runs of whole 8-group steps
    (3, 1, 4096, "do not split"),
    (0, 1, 4096, "positive integer"),
])
def test_split_packed_gemv_refuses_what_it_cannot_split(split: int, rows: int, k: int, message: str) -> None:
    """Refused with a ValueError (the start-up choice skips the tile for that shape) before the
    kernel is reached, also on the CPU."""
    weights, _ = _weights("awq", 16, k, 128, False)
    with pytest.raises(ValueError, match=message):
        int4_gemv(torch.randn(rows, k), *weights, 128, None, PackedGemvConfig(16, 1024, 4, 2, split_k=split))
    with pytest.raises(ValueError, match=message):
        int4_gemv(torch.randn(rows, k), *weights, 128, None, PackedGemvConfig(16, 1024, 4, 2, split_k=split),
                  silu_and_mul=True)


# ---- GPU: compiled, bf16 -----------------------------------------------------------------
def _check_against_emulation(got: torch.Tensor, x: torch.Tensor, weights: tuple[torch.Tensor, ...], group: int,
                             bias: torch.Tensor | None = None, config: PackedGemvConfig | None = None) -> None:
    """The kernel's fp16 lanes are the emulation's bit for bit; fp32 sums may differ in order
    (far below the output's rounding), and the output is rounded to bf16 (2^-9)."""
    emulated = packed_gemv_emulation(x, *weights, group, isinstance(config, PairedPackedGemvConfig))
    if bias is not None:
        emulated += bias.float()
    torch.testing.assert_close(got.float(), emulated, rtol=2.0**-8, atol=1e-5 * emulated.abs().max().item())


@pytest.mark.gpu
@_compiled_gpu
@pytest.mark.parametrize("fmt,group,symmetric", [("awq", 128, False), ("gptq", 128, True), ("gptq", 64, False)])
@pytest.mark.parametrize("shape", [(6144, 4096), (4096, 12288), (40, 512)])
def test_packed_gemv_matches_emulation_and_reference_gpu(fmt: str, group: int, symmetric: bool,
                                                         shape: tuple[int, int]) -> None:
    n, k = shape
    weights, exact_w = _weights(fmt, n, k, group, symmetric, device="cuda", dtype=torch.bfloat16)
    deq = dequantize(*weights, group, torch.bfloat16).float()
    configs = [c for c in INT4_GEMV_CONFIGS if isinstance(c, PackedGemvConfig)] if group == 128 else \
        [PackedGemvConfig(16, 1024, 4)]
    configs.append(PackedGemvConfig(16, 2 * group, 4))  # masked rows and groups on the small shape
    configs.append(PairedPackedGemvConfig(16, 2 * group, 4))
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    for rows, large in ((1, False), (1, True), (4, True)):
        x = _activations(rows, k, seed=rows, device="cuda") if large else \
            torch.randn(rows, k, device="cuda").to(torch.bfloat16)
        reference = torch.nn.functional.linear(x.float(), deq)
        tol = {"rtol": 2e-2, "atol": 2e-2 * reference.abs().max().item()}
        for config in configs:
            try:
                got = int4_gemv(x, *weights, group, None, config)
            except ValueError:  # the tile does not fit this shape (the choice skips it too)
                continue
            _check_against_emulation(got, x, weights, group, config=config)
            torch.testing.assert_close(got.float(), reference, **tol)
        got = int4_gemv(x, *weights, group, bias, configs[-1])
        _check_against_emulation(got, x, weights, group, bias, configs[-1])


@pytest.mark.gpu
@_compiled_gpu
@pytest.mark.parametrize("config", [PackedGemvConfig(16, 1024, 4, 2), PairedPackedGemvConfig(16, 1024, 4, 2)])
def test_packed_gemv_replays_in_a_cuda_graph(config: PackedGemvConfig) -> None:
    weights, _ = _weights("gptq", 4096, 4096, 128, False, device="cuda", dtype=torch.bfloat16)
    static = _activations(1, 4096, seed=3, device="cuda")
    int4_gemv(static, *weights, 128, None, config)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = int4_gemv(static, *weights, 128, None, config)
    for seed in (4, 5, 6):
        static.copy_(_activations(1, 4096, seed=seed, device="cuda") * (seed - 3))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, int4_gemv(static, *weights, 128, None, config), rtol=0, atol=0)
        _check_against_emulation(out, static, weights, 128, config=config)


@pytest.mark.gpu
@_compiled_gpu
def test_packed_gemv_agrees_with_the_fp32_by_groups_kernel_gpu() -> None:
    """Same tile, fp32 word math: the two differ by the packed kernel's fp16 roundings only."""
    weights, _ = _weights("awq", 6144, 4096, 128, False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, 4096, device="cuda").to(torch.bfloat16) * 30
    fp32 = int4_gemv(x, *weights, 128, None, GroupGemvConfig(16, 2048, 4)).float()
    packed = int4_gemv(x, *weights, 128, None, PackedGemvConfig(16, 2048, 4)).float()
    torch.testing.assert_close(packed, fp32, rtol=2e-2, atol=1e-2 * fp32.abs().max().item())


def _folded_checks(x: torch.Tensor, weights: tuple[torch.Tensor, ...], group: int, config: PackedGemvConfig,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """The packed kernel with SiLU-and-mul against the plain packed kernel followed by the
    activation kernel: each row's sum is computed as without it and rounded to bf16 the same
    way, and the activation is the activation kernel's fp32 arithmetic, so the two are expected
    to be equal; the tolerance allows one bf16 unit in the last place (2^-7 relative) in case the
    compiler contracts the epilogue differently. Returns the folded output."""
    folded = int4_gemv(x, *weights, group, bias, config, silu_and_mul=True)
    plain = silu_and_mul(int4_gemv(x, *weights, group, bias, config))
    assert folded.shape == (x.shape[0], weights[0].shape[0] // 2) and folded.dtype == x.dtype
    torch.testing.assert_close(folded.float(), plain.float(), rtol=2.0**-7, atol=1e-6 * plain.abs().max().item())
    return folded


@pytest.mark.gpu
@_compiled_gpu
@pytest.mark.parametrize("shape", [(24576, 4096), (48, 512)])
def test_packed_gemv_folds_silu_and_mul_as_the_activation_kernel_gpu(shape: tuple[int, int]) -> None:
    """Qwen3-8B's gate|up, and a small one whose 24 pairs leave the last tile of 8 pairs partly
    empty (masked rows and groups), at 1 and 4 rows, with and without a bias; also against the
    activation of the dequantized reference."""
    n, k = shape
    weights, _ = _weights("awq", n, k, 128, False, device="cuda", dtype=torch.bfloat16)
    deq = dequantize(*weights, 128, torch.bfloat16).float()
    configs = [c for c in INT4_GEMV_CONFIGS if isinstance(c, PackedGemvConfig)] + [
        PackedGemvConfig(16, 256, 4), PairedPackedGemvConfig(16, 1024, 4, 2), GroupGemvConfig(16, 1024, 4)]
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    for rows, large in ((1, False), (1, True), (4, True)):
        x = _activations(rows, k, seed=rows, device="cuda") if large else \
            torch.randn(rows, k, device="cuda").to(torch.bfloat16)
        reference = torch.nn.functional.linear(x.float(), deq)
        expected = torch.nn.functional.silu(reference[:, :n // 2]) * reference[:, n // 2:]
        for config in configs:
            try:
                folded = _folded_checks(x, weights, 128, config, None)
            except ValueError:  # the tile does not fit this shape
                continue
            torch.testing.assert_close(folded.float(), expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())
            _folded_checks(x, weights, 128, config, bias)


@pytest.mark.gpu
@_compiled_gpu
def test_packed_gemv_with_silu_and_mul_replays_in_a_cuda_graph() -> None:
    weights, _ = _weights("gptq", 2 * 12288, 4096, 128, False, device="cuda", dtype=torch.bfloat16)
    config = next(c for c in INT4_GEMV_CONFIGS if isinstance(c, PackedGemvConfig))
    static = _activations(1, 4096, seed=3, device="cuda")
    int4_gemv(static, *weights, 128, None, config, silu_and_mul=True)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = int4_gemv(static, *weights, 128, None, config, silu_and_mul=True)
    for seed in (4, 5, 6):
        static.copy_(_activations(1, 4096, seed=seed, device="cuda") * (seed - 3))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, int4_gemv(static, *weights, 128, None, config, silu_and_mul=True),
                                   rtol=0, atol=0)
        torch.testing.assert_close(out, _folded_checks(static, weights, 128, config, None), rtol=0, atol=0)


@pytest.mark.gpu
@_compiled_gpu
def test_choice_of_an_int4_gate_up_folds_and_replays_in_a_cuda_graph() -> None:
    """The start-up choice on a gate|up INT4 linear (timed with SiLU-and-mul as the step runs
    it), then the layer's activated forward at 1 and 4 rows, captured after the choice compiled
    the folded kernel (``launch_folded``), equal to eager and to the unfolded path."""
    from tidal_engine.kernels.gemv_choice import choose_gemv
    from tidal_engine.layers.activation import SiluAndMul
    from tidal_engine.layers.linear import Linear
    from tidal_engine.quantization.int4 import Int4LinearMethod

    n, k = 2 * 12288, 4096
    weights, _ = _weights("awq", n, k, 128, False, device="cuda", dtype=torch.bfloat16)
    with torch.device("cuda"):
        layer = Linear(k, n, bias=False, method=Int4LinearMethod("awq", 128))
    layer.qweight, layer.scales, layer.zeros = (torch.nn.Parameter(t, requires_grad=False) for t in weights)
    del layer.qzeros  # the checkpoint's layout, replaced by ``zeros`` (as after loading)
    layer.group_size = 128
    layer.output_activation_name = "silu_and_mul"
    cache: dict = {}
    choose_gemv(torch.nn.ModuleList([layer]), cache, dtype=torch.bfloat16)
    assert {key[2] for key in cache} == {"int4g128r1", "int4g128r4"}
    act = SiluAndMul()
    assert layer.gemv_config is not None and layer.folds(torch.zeros(1, k, device="cuda", dtype=torch.bfloat16), act)
    for rows in (1, 4):
        static = torch.randn(rows, k, device="cuda").to(torch.bfloat16)
        eager = layer(static, output_activation=act)
        torch.testing.assert_close(eager.float(), act(layer(static)).float(), rtol=2.0**-7,
                                   atol=1e-6 * eager.float().abs().max().item())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer(static, output_activation=act)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, eager, rtol=0, atol=0)


def _split_counters_are_zero() -> bool:
    from tidal_engine.kernels.triton import quant_int4

    return all(not counters.any() for _, counters in quant_int4._packed_split_workspaces.values())


@pytest.mark.gpu
@_compiled_gpu
@pytest.mark.parametrize("shape", [(6144, 4096), (4096, 12288), (44, 4096)])
def test_split_packed_gemv_matches_emulation_and_reference_gpu(shape: tuple[int, int]) -> None:
    """Every split-K candidate at the 8B qkv and down shapes and a small one whose last tile is
    partly empty (masked rows), at 1 and 4 rows, with and without a bias: against the emulation
    and the reference, equal to itself when run again (the partial sums are added in a fixed
    order), and every counter back at zero after each call; folded on the small shape."""
    n, k = shape
    weights, _ = _weights("gptq", n, k, 128, False, device="cuda", dtype=torch.bfloat16)
    deq = dequantize(*weights, 128, torch.bfloat16).float()
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    for rows in (1, 4):
        x = _activations(rows, k, seed=rows, device="cuda")
        reference = torch.nn.functional.linear(x.float(), deq)
        tol = {"rtol": 2e-2, "atol": 2e-2 * reference.abs().max().item()}
        for config in SPLIT_CONFIGS:
            got = int4_gemv(x, *weights, 128, None, config)
            torch.cuda.synchronize()
            assert _split_counters_are_zero()
            _check_against_emulation(got, x, weights, 128, config=config)
            torch.testing.assert_close(got.float(), reference, **tol)
            torch.testing.assert_close(int4_gemv(x, *weights, 128, None, config), got, rtol=0, atol=0)
            unsplit = PackedGemvConfig(config.block_n, config.block_k, config.num_warps, config.num_stages)
            torch.testing.assert_close(got.float(), int4_gemv(x, *weights, 128, None, unsplit).float(),
                                       rtol=2.0**-7, atol=1e-5 * reference.abs().max().item())
            with_bias = int4_gemv(x, *weights, 128, bias, config)
            _check_against_emulation(with_bias, x, weights, 128, bias, config)
            if n < 1000:  # a gate|up of 22 pairs: the last tile partly empty
                _folded_checks(x, weights, 128, config, bias)
            torch.cuda.synchronize()
            assert _split_counters_are_zero()


@pytest.mark.gpu
@_compiled_gpu
def test_split_packed_gemvs_of_one_width_replay_in_a_cuda_graph() -> None:
    """Several split GEMVs sharing one width's workspace (two weights, splits 2 and 4, plain and
    folded) captured in one graph: each replay equals eager and leaves the counters at zero."""
    weights_a, _ = _weights("gptq", 4096, 4096, 128, False, seed=1, device="cuda", dtype=torch.bfloat16)
    weights_b, _ = _weights("awq", 4096, 4096, 128, False, seed=2, device="cuda", dtype=torch.bfloat16)
    static = _activations(1, 4096, seed=3, device="cuda")

    def step() -> list[torch.Tensor]:
        outs = []
        for config in SPLIT_CONFIGS:
            outs.append(int4_gemv(static, *weights_a, 128, None, config))
            outs.append(int4_gemv(static, *weights_b, 128, None, config))
            outs.append(int4_gemv(static, *weights_a, 128, None, config, silu_and_mul=True))
        return outs

    step()  # compiled and the workspaces made outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for seed in (4, 5, 6):
        static.copy_(_activations(1, 4096, seed=seed, device="cuda") * (seed - 3))
        graph.replay()
        torch.cuda.synchronize()
        assert _split_counters_are_zero()
        for out, eager in zip(outs, step(), strict=True):
            torch.testing.assert_close(out, eager, rtol=0, atol=0)
        _check_against_emulation(outs[0], static, weights_a, 128, config=SPLIT_CONFIGS[0])
