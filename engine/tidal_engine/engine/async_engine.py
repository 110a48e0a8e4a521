"""AsyncLLMEngine: the engine in the API server's process, on one loop thread.

`tidal-engine serve` runs the engine core in its own process (async_llm.py); this
in-process client serves the offline tools and the server's unit tests, which skip the
second process.

`LLMEngine` is synchronous and not thread-safe, so exactly one thread (the loop thread)
ever touches it. Everything else talks to that thread through a small inbox guarded by a
condition variable:

- new requests and aborts, which the thread applies between two `step()` calls;
- control operations (sleep, wake, reset, stats), run in the thread between steps and in
  arrival order; an operation marked `needs_idle` waits until no request is left in flight
  (that is how `sleep(mode="wait")` and the shutdown drain work).

Outputs travel back through one `asyncio.Queue` per request, filled with
`loop.call_soon_threadsafe`, so the asyncio side never blocks on the engine.
The thread sleeps on the condition while there is no work; a new request wakes it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from tidal_engine.outputs import CompletionOutput, RequestOutput
from tidal_engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The loop thread died; the engine can no longer serve."""


class EngineSleepingError(RuntimeError):
    """The engine is asleep (or going to sleep) and refuses new requests."""


class EngineShuttingDownError(RuntimeError):
    """The server is draining for shutdown and refuses new requests."""


class SyncEngine(Protocol):
    """The part of LLMEngine's contract the loop uses (fakes in tests implement it too)."""

    tokenizer: Any
    max_model_len: int
    model_name: str

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> None: ...

    def abort_request(self, request_id: str) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished_requests(self) -> bool: ...

    def get_stats(self) -> Any: ...

    def reset_prefix_cache(self) -> bool: ...

    def sleep(self, level: int) -> None: ...

    def wake_up(self, tags: list[str] | None = None) -> None: ...

    def is_sleeping(self) -> bool: ...


class EngineClient(Protocol):
    """What the server needs of an engine: the in-process ``AsyncLLMEngine`` below, or
    ``AsyncLLM`` (async_llm.py), which talks to the engine-core process."""

    tokenizer: Any
    model_name: str
    max_model_len: int

    @property
    def is_healthy(self) -> bool: ...

    @property
    def dead_error(self) -> BaseException | None: ...

    @property
    def snapshot(self) -> "EngineSnapshot": ...

    @property
    def num_in_flight(self) -> int: ...

    def start(self) -> None: ...

    async def shutdown(self, timeout_s: float = 30.0) -> None: ...

    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, *,
                          cache_salt: str | None = None, lora_name: str | None = None) -> Any: ...

    def iterate(self, stream: Any) -> AsyncIterator[RequestOutput]: ...

    def abort(self, request_id: str) -> None: ...

    def add_finished_listener(self, listener: Callable[["FinishedRequest"], None]) -> None: ...

    async def is_sleeping(self) -> bool: ...

    async def sleep(self, level: int = 1, mode: str = "wait") -> None: ...

    async def wake_up(self, tags: list[str] | None = None) -> None: ...

    async def reset_prefix_cache(self) -> bool: ...

    def list_lora_adapters(self) -> list[Any]: ...

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> None: ...

    async def unload_lora_adapter(self, lora_name: str) -> bool: ...

    async def get_stats(self) -> Any: ...


def check_sleep_request(level: int, mode: str, enabled: bool) -> None:
    """A /sleep call's arguments, checked the same way by every engine client (ValueError: a 400)."""
    if level not in (1, 2):
        raise ValueError(f"sleep level must be 1 or 2, got {level}")
    if mode not in ("wait", "abort"):
        raise ValueError(f"sleep mode must be 'wait' or 'abort', got {mode!r}")
    if not enabled:
        raise ValueError("sleep mode is not enabled; start the server with --enable-sleep-mode")


@dataclass
class FinishedRequest:
    """Everything the metrics and the request log need about one finished request."""

    request_id: str
    prompt: str | list[int] | None
    prompt_tokens: int
    generation_tokens: int
    cached_tokens: int
    finish_reasons: list[str]
    queue_time_s: float | None
    ttft_s: float | None
    e2e_s: float
    inter_token_latencies_s: list[float]


