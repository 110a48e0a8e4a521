"""argmax_rows (kernels/triton/argmax.py) against torch.argmax.

CPU cases run the kernel in Triton's interpreter (the root conftest sets TRITON_INTERPRET=1) on
tiny rows with a small chunk, so a row spans several programs and the last-program reduction,
the counters and the ties across chunks are all exercised. GPU cases (marked ``gpu``) run the
compiled kernel on a Qwen3-sized vocabulary, eagerly and inside a replayed CUDA graph.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from tidal_engine.kernels.triton import argmax as argmax_mod  # noqa: E402
from tidal_engine.kernels.triton.argmax import argmax_rows  # noqa: E402

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")
cpu_kernel = pytest.mark.skipif(not INTERPRETING, reason="CPU kernels need TRITON_INTERPRET=1")
gpu = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(INTERPRETING, reason="GPU tests run compiled: set TRITON_INTERPRET=0"),
]

NAN, INF = float("nan"), float("inf")
CHUNK = 32  # a 200-column row: 7 programs, the last one partial


def kernel(x: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    return argmax_rows(x, chunk=chunk, force_kernel=True)


@cpu_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_rows_match_torch(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x = torch.randn(5, 200).to(dtype)  # 200 is not a multiple of the chunk
    out = kernel(x)
    assert out.dtype == torch.int64 and out.shape == (5,)
    assert out.tolist() == x.argmax(dim=-1).tolist()


@cpu_kernel
def test_one_row_and_one_chunk() -> None:
    torch.manual_seed(1)
    x = torch.randn(1, 20)  # shorter than one chunk: a single, partial program
    assert kernel(x).tolist() == x.argmax(dim=-1).tolist()


@cpu_kernel
def test_ties_take_the_first_index_within_and_across_chunks() -> None:
    x = torch.zeros(4, 200)
    x[0, [3, 9]] = 5.0  # within one chunk
    x[1, [40, 10, 190]] = 5.0  # across chunks: 10 comes first
    x[2, [199, 100]] = 5.0  # the later one is in the last, partial chunk
    x[3, 64] = -0.0  # -0.0 equals 0.0: an all-zero row gives 0
    x[3, 0] = -0.0
    assert kernel(x).tolist() == x.argmax(dim=-1).tolist() == [3, 10, 100, 0]


@cpu_kernel
def test_nan_is_the_maximum_and_the_first_nan_wins() -> None:
    torch.manual_seed(2)
    x = torch.randn(3, 200)
    x[0, [150, 70]] = NAN  # across chunks
    x[1, 5] = INF
    x[1, 180] = NAN  # NaN above +inf
    x[2, [33, 34]] = NAN
    assert kernel(x).tolist() == x.argmax(dim=-1).tolist() == [70, 180, 33]


@cpu_kernel
def test_all_neg_inf_row_gives_index_zero() -> None:
    x = torch.full((2, 200), -INF)
    x[1, 130] = -1e30
    assert kernel(x).tolist() == x.argmax(dim=-1).tolist() == [0, 130]


@cpu_kernel
def test_loop_over_blocks_within_a_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(argmax_mod, "MAX_BLOCK", 16)  # each 64-column chunk loads 4 blocks
    torch.manual_seed(3)
    x = torch.randn(3, 200)
    x[2, [120, 77]] = x[2].max() + 1  # a tie inside one chunk, in different blocks
    assert kernel(x, chunk=64).tolist() == x.argmax(dim=-1).tolist()


@cpu_kernel
def test_second_call_gives_the_same_answer_counters_reset() -> None:
    torch.manual_seed(4)
    x = torch.randn(3, 200)
    first = kernel(x).tolist()
    assert kernel(x).tolist() == first == x.argmax(dim=-1).tolist()
    assert argmax_mod._workspaces[x.device].counters.tolist() == [0] * argmax_mod._workspaces[x.device].rows
    y = torch.randn(6, 300)  # more rows and chunks: the workspace grows
    assert kernel(y).tolist() == y.argmax(dim=-1).tolist()
    assert kernel(x).tolist() == first


def test_workspace_made_inside_a_capture_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    device = torch.device("cpu")
    monkeypatch.setattr(argmax_mod, "_workspaces", {})
    monkeypatch.setattr(argmax_mod, "stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="CUDA-graph capture"):
        argmax_mod._workspace(device, 2, 4)
    monkeypatch.setattr(argmax_mod, "stream_capturing", lambda: False)
    ws = argmax_mod._workspace(device, 2, 4)
    monkeypatch.setattr(argmax_mod, "stream_capturing", lambda: True)
    assert argmax_mod._workspace(device, 2, 3) is ws  # big enough: no allocation, no error
    with pytest.raises(RuntimeError, match="CUDA-graph capture"):
        argmax_mod._workspace(device, 3, 4)


@cpu_kernel
def test_scatter_into_writes_each_rows_index_in_the_same_launch() -> None:
    torch.manual_seed(2)
    x = torch.randn(3, 200)
    dest = torch.full((6,), -1, dtype=torch.int64)
    out = argmax_rows(x, chunk=CHUNK, force_kernel=True, scatter_into=(dest, torch.tensor([4, 0, 2])))
    assert out.tolist() == x.argmax(dim=-1).tolist()
    assert dest.tolist() == [out[1], -1, out[2], -1, out[0], -1]


def test_scatter_into_off_the_kernel_and_its_checks() -> None:
    x = torch.tensor([[1.0, 3.0, 2.0], [5.0, 0.0, 1.0]])
    dest = torch.zeros(3, dtype=torch.int64)
    assert argmax_rows(x, scatter_into=(dest, torch.tensor([2, 1]))).tolist() == [1, 0]
    assert dest.tolist() == [0, 0, 1]
    with pytest.raises(ValueError, match="scatter_into"):
        argmax_rows(x, scatter_into=(dest.float(), torch.tensor([2, 1])))
    with pytest.raises(ValueError, match="scatter_into"):
        argmax_rows(x, scatter_into=(dest, torch.tensor([2])))


def test_cpu_without_force_is_torch() -> None:
    x = torch.tensor([[1.0, 3.0, 3.0], [NAN, 0.0, NAN]])
    assert argmax_rows(x).tolist() == [1, 0]


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError, match=r"\[M, V\]"):
        argmax_rows(torch.zeros(4))
    with pytest.raises(ValueError, match="power of two"):
        argmax_rows(torch.zeros(2, 100), chunk=48, force_kernel=True)
    with pytest.raises(TypeError, match="dtype"):
        argmax_rows(torch.zeros(2, 100, dtype=torch.int32), force_kernel=True)


def test_micro_benchmark_checks_every_candidate_against_torch() -> None:
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "argmax_micro.py"
    spec = importlib.util.spec_from_file_location("argmax_micro", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    fns = bench.candidates()
    assert {"torch", "argmax_rows"} <= set(fns)
    inputs = [torch.tensor([[0.0, 2.0, 2.0], [NAN, 1.0, NAN]])]
    bench.check(fns, inputs)  # off CUDA argmax_rows is torch's: all agree
    with pytest.raises(AssertionError, match="last disagrees with torch.argmax on input 0, rows \\[0, 1\\]"):
        bench.check({"last": lambda x: x.shape[1] - 1 - x.flip(-1).argmax(dim=-1)}, inputs)


# ---------------------------------------------------------------------------------------- GPU

QWEN3_VOCAB = 151936


def on_gpu(fn):  # type: ignore[no-untyped-def]
    for mark in gpu:
        fn = mark(fn)
    return fn


@on_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_rows_match_torch(dtype: torch.dtype) -> None:
    gen = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(4, QWEN3_VOCAB, device="cuda", generator=gen).to(dtype)
    x[1, [151000, 7]] = 100.0  # a tie across chunks
    x[2, [90000, 3000]] = NAN
    x[3] = -INF
    expected = x.argmax(dim=-1)
    assert expected.tolist()[1:] == [7, 3000, 0]
    for _ in range(2):  # the counters reset: the second call agrees too
        assert torch.equal(argmax_rows(x), expected)
    wide = torch.randn(64, QWEN3_VOCAB, device="cuda", generator=gen).to(dtype)
    assert torch.equal(argmax_rows(wide), wide.argmax(dim=-1))
    strided = wide[:, :-7]  # rows 151936 apart, 151929 columns
    assert torch.equal(argmax_rows(strided), strided.argmax(dim=-1))


@on_gpu
def test_gpu_inside_a_cuda_graph_replayed_with_fresh_inputs() -> None:
    gen = torch.Generator(device="cuda").manual_seed(6)
    x = torch.randn(4, QWEN3_VOCAB, device="cuda", generator=gen)
    argmax_rows(x)  # the workspace is made eagerly, before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = argmax_rows(x)
    for _ in range(3):
        x.copy_(torch.randn(x.shape, device="cuda", generator=gen))
        x[0, [5, 150000]] = 50.0  # a tie across chunks in every replay
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, x.argmax(dim=-1))
        assert out[0].item() == 5


@on_gpu
def test_gpu_sampler_greedy_path_uses_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    from tidal_engine.executor.plan import SamplingOptions
    from tidal_engine.runner import sampler as sampler_mod

    calls: list[tuple[int, ...]] = []

    def counted(logits: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        calls.append(tuple(logits.shape))
        return argmax_rows(logits, **kwargs)

    monkeypatch.setattr(sampler_mod, "_split_argmax", lambda: counted)
    sampler = sampler_mod.Sampler(QWEN3_VOCAB, 4, torch.device("cuda"))
    for i in range(3):
        sampler.add_request(str(i), SamplingOptions(temperature=0.0), [1, 2])
    logits = torch.randn(3, QWEN3_VOCAB, device="cuda")
    last = torch.zeros(5, dtype=torch.int64, device="cuda")
    ids, _ = sampler.sample(logits, ["0", "1", "2"], record_into=(last, torch.tensor([3, 1, 4], device="cuda"))).result()
    assert ids == logits.argmax(dim=-1).tolist()
    assert last.tolist() == [0, ids[1], 0, ids[0], ids[2]]
    assert calls == [(3, QWEN3_VOCAB)]
