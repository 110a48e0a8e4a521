"""The one-row GEMV (Triton) and the start-up choice between it and cuBLAS."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch

pytest.importorskip("triton")

from tidal_engine.kernels.gemv_choice import pick_fastest  # noqa: E402
from tidal_engine.kernels.triton.gemv import (  # noqa: E402
    GEMV_CONFIGS,
    GEMV_ROWS_CONFIGS,
    GEMV_ROWS_MAX,
    GemvConfig,
    gemv,
    gemv_rows,
)
from tidal_engine.kernels.triton import activation as act_module  # noqa: E402
from tidal_engine.kernels.triton import gemv as gemv_module  # noqa: E402
from tidal_engine.kernels.triton.activation import silu_and_mul  # noqa: E402
from tidal_engine.layers.activation import SiluAndMul  # noqa: E402
from tidal_engine.layers.linear import Linear  # noqa: E402

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
_cpu = pytest.mark.skipif(not INTERPRETING, reason="CPU kernels need TRITON_INTERPRET=1")
_needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
_compiled = pytest.mark.skipif(INTERPRETING, reason="GPU tests run compiled: set TRITON_INTERPRET=0")


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    return {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}


@_cpu
@pytest.mark.parametrize("config", [GemvConfig(2, 64, 1), GemvConfig(8, 128, 2), GemvConfig(32, 32, 4)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_linear_on_cpu(config: GemvConfig, dtype: torch.dtype, bias: bool) -> None:
    # N and K not multiples of the tiles: the masked edges must add nothing.
    torch.manual_seed(0)
    weight = torch.randn(45, 300, dtype=dtype)
    b = torch.randn(45, dtype=dtype) if bias else None
    x = torch.randn(1, 300, dtype=dtype)
    expected = torch.nn.functional.linear(x.float(), weight.float(), b.float() if b is not None else None)
    got = gemv(x, weight, b, config)
    assert got.shape == (1, 45) and got.dtype == dtype
    torch.testing.assert_close(got.float(), expected, **_tolerance(dtype))


@_cpu
def test_gemv_rejects_bad_shapes() -> None:
    weight = torch.randn(8, 16)
    with pytest.raises(ValueError, match="one row"):
        gemv(torch.randn(2, 16), weight, None, GEMV_CONFIGS[0])
    with pytest.raises(ValueError, match="features"):
        gemv(torch.randn(1, 15), weight, None, GEMV_CONFIGS[0])


@_cpu
def test_linear_routes_only_one_row_inputs() -> None:
    torch.manual_seed(1)
    layer = Linear(64, 24, bias=True)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    one, many = torch.randn(1, 64), torch.randn(3, 64)
    before = layer(one)
    layer.gemv_config = GemvConfig(8, 32, 1)
    calls = []
    import tidal_engine.kernels.triton.gemv as module

    original = module.gemv
    module.gemv = lambda *a, **k: calls.append(1) or original(*a, **k)  # type: ignore[assignment]
    try:
        after = layer(one)
        batched = layer(many)
    finally:
        module.gemv = original  # type: ignore[assignment]
    assert len(calls) == 1  # the one-row call only
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(batched, torch.nn.functional.linear(many, layer.weight, layer.bias))


def test_pick_fastest_prefers_cublas_unless_clearly_beaten() -> None:
    a, b = GEMV_CONFIGS[0], GEMV_CONFIGS[1]
    assert pick_fastest({None: 10.0, a: 9.0, b: 8.0}) == b
    assert pick_fastest({None: 10.0, a: 9.8}) is None  # within 3%: keep cuBLAS
    assert pick_fastest({None: 10.0, a: 12.0}) is None
    assert pick_fastest({None: 10.0}) is None


@pytest.mark.gpu
@_needs_cuda
@_compiled
@pytest.mark.parametrize("shape", [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024),
                                   (6144, 4096), (4096, 12288)])
def test_gemv_matches_linear_gpu(shape: tuple[int, int]) -> None:
    torch.manual_seed(0)
    n, k = shape
    weight = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
    x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
    expected = torch.nn.functional.linear(x.float(), weight.float())
    for config in GEMV_CONFIGS:
        got = gemv(x, weight, None, config).float()
        torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())


@pytest.mark.gpu
@_needs_cuda
@_compiled
def test_engine_chooses_per_shape_and_single_stream_still_decodes(tmp_path: object) -> None:
    # The runner times cuBLAS against the GEMV per weight shape; whatever it picks, a bf16
    # single stream (every decode step one row, through the captured graph) gives the tokens
    # of the same engine with the choice off, for 8 prompts x 64 steps.
    from pathlib import Path

    from tidal_engine import LLM, SamplingParams

    from tiny_models import make_tiny_model
    from tiny_tokenizer import EOS_ID, save_byte_tokenizer

    folder = Path(str(tmp_path)) / "tiny"
    make_tiny_model("qwen3", folder, eos_token_id=EOS_ID, bos_token_id=None, max_position_embeddings=512)
    save_byte_tokenizer(folder, vocab_size=1000)
    prompts = ["hello world", "the tide comes in", "a", "0123456789" * 4, "tidal", "xyz", "paged attention", "batching"]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)

    cache_dir = str(Path(str(tmp_path)) / "cache")  # a fresh choices file: every shape is timed

    def run() -> tuple[list[list[int]], int]:
        llm = LLM(str(folder), device="cuda", dtype="bfloat16", max_model_len=256, num_gpu_blocks_override=128,
                  cache_dir=cache_dir)
        tokens = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]  # one at a time: one-row steps
        routed = sum(getattr(m, "gemv_config", None) is not None for m in llm.engine.runner.model.modules())
        return tokens, routed

    def one_row_choices(llm: object) -> dict[tuple[int, int], str]:
        return {(n, k): str(c) for (n, k, kind, _), c in llm.engine.runner._gemv_choices.items()  # type: ignore[attr-defined]
                if not isinstance(kind, str)}

    # The tiny model's weights are all small: the shapes whose tiles timed close alone were
    # timed again inside the batch-1 decode step, and the step's choice is what was kept and stored.
    first = LLM(str(folder), device="cuda", dtype="bfloat16", max_model_len=256, num_gpu_blocks_override=128,
                cache_dir=cache_dir)
    step_timings = first.engine.runner.gemv_step_timings
    chosen = one_row_choices(first)
    for shape, times in step_timings.items():
        n, k = (int(v) for v in shape.split("x"))
        assert chosen[(n, k)] in times and all(0 < t < 1 for t in times.values())
    del first
    again = LLM(str(folder), device="cuda", dtype="bfloat16", max_model_len=256, num_gpu_blocks_override=128,
                cache_dir=cache_dir)
    assert again.engine.runner.gemv_step_timings == {} and one_row_choices(again) == chosen  # from disk, untimed
    del again

    with_choice, _ = run()
    os.environ["TIDAL_GEMV"] = "0"
    try:
        without, routed_off = run()
    finally:
        del os.environ["TIDAL_GEMV"]
    assert routed_off == 0
    agree = sum(a == b for a, b in zip(with_choice, without))
    assert agree >= 7, (with_choice, without)  # bf16 sums in another order may flip one near-tie


# ---- the few-row GEMV (2 to GEMV_ROWS_MAX rows: a speculative verify step of one sequence) ----


@_cpu
@pytest.mark.parametrize("rows", [1, 2, 5, GEMV_ROWS_MAX])
@pytest.mark.parametrize("config", [GemvConfig(16, 64, 1), GemvConfig(32, 128, 2)], ids=str)
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_rows_matches_linear_on_cpu(rows: int, config: GemvConfig, bias: bool) -> None:
    # fp32 (the interpreter's 16-bit dot is wrong); N and K not multiples of the tiles, and x a
    # strided view of a wider tensor: masked edges and padding rows must add nothing.
    torch.manual_seed(rows)
    weight = torch.randn(45, 300)
    b = torch.randn(45) if bias else None
    x = torch.randn(rows, 600)[:, ::2]
    got = gemv_rows(x, weight, b, config)
    assert got.shape == (rows, 45) and got.dtype == torch.float32
    torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, b), rtol=1e-5, atol=1e-4)


@_cpu
def test_gemv_rows_rejects_bad_shapes() -> None:
    weight = torch.randn(32, 16)
    config = GEMV_ROWS_CONFIGS[0]
    with pytest.raises(ValueError, match="rows"):
        gemv_rows(torch.randn(GEMV_ROWS_MAX + 1, 16), weight, None, config)
    with pytest.raises(ValueError, match="features"):
        gemv_rows(torch.randn(2, 15), weight, None, config)
    with pytest.raises(ValueError, match="block_n"):
        gemv_rows(torch.randn(2, 16), weight, None, GemvConfig(8, 16, 1))
    assert all(c.block_n >= 16 for c in GEMV_ROWS_CONFIGS)


@_cpu
def test_linear_routes_few_row_inputs_to_the_few_row_kernel() -> None:
    # One row keeps the one-row kernel (and its choice); 2..GEMV_ROWS_MAX rows take their entry of
    # gemv_rows_configs when it is a config; more rows, None entries or no few-row choice stay on torch.
    torch.manual_seed(2)
    layer = Linear(64, 24, bias=True)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    import tidal_engine.kernels.triton.gemv as module

    calls: list[tuple[str, int]] = []
    one, rows = module.gemv, module.gemv_rows
    module.gemv = lambda x, *a, **k: calls.append(("one", x.shape[0])) or one(x, *a, **k)  # type: ignore[assignment]
    module.gemv_rows = lambda x, *a, **k: calls.append(("few", x.shape[0])) or rows(x, *a, **k)  # type: ignore[assignment]
    try:
        inputs = {m: torch.randn(m, 64) for m in (1, 2, GEMV_ROWS_MAX, GEMV_ROWS_MAX + 1)}
        for x in inputs.values():
            layer(x)
        assert calls == []  # no choice: torch for every row count
        layer.gemv_config = GemvConfig(8, 32, 1)
        layer.gemv_rows_configs = {m: GemvConfig(16, 32, 1) if m > 2 else None for m in range(2, GEMV_ROWS_MAX + 1)}
        outs = {m: layer(x) for m, x in inputs.items()}
    finally:
        module.gemv, module.gemv_rows = one, rows  # type: ignore[assignment]
    assert calls == [("one", 1), ("few", GEMV_ROWS_MAX)]  # 2 rows: cuBLAS won that bucket
    for m, x in inputs.items():
        torch.testing.assert_close(outs[m], torch.nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-4)


@_cpu
def test_gemv_activates_gate_up_pairs_exactly_as_the_activation_kernel() -> None:
    # A gate_up projection's GEMV computes gate row i next to up row I + i and writes
    # silu(gate) * up: bit for bit the plain GEMV then the activation kernel (same sums, same
    # roundings). I = 23 activations: the last tile is partly empty.
    torch.manual_seed(4)
    weight, b = torch.randn(46, 300), torch.randn(46)
    x = torch.randn(1, 300)
    for config in (GemvConfig(2, 64, 1), GemvConfig(8, 128, 2), GemvConfig(16, 64, 1)):
        got = gemv(x, weight, b, config, silu_and_mul=True)
        assert got.shape == (1, 23) and torch.equal(got, silu_and_mul(gemv(x, weight, b, config)))
    with pytest.raises(ValueError, match="even"):
        gemv(x, weight, b, GemvConfig(1, 64, 1), silu_and_mul=True)  # a one-row tile holds no pair
    with pytest.raises(ValueError, match="even"):
        gemv(x, weight[:45], b[:45], GemvConfig(2, 64, 1), silu_and_mul=True)


@_cpu
def test_linear_folds_its_output_activation_into_the_one_row_gemv_only() -> None:
    # ``output_activation``: the one-row GEMV activates in its epilogue; the few-row GEMV and
    # torch give their output to SiluAndMul, as before.
    torch.manual_seed(5)
    layer = Linear(32, 48, bias=True)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    act = SiluAndMul()
    import tidal_engine.kernels.triton.gemv as module

    calls: list[tuple[str, int, bool]] = []
    one, rows = module.gemv, module.gemv_rows
    module.gemv = lambda x, *a, **k: calls.append(("one", x.shape[0], k.get("silu_and_mul", False))) or one(x, *a, **k)  # type: ignore[assignment]
    module.gemv_rows = lambda x, *a, **k: calls.append(("few", x.shape[0], False)) or rows(x, *a, **k)  # type: ignore[assignment]
    try:
        inputs = {m: torch.randn(m, 32) for m in (1, 3, GEMV_ROWS_MAX + 1)}
        plain = {m: act(torch.nn.functional.linear(x, layer.weight, layer.bias)) for m, x in inputs.items()}
        assert all(torch.equal(layer(x, output_activation=act), plain[m]) for m, x in inputs.items())
        assert calls == [] and not layer.folds(inputs[1], act)
        layer.gemv_config = GemvConfig(1, 32, 1)  # a one-row tile holds no gate/up pair
        assert not layer.folds(inputs[1], act)
        layer.gemv_config = GemvConfig(8, 32, 1)
        layer.gemv_rows_configs = {m: GemvConfig(16, 32, 1) for m in range(2, GEMV_ROWS_MAX + 1)}
        assert layer.folds(inputs[1], act) and not layer.folds(inputs[3], act)
        outs = {m: layer(x, output_activation=act) for m, x in inputs.items()}
    finally:
        module.gemv, module.gemv_rows = one, rows  # type: ignore[assignment]
    assert calls == [("one", 1, True), ("few", 3, False)]
    # The CPU SiluAndMul is torch's silu (the kernel's fp32 sigmoid differs in the last bit).
    for m in inputs:
        torch.testing.assert_close(outs[m], plain[m], rtol=1e-5, atol=1e-5)
    # A delta hook (LoRA) adds to gate/up before the activation: then the layer does not fold.
    seen: list[int] = []
    layer.delta_hooks.append(lambda x, y: seen.append(y.shape[-1]))
    torch.testing.assert_close(layer(inputs[1], output_activation=act), plain[1], rtol=1e-5, atol=1e-5)
    assert seen == [48]


@_cpu
def test_one_row_timing_runs_a_gate_up_linear_as_the_decode_step_does() -> None:
    # The start-up times each candidate of a gate|up weight in the form the step runs: the folded
    # GEMV where the tile holds pairs, else the matmul and then the activation kernel; so a tile
    # that cannot fold pays for the extra kernel in its timing too.
    from tidal_engine.kernels import gemv_choice
    from tidal_engine.kernels.gemv_choice import one_row_as_in_the_step

    torch.manual_seed(6)
    layer = Linear(96, 46, bias=True)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    layer.output_activation_name = SiluAndMul.name
    x = torch.randn(1, 96)
    calls: list[tuple[object, bool]] = []
    one, activate = gemv_module.gemv, act_module.silu_and_mul
    gemv_module.gemv = lambda x, w, b, c, **k: calls.append((c, k.get("silu_and_mul", False))) or one(x, w, b, c, **k)  # type: ignore[assignment]
    act_module.silu_and_mul = lambda y: calls.append(("activation", False)) or activate(y)  # type: ignore[assignment]
    try:
        for config in (GemvConfig(2, 32, 1), GemvConfig(1, 32, 1), None):
            calls.clear()
            timed = gemv_choice.one_row_as_in_the_step(x, layer.weight, layer.bias, config, silu_and_mul=True)
            layer.gemv_config = config
            torch.testing.assert_close(timed, layer(x, output_activation=SiluAndMul()), rtol=1e-5, atol=1e-5)
            folds = config is not None and config.block_n == 2
            assert calls[:2] == ([(config, True), (config, True)] if folds else
                                 [(config, False), ("activation", False)] if config is not None else [("activation", False)])
        calls.clear()
        plain = one_row_as_in_the_step(x, layer.weight, layer.bias, GemvConfig(2, 32, 1))
        assert plain.shape == (1, 46) and calls == [(GemvConfig(2, 32, 1), False)]
    finally:
        gemv_module.gemv, act_module.silu_and_mul = one, activate  # type: ignore[assignment]


@_cpu
def test_start_up_launches_the_folded_gemvs_of_a_layer_that_takes_an_output_activation() -> None:
    # So that none compiles while a decode graph is captured: every row count whose GEMV folds
    # (for the bf16 GEMVs, one row; FP8: test_quantization_kernels.py).
    layer = Linear(32, 48)
    torch.nn.init.normal_(layer.weight)
    layer.gemv_config = GemvConfig(8, 32, 1)
    layer.gemv_rows_configs = {m: GemvConfig(16, 32, 1) for m in range(2, GEMV_ROWS_MAX + 1)}
    import tidal_engine.kernels.triton.gemv as module

    calls: list[tuple[int, bool]] = []
    one = module.gemv
    module.gemv = lambda x, *a, **k: calls.append((x.shape[0], k.get("silu_and_mul", False))) or one(x, *a, **k)  # type: ignore[assignment]
    try:
        layer.launch_folded(torch.float32, GEMV_ROWS_MAX)
        assert calls == []  # no output activation: nothing to fold
        layer.output_activation_name = SiluAndMul.name
        layer.launch_folded(torch.float32, GEMV_ROWS_MAX)
    finally:
        module.gemv = one  # type: ignore[assignment]
    assert calls == [(1, True)]


def test_few_row_choices_keep_the_one_row_keys_and_come_back_from_disk(tmp_path: object) -> None:
    # The few-row choices are stored under their own kinds ("bfloat16r2" ... "r8"), next to the
    # one-row key (N, K, torch dtype, bias), and read back as the same candidates.
    from pathlib import Path

    from tidal_engine.kernels.gemv_choice import load_choices, save_choices

    path = Path(str(tmp_path)) / "choices.json"
    choices = {(4096, 4096, torch.bfloat16, False): GEMV_CONFIGS[1], (4096, 4096, "bfloat16r8", False): GEMV_ROWS_CONFIGS[2],
               (4096, 4096, "bfloat16r2", False): None, (1024, 4096, "float16r4", True): GEMV_ROWS_CONFIGS[0]}
    save_choices(path, choices)
    assert load_choices(path, GEMV_CONFIGS) == choices


@pytest.mark.gpu
@_needs_cuda
@_compiled
@pytest.mark.parametrize("shape", [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (151936, 4096), (1000, 96)])
def test_gemv_rows_matches_linear_gpu(shape: tuple[int, int]) -> None:
    # The compiled few-row kernel, bf16, the 8B shapes (and a small odd one), every candidate
    # tile, 2 / 5 / 8 rows and a bias; a tile the GPU cannot run is skipped, as start-up skips it.
    torch.manual_seed(0)
    n, k = shape
    weight = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    ran = 0
    for rows in (2, 5, GEMV_ROWS_MAX):
        x = torch.randn(rows, k, device="cuda").to(torch.bfloat16)
        expected = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
        for config in GEMV_ROWS_CONFIGS:
            try:
                got = gemv_rows(x, weight, bias, config).float()
            except Exception as exc:  # noqa: BLE001 - out of resources: start-up skips the tile too
                if "CUDA error" in str(exc):
                    raise
                continue
            ran += 1
            torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())
    assert ran >= 3 * (len(GEMV_ROWS_CONFIGS) - 2)


@pytest.mark.gpu
@_needs_cuda
@_compiled
def test_gemv_with_silu_and_mul_matches_the_activation_kernel_gpu() -> None:
    # The 8B gate_up projection in bf16, every candidate with gate/up pairs: the GEMV that
    # activates in its epilogue gives the plain GEMV then the activation kernel to within one
    # bf16 ulp of the largest output.
    n, k = 24576, 4096
    torch.manual_seed(0)
    weight = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
    x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
    for config in GEMV_CONFIGS:
        if config.block_n % 2:
            continue
        want = silu_and_mul(gemv(x, weight, None, config)).float()
        got = gemv(x, weight, None, config, silu_and_mul=True).float()
        torch.testing.assert_close(got, want, rtol=0, atol=2**-7 * want.abs().max().item())


@pytest.mark.parametrize("few_rows", [True, False])
def test_few_row_tiles_are_timed_and_set_only_when_asked(monkeypatch: pytest.MonkeyPatch, few_rows: bool) -> None:
    """The runner asks for them only with speculative decoding (model_runner._few_row_linears_wanted).
    Fixed timings: each candidate 'runs' twice as fast as the one timed before it, and cuBLAS is
    timed first, so every choice is a tile."""
    from torch import nn

    from tidal_engine.kernels import gemv_choice
    from tidal_engine.kernels.triton import gemv as gemv_module

    def linear_of(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, config: object) -> torch.Tensor:
        return torch.nn.functional.linear(x, w, b)

    monkeypatch.setattr(gemv_module, "gemv", linear_of)
    monkeypatch.setattr(gemv_module, "gemv_rows", linear_of)
    monkeypatch.setattr(gemv_choice, "rotation_copies", lambda weight: [weight])
    timed: list[object] = []

    def fake_time(fns: dict, copies: object) -> dict:
        timings = {}
        for candidate in fns:
            timed.append(candidate)
            timings[candidate] = 0.5 ** len(timed)
        return timings

    monkeypatch.setattr(gemv_choice, "time_in_graphs", fake_time)
    torch.manual_seed(3)
    model = nn.Module()
    model.a = Linear(64, 32)
    torch.nn.init.normal_(model.a.weight)  # torch.empty's leftovers could be NaN, which no candidate matches
    model.to(torch.bfloat16)
    cache: dict = {}
    gemv_choice.choose_gemv(model, cache, few_rows=few_rows)
    few_keys = {k for k in cache if isinstance(k[2], str)}
    assert model.a.gemv_config is not None
    if few_rows:
        assert {k[2] for k in few_keys} == {f"bfloat16r{r}" for r in gemv_module.GEMV_ROW_BUCKETS}
        assert model.a.gemv_rows_configs is not None
    else:
        assert few_keys == set() and model.a.gemv_rows_configs is None


# ---- small shapes: the isolated timings shortlist, the decode step's time chooses ----


def test_shortlist_is_the_choice_then_the_rest_fastest_alone_first() -> None:
    from tidal_engine.kernels.gemv_step_choice import shortlist

    a, b, c, d = GEMV_CONFIGS[:4]
    timings = {None: 10.0, a: 5.0, b: 5.5, c: 5.7, d: 9.0}
    assert shortlist(timings, a) == [a, b, c, d, None]
    assert shortlist(timings, None) == [None, a, b, c, d]  # the isolated choice first even if not the fastest
    assert shortlist({None: 10.0}, None) == [None]


def test_a_large_weights_shortlist_is_the_other_kinds_best_and_a_near_tie() -> None:
    from tidal_engine.kernels.gemv_step_choice import large_shortlist

    a, b, c = GEMV_CONFIGS[:3]
    assert large_shortlist({None: 5.2, a: 5.0, b: 5.1, c: 5.7}, a) == [a, None, b]  # cuBLAS within 5%, b within 3%
    assert large_shortlist({None: 10.0, a: 5.0, b: 5.1}, a) == [a, b]  # cuBLAS far behind: not timed again
    assert large_shortlist({None: 5.0, a: 5.2, b: 5.5}, None) == [None, a]  # the best tile within 5%; none near
    assert large_shortlist({None: 5.0, a: 4.9, b: 5.0}, None) == [None, a, b]  # cuBLAS kept by the 3% rule
    assert large_shortlist({None: 4.0, a: 5.0}, None) == [None]


class _StepLinear(torch.nn.Module):
    """A linear as refine_in_step sees one: a one-row choice, and the folded launches it asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.gemv_config: object = None
        self.folded: list[object] = []

    def launch_folded(self, dtype: torch.dtype, max_rows: int) -> None:
        assert max_rows == 1
        self.folded.append(self.gemv_config)


