"""Pipeline parallelism with several micro-batches in flight, on CPU (gloo), PP=2.

The engine core keeps up to PP batches of distinct requests in flight (engine/core.py,
``_step_pipelined``); the stages before the last get the sampled ids with each request's
next chunk. What is checked, against a PP=1 engine with the same options:

- greedy (and seeded) outputs equal token for token under chunked prefill, preemption,
  prefix-cache hits, n > 1, a grammar, and more requests than one batch holds;
- a request aborted while its batch is in flight ends cleanly, the others are unaffected,
  and every rank forgets it;
- the batch queue itself (a model-free worker): consecutive batches share no request, and a
  uniform workload settles into two equal halves;
- two batches are really in the pipeline at once: the last stage holds its first step
  until the first stage has launched the next one (events between the worker processes;
  if the first stage could not run batch i+1 before the last stage finished batch i, the
  hold would time out and the step fail);
- a stage whose step fails, or that dies with batches in flight, ends the engine with an
  error naming it, never a hang.

One PP=2 engine serves the whole module (two worker processes on the 2-core CI box).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from tidal_engine import SamplingParams
from tidal_engine.config import EngineConfig
from tidal_engine.engine.core import EngineCore
from tidal_engine.executor import create_executor
from tidal_engine.executor.plan import NewRequest, SamplingOptions, ScheduledRequest, StepPlan
from tidal_engine.structured.params import StructuredOutputsParams

from tiny_models import TINY_MODELS, make_tiny_model
from tiny_tokenizer import EOS_ID, save_byte_tokenizer

pytestmark = pytest.mark.slow  # real engines: worker processes

HOLD_TIMEOUT_S = 60.0

OPTIONS: dict[str, Any] = dict(
    device="cpu", dtype="float32", block_size=4,
    max_model_len=48,
    max_num_batched_tokens=7,  # every prompt is chunked; two batches form from the first step
    num_gpu_blocks_override=14,  # 56 tokens of KV for up to 4 sequences: preemption
    max_num_seqs=4,  # fewer than the requests: the rest wait for a finished one
    enable_prefix_caching=True,
)


class HoldLastStage:
    """A worker ``step_observer``: once armed, the last of two stages holds the first step it
    launches until the first stage has launched a later step. Events and a shared counter
    cross the processes (they travel to the spawned workers with the executor's arguments)."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.armed = ctx.Event()
        self.released = ctx.Event()  # the hold ended because stage 0 got further
        self.changed = ctx.Condition()
        self.launched = ctx.Value("q", 0)  # the newest step stage 0 launched
        self.held = ctx.Value("q", 0)  # the step stage 1 held

    def __call__(self, rank: int, step_id: int) -> None:
        if rank == 0:
            with self.changed:
                self.launched.value = step_id
                self.changed.notify_all()
        elif rank == 1 and self.armed.is_set() and not self.held.value:
            self.held.value = step_id
            with self.changed:
                got_further = self.changed.wait_for(lambda: self.launched.value > step_id, HOLD_TIMEOUT_S)
            if not got_further:
                raise RuntimeError(f"stage 0 launched no step after {step_id} while stage 1 held step {step_id}")
            self.released.set()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("pp-qwen3")
    make_tiny_model("qwen3", folder, eos_token_id=EOS_ID, bos_token_id=None)
    save_byte_tokenizer(folder, vocab_size=TINY_MODELS["qwen3"][1]["vocab_size"])
    return folder


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> EngineCore:
    core = EngineCore(EngineConfig(model=str(model_dir), **OPTIONS))
    yield core
    core.shutdown()


@pytest.fixture(scope="module")
def hold() -> HoldLastStage:
    return HoldLastStage()


@pytest.fixture(scope="module")
def pp2(model_dir: Path, hold: HoldLastStage) -> EngineCore:
    config = EngineConfig(model=str(model_dir), pipeline_parallel_size=2, **OPTIONS)
    core = EngineCore(config, executor=create_executor(config, step_observer=hold))
    yield core
    core.shutdown()


def _requests() -> list[tuple[str, list[int], SamplingParams]]:
    shared = list(range(30, 50))  # 5 full blocks: later requests with this prefix hit the cache
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    return [
        ("a", shared + [1, 2], greedy),
        ("b", [5, 17, 99, 3, 25, 8, 41], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)),
        ("c", shared + [3], greedy),
        ("d", [1, 2, 3], SamplingParams(temperature=0.9, top_p=0.9, seed=7, n=2, max_tokens=8, ignore_eos=True)),
        ("e", [200, 201, 7, 7, 7, 7, 9, 11, 13, 15, 2], greedy),
        ("f", shared + [4, 5, 6], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)),
        # A grammar row: its batch completes before another is launched (the next bitmask needs its token).
        ("g", [7, 8, 9], SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(
            regex="(ab|cd)+"))),
    ]


