"""Executor → Worker → ModelRunner, driven by hand-built StepPlans (no scheduler).

A small ``MiniCore`` below plays the engine core: it allocates blocks, cuts prompts into
chunks under a token budget, sends each request once (``NewRequest``) and then only diffs,
optionally launches step N+1 before it takes N's result (async scheduling), preempts and
resumes on request. Greedy outputs are checked against the model's own forward over the
full sequences. The multiprocess executor must give the uniprocess tokens, fail clearly
(not hang) when a worker dies, and leave no worker process behind.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import pytest
import torch

from tidal_engine.config import EngineConfig
from tidal_engine.executor import create_executor
from tidal_engine.executor.base import Executor, PendingStep
from tidal_engine.executor.plan import NewRequest, SamplingOptions, ScheduledRequest, StepPlan, StepResult

from tiny_models import make_tiny_model, run_chunks

BLOCK_SIZE = 4
NUM_BLOCKS = 96


# ---------------------------------------------------------------------------------------
# A stand-in for runner/sampler.py's new interface (greedy only), until that rewrite lands.


class StandInSampler:
    def __init__(self, vocab_size: int, max_num_seqs: int, device: torch.device, generator: Any = None) -> None:
        self.vocab_size = vocab_size
        self.options: dict[str, SamplingOptions] = {}

    def add_request(self, req_id: str, options: SamplingOptions, prompt_token_ids: Sequence[int],
                    output_token_ids: Sequence[int] = ()) -> None:
        assert req_id not in self.options
        self.options[req_id] = options

    def remove_request(self, req_id: str) -> None:
        self.options.pop(req_id, None)

    def sample(self, logits: torch.Tensor, req_ids: list[str], grammar_bitmasks: Any = None,
               record_into: tuple[torch.Tensor, torch.Tensor] | None = None) -> "StandInTokens":
        assert logits.shape == (len(req_ids), self.vocab_size)
        assert all(r in self.options for r in req_ids), "the sampler was not told of a request"
        ids = logits.argmax(dim=-1)
        if record_into is not None:
            record_into[0].index_copy_(0, record_into[1], ids)
        return StandInTokens(ids)


class StandInTokens:
    def __init__(self, device_ids: torch.Tensor) -> None:
        self.device_ids = device_ids

    def result(self) -> tuple[list[int], list[None]]:
        ids = self.device_ids.tolist()
        return ids, [None] * len(ids)


def _sampler_factory() -> Any:
    """The real sampler once its new interface has landed, else the stand-in."""
    import inspect

    from tidal_engine.runner import sampler

    params = inspect.signature(sampler.Sampler.__init__).parameters
    return None if "vocab_size" in params else StandInSampler


# ---------------------------------------------------------------------------------------
# A miniature engine core


@dataclass
class _Req:
    rid: str
    prompt: list[int]
    max_tokens: int
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)
    sent_blocks: int | None = None  # None: the worker has not seen it
    out: list[int] = field(default_factory=list)
    pending: int = 0  # sampled, result not taken yet
    sent_out: int = 0  # output tokens sent to the workers (pipeline stages before the last need them)
    resumed: bool = False
    paused: bool = False
    lora_name: str | None = None

    @property
    def known(self) -> int:
        return len(self.prompt) + len(self.out) + self.pending

    @property
    def done(self) -> bool:
        return len(self.out) >= self.max_tokens


class MiniCore:
    def __init__(self, executor: Executor, budget: int = 1 << 20, async_mode: bool = False, seed: int = 0) -> None:
        self.executor = executor
        self.budget = budget
        self.async_mode = async_mode
        self.free = list(range(1, executor.num_kv_blocks))
        random.Random(seed).shuffle(self.free)  # scattered block ids
        self.reqs: dict[str, _Req] = {}
        self.finished: dict[str, list[int]] = {}
        self.forget: list[str] = []
        self.step_id = 0
        self.results: list[StepResult] = []

    def add(self, rid: str, prompt: list[int], max_tokens: int, *, computed: int = 0, blocks: list[int] | None = None,
            lora_name: str | None = None) -> None:
        req = _Req(rid, list(prompt), max_tokens, num_computed=computed, lora_name=lora_name)
        if blocks:
            req.blocks = list(blocks)
            self.free = [b for b in self.free if b not in blocks]
        self.reqs[rid] = req

    def preempt(self, rid: str) -> None:
        req = self.reqs[rid]
        assert req.pending == 0
        self.free.extend(req.blocks)
        req.blocks, req.num_computed = [], 0
        req.resumed = req.sent_blocks is not None
        req.paused = True

    def resume(self, rid: str) -> None:
        self.reqs[rid].paused = False

    def plan(self) -> tuple[StepPlan, list[tuple[_Req, int, bool]]]:
        left = self.budget
        new: list[NewRequest] = []
        scheduled: list[ScheduledRequest] = []
        chunks: list[tuple[_Req, int, bool]] = []
        for req in self.reqs.values():
            if req.paused or left <= 0 or len(req.out) + req.pending >= req.max_tokens:
                continue
            n = min(req.known - req.num_computed, left)
            if n <= 0:
                continue
            end = req.num_computed + n
            while len(req.blocks) * BLOCK_SIZE < end:
                req.blocks.append(self.free.pop())
            samples = end == req.known
            if req.sent_blocks is None:
                new.append(NewRequest(req.rid, req.prompt, SamplingOptions(temperature=0.0), list(req.blocks),
                                      req.num_computed, lora_name=req.lora_name, output_token_ids=list(req.out)))
                diff: list[int] = []
            elif req.resumed:
                diff = list(req.blocks)
            else:
                diff = req.blocks[req.sent_blocks :]
            new_tokens = req.out[req.sent_out :] if req.sent_blocks is not None else []
            req.sent_out = len(req.out)
            scheduled.append(ScheduledRequest(req.rid, req.num_computed, n, diff, samples, req.resumed, [], new_tokens))
            req.resumed = False
            req.sent_blocks = len(req.blocks)
            chunks.append((req, n, samples))
            left -= n
        forget, self.forget = self.forget, []
        self.step_id += 1
        return StepPlan(self.step_id, new, scheduled, forget), chunks

    def launch(self) -> tuple[PendingStep, list[tuple[_Req, int, bool]]] | None:
        plan, chunks = self.plan()
        if not plan.scheduled:
            self.forget[:0] = plan.finished_req_ids  # sent with the next step instead
            return None
        pending = self.executor.execute(plan)
        for req, n, samples in chunks:
            req.num_computed += n
            req.pending += samples
        return pending, chunks

    def complete(self, launched: tuple[PendingStep, list[tuple[_Req, int, bool]]]) -> None:
        pending, chunks = launched
        result = pending.result()
        self.results.append(result)
        sampled = [req for req, _, samples in chunks if samples]
        assert result.req_ids == [r.rid for r in sampled]
        for req, token in zip(sampled, result.token_ids):
            req.pending -= 1
            req.out.append(token)
            if req.done:
                self.finished[req.rid] = req.out
                self.forget.append(req.rid)
                self.free.extend(req.blocks)
                del self.reqs[req.rid]

    def step(self) -> None:
        """One step: sync, or (async) launch the next step before taking the last one's tokens."""
        if not self.async_mode:
            launched = self.launch()
            if launched is not None:
                self.complete(launched)
            return
        launched = self.launch()
        if self._in_flight is not None:
            self.complete(self._in_flight)
        self._in_flight = launched

    _in_flight: tuple[PendingStep, list[tuple[_Req, int, bool]]] | None = None

    def run(self, max_steps: int = 500) -> dict[str, list[int]]:
        for _ in range(max_steps):
            if not self.reqs and self._in_flight is None:
                break
            self.step()
        assert not self.reqs, "the requests did not finish"
        if self.forget:  # let the worker drop the last finished requests
            self.step_id += 1
            self.executor.execute(StepPlan(self.step_id, [], [], self.forget)).result()
            self.forget = []
        return self.finished