def _compare_by(step_time: Callable[[], float]) -> Callable[[list[Callable[[], None]]], list[float]]:
    """A fake ``compare_steps``: each setup, then the step's time as the linears are set then."""
    def compare(setups: list[Callable[[], None]]) -> list[float]:
        times = []
        for setup in setups:
            setup()
            times.append(step_time())
        return times
    return compare


def test_refine_in_step_keeps_each_shapes_fastest_candidate_in_the_step() -> None:
    # Two shapes; the step's time is a table over the pair of choices. Coordinate descent from
    # the isolated choices (a, c) finds (b, d); a gain under min_gain keeps the current choice.
    from tidal_engine.kernels.gemv_step_choice import StepShortlist, refine_in_step

    a, b, c, d = GEMV_CONFIGS[:4]
    qkv, o1, o2 = _StepLinear(), _StepLinear(), _StepLinear()
    key1, key2 = (4096, 1024, torch.bfloat16, False), (1024, 2048, torch.bfloat16, False)
    cache = {key1: a, key2: c}
    qkv.gemv_config, o1.gemv_config, o2.gemv_config = a, c, c
    shortlists = {key1: StepShortlist([a, b], [qkv]), key2: StepShortlist([c, d, None], [o1, o2])}
    step = {(a, c): 1.00, (b, c): 0.96, (b, d): 0.93, (b, None): 0.929}

    def step_time() -> float:
        assert o1.gemv_config == o2.gemv_config  # every linear of a shape moves together
        return step[(qkv.gemv_config, o1.gemv_config)]

    report = refine_in_step(shortlists, cache, _compare_by(step_time), min_gain=0.005)
    assert cache == {key1: b, key2: d}  # None's 0.1% gain over d is noise, not a reason to switch
    assert (qkv.gemv_config, o1.gemv_config, o2.gemv_config) == (b, d, d)
    assert report["4096x1024"] == {str(a): 1.00, str(b): 0.96}
    assert report["1024x2048"] == {str(c): 0.96, str(d): 0.93, "None": 0.929}
    # Each candidate's folded form was launched once, before any step was timed (one module a shape).
    assert qkv.folded == [a, b] and o1.folded == [c, d, None] and o2.folded == []