def _run(core: EngineCore, requests: list[tuple[str, list[int], SamplingParams]],
         abort_in_flight: str | None = None) -> dict[tuple[str, int], list[int]]:
    """Every sample's tokens. ``abort_in_flight``: abort that request once it has a token and
    is in a batch still in flight behind the one just completed (the test fails if it never is)."""
    for rid, prompt, params in requests:
        core.add_request(rid, prompt, params)
    tokens: dict[tuple[str, int], list[int]] = {}
    aborted = False
    while core.has_unfinished_requests():
        for delta in core.step():
            tokens.setdefault((delta.request_id, delta.index), []).extend(delta.new_token_ids)
        if abort_in_flight is not None and not aborted and tokens.get((abort_in_flight, 0)) \
                and _in_flight(core, abort_in_flight):
            core.abort_request(abort_in_flight)
            aborted = True
    assert abort_in_flight is None or aborted, "the request was never in a batch in flight"
    return tokens


def _drain(core: EngineCore) -> dict[tuple[str, int], list[int]]:
    tokens: dict[tuple[str, int], list[int]] = {}
    while core.has_unfinished_requests():
        for delta in core.step():
            tokens.setdefault((delta.request_id, delta.index), []).extend(delta.new_token_ids)
    return tokens


def _in_flight(core: EngineCore, request_id: str) -> bool:
    return any(c.request.request_id.split("#")[0] == request_id for b in core._batches for c in b.output.chunks)


