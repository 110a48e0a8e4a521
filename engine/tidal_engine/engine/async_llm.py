"""AsyncLLM: an API server's view of the engine core running in its own process.

It does the request side's CPU work here, in the API server: tokenizing, and turning the
core's deltas into text and ``RequestOutput``s (the output
processor: incremental detokenizing, stop strings, logprob text). The core gets token
ids over ZeroMQ and answers with deltas only.

Each request has a stream that keeps only its latest state: when a client reads slower
than the engine steps, the outputs in between are merged, never queued. Adds wait for
the core's acknowledgement, so bad input found there is still a 4xx before streaming.

If the core process dies (its socket disconnects, or it reports a fatal error), every
waiting request fails with ``EngineDeadError`` (a 500 or 503 to the client), /health
fails, and ``on_dead`` lets the server exit so Kubernetes restarts the Pod.

It offers the same methods as the in-process ``AsyncLLMEngine`` (async_engine.py), which
the server's unit tests use to skip the second process.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from multiprocessing.process import BaseProcess
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from tidal_engine.engine.async_engine import (
    EngineDeadError,
    EngineShuttingDownError,
    EngineSleepingError,
    EngineSnapshot,
    FinishedRequest,
    check_sleep_request,
    finished_record,
    note_new_tokens,
    notify_finished,
)
from tidal_engine.engine.core_proc import CoreAddresses
from tidal_engine.engine.llm_engine import tokenize
from tidal_engine.engine.messages import (
    AbortRequests,
    CoreInfo,
    EngineCoreOutputs,
    EngineCoreRequest,
    UtilityCall,
    encoder,
    output_decoder,
    params_to_dict,
)
from tidal_engine.engine.output_processor import OutputProcessor, RequestState
from tidal_engine.lora.adapter import LoRAError
from tidal_engine.lora.manager import AdapterInfo
from tidal_engine.outputs import RequestOutput
from tidal_engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class RequestStream:
    """One request's latest state, read by one consumer."""

    def __init__(self, request_id: str, prompt: str | list[int], state: RequestState) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.state = state
        self.finished = False  # the consumer saw the final output
        self.error: BaseException | None = None
        self._ready = asyncio.Event()
        # Timings for metrics and the request log.
        self.arrival_mono = time.monotonic()
        self.first_token_mono: float | None = None
        self.last_token_mono: float | None = None
        self.itl: list[float] = []

    def notify(self) -> None:
        self._ready.set()

    async def wait(self) -> None:
        await self._ready.wait()
        self._ready.clear()