def test_refine_in_step_compares_against_the_current_choice_timed_with_the_rest() -> None:
    # The current choice is one of the compared setups (first), so it is timed in the same
    # interleaved rounds as the others; a candidate that is only within noise of it never wins,
    # and whatever the comparison's last setup, the linears end at the choice.
    from tidal_engine.kernels.gemv_step_choice import StepShortlist, refine_in_step

    a, b, c = GEMV_CONFIGS[:3]
    linear = _StepLinear()
    linear.gemv_config = b
    key = (4096, 1024, torch.bfloat16, False)
    cache = {key: b}  # the descent of an earlier shape left b; the shortlist names a first
    seen: list[list[object]] = []

    def compare(setups: list[Callable[[], None]]) -> list[float]:
        configs = []
        for setup in setups:
            setup()
            configs.append(linear.gemv_config)
        seen.append(configs)
        return [1.00, 0.999, 0.90][: len(setups)]

    refine_in_step({key: StepShortlist([a, b, c], [linear])}, cache, compare)
    assert seen == [[b, a, c]] and cache[key] == c and linear.gemv_config == c
    cache[key] = linear.gemv_config = b
    refine_in_step({key: StepShortlist([a, b], [linear])}, cache, compare)
    assert seen[-1] == [b, a] and cache[key] == b and linear.gemv_config == b  # 0.1%: noise