# ---------------------------------------------------------------------------------------
# Fixtures and the reference


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llama-executor")
    make_tiny_model("llama", folder, max_position_embeddings=256)
    return folder


def _config(folder: Path, **overrides: Any) -> EngineConfig:
    options: dict[str, Any] = dict(device="cpu", dtype="float32", max_model_len=128, max_num_seqs=4,
                                   block_size=BLOCK_SIZE, num_gpu_blocks_override=NUM_BLOCKS)
    options.update(overrides)
    return EngineConfig(model=str(folder), **options)


@pytest.fixture(scope="module")
def uni(tiny_dir: Path) -> Executor:
    executor = create_executor(_config(tiny_dir), sampler_factory=_sampler_factory())
    yield executor
    executor.shutdown()


PROMPTS = {
    "a": [5, 17, 99, 3, 250, 8, 41, 77, 12],
    "b": [300, 2, 2, 9],
    "c": list(range(40, 63)),
    "d": [1],
    "e": [11, 22, 33, 44, 55, 66, 77, 88, 99, 111, 122, 133, 144],
}
MAX_TOKENS = {"a": 7, "b": 10, "c": 5, "d": 9, "e": 6}


@pytest.fixture(scope="module")
def reference(uni: Executor) -> dict[str, list[int]]:
    """Greedy tokens from the model's own forward over each full sequence."""
    model = uni.driver_worker.runner.model  # type: ignore[attr-defined]
    out: dict[str, list[int]] = {}
    for rid, prompt in PROMPTS.items():
        tokens = list(prompt)
        for _ in range(MAX_TOKENS[rid]):
            logits = run_chunks(model, tokens, [len(tokens)], BLOCK_SIZE)
            tokens.append(int(logits[-1].argmax()))
        out[rid] = tokens[len(prompt) :]
    return out