@dataclass
class EngineSnapshot:
    """Stats copied out of the loop thread, so a scrape never touches the engine."""

    stats: Any = None
    peak_running: int = 0
    sleep_level: int = 0  # 0 awake, 1 weights offloaded, 2 everything discarded
    updated_at: float = 0.0  # wall time of the last refresh (lora_requests_info's value)


class _RequestStream:
    """One request's outbox: written by the loop thread, read by one asyncio consumer."""

    def __init__(self, request_id: str, prompt: str | list[int], loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False
        # Loop-thread-only bookkeeping (timings for metrics, last output to synthesise aborts).
        self.arrival_wall = time.time()
        self.arrival_mono = time.monotonic()
        self.first_token_mono: float | None = None
        self.last_token_mono: float | None = None
        self.tokens_seen: dict[int, int] = {}
        self.itl: list[float] = []
        self.last_output: RequestOutput | None = None

    def put(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            pass  # the consumer's event loop is gone; nobody is listening any more


@dataclass
class _PendingAdd:
    stream: _RequestStream
    params: SamplingParams
    cache_salt: str | None
    ack: concurrent.futures.Future[None]
    lora_name: str | None = None


@dataclass
class _ControlOp:
    fn: Callable[[], Any]
    future: concurrent.futures.Future[Any]
    needs_idle: bool = False


@dataclass
class _Inbox:
    adds: list[_PendingAdd] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    ops: list[_ControlOp] = field(default_factory=list)


class AsyncLLMEngine:
    """Asyncio front of a synchronous engine; see the module docstring for the design."""

    def __init__(self, engine: SyncEngine, *, enable_sleep_mode: bool = True) -> None:
        self.engine = engine
        self.enable_sleep_mode = enable_sleep_mode
        self._cond = threading.Condition()
        self._inbox = _Inbox()
        self._streams: dict[str, _RequestStream] = {}  # loop-thread view of requests in the engine
        self._stop = False
        self._thread: threading.Thread | None = None
        self._dead: BaseException | None = None
        # Why new requests are refused right now (None: accepted). Set before a drain starts.
        self._refusal: type[RuntimeError] | None = None
        self._snapshot = EngineSnapshot()
        self._admin_lock: asyncio.Lock | None = None
        self._finished_listeners: list[Callable[[FinishedRequest], None]] = []

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    def from_config(cls, config: Any) -> "AsyncLLMEngine":
        from tidal_engine.engine.llm_engine import LLMEngine

        return cls(LLMEngine(config), enable_sleep_mode=bool(getattr(config, "enable_sleep_mode", False)))

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def start(self) -> None:
        if self._thread is not None:
            return
        self._refresh_snapshot()
        self._thread = threading.Thread(target=self._run_loop, name="tidal-engine-loop", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def is_healthy(self) -> bool:
        return self._dead is None and self.is_running

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead

    @property
    def snapshot(self) -> EngineSnapshot:
        return self._snapshot

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def add_finished_listener(self, listener: Callable[[FinishedRequest], None]) -> None:
        """Called in the loop thread once per finished (or aborted) request."""
        self._finished_listeners.append(listener)

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Refuse new requests, let in-flight ones finish for up to `timeout_s`, abort the rest."""
        if self._thread is None:
            return
        self._refusal = EngineShuttingDownError
        if self.is_healthy:
            try:
                await asyncio.wait_for(self._call(lambda: None, needs_idle=True), timeout=timeout_s)
            except asyncio.TimeoutError:
                logger.warning("shutdown timeout (%.1fs) reached: aborting %d request(s)", timeout_s, self.num_in_flight)
                try:
                    await asyncio.wait_for(self._call(self._abort_all), timeout=10)
                except (asyncio.TimeoutError, EngineDeadError):
                    pass
            except EngineDeadError:
                pass
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        thread = self._thread
        await asyncio.to_thread(thread.join, 30)

    # ------------------------------------------------------------------ requests

    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> _RequestStream:
        """Submit a request and wait until the engine accepted it.

        Raises ValueError for input the engine rejects (so the caller can answer 400 before
        any streaming starts), EngineSleepingError/EngineShuttingDownError/EngineDeadError
        when the engine refuses work.
        """
        self._check_accepting()
        stream = _RequestStream(request_id, prompt, asyncio.get_running_loop())
        ack: concurrent.futures.Future[None] = concurrent.futures.Future()
        with self._cond:
            self._inbox.adds.append(_PendingAdd(stream, params, cache_salt, ack, lora_name))
            self._cond.notify_all()
        await asyncio.wrap_future(ack)
        return stream

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        *,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield cumulative outputs until the request finishes.

        If the consumer stops early (client disconnect, task cancelled), the request is
        aborted so its KV blocks are freed.
        """
        stream = await self.add_request(request_id, prompt, params, cache_salt=cache_salt, lora_name=lora_name)
        async for output in self.iterate(stream):
            yield output

    async def iterate(self, stream: _RequestStream) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    stream.finished = True
                    return
        finally:
            if not stream.finished:
                self.abort(stream.request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe, non-blocking, a no-op for unknown ids)."""
        with self._cond:
            self._inbox.aborts.append(request_id)
            self._cond.notify_all()

    def _check_accepting(self) -> None:
        if self._dead is not None or (self._thread is not None and not self._thread.is_alive()):
            raise EngineDeadError(f"the engine loop has stopped: {self._dead!r}")
        if self._refusal is not None:
            raise self._refusal(self._refusal_message())
        if self._snapshot.sleep_level:
            raise EngineSleepingError(self._refusal_message())

    def _refusal_message(self) -> str:
        if self._refusal is EngineShuttingDownError:
            return "the server is shutting down"
        return "the engine is sleeping"

    # ------------------------------------------------------------------ control

    def _lock(self) -> asyncio.Lock:
        if self._admin_lock is None:
            self._admin_lock = asyncio.Lock()
        return self._admin_lock

    async def _call(self, fn: Callable[[], Any], *, needs_idle: bool = False) -> Any:
        """Run `fn` in the loop thread between steps (after the engine drained if needs_idle)."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine loop has stopped: {self._dead!r}")
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._cond:
            self._inbox.ops.append(_ControlOp(fn, future, needs_idle))
            self._cond.notify_all()
        return await asyncio.wrap_future(future)

    async def is_sleeping(self) -> bool:
        return self._snapshot.sleep_level > 0

    async def sleep(self, level: int = 1, mode: str = "wait") -> None:
        """Sleep at `level` (1: weights to host, 2: discard all). Idempotent and serialised.

        mode="wait" lets in-flight requests finish first; mode="abort" aborts them.
        New requests are refused (engine_sleeping) from the moment this is called.
        """
        check_sleep_request(level, mode, self.enable_sleep_mode)
        async with self._lock():
            if self._snapshot.sleep_level:
                return  # already asleep: repeating the call changes nothing
            if self._refusal is EngineShuttingDownError:
                raise EngineShuttingDownError("the server is shutting down")
            self._refusal = EngineSleepingError
            try:
                if mode == "abort":
                    await self._call(self._abort_all)

                def do_sleep() -> None:
                    self.engine.sleep(level)
                    self._snapshot.sleep_level = level

                await self._call(do_sleep, needs_idle=True)
            finally:
                if self._refusal is EngineSleepingError:
                    self._refusal = None  # the sleep level itself now refuses requests

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake the engine (all of it, or just the `tags` given). Idempotent and serialised."""
        if not self.enable_sleep_mode:
            raise ValueError("sleep mode is not enabled; start the server with --enable-sleep-mode")
        async with self._lock():
            if not self._snapshot.sleep_level:
                return

            def do_wake() -> None:
                self.engine.wake_up(tags)
                if not self.engine.is_sleeping():
                    self._snapshot.sleep_level = 0

            await self._call(do_wake)

    async def reset_prefix_cache(self) -> bool:
        async with self._lock():
            return bool(await self._call(self.engine.reset_prefix_cache))

    # ------------------------------------------------------------------ LoRA

    def list_lora_adapters(self) -> list[Any]:
        """Adapters requests may name now (thread-safe read of the engine's registry)."""
        list_loras = getattr(self.engine, "list_loras", None)
        return list(list_loras()) if list_loras is not None else []

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> None:
        """Read and validate the adapter off the loop thread, then register it between steps.
        Raises LoRAError (a ValueError with an HTTP ``status``)."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine loop has stopped: {self._dead!r}")
        adapter = await asyncio.to_thread(self.engine.read_lora, lora_name, lora_path)  # type: ignore[attr-defined]
        await self._call(lambda: self.engine.add_lora(adapter))  # type: ignore[attr-defined]

    async def unload_lora_adapter(self, lora_name: str) -> bool:
        """True: unloaded now; False: refused to new requests, gone once running ones finish."""
        return bool(await self._call(lambda: self.engine.remove_lora(lora_name)))  # type: ignore[attr-defined]

    async def get_stats(self) -> Any:
        """Fresh stats from the loop thread (the snapshot may be one step old)."""
        return await self._call(self._refresh_snapshot)

    def _abort_all(self) -> None:
        for request_id in list(self._streams):
            self._abort_in_loop(request_id)

    # ------------------------------------------------------------------ loop thread

    def _has_work(self) -> bool:
        inbox = self._inbox
        return bool(self._stop or inbox.adds or inbox.aborts or inbox.ops or self.engine.has_unfinished_requests())

    def _run_loop(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._has_work():
                        self._cond.wait()
                    if self._stop:
                        break
                    inbox, self._inbox = self._inbox, _Inbox()
                for request_id in inbox.aborts:
                    self._abort_in_loop(request_id)
                for pending in inbox.adds:
                    self._add_in_loop(pending)
                waiting_ops = self._run_ops(inbox.ops)
                if waiting_ops:
                    with self._cond:
                        self._inbox.ops[:0] = waiting_ops  # keep arrival order
                if self.engine.has_unfinished_requests():
                    self._deliver(self.engine.step())
                if self._streams and not self.engine.has_unfinished_requests():
                    # The engine dropped requests without a final output; end their streams
                    # rather than leaving their consumers waiting forever.
                    for request_id in list(self._streams):
                        logger.warning("request %s ended without a final output", request_id)
                        self._abort_in_loop(request_id)
                # Every pass (aborts included), so /metrics never shows stale KV usage.
                self._refresh_snapshot()
        except BaseException as exc:  # noqa: BLE001 - anything that kills the loop kills the engine
            logger.exception("engine loop died")
            self._dead = exc
        finally:
            self._fail_everything()

    def _run_ops(self, ops: list[_ControlOp]) -> list[_ControlOp]:
        """Run ops in order; stop at the first that needs an idle engine while it is busy."""
        for i, op in enumerate(ops):
            if op.future.cancelled():
                continue  # its caller gave up; it must not block the ops behind it
            if op.needs_idle and self.engine.has_unfinished_requests():
                return ops[i:]
            if not op.future.set_running_or_notify_cancel():
                continue  # the caller gave up (timeout, disconnect): don't run it at all
            try:
                op.future.set_result(op.fn())
            except Exception as exc:  # the op failed, not the loop: report it to the caller
                op.future.set_exception(exc)
            self._refresh_snapshot()
        return []

    def _add_in_loop(self, pending: _PendingAdd) -> None:
        stream = pending.stream
        if not pending.ack.set_running_or_notify_cancel():
            return  # the client left before the engine saw the request
        if self._dead is None and self._snapshot.sleep_level:
            pending.ack.set_exception(EngineSleepingError("the engine is sleeping"))
            return
        # Only engines with LoRA get the keyword, so simple engines (test fakes) need not know it.
        lora = {"lora_name": pending.lora_name} if pending.lora_name is not None else {}
        try:
            self.engine.add_request(
                stream.request_id,
                stream.prompt,
                pending.params,
                cache_salt=pending.cache_salt,
                arrival_time=stream.arrival_wall,
                **lora,
            )
        except Exception as exc:  # ValueError for bad input; the caller maps it
            pending.ack.set_exception(exc)
            return
        self._streams[stream.request_id] = stream
        pending.ack.set_result(None)

    def _abort_in_loop(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return  # finished already, or never added
        self.engine.abort_request(request_id)
        final = _aborted_output(stream)
        self._record_finished(stream, final)
        stream.put(final)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # aborted while the step ran
            self._track_tokens(stream, output, now)
            stream.last_output = output
            if output.finished:
                del self._streams[output.request_id]
                self._record_finished(stream, output)
            stream.put(output)

    def _track_tokens(self, stream: _RequestStream, output: RequestOutput, now: float) -> None:
        new_tokens = 0
        for completion in output.outputs:
            seen = stream.tokens_seen.get(completion.index, 0)
            new_tokens += max(0, len(completion.token_ids) - seen)
            stream.tokens_seen[completion.index] = len(completion.token_ids)
        note_new_tokens(stream, new_tokens, now)

    def _record_finished(self, stream: _RequestStream, output: RequestOutput) -> None:
        if self._finished_listeners:
            notify_finished(self._finished_listeners, finished_record(stream, output, time.monotonic()))

    def _refresh_snapshot(self) -> Any:
        stats = self.engine.get_stats()
        self._snapshot.stats = stats
        self._snapshot.updated_at = time.time()
        # The engine's own peak counts every request batched into one step; fall back to
        # sampling num_running after each step for engines that don't report it.
        running = int(getattr(stats, "max_num_running_seen", 0) or getattr(stats, "num_running", 0) or 0)
        self._snapshot.peak_running = max(self._snapshot.peak_running, running)
        return stats

    def _fail_everything(self) -> None:
        error = EngineDeadError(f"the engine loop has stopped: {self._dead!r}")
        with self._cond:
            inbox, self._inbox = self._inbox, _Inbox()
        for future in [p.ack for p in inbox.adds] + [op.future for op in inbox.ops]:
            if not future.done() and future.set_running_or_notify_cancel():
                future.set_exception(error)
        for stream in list(self._streams.values()):
            stream.put(error)
        self._streams.clear()


def note_new_tokens(stream: Any, new_tokens: int, now: float) -> None:
    """Time a request's tokens as they reach its API server: the first one (TTFT), then the
    gaps; tokens that arrive together in one step share the step's latency."""
    if not new_tokens:
        return
    if stream.first_token_mono is None:
        stream.first_token_mono = now
    elif stream.last_token_mono is not None:
        gap = (now - stream.last_token_mono) / new_tokens
        stream.itl.extend([gap] * new_tokens)
    stream.last_token_mono = now


def finished_record(stream: Any, output: RequestOutput, now: float) -> FinishedRequest:
    """What the metrics and the request log need of a finished (or aborted) request."""
    metrics = output.metrics
    queue_time = None
    if metrics is not None and metrics.first_scheduled_time is not None:
        queue_time = max(0.0, metrics.first_scheduled_time - metrics.arrival_time)
    return FinishedRequest(
        request_id=stream.request_id,
        prompt=stream.prompt,
        prompt_tokens=len(output.prompt_token_ids),
        generation_tokens=sum(len(c.token_ids) for c in output.outputs),
        cached_tokens=output.num_cached_tokens,
        finish_reasons=[c.finish_reason or "abort" for c in output.outputs],
        queue_time_s=queue_time,
        ttft_s=None if stream.first_token_mono is None else stream.first_token_mono - stream.arrival_mono,
        e2e_s=now - stream.arrival_mono,
        inter_token_latencies_s=stream.itl,
    )


def notify_finished(listeners: list[Callable[[FinishedRequest], None]], record: FinishedRequest) -> None:
    for listener in listeners:
        try:
            listener(record)
        except Exception:  # a broken listener must not stop the engine's output delivery
            logger.exception("finished-request listener failed")


def _aborted_output(stream: _RequestStream) -> RequestOutput:
    """The final output of an aborted request: what it had so far, marked 'abort'."""
    last = stream.last_output
    if last is None:
        return RequestOutput(
            request_id=stream.request_id,
            prompt=stream.prompt if isinstance(stream.prompt, str) else None,
            prompt_token_ids=list(stream.prompt) if isinstance(stream.prompt, list) else [],
            outputs=[CompletionOutput(index=0, text="", token_ids=[], finish_reason="abort")],
            finished=True,
        )
    final = copy.copy(last)
    final.outputs = [
        c if c.finished else CompletionOutput(
            index=c.index,
            text=c.text,
            token_ids=list(c.token_ids),
            cumulative_logprob=c.cumulative_logprob,
            logprobs=c.logprobs,
            finish_reason="abort",
        )
        for c in last.outputs
    ]
    final.finished = True
    return final
