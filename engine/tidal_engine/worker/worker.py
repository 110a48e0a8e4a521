"""The worker: one device's model runner plus what it knows of each request.

The engine core never sends tokens back to a worker: a request arrives once (``NewRequest``:
prompt, sampling options, blocks), and each ``StepPlan`` after that carries diffs (blocks
appended, or a whole table after a preemption; how many tokens to compute from where;
which requests are gone). The worker keeps every live request's token history (prompt
plus each token it sampled) and block table in the runner's persistent batch, applies the
diffs to it, and runs the step.

``execute(plan)`` never waits for the device: it returns a ``WorkerStep`` whose ``result()``
waits for the sampled ids, appends them to the histories and gives the ``StepResult``.

Async scheduling: the core may send step N+1 before it took N's result. A chunk that ends
one token past a request's history (``num_computed_tokens + num_new_tokens == len(history)
+ 1``: normally one token at position ``len(history)``) reads the token the request sampled
last, which is not on the host yet: the runner feeds it on the device from the persistent
batch's last sampled ids. Results are taken in order: ``result()`` of a step first takes
the results of the steps before it, so histories always grow in order.

Pipeline parallelism: only the last stage samples. The stages before it take each
request's sampled ids from the plan that next schedules it (``new_token_ids``), so they
never wait for the last stage and run the next micro-batch while it works on this one;
their ``result()`` only waits for their own share of the device work.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from tidal_engine.distributed.parallel_state import get_parallel
from tidal_engine.executor.base import PendingStep
from tidal_engine.executor.plan import NewRequest, SampledLogprobs, SamplingOptions, StepPlan, StepResult
from tidal_engine.kv_transfer.factory import create_worker_connector
from tidal_engine.runner.input_buffers import StepInput
from tidal_engine.runner.model_runner import ModelRunner, SamplerFactory
from tidal_engine.runner.prompt_logprobs import PromptLogprobsJob

StepObserver = Callable[[int, int], None]  # (rank, step_id), after the step is launched on that rank

logger = logging.getLogger(__name__)


@dataclass
class _ReqState:
    req_id: str
    row: int
    sampling: SamplingOptions
    lora_name: str | None
    num_prompt_tokens: int = 0
    unrecorded: int = 0  # tokens sampled (or being sampled) that are not in the history yet
    # prompt_logprobs: the next prompt position to give (position 0 has none); never repeated,
    # even when a preemption recomputes the prompt.
    next_prompt_position: int = 1
    alive: bool = True


@dataclass
class _LoRARequest:  # what LoRAManager.begin_step reads of a chunk: .request.lora_name
    lora_name: str | None


@dataclass
class _LoRAChunk:
    request: _LoRARequest
    num_new_tokens: int


class WorkerStep(PendingStep):
    """A launched step; ``result()`` waits for its tokens (and those of the steps before)."""

    def __init__(
        self,
        worker: "Worker",
        step_id: int,
        sampled: Any,  # SampledTokens | None
        states: list[_ReqState],
        previous: "WorkerStep | None",
    ) -> None:
        self._worker = worker
        self.step_id = step_id
        self._sampled = sampled
        self._states = states
        self._previous = previous
        self._result: StepResult | None = None
        self._error: BaseException | None = None
        self.idle = False  # no forward: only KV transfers to wait for
        self.prompt_job: PromptLogprobsJob | None = None  # prompt_logprobs this step computes

    @property
    def done(self) -> bool:
        return self._result is not None or self._error is not None

    def result(self) -> StepResult:
        # One taker at a time: a rank's sender thread and its main thread (catching up, see
        # Worker._launch) may both ask.
        with self._worker._taking:
            if self._result is None:
                if self._error is not None:
                    raise self._error
                try:
                    self._result = self._worker._complete(self)
                except BaseException as exc:
                    self._error = exc
                    raise
            return self._result


class _StageDone:
    """A pipeline stage before the last: its step gives no ids; ``result()`` waits for the
    stage's own device work (a CUDA event; on CPU the work is done when ``execute`` returns)."""

    def __init__(self, device: torch.device) -> None:
        self._event: Any = None
        if device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record()

    def result(self) -> tuple[list[int], list[None]]:
        if self._event is not None:
            self._event.synchronize()
        return [], []