def test_two_batches_are_in_the_pipeline_at_once(pp2: EngineCore, hold: HoldLastStage) -> None:
    hold.armed.set()
    for rid, first in (("x", 10), ("y", 60), ("z", 110)):
        pp2.add_request(rid, list(range(first, first + 6)), SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    # The first call launches step 1 (x's prompt and the first token of y's: the budget is 7),
    # then step 2 (z's prompt: x and y are in flight, so they sit out), then waits for step 1,
    # which stage 1 holds until stage 0 has launched step 2.
    deltas = pp2.step()
    assert hold.released.is_set() and hold.held.value == 1
    assert [d.request_id for d in deltas] == ["x"]
    assert [c.request.request_id for b in pp2._batches for c in b.output.chunks] == ["z"]
    assert pp2.max_batches_in_flight == 2
    while pp2.has_unfinished_requests():
        pp2.step()


def test_the_batch_queue_splits_a_uniform_workload_in_two(model_dir: Path) -> None:
    # Model-free (the scripted worker answers at once): 32 equal requests at PP=2. Each batch
    # is scheduled while the previous one is in flight, so consecutive batches share no
    # request, and the decodes settle into two halves of 16 (the shape of the GPU benchmark).
    from scripted_executor import ScriptedExecutor, expected_tokens

    config = EngineConfig(model=str(model_dir), device="cpu", dtype="float32", max_model_len=256, block_size=16,
                          num_gpu_blocks_override=512, max_num_seqs=32, max_num_batched_tokens=512,
                          skip_tokenizer_init=True, pipeline_parallel_size=2)
    executor = ScriptedExecutor(config)
    core = EngineCore(config, executor=executor)
    prompts = {f"r{i}": [50 + i] * 64 for i in range(32)}
    for rid, prompt in prompts.items():
        core.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    tokens = _drain(core)
    assert tokens == {(rid, 0): expected_tokens(prompt, 16) for rid, prompt in prompts.items()}
    batches = [{s.req_id for s in p.scheduled} for p in executor.plans if p.scheduled]
    assert all(not (a & b) for a, b in zip(batches, batches[1:]))
    decode_only = [p for p in executor.plans if p.scheduled and all(s.num_new_tokens == 1 for s in p.scheduled)]
    assert max(len(p.scheduled) for p in decode_only) == 16
    assert sum(len(p.scheduled) == 16 for p in decode_only) >= 2 * 12  # most of each half's 15 decode steps
    assert core.max_batches_in_flight == 2


def test_pp2_micro_batches_equal_pp1(reference: EngineCore, pp2: EngineCore) -> None:
    expected = _run(reference, _requests())
    preemptions = pp2.get_stats().num_preemptions
    hits = pp2.get_stats().prefix_cache_hits
    pp2.max_batches_in_flight = 0  # counted for this workload only
    got = _run(pp2, _requests())
    assert got == expected
    assert len([k for k in got if k[0] == "d"]) == 2  # n = 2
    text = bytes(t for t in got[("g", 0)] if t != EOS_ID).decode()  # the byte tokenizer: ids are bytes
    assert text and set(text) <= set("abcd")
    assert pp2.get_stats().num_preemptions > preemptions and pp2.get_stats().prefix_cache_hits > hits
    assert pp2.max_batches_in_flight == 2


def test_abort_while_its_batch_is_in_flight(reference: EngineCore, pp2: EngineCore) -> None:
    requests = _requests()[:3]
    expected = _run(reference, [r for r in requests if r[0] != "b"])
    got = _run(pp2, requests, abort_in_flight="b")
    assert {k: v for k, v in got.items() if k[0] != "b"} == expected
    assert len(got[("b", 0)]) < 10
    pp2.settle()
    assert pp2.executor.collective_rpc("request_ids") == [[], []]  # every rank forgot every request
    again = _run(pp2, requests[:1])  # and the engine goes on
    assert again == _run(reference, requests[:1])


def test_a_step_failing_on_the_first_stage_is_an_error_not_a_hang(model_dir: Path) -> None:
    # A plan that leaves out the sampled id the first stage needs: that rank's step fails, it
    # exits (closing its sockets first), and the last stage, waiting for its activations,
    # fails too. The error names the rank.
    config = EngineConfig(model=str(model_dir), pipeline_parallel_size=2, **OPTIONS)
    executor = create_executor(config)
    try:
        options = SamplingOptions(temperature=0.0)
        prefill = StepPlan(1, [NewRequest("r", [1, 2, 3], options, [0], 0)], [ScheduledRequest("r", 0, 3, [], True)], [])
        assert len(executor.execute(prefill).result().token_ids) == 1
        decode = StepPlan(2, [], [ScheduledRequest("r", 3, 1, [], True)], [])  # no new_token_ids
        with pytest.raises(RuntimeError, match=r"worker rank 0 \(pid \d+\) died \(exit code 1\)"):
            executor.execute(decode).result()
    finally:
        executor.shutdown()


def test_a_dead_first_stage_ends_the_engine(pp2: EngineCore) -> None:
    # Last in the module: it kills the shared engine's first stage with batches in flight.
    for rid, prompt, params in _requests():
        pp2.add_request(rid, prompt, params)
    while not pp2._batches:  # until a step returns with a batch still in flight
        assert pp2.has_unfinished_requests()
        pp2.step()
    os.kill(pp2.executor.worker_pids[0], signal.SIGKILL)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match=r"worker rank 0 \(pid \d+\) died \(killed by signal 9\)"):
        while pp2.has_unfinished_requests():
            pp2.step()