def _run(executor: Executor, budget: int = 1 << 20, async_mode: bool = False, rids: Sequence[str] = tuple(PROMPTS)) -> dict[str, list[int]]:
    core = MiniCore(executor, budget=budget, async_mode=async_mode)
    for rid in rids:
        core.add(rid, PROMPTS[rid], MAX_TOKENS[rid])
    return core.run()


def _worker(executor: Executor) -> Any:
    return executor.driver_worker  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------
# Uniprocess: the worker's bookkeeping against the reference


@pytest.mark.parametrize("budget", [1 << 20, 7, 3])
def test_greedy_outputs_with_chunked_prefill(uni: Executor, reference: dict[str, list[int]], budget: int) -> None:
    assert _run(uni, budget=budget) == reference
    assert _worker(uni).request_ids() == []  # every finished request was forgotten


@pytest.mark.parametrize("budget", [1 << 20, 5])
def test_async_feeding_matches(uni: Executor, reference: dict[str, list[int]], budget: int) -> None:
    # Step N+1 is executed before N's result is taken: decodes read their token on the device.
    assert _run(uni, budget=budget, async_mode=True) == reference


def test_async_feeds_happen_on_the_device(uni: Executor) -> None:
    worker = _worker(uni)
    core = MiniCore(uni, async_mode=True)
    core.add("a", PROMPTS["a"], 3)
    first = core.launch()  # the prefill: samples token 1
    assert first is not None
    second = core.launch()  # one token at position len(history): fed from `first`
    assert second is not None
    plan_req = second[1][0]
    assert plan_req[1] == 1 and len(worker.token_history("a")) == len(PROMPTS["a"])
    core.complete(first)
    core.complete(second)
    assert worker.token_history("a") == PROMPTS["a"] + core.reqs["a"].out
    core.run()


def test_history_and_block_table_follow_the_diffs(uni: Executor, reference: dict[str, list[int]]) -> None:
    worker = _worker(uni)
    core = MiniCore(uni, budget=6)
    core.add("c", PROMPTS["c"], MAX_TOKENS["c"])
    core.add("b", PROMPTS["b"], MAX_TOKENS["b"])
    for _ in range(6):
        core.step()
        for rid, req in core.reqs.items():
            if req.sent_blocks is not None:
                assert worker.block_table(rid) == req.blocks
                assert worker.token_history(rid) == req.prompt + req.out
    out = core.run()
    assert out == {"c": reference["c"], "b": reference["b"]}


