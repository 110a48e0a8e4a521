"""The pooling engine: requests from any number of API coroutines, batched into steps that
run on one worker thread (so the event loop keeps serving while the device works).

Every step is prefill-only: a request's whole prompt goes through the model once, its
pooled vector comes back, and no KV cache outlives the step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tidal_engine.pooling.batching import take_batch
from tidal_engine.pooling.loader import ConvertOption, load_pooling_model
from tidal_engine.pooling.params import PoolingModelInfo
from tidal_engine.pooling.runner import PoolingInput, PoolingRunner

logger = logging.getLogger(__name__)


class EngineSleepingError(RuntimeError):
    """A request reached a sleeping engine (the server answers 503 with Retry-After)."""


@dataclass(eq=False)  # identity: two requests with the same tokens are still two requests
class _Pending:
    item: PoolingInput
    future: asyncio.Future[torch.Tensor]
    loop: asyncio.AbstractEventLoop

    @property
    def num_tokens(self) -> int:
        return self.item.num_tokens


@dataclass
class PoolingStats:
    num_running: int = 0
    num_waiting: int = 0
    prompt_tokens_total: int = 0
    requests_total: int = 0
    step_seconds_total: float = 0.0
    created: float = field(default_factory=time.time)


def default_token_budget(device: torch.device) -> int:
    return 16384 if device.type == "cuda" else 4096


class PoolingEngine:
    def __init__(self, runner: PoolingRunner, tokenizer: Any, model_name: str,
                 max_num_seqs: int = 256, max_num_batched_tokens: int | None = None,
                 enable_sleep_mode: bool = False, reload: Callable[[], PoolingRunner] | None = None) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.info: PoolingModelInfo = runner.info
        self.max_model_len = runner.info.max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens or default_token_budget(runner.device)
        self.stats = PoolingStats()
        self.dead_error: BaseException | None = None
        self.enable_sleep_mode = enable_sleep_mode
        self.sleep_level = 0  # 0 awake; 1 weights in host memory; 2 weights discarded
        self._reload = reload  # level 2's wake: the model again, from disk
        self._step_lock = threading.Lock()  # held by a step; sleep and wake take it between steps
        self._waiting: deque[_Pending] = deque()
        self._wakeup = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None

    @classmethod
    def from_model(cls, model: str, model_name: str, convert: ConvertOption = "auto", dtype: str = "auto",
                   device: str = "auto", max_model_len: int | None = None, tokenizer: str | None = None,
                   max_num_seqs: int = 256, max_num_batched_tokens: int | None = None,
                   enable_sleep_mode: bool = False) -> PoolingEngine:
        from tidal_engine.engine.core import resolve_device

        target = resolve_device(device)

        def load() -> tuple[PoolingRunner, Any]:
            loaded = load_pooling_model(model, convert, dtype, target, max_model_len, tokenizer)
            logger.info("pooling model %s loaded: task %s, %s pooling, %s on %s, max_model_len %d", model,
                        loaded.info.task, loaded.info.method, loaded.dtype, target, loaded.info.max_model_len)
            return PoolingRunner(loaded, target), loaded.tokenizer

        runner, tok = load()
        return cls(runner, tok, model_name, max_num_seqs, max_num_batched_tokens, enable_sleep_mode,
                   reload=lambda: load()[0])

    # ---------------------------------------------------------------- lifecycle

    @property
    def is_healthy(self) -> bool:
        return self.dead_error is None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="pooling-engine", daemon=True)
            self._thread.start()

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Finish what is queued (up to the timeout), then stop the worker."""
        deadline = time.monotonic() + timeout_s
        while (self._waiting or self.stats.num_running) and time.monotonic() < deadline and self.is_healthy:
            await asyncio.sleep(0.05)
        with self._wakeup:
            self._stopping = True
            for pending in self._waiting:
                pending.loop.call_soon_threadsafe(_fail, pending.future, RuntimeError("the server is shutting down"))
            self._waiting.clear()
            self._wakeup.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10)

    # ---------------------------------------------------------------- sleep

    @property
    def is_sleeping(self) -> bool:
        return self.sleep_level > 0

    async def sleep(self, level: int, mode: str = "wait") -> None:
        """Free the device: level 1 keeps the weights in host memory, level 2 drops them (wake
        reloads from disk). ``wait`` lets queued requests finish first; ``abort`` fails them."""
        if not self.enable_sleep_mode:
            raise ValueError("sleep mode is not enabled; start the server with --enable-sleep-mode")
        if level not in (1, 2):
            raise ValueError(f"level must be 1 or 2, got {level}")
        if mode == "abort":
            with self._wakeup:
                for pending in self._waiting:
                    pending.loop.call_soon_threadsafe(_fail, pending.future, RuntimeError("aborted: the engine sleeps"))
                self._waiting.clear()
                self.stats.num_waiting = 0
        else:
            while self._waiting or self.stats.num_running:
                await asyncio.sleep(0.01)
        await asyncio.to_thread(self._sleep_now, level)

    def _sleep_now(self, level: int) -> None:
        with self._step_lock:
            if self.sleep_level >= level:
                return
            if level == 2 and self._reload is None:
                raise ValueError("this engine cannot reload its weights: use level 1")
            if level == 1:
                self.runner.model.to("cpu")
            else:
                self.runner.model = None  # type: ignore[assignment]  # dropped: wake reloads it
            self.sleep_level = level
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    async def wake_up(self) -> None:
        await asyncio.to_thread(self._wake_now)

    def _wake_now(self) -> None:
        with self._step_lock:
            if self.sleep_level == 1:
                self.runner.model.to(self.runner.device)
            elif self.sleep_level == 2:
                assert self._reload is not None
                self.runner = self._reload()
            self.sleep_level = 0

    # ---------------------------------------------------------------- requests

    async def encode(self, items: list[PoolingInput]) -> list[torch.Tensor]:
        """Pooled outputs of ``items``, in order. They join the queue together (FCFS)."""
        if self.dead_error is not None:
            raise RuntimeError(f"the pooling engine has stopped: {self.dead_error}")
        if self.is_sleeping:
            raise EngineSleepingError("the engine is sleeping")
        loop = asyncio.get_running_loop()
        pending = [_Pending(item, loop.create_future(), loop) for item in items]
        with self._wakeup:
            self._waiting.extend(pending)
            self.stats.num_waiting = len(self._waiting)
            self._wakeup.notify()
        try:
            return list(await asyncio.gather(*(p.future for p in pending)))
        except asyncio.CancelledError:
            with self._wakeup:  # the client went away: drop what has not started
                for p in pending:
                    if p in self._waiting:
                        self._waiting.remove(p)
                self.stats.num_waiting = len(self._waiting)
            raise

    def encode_offline(self, items: list[PoolingInput]) -> list[torch.Tensor]:
        """Synchronous batch for offline use: longest first, so a step's prompts pad little."""
        order = sorted(range(len(items)), key=lambda i: -items[i].num_tokens)
        results: list[torch.Tensor | None] = [None] * len(items)
        start = 0
        while start < len(order):
            count = take_batch([items[i] for i in order[start:]], self.max_num_batched_tokens, self.max_num_seqs)
            chosen = order[start : start + count]
            for i, out in zip(chosen, self.runner.run([items[i] for i in chosen]), strict=True):
                results[i] = out
            start += count
        return [r for r in results if r is not None]

    # ---------------------------------------------------------------- the worker

    def _loop(self) -> None:
        while True:
            with self._wakeup:
                while not self._waiting and not self._stopping:
                    self._wakeup.wait()
                if self._stopping:
                    return
                count = take_batch(self._waiting, self.max_num_batched_tokens, self.max_num_seqs)
                batch = [self._waiting.popleft() for _ in range(count)]
                self.stats.num_waiting = len(self._waiting)
                self.stats.num_running = len(batch)
            started = time.perf_counter()
            try:
                with self._step_lock:
                    if self.is_sleeping:
                        raise EngineSleepingError("the engine fell asleep before this step")
                    outputs = self.runner.run([p.item for p in batch])
            except Exception as exc:  # a failed step fails its requests, not the server
                logger.exception("pooling step of %d request(s) failed", len(batch))
                for p in batch:
                    p.loop.call_soon_threadsafe(_fail, p.future, exc)
                outputs = None
            if outputs is not None:
                for p, out in zip(batch, outputs, strict=True):
                    p.loop.call_soon_threadsafe(_resolve, p.future, out)
            self.stats.step_seconds_total += time.perf_counter() - started
            self.stats.requests_total += len(batch)
            self.stats.prompt_tokens_total += sum(p.num_tokens for p in batch)
            self.stats.num_running = 0


def _resolve(future: asyncio.Future[torch.Tensor], value: torch.Tensor) -> None:
    if not future.done():
        future.set_result(value)


def _fail(future: asyncio.Future[torch.Tensor], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