def test_refine_in_step_times_larger_weights_most_ambiguous_first_within_a_budget() -> None:
    # Every step timing takes 0.1 s of the fake clock. The small shape is timed in full first; of
    # the large ones the closer call (gap 1%) goes first, and a large shape starts only while the
    # large ones so far took under the budget (0.15 s): near (0.2 s) uses it up, far is not timed.
    from tidal_engine.kernels.gemv_step_choice import StepShortlist, refine_in_step

    a, b, c, d = GEMV_CONFIGS[:4]
    small, near, far = _StepLinear(), _StepLinear(), _StepLinear()
    keys = {"small": (1024, 1024, torch.bfloat16, False), "far": (4096, 4096, torch.bfloat16, False),
            "near": (24576, 4096, torch.bfloat16, False)}
    cache = {keys["small"]: a, keys["far"]: None, keys["near"]: None}
    small.gemv_config, near.gemv_config, far.gemv_config = a, None, None
    shortlists = {keys["small"]: StepShortlist([a, b, c], [small]),
                  keys["far"]: StepShortlist([None, d], [far], small=False, gap=0.04),
                  keys["near"]: StepShortlist([None, a, b], [near], small=False, gap=0.01)}
    now = [0.0]
    timed: list[tuple[object, object, object]] = []

    def step_time() -> float:
        now[0] += 0.1
        timed.append((small.gemv_config, near.gemv_config, far.gemv_config))
        return 1.0 - 0.01 * len(timed)  # each timing 1% faster than the last: the last candidate wins

    report = refine_in_step(shortlists, cache, _compare_by(step_time), large_budget_s=0.15, clock=lambda: now[0])
    assert timed == [(a, None, None), (b, None, None), (c, None, None),
                     (c, None, None), (c, a, None), (c, b, None)]
    assert cache == {keys["small"]: c, keys["near"]: b, keys["far"]: None}
    assert set(report) == {"1024x1024", "24576x4096"}