class AsyncLLM:
    def __init__(
        self,
        tokenizer: Any,
        info: CoreInfo,
        addresses: CoreAddresses,
        client_index: int = 0,
        *,
        enable_sleep_mode: bool = False,
        core_process: BaseProcess | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.info = info
        self.model_name = info.model_name
        self.max_model_len = info.max_model_len
        self.addresses = addresses
        self.client_index = client_index
        self.enable_sleep_mode = enable_sleep_mode
        self.core_process = core_process  # set when this server owns the core (it stops it)
        self.on_dead: Callable[[BaseException], None] | None = None
        self.processor = OutputProcessor(tokenizer)
        self._streams: dict[str, RequestStream] = {}
        self._acks: dict[str, asyncio.Future[None]] = {}
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count()
        self._snapshot = EngineSnapshot()
        self._finished_listeners: list[Callable[[FinishedRequest], None]] = []
        self._dead: BaseException | None = None
        self._refusal: type[RuntimeError] | None = None
        self._admin_lock: asyncio.Lock | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._ctx: zmq.asyncio.Context | None = None
        self._to_core: zmq.asyncio.Socket | None = None
        self._from_core: zmq.asyncio.Socket | None = None
        self._drained: asyncio.Event | None = None
        self._stopping = False
        self._encode = encoder().encode
        self._decode = output_decoder().decode

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Connect to the core (call inside the server's event loop)."""
        if self._ctx is not None:
            return
        self._ctx = zmq.asyncio.Context()
        self._from_core = self._ctx.socket(zmq.PULL)
        monitor = self._from_core.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._from_core.bind(self.addresses.outputs[self.client_index])
        self._to_core = self._ctx.socket(zmq.PUSH)
        self._to_core.setsockopt(zmq.LINGER, 0)
        self._to_core.connect(self.addresses.input)
        self._drained = asyncio.Event()
        self._drained.set()
        self._tasks = [
            asyncio.create_task(self._read_outputs(), name="tidal-core-outputs"),
            asyncio.create_task(self._watch_disconnect(monitor), name="tidal-core-watch"),
        ]
        if self.core_process is not None:
            asyncio.get_running_loop().add_reader(self.core_process.sentinel, self._core_process_ended)

    @property
    def is_running(self) -> bool:
        return self._ctx is not None and self._dead is None

    @property
    def is_healthy(self) -> bool:
        return self._dead is None and self._ctx is not None

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
        self._finished_listeners.append(listener)

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Refuse new requests, let in-flight ones finish for up to `timeout_s`, abort the
        rest; then stop the core if this server owns it."""
        if self._ctx is None:
            return
        self._refusal = EngineShuttingDownError
        assert self._drained is not None
        if self._streams and self._dead is None:
            try:
                await asyncio.wait_for(self._drained.wait(), timeout=timeout_s)
            except asyncio.TimeoutError:
                logger.warning("shutdown timeout (%.1fs) reached: aborting %d request(s)", timeout_s, len(self._streams))
                for request_id in list(self._streams):
                    self.abort(request_id)
        self._stopping = True
        if self.core_process is not None:
            asyncio.get_running_loop().remove_reader(self.core_process.sentinel)
            if self._dead is None:
                try:
                    await asyncio.wait_for(self._call("shutdown"), timeout=10)
                except (asyncio.TimeoutError, EngineDeadError):
                    pass
            await asyncio.to_thread(self.core_process.join, 30)
            if self.core_process.is_alive():
                self.core_process.kill()
        for task in self._tasks:
            task.cancel()
        self._ctx.destroy(linger=0)
        self._ctx = None

    # ------------------------------------------------------------------ requests
    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> RequestStream:
        """Tokenize, send, and wait until the core accepted the request (ValueError and
        the Engine*Error types otherwise, before any streaming starts)."""
        self._check_accepting()
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_text, token_ids = tokenize(self.tokenizer, prompt)  # the core checks the ids (a refusal is a ValueError)
        arrival = time.time()
        state = self.processor.add_request(request_id, prompt_text, token_ids, params, arrival)
        stream = RequestStream(request_id, prompt, state)
        ack: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._acks[request_id] = ack
        self._streams[request_id] = stream
        assert self._drained is not None
        self._drained.clear()
        self._send(EngineCoreRequest(
            request_id=request_id, prompt_token_ids=token_ids, params=params_to_dict(params),
            arrival_time=arrival, cache_salt=cache_salt, lora_name=lora_name, client_index=self.client_index,
        ))
        try:
            await ack
        except BaseException:
            self._forget(request_id)
            if not ack.done() or ack.cancelled():  # the client left: the core may have it
                self._send(AbortRequests([request_id]))
            raise
        return stream

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str, *,
        cache_salt: str | None = None, lora_name: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        stream = await self.add_request(request_id, prompt, params, cache_salt=cache_salt, lora_name=lora_name)
        async for output in self.iterate(stream):
            yield output

    async def iterate(self, stream: RequestStream) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs until the request finishes; a consumer that stops early
        (disconnect, cancel) aborts the request so its KV blocks are freed."""
        try:
            while True:
                await stream.wait()
                if stream.error is not None:
                    raise stream.error
                output = OutputProcessor.output(stream.state)
                yield output
                if output.finished:
                    stream.finished = True
                    return
        finally:
            if not stream.finished:
                self.abort(stream.request_id)

    def abort(self, request_id: str) -> None:
        """End a request now (a no-op for unknown or finished ones)."""
        stream = self._streams.get(request_id)
        if stream is None:
            return
        if self._dead is None and self._to_core is not None:
            self._send(AbortRequests([request_id]))
        self._end_aborted(stream)

    def _end_aborted(self, stream: RequestStream) -> None:
        self.processor.abort_request(stream.request_id)
        self._record_finished(stream)
        self._forget(stream.request_id)
        stream.notify()  # the consumer (if any) reads the final "abort" output

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._acks.pop(request_id, None)
        self.processor.requests.pop(request_id, None)
        if not self._streams and self._drained is not None:
            self._drained.set()

    def _check_accepting(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine core has stopped: {self._dead}")
        if self._ctx is None:
            raise EngineDeadError("the engine client is not started")
        if self._refusal is EngineShuttingDownError:
            raise EngineShuttingDownError("the server is shutting down")
        if self._refusal is not None:
            raise EngineSleepingError("the engine is sleeping")
        # A sleeping core refuses adds itself: another API server may have just woken it,
        # and this server's snapshot may be a few milliseconds old.

    def _send(self, message: msgspec.Struct) -> None:
        assert self._to_core is not None
        # PUSH never blocks here: ZeroMQ queues the frame (the high-water mark is far away).
        self._to_core.send(self._encode(message), copy=False)

    # ------------------------------------------------------------------ outputs
    async def _read_outputs(self) -> None:
        assert self._from_core is not None
        try:
            while True:
                frame = await self._from_core.recv(copy=False)
                self._handle(self._decode(frame.buffer))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a broken frame is as fatal as a dead core
            logger.exception("reading the engine core's outputs failed")
            self._die(EngineDeadError(f"reading the engine core's outputs failed: {exc!r}"))

    def _handle(self, out: EngineCoreOutputs) -> None:
        if out.stats is not None:
            self._snapshot.stats = out.stats
            self._snapshot.sleep_level = out.stats.sleep_level
            self._snapshot.updated_at = time.time()
            self._snapshot.peak_running = max(self._snapshot.peak_running, out.stats.max_num_running_seen, out.stats.num_running)
        for request_id in out.accepted:
            ack = self._acks.pop(request_id, None)
            if ack is not None and not ack.done():
                ack.set_result(None)
        for request_id, (kind, message, status) in out.rejected.items():
            ack = self._acks.pop(request_id, None)
            if ack is not None and not ack.done():
                ack.set_exception(_rebuild_error(kind, message, status))
        if out.deltas:
            self._deliver(out)
        for request_id in out.aborted:
            stream = self._streams.get(request_id)
            if stream is not None:
                self._end_aborted(stream)
        for result in out.utility_results:
            future = self._calls.pop(result.call_id, None)
            if future is None or future.done():
                continue
            if result.ok:
                future.set_result(result.value)
            else:
                future.set_exception(_rebuild_error(result.error_type or "RuntimeError", result.error_message or "", result.error_status))
        if out.fatal is not None:
            self._die(EngineDeadError(out.fatal))

    def _deliver(self, out: EngineCoreOutputs) -> None:
        touched, stopped = self.processor.process(out.deltas)
        if stopped:
            self._send(AbortRequests(stopped, finish_reason="stop"))
        now = time.monotonic()
        for state in touched:
            stream = self._streams.get(state.request_id)
            if stream is None:
                continue
            note_new_tokens(stream, state.new_tokens, now)
            state.new_tokens = 0
            if state.finished:
                self._record_finished(stream)
                self._forget(state.request_id)
            stream.notify()

    def _record_finished(self, stream: RequestStream) -> None:
        if self._finished_listeners:
            output = OutputProcessor.output(stream.state)
            notify_finished(self._finished_listeners, finished_record(stream, output, time.monotonic()))

    # ------------------------------------------------------------------ core death
    async def _watch_disconnect(self, monitor: zmq.asyncio.Socket) -> None:
        from zmq.utils.monitor import parse_monitor_message

        while True:
            event = parse_monitor_message(await monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED and not self._stopping:
                self._die(EngineDeadError("the engine core process disconnected (it exited or was killed)"))
                return

    def _core_process_ended(self) -> None:
        if self.core_process is None or self._stopping:
            return
        asyncio.get_running_loop().remove_reader(self.core_process.sentinel)
        self.core_process.join(0)
        self._die(EngineDeadError(f"the engine core process exited with code {self.core_process.exitcode}"))

    def _die(self, error: EngineDeadError) -> None:
        if self._dead is not None:
            return
        self._dead = error
        logger.error("%s; failing %d in-flight request(s) and stopping the server so it is restarted",
                     error, len(self._streams))
        for future in [*self._acks.values(), *self._calls.values()]:
            if not future.done():
                future.set_exception(error)
        self._acks.clear()
        self._calls.clear()
        for stream in list(self._streams.values()):
            stream.error = error
            stream.notify()
        self._streams.clear()
        if self._drained is not None:
            self._drained.set()
        if self.on_dead is not None:
            self.on_dead(error)

    # ------------------------------------------------------------------ control
    async def _call(self, method: str, *args: Any) -> Any:
        if self._dead is not None:
            raise EngineDeadError(f"the engine core has stopped: {self._dead}")
        call_id = next(self._call_ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        self._send(UtilityCall(call_id, method, list(args), self.client_index))
        try:
            return await future
        finally:
            self._calls.pop(call_id, None)

    def _lock(self) -> asyncio.Lock:
        if self._admin_lock is None:
            self._admin_lock = asyncio.Lock()
        return self._admin_lock

    async def is_sleeping(self) -> bool:
        """Asks the core: another API server may have just put it to sleep or woken it."""
        if self._dead is None:
            try:
                await self._call("get_stats")  # the reply brings fresh stats, the sleep level included
            except EngineDeadError:
                pass
        return self._snapshot.sleep_level > 0

    async def sleep(self, level: int = 1, mode: str = "wait") -> None:
        """Sleep at `level` (1: weights to host, 2: discard all). mode "wait" lets every
        request (of every API server) finish first; "abort" ends them. New requests are
        refused (engine_sleeping) from the moment this is called."""
        check_sleep_request(level, mode, self.enable_sleep_mode)
        async with self._lock():
            if self._snapshot.sleep_level:
                return
            if self._refusal is EngineShuttingDownError:
                raise EngineShuttingDownError("the server is shutting down")
            self._refusal = EngineSleepingError
            try:
                await self._call("sleep", level, mode)
                self._snapshot.sleep_level = level
            finally:
                if self._refusal is EngineSleepingError:
                    self._refusal = None

    async def wake_up(self, tags: list[str] | None = None) -> None:
        if not self.enable_sleep_mode:
            raise ValueError("sleep mode is not enabled; start the server with --enable-sleep-mode")
        async with self._lock():
            if not self._snapshot.sleep_level:
                return
            await self._call("wake_up", tags)

    async def reset_prefix_cache(self) -> bool:
        async with self._lock():
            return bool(await self._call("reset_prefix_cache"))

    def list_lora_adapters(self) -> list[AdapterInfo]:
        stats = self._snapshot.stats
        return [AdapterInfo(*entry) for entry in getattr(stats, "lora_adapters", ())] if stats is not None else []

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> None:
        await self._call("load_lora", lora_name, lora_path)

    async def unload_lora_adapter(self, lora_name: str) -> bool:
        return bool(await self._call("remove_lora", lora_name))

    async def get_stats(self) -> Any:
        await self._call("get_stats")
        return self._snapshot.stats


def _rebuild_error(kind: str, message: str, status: int | None) -> BaseException:
    """The core's exception, as the caller would have seen it in process."""
    if kind == "LoRAError":
        return LoRAError(message, status=status or 400)
    if kind == "EngineSleepingError":
        return EngineSleepingError(message)
    if kind == "ValueError":
        return ValueError(message)
    if kind == "RuntimeError" and "sleeping" in message:
        return EngineSleepingError(message)
    return RuntimeError(message)