def test_prefix_hit_starts_from_cached_blocks(uni: Executor, reference: dict[str, list[int]]) -> None:
    # "x" computes e's prompt; then "y" (the same prompt) starts after x's first two full
    # blocks (num_computed_tokens = 8), reading their K/V, as a prefix-cache hit does.
    prompt = PROMPTS["e"]
    core = MiniCore(uni, budget=64)
    core.add("x", prompt, MAX_TOKENS["e"])
    launched = core.launch()
    assert launched is not None
    shared = core.reqs["x"].blocks[:2]
    core.complete(launched)
    core.add("y", prompt, MAX_TOKENS["e"], computed=2 * BLOCK_SIZE, blocks=shared)
    out = core.run()
    assert out["x"] == reference["e"] and out["y"] == reference["e"]


def test_preemption_and_resume(uni: Executor, reference: dict[str, list[int]]) -> None:
    worker = _worker(uni)
    core = MiniCore(uni, budget=64)
    for rid in ("a", "b", "d"):
        core.add(rid, PROMPTS[rid], MAX_TOKENS[rid])
    for _ in range(3):
        core.step()
    core.preempt("b")  # its blocks go back to the pool and are reused by the others
    for _ in range(3):
        core.step()
    assert len(worker.token_history("b")) == len(PROMPTS["b"]) + 3  # the worker kept its history
    core.resume("b")  # recomputes prompt + 3 outputs into new blocks (resumed=True)
    out = core.run()
    assert out == {rid: reference[rid] for rid in ("a", "b", "d")}


def test_finished_requests_free_their_rows(uni: Executor, reference: dict[str, list[int]]) -> None:
    worker = _worker(uni)
    batch = worker.batch
    # Twice as many requests as max_num_seqs over time: rows are reused, never grown.
    capacity = batch.capacity
    for wave in range(2):
        out = _run(uni, rids=["a", "b", "c", "d"])
        assert out == {rid: reference[rid] for rid in "abcd"}
        assert batch.row_of == {} and batch.capacity == capacity


def test_worker_rejects_an_unknown_token(uni: Executor) -> None:
    # A chunk past the known tokens with nothing in flight is a core bug: a clear error.
    worker = _worker(uni)
    worker.execute(StepPlan(900, [NewRequest("z", [1, 2, 3], SamplingOptions(), [1], 0)],
                            [ScheduledRequest("z", 0, 3, [], True)], [])).result()
    with pytest.raises(ValueError, match="only 4 are known"):
        worker.execute(StepPlan(901, [], [ScheduledRequest("z", 3, 2, [], True)], []))
    worker.execute(StepPlan(902, [], [], ["z"])).result()
    assert worker.request_ids() == []


def test_collective_rpc_on_the_worker(uni: Executor) -> None:
    assert uni.collective_rpc("ping") == ["pong"]
    usage = uni.collective_rpc("memory_usage")[0]
    assert usage["kv_cache_bytes"] > 0 and usage["weights_bytes"] > 0
    assert uni.collective_rpc("num_kv_blocks") == [NUM_BLOCKS]


def test_sleep_and_wake_through_rpc(tiny_dir: Path, reference: dict[str, list[int]]) -> None:
    executor = create_executor(_config(tiny_dir), sampler_factory=_sampler_factory())
    try:
        for level in (1, 2):
            executor.collective_rpc("sleep", level)
            usage = executor.collective_rpc("memory_usage")[0]
            assert usage["kv_cache_bytes"] == 0 and usage["weights_bytes"] == 0
            assert executor.collective_rpc("wake_up", ["kv_cache"]) == [True]  # weights still asleep
            assert executor.collective_rpc("wake_up", None) == [False]
            assert _run(executor, rids=["a", "d"]) == {rid: reference[rid] for rid in "ad"}
    finally:
        executor.shutdown()