def test_choose_gemv_shortlists_the_shapes_timed_now(monkeypatch: pytest.MonkeyPatch) -> None:
    # A small weight (at most IN_STEP_MAX_BYTES) gets every candidate, with every linear of its
    # shape; a large one its large_shortlist; a shape whose choice came from disk nothing.
    from torch import nn

    from tidal_engine.kernels import gemv_choice, gemv_step_choice
    from tidal_engine.kernels.triton import gemv as gemv_module

    monkeypatch.setattr(gemv_module, "gemv", lambda x, w, b, config: torch.nn.functional.linear(x, w, b))
    monkeypatch.setattr(gemv_choice, "rotation_copies", lambda weight: [weight])
    monkeypatch.setattr(gemv_step_choice, "IN_STEP_MAX_BYTES", 64 * 32 * 2)

    def fake_time(fns: dict, copies: object) -> dict:  # cuBLAS slowest, then the tiles in list order
        return {tile: 1.0 if tile is None else 0.5 + 0.01 * GEMV_CONFIGS.index(tile) for tile in fns}

    monkeypatch.setattr(gemv_choice, "time_in_graphs", fake_time)
    torch.manual_seed(5)
    model = nn.Module()
    model.small1, model.small2 = Linear(64, 32), Linear(64, 32)
    model.large = Linear(64, 64)
    model.stored = Linear(32, 16)
    for m in model.children():
        torch.nn.init.normal_(m.weight)
    model.to(torch.bfloat16)
    cache: dict = {(16, 32, torch.bfloat16, False): GEMV_CONFIGS[0]}
    shortlists: dict = {}
    gemv_choice.choose_gemv(model, cache, few_rows=False, shortlists=shortlists)
    assert list(shortlists) == [(32, 64, torch.bfloat16, False), (64, 64, torch.bfloat16, False)]
    large = shortlists[(64, 64, torch.bfloat16, False)]
    assert large.modules == [model.large]
    assert large.candidates == [GEMV_CONFIGS[0], GEMV_CONFIGS[1]]  # 0.5 alone, 0.51 within 3% (cuBLAS 1.0: far)
    entry = shortlists[(32, 64, torch.bfloat16, False)]
    assert entry.modules == [model.small1, model.small2]
    assert entry.candidates == [*GEMV_CONFIGS, None]  # every tile (the fastest alone first), then cuBLAS
    assert cache[(32, 64, torch.bfloat16, False)] == GEMV_CONFIGS[0]