class Worker:
    def __init__(
        self,
        config: Any,
        source: Any,
        device: torch.device,
        dtype: torch.dtype,
        rank: int = 0,
        world_size: int = 1,
        sampler_factory: SamplerFactory | None = None,
        step_observer: StepObserver | None = None,
    ) -> None:
        """``step_observer``: called on this rank's thread right after each step is launched (tests
        watch the pipeline with it: a stage can hold a step until another stage got further)."""
        self.config = config
        self.device = device
        self.rank = rank
        self.world_size = world_size
        self.runner = ModelRunner(config, source, device, dtype, sampler_factory=sampler_factory)
        self._samples_here = get_parallel().is_last_stage  # stages before the last get the ids from plans
        self._step_observer = step_observer
        self.batch = self.runner.batch
        self._requests: dict[str, _ReqState] = {}
        self._last_step: WorkerStep | None = None  # the newest step whose result is not taken
        self._num_lora_requests = 0
        self._num_prompt_logprobs_requests = 0  # known requests with prompt_logprobs
        self._sleep_level = 0
        # execute() and result() may run on different threads (the multiprocess worker takes
        # results on a sender thread): both touch the histories under this lock.
        self._lock = threading.RLock()
        self._taking = threading.RLock()  # held while a step's result is being taken
        # KV connector (kv_transfer/): starts each plan's loads and saves, reports them with results.
        self.kv_connector = create_worker_connector(config, self.runner.kv_caches, device)

    # ---- steps -----------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> WorkerStep:
        if not self._samples_here:
            with self._lock:
                self._record_plan_tokens(plan)
        if self._last_step is not None and self._behind(plan):
            # The core took step N's result from the driver and scheduled on it; this rank has
            # not taken N's tokens into its histories yet (a non-driver rank's sender thread
            # runs behind): take them first (outside the lock, which taking a result needs).
            self.settle()
        with self._lock:
            for req_id in plan.finished_req_ids:
                self._forget(req_id)
            for new in plan.new_requests:
                self._add(new)
            if plan.kv_transfer is not None and self.kv_connector is not None:
                self.kv_connector.start(plan.kv_transfer)  # before the forward: copies overlap it
            return self._launch(plan)

    def _record_plan_tokens(self, plan: StepPlan) -> None:
        """A stage before the last: take the ids the last stage sampled for the scheduled requests."""
        one_rows: list[int] = []
        one_ids: list[int] = []
        for s in plan.scheduled:
            if not s.new_token_ids:
                continue
            state = self._requests.get(s.req_id)
            if state is None:
                raise KeyError(f"step {plan.step_id}: request {s.req_id!r} is unknown to the worker")
            if len(s.new_token_ids) == 1:
                one_rows.append(state.row)
                one_ids.append(s.new_token_ids[0])
            else:
                for t in s.new_token_ids:
                    self.batch.append_tokens(np.array([state.row]), [t])
        if one_rows:
            self.batch.append_tokens(np.array(one_rows, dtype=np.int64), one_ids)

    def _behind(self, plan: StepPlan) -> bool:
        """Whether a chunk of ``plan`` ends more than one token past what this rank has recorded."""
        num_tokens = self.batch.num_tokens
        for s in plan.scheduled:
            state = self._requests.get(s.req_id)
            # (drafts sit past the known tokens; they are not history this rank lacks)
            ends = s.num_computed_tokens + s.num_new_tokens - len(s.draft_token_ids)
            if state is not None and ends > int(num_tokens[state.row]) + 1:
                return True
        return False

    def _add(self, new: NewRequest) -> None:
        if new.req_id in self._requests:
            raise ValueError(f"request {new.req_id!r} is already known to the worker")
        tokens = list(new.prompt_token_ids) + list(new.output_token_ids)
        row = self.batch.add(new.req_id, tokens, new.block_ids)
        self._requests[new.req_id] = _ReqState(new.req_id, row, new.sampling, new.lora_name,
                                               num_prompt_tokens=len(new.prompt_token_ids))
        if new.lora_name is not None:
            self._num_lora_requests += 1
        if new.sampling.prompt_logprobs is not None:
            self._num_prompt_logprobs_requests += 1
        self.runner.sampler.add_request(new.req_id, new.sampling, new.prompt_token_ids, new.output_token_ids)

    def _forget(self, req_id: str) -> None:
        state = self._requests.pop(req_id, None)
        if state is None:
            return
        state.alive = False
        if state.lora_name is not None:
            self._num_lora_requests -= 1
        if state.sampling.prompt_logprobs is not None:
            self._num_prompt_logprobs_requests -= 1
        self.batch.remove(req_id)
        self.runner.sampler.remove_request(req_id)

    def _launch(self, plan: StepPlan) -> WorkerStep:
        batch = self.batch
        num_tokens = batch.num_tokens
        n = len(plan.scheduled)
        rows = np.empty(n, dtype=np.int64)
        starts = np.empty(n, dtype=np.int64)
        q_lens = np.empty(n, dtype=np.int64)
        samples = np.empty(n, dtype=bool)
        num_drafts = np.zeros(n, dtype=np.int64)
        drafts: list[list[int]] = []  # per sampling row, in sample order
        sampling_states: list[_ReqState] = []
        requests = self._requests
        for i, s in enumerate(plan.scheduled):
            state = requests.get(s.req_id)
            if state is None:
                raise KeyError(f"step {plan.step_id}: request {s.req_id!r} is unknown to the worker")
            row = state.row
            if s.resumed:
                batch.replace_blocks(row, s.new_block_ids)
            elif s.new_block_ids:
                batch.append_blocks(row, s.new_block_ids)
            rows[i] = row
            starts[i] = s.num_computed_tokens
            q_lens[i] = s.num_new_tokens
            samples[i] = s.samples
            if s.draft_token_ids:
                # Drafts sit past the known tokens (not counted in num_tokens) for the gather.
                nd = len(s.draft_token_ids)
                known_i = int(num_tokens[row])
                batch.ensure_token_capacity(known_i + nd)
                batch.token_ids[row, known_i : known_i + nd] = s.draft_token_ids
                num_drafts[i] = nd
            if s.samples and self._samples_here:
                sampling_states.append(state)
                drafts.append(list(s.draft_token_ids))
        if not n:
            step = WorkerStep(self, plan.step_id, None, [], self._last_step)
            step.idle = True
            self._last_step = step
            self._observe(plan.step_id)
            return step
        ends = starts + q_lens - num_drafts
        known = batch.num_tokens[rows]
        fed = ends > known
        if fed.any():
            self._check_feeds(plan, fed, ends, known, starts)
        if (q_lens < 1).any():
            raise ValueError(f"step {plan.step_id}: every scheduled request computes at least one token")
        step_input = StepInput(rows=rows, starts=starts, q_lens=q_lens, samples=samples, fed=fed,
                               num_drafts=num_drafts if num_drafts.any() else None)
        lora_chunks = None
        if self._num_lora_requests:
            lora_chunks = [
                _LoRAChunk(_LoRARequest(requests[s.req_id].lora_name), s.num_new_tokens) for s in plan.scheduled
            ]
        sample_ids = [s.req_id for s in plan.scheduled if s.samples]
        prompt_job = self._prompt_logprobs_job(plan, step_input) if self._num_prompt_logprobs_requests else None
        sampled = self.runner.execute(step_input, sample_ids, plan.grammar_bitmasks or None, lora_chunks,
                                      drafts if step_input.num_drafts is not None else None,
                                      prompt_job or None)
        if not self._samples_here:
            sampled = _StageDone(self.device)  # the last stage samples; this stage's work is queued
        for st in sampling_states:
            st.unrecorded += 1
        step = WorkerStep(self, plan.step_id, sampled, sampling_states, self._last_step)
        step.prompt_job = prompt_job or None
        self._last_step = step
        self._observe(plan.step_id)
        return step

    def _observe(self, step_id: int) -> None:
        if self._step_observer is not None:
            self._step_observer(self.rank, step_id)

    def _prompt_logprobs_job(self, plan: StepPlan, step: StepInput) -> PromptLogprobsJob:
        """The prompt positions this step computes for requests with prompt_logprobs: the
        hidden state at position j (flat row) predicts the prompt token at j + 1."""
        job = PromptLogprobsJob()
        first_row = 0
        for i, s in enumerate(plan.scheduled):
            state = self._requests[s.req_id]
            k = state.sampling.prompt_logprobs
            if k is not None:
                lo = max(s.num_computed_tokens, state.next_prompt_position - 1)
                hi = min(s.num_computed_tokens + s.num_new_tokens, state.num_prompt_tokens - 1)
                if hi > lo:
                    positions = np.arange(lo, hi, dtype=np.int64)
                    job.add(s.req_id, k, first_row + positions - s.num_computed_tokens,
                            self.batch.token_ids[state.row, lo + 1 : hi + 1].astype(np.int64))
                    state.next_prompt_position = hi + 1
            first_row += int(step.q_lens[i])
        return job

    def _check_feeds(self, plan: StepPlan, fed: np.ndarray, ends: np.ndarray, known: np.ndarray, starts: np.ndarray) -> None:
        for i in np.flatnonzero(fed).tolist():
            s = plan.scheduled[i]
            state = self._requests[s.req_id]
            if ends[i] != known[i] + 1 or state.unrecorded != 1 or starts[i] > known[i]:
                raise ValueError(
                    f"step {plan.step_id}: request {s.req_id!r} computes tokens up to {int(ends[i])}, but only "
                    f"{int(known[i])} are known and {state.unrecorded} sampled one(s) are in flight"
                )

    def _complete(self, step: WorkerStep) -> StepResult:
        """Take the step's sampled ids (after those of the steps before it) into the histories."""
        chain = []
        previous = step._previous
        while previous is not None and not previous.done:
            chain.append(previous)
            previous = previous._previous
        for earlier in reversed(chain):  # oldest first; no recursion however long the chain
            earlier.result()
        sampled = step._sampled
        if sampled is not None:
            token_ids, logprobs = sampled.result()  # waits for the device (no lock held)
            token_ids = list(token_ids)
        else:
            token_ids, logprobs = [], []
        states = step._states
        if len(token_ids) != len(states):
            raise RuntimeError(f"step {step.step_id}: {len(token_ids)} sampled ids for {len(states)} sampling requests")
        token_lists: list[list[int]] = []
        if token_ids and isinstance(token_ids[0], list):  # a verify step: 1..k+1 tokens per row
            token_lists, token_ids = token_ids, [t[-1] for t in token_ids]
        with self._lock:
            step._previous = None
            step._sampled = None
            if token_lists:
                for st, tokens in zip(states, token_lists):
                    if st.alive:
                        for t in tokens:
                            self.batch.append_tokens(np.array([st.row]), [t])
                        self.runner.sampler.count_extra(st.req_id, len(tokens) - 1)
                    st.unrecorded -= 1
                live = []
            else:
                live = [(st.row, t) for st, t in zip(states, token_ids) if st.alive]
                for st in states:
                    st.unrecorded -= 1
            if live:
                rows = np.fromiter((r for r, _ in live), dtype=np.int64, count=len(live))
                self.batch.append_tokens(rows, [t for _, t in live])
            if self._last_step is step:
                self._last_step = None
        lps: list[SampledLogprobs | None] = list(logprobs) if any(lp is not None for lp in logprobs) else []
        report = None
        if self.kv_connector is not None:  # a step without a forward only waits for transfers
            report = self.kv_connector.poll(wait=step.idle)
        prompt_lps = step.prompt_job.to_host() if step.prompt_job is not None else {}
        step.prompt_job = None
        return StepResult(step_id=step.step_id, req_ids=[st.req_id for st in states], token_ids=token_ids, logprobs=lps,
                          kv_transfer=report, token_lists=token_lists, prompt_logprobs=prompt_lps)

    def settle(self) -> None:
        """Take the results of every launched step (errors included: they were reported)."""
        step = self._last_step
        if step is not None:
            try:
                step.result()
            except Exception:  # noqa: BLE001 - reported to whoever asked for the result
                pass

    # ---- queries ---------------------------------------------------------------------
    def num_kv_blocks(self) -> int:
        return self.runner.num_blocks

    def token_history(self, req_id: str) -> list[int]:
        """The request's known tokens (prompt + sampled tokens taken into the history)."""
        with self._lock:
            return self.batch.tokens(req_id)

    def block_table(self, req_id: str) -> list[int]:
        with self._lock:
            return self.batch.blocks(req_id)

    def request_ids(self) -> list[str]:
        with self._lock:
            return list(self._requests)

    def memory_usage(self) -> dict[str, int]:
        return self.runner.memory_usage()

    def kv_connector_info(self) -> dict[str, Any]:
        """What the core's side of the KV connector needs (e.g. the host pool's size)."""
        return self.kv_connector.info() if self.kv_connector is not None else {}

    def cuda_graph_counts(self) -> dict[str, int]:
        """How many decode and mixed-step CUDA graphs this rank captured."""
        runner = self.runner
        return {"decode": len(runner.graphs.graphs) if runner.graphs else 0,
                "mixed": len(runner.mixed_graphs.graphs) if runner.mixed_graphs else 0}

    def ping(self) -> str:
        return "pong"

    # ---- state -----------------------------------------------------------------------
    def reset_requests(self) -> None:
        """Forget every request (the core lost its state, e.g. after an error)."""
        self.settle()
        with self._lock:
            for req_id in list(self._requests):
                self._forget(req_id)
            self.batch.clear()

    def sleep(self, level: int = 1) -> None:
        """Give the device memory back: the KV cache, then the weights (level 1: kept in host
        memory; level 2: dropped, reloaded from the model source on wake). Requests must be
        finished first (the core drains them); sleeping twice is a no-op."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if self._sleep_level:
            return
        self.settle()
        if self._requests:
            raise RuntimeError(f"cannot sleep with {len(self._requests)} request(s) still known to the worker")
        if self.kv_connector is not None:
            self.kv_connector.wait_all()  # no copy may touch the cache once it is released
        self.runner.release_kv_cache()
        if level == 1:
            self.runner.offload_weights()
        else:
            self.runner.discard_weights()
        self._sleep_level = level

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Restore the weights and/or the KV cache (``tags``: "weights", "kv_cache"; default
        both). Returns True while something is still asleep."""
        tags = list(tags or ["weights", "kv_cache"])
        unknown = set(tags) - {"weights", "kv_cache"}
        if unknown:
            raise ValueError(f"unknown wake_up tags {sorted(unknown)}; use 'weights' and/or 'kv_cache'")
        if not self._sleep_level:
            return False
        both = "weights" in tags and "kv_cache" in tags
        if both and self._sleep_level == 1 and self._weights_asleep():
            self.runner.wake_from_level1()  # the KV cache's zeroing overlaps the weights' copy
        elif "weights" in tags and self._weights_asleep():
            if self._sleep_level == 1:
                self.runner.onload_weights()
            else:
                self.runner.reload_weights()
        if "kv_cache" in tags:
            self.runner.restore_kv_cache()  # a no-op when wake_from_level1 restored it
            if self.kv_connector is not None:
                self.kv_connector.register_kv_caches(self.runner.kv_caches)
        if not self._weights_asleep() and self.runner.kv_cache_resident():
            self._sleep_level = 0
        return self._sleep_level > 0

    def is_sleeping(self) -> bool:
        return self._sleep_level > 0

    def _weights_asleep(self) -> bool:
        return not self.runner.weights_resident()

    # ---- LoRA ------------------------------------------------------------------------
    def add_lora(self, adapter: Any) -> None:
        """Register an adapter (a ``LoRAAdapter`` read by the core, or a (name, path) pair)."""
        manager = self._lora()
        name = adapter[0] if isinstance(adapter, tuple) else adapter.name
        if manager.get(name) is not None:  # the core dropped it after its last request, then loaded it again
            manager.remove(name)
        if isinstance(adapter, tuple):
            manager.load(name, adapter[1])
        else:
            manager.add(adapter)

    def remove_lora(self, name: str) -> bool:
        manager = self._lora()
        return manager.remove(name) if manager.get(name) is not None else False

    def list_loras(self) -> list[str]:
        return [] if self.runner.lora_manager is None else [a.name for a in self.runner.lora_manager.list_adapters()]

    def _lora(self) -> Any:
        if self.runner.lora_manager is None:
            raise RuntimeError("LoRA is not enabled on this worker (enable_lora)")
        return self.runner.lora_manager