def test_level1_sleep_is_one_copy_into_a_reused_host_buffer(tiny_dir: Path, reference: dict[str, list[int]]) -> None:
    # After a wake the parameters are views into one flat buffer; the host copy is allocated at
    # the first sleep and the same buffer takes every later one; greedy output after each wake
    # is unchanged.
    executor = create_executor(_config(tiny_dir), sampler_factory=_sampler_factory())
    try:
        runner = _worker(executor).runner
        storages = lambda: {p.untyped_storage().data_ptr() for p in runner.model.parameters()}  # noqa: E731
        assert len(storages()) > 1  # no sleep yet: every parameter keeps its own storage
        hosts = []
        for _ in range(2):
            executor.collective_rpc("sleep", 1)
            assert executor.collective_rpc("memory_usage")[0]["offloaded_weights_bytes"] == runner.weights.nbytes
            hosts.append(runner.weights.host_buffer.get().data_ptr())
            assert executor.collective_rpc("wake_up", None) == [False]
            assert not runner.kv_caches[0].any()  # a fresh cache, nothing re-profiled
            assert executor.num_kv_blocks == NUM_BLOCKS
            assert _run(executor, rids=["a", "c"]) == {rid: reference[rid] for rid in "ac"}
            assert len(storages()) == 1
        assert hosts[0] == hosts[1]
    finally:
        executor.shutdown()


# ---------------------------------------------------------------------------------------
# Multiprocess


@pytest.fixture(scope="module")
def mp(tiny_dir: Path) -> Executor:
    executor = create_executor(_config(tiny_dir, distributed_executor_backend="mp"), sampler_factory=_sampler_factory())
    yield executor
    executor.shutdown()


@pytest.mark.parametrize("async_mode", [False, True])
def test_multiproc_matches_uniproc(mp: Executor, uni: Executor, reference: dict[str, list[int]], async_mode: bool) -> None:
    assert mp.num_kv_blocks == uni.num_kv_blocks
    assert _run(mp, budget=5, async_mode=async_mode) == _run(uni, budget=5, async_mode=async_mode) == reference


def test_multiproc_rpc_and_errors(mp: Executor) -> None:
    assert mp.collective_rpc("ping") == ["pong"]
    assert mp.collective_rpc("request_ids") == [[]]
    with pytest.raises(RuntimeError, match="no_such_method"):
        mp.collective_rpc("no_such_method")
    # A bad plan fails its own result(), and the worker keeps serving.
    bad = mp.execute(StepPlan(1000, [], [ScheduledRequest("ghost", 0, 1, [], True)], []))
    with pytest.raises(RuntimeError, match="ghost"):
        bad.result()
    mp.check_health()
    assert mp.collective_rpc("ping") == ["pong"]


def test_multiproc_non_blocking_execute(mp: Executor, reference: dict[str, list[int]]) -> None:
    # Several plans go out before any result is read; results come back per step, in any order asked.
    core = MiniCore(mp, async_mode=True)
    core.add("a", PROMPTS["a"], MAX_TOKENS["a"])
    first = core.launch()
    second = core.launch()
    assert first is not None and second is not None
    r2 = second[0].result()  # taken first: the executor buffers step 1's result meanwhile
    core.complete(first)
    assert r2.step_id == second[0].result().step_id
    core.complete(second)
    assert core.run()["a"] == reference["a"]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (dead, not reaped yet) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if _pid_alive(p)]
        if not alive:
            return []
        time.sleep(0.05)
    return [p for p in pids if _pid_alive(p)]


def test_dead_worker_is_a_clear_error(tiny_dir: Path) -> None:
    executor = create_executor(_config(tiny_dir, distributed_executor_backend="mp"), sampler_factory=_sampler_factory())
    try:
        pids = executor.worker_pids  # type: ignore[attr-defined]
        core = MiniCore(executor)
        core.add("a", PROMPTS["a"], 4)
        launched = core.launch()
        assert launched is not None
        os.kill(pids[0], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="worker .*died"):
            launched[0].result()
        with pytest.raises(RuntimeError, match="died"):
            executor.check_health()
        with pytest.raises(RuntimeError, match="died"):
            executor.execute(StepPlan(99, [], [], [])).result()
        assert time.monotonic() - start < 30
    finally:
        executor.shutdown()