def test_compile_ahead_launches_a_gate_up_weights_tiles_with_the_activation_folded_in(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Any of them may be timed in the decode step, where the gate|up GEMV runs with SiLU-and-mul
    # folded in: a dry run launches both forms of every one-row tile, so none compiles then.
    from torch import nn

    from tidal_engine.kernels import gemv_choice
    from tidal_engine.kernels.triton import gemv as gemv_module

    calls: list[tuple[GemvConfig, bool]] = []
    monkeypatch.setattr(gemv_module, "gemv", lambda x, w, b, config, silu_and_mul=False: calls.append((config, silu_and_mul)))
    model = nn.Module()
    model.gate_up, model.down = Linear(32, 48), Linear(24, 32)
    model.gate_up.output_activation_name = SiluAndMul.name
    model.to(torch.bfloat16)
    launched = gemv_choice.launch_candidates(model, {}, few_rows=False)
    assert launched == len(calls) == 3 * len(GEMV_CONFIGS)  # gate_up: plain and folded; down: plain
    assert sorted((c for c, folded in calls if folded), key=str) == sorted(GEMV_CONFIGS, key=str)
    calls.clear()
    gemv_choice.launch_candidates(model, {(48, 32, torch.bfloat16, False): None}, few_rows=False)
    assert len(calls) == len(GEMV_CONFIGS) and not any(folded for _, folded in calls)  # gate_up's choice is stored
