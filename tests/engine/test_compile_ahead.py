"""Compiling Triton kernels ahead from a dry run (kernels/compile_ahead.py): which launches are
handed over, once per specialization, and that nothing is launched meanwhile. The compile step
is the test's own (no GPU): Triton's warm-up is what the engine gives it."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
import triton.language as tl
from triton.runtime.jit import JITFunction

from tidal_engine.kernels.compile_ahead import CompileAhead, arg_signature, launch_key


def _kernel_source(x_ptr, n, BLOCK: tl.constexpr) -> None:  # never compiled here
    pass


@pytest.fixture()
def launches(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """``JITFunction.run`` as a recorder of real launches (this machine cannot launch)."""
    seen: list[tuple[Any, ...]] = []

    def run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> str:
        seen.append((args, grid, warmup, kwargs))
        return "launched"

    monkeypatch.setattr(JITFunction, "run", run)
    return seen


def _recorder() -> tuple[list[tuple[Any, ...]], Any]:
    compiled: list[tuple[Any, ...]] = []
    lock = threading.Lock()

    def compile_fn(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        with lock:
            compiled.append((fn, args, kwargs))

    return compiled, compile_fn


def test_a_dry_run_hands_each_specialization_over_once_and_launches_nothing(launches: list[Any]) -> None:
    kernel = JITFunction(_kernel_source)
    compiled, compile_fn = _recorder()
    x = torch.zeros(64)
    with CompileAhead(workers=2, compile_fn=compile_fn) as ahead:
        with ahead.dry_run():
            for _ in range(3):  # three layers launching the same specialization
                assert kernel[(4,)](x, 4096, BLOCK=128) is None
            kernel[(4,)](x, 4096, BLOCK=256)  # another constexpr
            kernel[(1,)](x, 1, BLOCK=128)  # an integer Triton specializes on (== 1)
            kernel[(4,)](x, 4095, BLOCK=128)  # no longer a multiple of 16
    assert launches == []
    assert ahead.submitted == 4 and ahead.skipped == 2 and ahead.failed == 0
    assert sorted((args[1], kwargs["BLOCK"]) for _, args, kwargs in compiled) == [(1, 128), (4095, 128), (4096, 128),
                                                                                  (4096, 256)]
    assert all(fn is kernel for fn, _, _ in compiled)


def test_launches_outside_the_dry_run_or_from_other_threads_run(launches: list[Any]) -> None:
    kernel = JITFunction(_kernel_source)
    compiled, compile_fn = _recorder()
    x = torch.zeros(8)
    results: list[Any] = []
    with CompileAhead(workers=1, compile_fn=compile_fn) as ahead:
        with ahead.dry_run():
            other = threading.Thread(target=lambda: results.append(kernel[(1,)](x, 16, BLOCK=32)))
            other.start()
            other.join()
        assert kernel[(1,)](x, 16, BLOCK=32) == "launched"
    assert results == ["launched"]
    assert len(launches) == 2 and compiled == []


def test_the_patch_is_undone_and_a_second_dry_run_refused(launches: list[Any]) -> None:
    recorder = JITFunction.run
    _, compile_fn = _recorder()
    with CompileAhead(workers=1, compile_fn=compile_fn) as ahead:
        with ahead.dry_run():
            assert JITFunction.run is not recorder
            with pytest.raises(RuntimeError, match="already under way"):
                with CompileAhead(workers=1, compile_fn=compile_fn).dry_run():
                    pass
        assert JITFunction.run is recorder


def test_a_compile_that_fails_is_counted_not_raised(launches: list[Any]) -> None:
    kernel = JITFunction(_kernel_source)

    def compile_fn(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        raise RuntimeError("out of resources")

    with CompileAhead(workers=1, compile_fn=compile_fn) as ahead:
        with ahead.dry_run():
            kernel[(1,)](torch.zeros(4), 16, BLOCK=32)
    assert ahead.submitted == 1 and ahead.failed == 1


def test_signatures_follow_what_triton_specializes_on() -> None:
    base = torch.zeros(64, dtype=torch.bfloat16)
    assert arg_signature(base) == arg_signature(torch.ones(64, dtype=torch.bfloat16))
    assert arg_signature(base) != arg_signature(torch.zeros(64, dtype=torch.float16))
    assert arg_signature(base) != arg_signature(base[1:])  # 2-byte offset: no longer 16-byte aligned
    assert arg_signature(32) == arg_signature(4096) != arg_signature(33) == arg_signature(4095)
    assert arg_signature(1) != arg_signature(33)
    assert arg_signature(2**40) != arg_signature(32)  # 64-bit
    assert arg_signature(True) != arg_signature(1)


def test_constexprs_and_launch_options_are_keyed_by_value() -> None:
    fn = JITFunction(_kernel_source)
    x = torch.zeros(64)
    assert launch_key(fn, (x, 32), {"BLOCK": 64}) == launch_key(fn, (x, 48), {"BLOCK": 64})
    assert launch_key(fn, (x, 32, 64), {}) == launch_key(fn, (x, 48, 64), {})  # the constexpr given by position
    assert launch_key(fn, (x, 32, 64), {}) != launch_key(fn, (x, 32, 128), {})
    assert launch_key(fn, (x, 32), {"BLOCK": 64}) != launch_key(fn, (x, 32), {"BLOCK": 128})
    assert launch_key(fn, (x, 32), {"BLOCK": 64, "num_warps": 4}) != launch_key(fn, (x, 32), {"BLOCK": 64, "num_warps": 8})
    assert launch_key(fn, (x, 32), {"BLOCK": 64}) != launch_key(JITFunction(_kernel_source), (x, 32), {"BLOCK": 64})


def test_triton_is_prepared_on_a_thread() -> None:
    from tidal_engine.kernels.compile_ahead import prepare_triton_in_background

    from triton.runtime.cache import triton_key

    triton_key.cache_clear()
    thread = prepare_triton_in_background()
    thread.join()
    assert thread.name == "tidal-triton-key"
    assert triton_key.cache_info().currsize == 1  # computed there, so the first compile finds it


def test_decode_sizes_of_each_specialization_kind() -> None:
    from tidal_engine.runner.cuda_graphs import specialization_sizes
    from tidal_engine.runner.input_buffers import normalize_capture_sizes

    assert specialization_sizes(normalize_capture_sizes(None, 256)) == [1, 2, 16, 256]
    assert specialization_sizes([1]) == [1]
    assert specialization_sizes([8, 4, 24]) == [4, 24]  # no multiple of 16: the smallest (also "any other") and the largest
    assert specialization_sizes([]) == []


def test_the_gemv_tiles_of_each_untimed_shape_are_launched_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch import nn

    from tidal_engine.kernels import gemv_choice
    from tidal_engine.kernels.triton import gemv as gemv_module
    from tidal_engine.layers.linear import Linear

    launched: list[tuple[str, int, tuple[int, int], Any]] = []

    def recorder(name: str) -> Any:
        def launch(x: torch.Tensor, weight: torch.Tensor, bias: Any, config: Any) -> None:
            launched.append((name, x.shape[0], tuple(weight.shape), config))
        return launch

    monkeypatch.setattr(gemv_module, "gemv", recorder("gemv"))
    monkeypatch.setattr(gemv_module, "gemv_rows", recorder("gemv_rows"))
    model = nn.Module()
    model.a = Linear(64, 32)
    model.b = Linear(64, 32)  # the same shape: launched once
    model.c = Linear(32, 48)
    model.d = Linear(16, 16)
    model.to(torch.bfloat16)
    timed = {(48, 32, torch.bfloat16, False): None, (48, 32, "bfloat16r2", False): None}  # c, partly timed
    count = gemv_choice.launch_candidates(model, timed)
    per_shape = len(gemv_module.GEMV_CONFIGS) + len(gemv_module.GEMV_ROW_BUCKETS) * len(gemv_module.GEMV_ROWS_CONFIGS)
    untimed_c = (len(gemv_module.GEMV_ROW_BUCKETS) - 1) * len(gemv_module.GEMV_ROWS_CONFIGS)
    assert count == len(launched) == 2 * per_shape + untimed_c
    assert {(name, rows) for name, rows, shape, _ in launched if shape == (48, 32)} == {("gemv_rows", 4), ("gemv_rows", 8)}
    assert sorted({rows for _, rows, _, _ in launched}) == [1, *gemv_module.GEMV_ROW_BUCKETS]


def test_without_few_row_linears_only_the_one_row_tiles_are_launched(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch import nn

    from tidal_engine.kernels import gemv_choice
    from tidal_engine.kernels.triton import gemv as gemv_module
    from tidal_engine.layers.linear import Linear

    launched: list[tuple[str, int]] = []
    monkeypatch.setattr(gemv_module, "gemv", lambda x, w, b, c: launched.append(("gemv", x.shape[0])))
    monkeypatch.setattr(gemv_module, "gemv_rows", lambda x, w, b, c: launched.append(("gemv_rows", x.shape[0])))
    model = nn.Module()
    model.a = Linear(64, 32)
    model.to(torch.bfloat16)
    count = gemv_choice.launch_candidates(model, {}, few_rows=False)
    assert count == len(launched) == len(gemv_module.GEMV_CONFIGS)
    assert set(launched) == {("gemv", 1)}