def test_shutdown_leaves_no_worker(tiny_dir: Path) -> None:
    executor = create_executor(_config(tiny_dir, distributed_executor_backend="mp"), sampler_factory=_sampler_factory())
    pids = list(executor.worker_pids)  # type: ignore[attr-defined]
    assert pids and all(_pid_alive(p) for p in pids)
    executor.shutdown()
    assert _wait_gone(pids, 10) == []


PARENT_SCRIPT = textwrap.dedent(
    """
    import sys
    sys.path[:0] = {paths!r}
    from tidal_engine.config import EngineConfig
    from tidal_engine.executor import create_executor
    from test_executor import _sampler_factory

    if __name__ == "__main__":
        config = EngineConfig(model={model!r}, device="cpu", dtype="float32", max_model_len=64, max_num_seqs=2,
                              block_size=4, num_gpu_blocks_override=16, distributed_executor_backend="mp")
        executor = create_executor(config, sampler_factory=_sampler_factory())
        print("PIDS", *executor.worker_pids, flush=True)
        sys.stdin.read()  # until killed
    """
)


def test_workers_die_with_a_killed_parent(tiny_dir: Path, tmp_path: Path) -> None:
    script = tmp_path / "parent.py"
    here = str(Path(__file__).parent)
    script.write_text(PARENT_SCRIPT.format(paths=[here, *sys.path], model=str(tiny_dir)))
    parent = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        line = parent.stdout.readline()
        assert line.startswith("PIDS"), line
        pids = [int(p) for p in line.split()[1:]]
        assert pids and all(_pid_alive(p) for p in pids)
        parent.kill()  # SIGKILL: no cleanup code runs in the parent
        parent.wait(timeout=10)
        assert _wait_gone(pids, 15) == []
    finally:
        if parent.poll() is None:
            parent.kill()


@pytest.mark.parametrize("backend, tp, pp", [("uni", 1, 1), ("mp", 1, 1), ("mp", 2, 1), ("mp", 1, 2)])
def test_lora_rows_next_to_base_rows(tmp_path: Path, backend: str, tp: int, pp: int) -> None:
    # One request through an adapter, one on the base model, in the same steps: each gets
    # the greedy tokens of its own model (PEFT's forward over the full sequence). At TP=2
    # each rank holds its slice of the adapter (B rows of qkv/gate_up, A columns of o/down);
    # at PP=2 each stage the adapter's layers it holds.
    from test_lora_support import make_peft_adapter

    hf = make_tiny_model("llama", tmp_path / "base", max_position_embeddings=256)
    peft = make_peft_adapter(hf, tmp_path / "a", rank=4, alpha=8, seed=1)
    config = _config(tmp_path / "base", enable_lora=True, max_loras=1, max_lora_rank=8, distributed_executor_backend=backend,
                     tensor_parallel_size=tp, pipeline_parallel_size=pp)
    executor = create_executor(config, sampler_factory=_sampler_factory())
    try:
        executor.collective_rpc("add_lora", ("a", str(tmp_path / "a")))  # (name, folder): read by the worker
        assert executor.collective_rpc("list_loras") == [["a"]] * tp * pp
        core = MiniCore(executor, budget=6)
        core.add("lora", PROMPTS["a"], 5, lora_name="a")
        core.add("base", PROMPTS["a"], 5)
        out = core.run()
    finally:
        executor.shutdown()

    def greedy(model: Any, n: int) -> list[int]:
        tokens = list(PROMPTS["a"])
        with torch.no_grad():
            for _ in range(n):
                tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
        return tokens[len(PROMPTS["a"]) :]

    assert out["base"] == greedy(hf, 5)
    assert out["lora"] == greedy(peft, 5)
    assert out["lora"] != out["base"]  # the adapter really changed the output
