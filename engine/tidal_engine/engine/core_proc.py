"""The engine-core process: the core's busy loop, fed and read over ZeroMQ.

One process runs ``EngineCore`` (scheduler, KV cache manager, executor), or for a pooling
model ``PoolingEngineCore`` (the same scheduler, a prefill-only runner), and nothing else,
so no HTTP parsing, tokenizing or detokenizing ever takes its GIL. API servers PUSH
msgpack messages (requests, aborts, utility calls) to its one PULL socket; it PUSHes
each API server's deltas back on that server's own socket, with the stats every
server's /metrics needs. Between steps it drains its inbox without blocking; with no
work it blocks on the socket (and checks its parent now and then).

Utility calls that need an idle engine (sleep) wait until no request is left, while new
requests are refused as sleeping; ``sleep`` with mode "abort" first ends every request.
The process ignores SIGTERM/SIGINT: its parent drains the API server and then sends
``shutdown``; if the parent dies, the kernel kills this process (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import logging
import os
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Callable

import msgspec
import zmq

from tidal_engine.config import EngineConfig
from tidal_engine.engine.core import EngineCore
from tidal_engine.engine.messages import (
    AbortRequests,
    CoreInfo,
    EngineCoreOutputs,
    EngineCoreRequest,
    PooledOutput,
    SampleDelta,
    UtilityCall,
    UtilityResult,
    encoder,
    input_decoder,
    params_from_dict,
)
from tidal_engine.engine.process_utils import die_with_parent, ignore_termination_signals, parent_alive, set_process_title
from tidal_engine.pooling.core import PoolingEngineCore
from tidal_engine.pooling.params import PoolingParams

logger = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.1  # how often idle API servers hear the core's stats
IDLE_POLL_MS = 500  # how long an idle core blocks before it checks its parent


@dataclass
class CoreAddresses:
    input: str  # the core binds PULL here; every API server connects PUSH
    outputs: list[str]  # API server i binds PULL at outputs[i]; the core connects PUSH


class EngineCoreProc:
    def __init__(self, core: EngineCore | PoolingEngineCore, addresses: CoreAddresses, parent_pid: int | None = None) -> None:
        self.core = core
        self.parent_pid = parent_pid
        self.ctx = zmq.Context()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.bind(addresses.input)
        self.outboxes = []
        for address in addresses.outputs:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(address)
            self.outboxes.append(sock)
        self.encode = encoder().encode
        self.decode = input_decoder().decode
        self.client_of: dict[str, int] = {}  # request id → the API server that sent it
        self.idle_calls: list[UtilityCall] = []  # sleeps waiting for the engine to drain
        self.sleeping_soon = False  # a sleep is draining: new requests are refused
        self.stopping = False
        self._pending: dict[int, EngineCoreOutputs] = {}
        self._last_stats = 0.0
        self._stats_dirty = False  # requests changed since the last stats went out

    # ---- the loop ----------------------------------------------------------------------
    def run(self) -> None:
        try:
            while not self.stopping:
                busy = self.core.has_unfinished_requests()
                if busy or self.inbox.poll(IDLE_POLL_MS):
                    self._drain_inbox()
                elif self.parent_pid is not None and not parent_alive(self.parent_pid):
                    logger.error("the engine core's parent process is gone; exiting")
                    return
                self._run_idle_calls()
                if self.core.has_unfinished_requests():
                    self._route(self.core.step())
                    # The step that leaves the engine idle carries fresh stats with its last
                    # deltas, so /metrics is exact once the last answer has arrived.
                    self._stats_dirty = True
                self._flush(force_stats=self._stats_dirty and not self.core.has_unfinished_requests())
        except Exception as exc:
            logger.exception("engine core loop died")
            self._broadcast_fatal(f"the engine core failed: {exc!r}")
            raise
        finally:
            self.core.shutdown()
            self.ctx.destroy(linger=1000)

    def _drain_inbox(self) -> None:
        while True:
            try:
                raw = self.inbox.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            message = self.decode(raw.buffer)
            if isinstance(message, EngineCoreRequest):
                self._add(message)
            elif isinstance(message, AbortRequests):
                self._abort(message)
            else:
                self._call(message)

    def _outputs(self, client: int) -> EngineCoreOutputs:
        out = self._pending.get(client)
        if out is None:
            out = self._pending[client] = EngineCoreOutputs()
        return out

    def _flush(self, force_stats: bool = False) -> None:
        now = time.monotonic()
        stats = None
        if force_stats or now - self._last_stats >= STATS_INTERVAL_S:
            stats = self.core.get_stats()
            self._last_stats = now
            self._stats_dirty = False
            for client in range(len(self.outboxes)):
                self._outputs(client)
        pending, self._pending = self._pending, {}
        for client, out in pending.items():
            out.stats = stats
            try:
                # Never block the loop on an API server that is gone: drop what it can't take.
                self.outboxes[client].send(self.encode(out), zmq.NOBLOCK, copy=False)
            except zmq.Again:
                logger.warning("API server %d is not reading its outputs; dropped one message", client)

    def _broadcast_fatal(self, message: str) -> None:
        for sock in self.outboxes:
            try:
                sock.send(self.encode(EngineCoreOutputs(fatal=message)), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    # ---- requests ------------------------------------------------------------------------
    def _add(self, msg: EngineCoreRequest) -> None:
        out = self._outputs(msg.client_index)
        if self.sleeping_soon or self.core.is_sleeping():
            out.rejected[msg.request_id] = ("EngineSleepingError", "the engine is sleeping", 503)
            return
        try:
            if msg.pooling_params is not None:
                add_pooling = getattr(self.core, "add_pooling_request", None)
                if add_pooling is None:
                    raise ValueError("this engine generates text; pooling requests need a pooling model")
                add_pooling(msg.request_id, msg.prompt_token_ids, PoolingParams(**msg.pooling_params),
                            msg.token_type_ids, msg.arrival_time)
            else:
                self.core.add_request(
                    msg.request_id, msg.prompt_token_ids, params_from_dict(msg.params),
                    cache_salt=msg.cache_salt, arrival_time=msg.arrival_time, lora_name=msg.lora_name,
                )
        except ValueError as exc:  # bad input, LoRAError included: the caller's 4xx
            out.rejected[msg.request_id] = (type(exc).__name__, str(exc), int(getattr(exc, "status", 400)))
            return
        self.client_of[msg.request_id] = msg.client_index
        out.accepted.append(msg.request_id)

    def _abort(self, msg: AbortRequests) -> None:
        self._stats_dirty = True  # blocks were freed
        if msg.finish_reason == "stop":  # samples whose stop string matched in the API server
            self.core.finish_samples(msg.request_ids)
            for request_id in msg.request_ids:
                if request_id in self.client_of and not self.core.has_request(request_id):
                    del self.client_of[request_id]
            return
        for request_id in msg.request_ids:
            self.core.abort_request(request_id)
            self.client_of.pop(request_id, None)

    def _route(self, deltas: list[SampleDelta] | list[PooledOutput]) -> None:
        ended: set[str] = set()
        for delta in deltas:
            if isinstance(delta, PooledOutput):  # a pooling request ends with its one output
                client = self.client_of.pop(delta.request_id, None)
                if client is not None:
                    self._outputs(client).pooled.append(delta)
                continue
            client = self.client_of.get(delta.request_id)
            if client is None:
                continue
            self._outputs(client).deltas.append(delta)
            if delta.finish_reason is not None and not self.core.has_request(delta.request_id):
                ended.add(delta.request_id)  # after the loop: its other samples may end in this step too
        for request_id in ended:
            del self.client_of[request_id]

    def _abort_all(self) -> None:
        for request_id, client in list(self.client_of.items()):
            self.core.abort_request(request_id)
            self._outputs(client).aborted.append(request_id)
        self.client_of.clear()

    # ---- utility calls ---------------------------------------------------------------
    def _call(self, call: UtilityCall) -> None:
        if call.method == "sleep":  # answered once no request is left (or, mode "abort", all ended)
            level, mode = call.args
            if self.core.is_sleeping():
                self._reply(call, None)
                return
            self.sleeping_soon = True
            if mode == "abort":
                self._abort_all()
            self.idle_calls.append(call)
            return
        if call.method == "shutdown":
            self.stopping = True
            self._reply(call, None)
            return
        core = self.core
        handlers: dict[str, Callable[..., Any]] = {
            "wake_up": core.wake_up,
            "reset_prefix_cache": core.reset_prefix_cache,
            "load_lora": core.load_lora,
            "remove_lora": core.remove_lora,
            "get_stats": lambda: None,  # the stats ride along with every reply
        }
        handler = handlers.get(call.method)
        if handler is None:
            self._reply_error(call, ValueError(f"unknown engine call {call.method!r}"))
            return
        self._run(call, lambda: handler(*call.args))

    def _run_idle_calls(self) -> None:
        """Sleeps waiting for the engine to drain."""
        if not self.idle_calls or self.core.has_unfinished_requests():
            return
        calls, self.idle_calls = self.idle_calls, []
        for call in calls:
            try:
                self._run(call, lambda: self.core.sleep(call.args[0]))
            finally:
                self.sleeping_soon = False

    def _run(self, call: UtilityCall, fn: Callable[[], Any]) -> None:
        try:
            value = fn()
        except Exception as exc:  # the call failed, not the loop: report it to the caller
            self._reply_error(call, exc)
            return
        self._reply(call, value)

    def _reply(self, call: UtilityCall, value: Any) -> None:
        self._outputs(call.client_index).utility_results.append(UtilityResult(call.call_id, True, value))
        self._flush(force_stats=True)

    def _reply_error(self, call: UtilityCall, exc: BaseException) -> None:
        result = UtilityResult(call.call_id, False, None, type(exc).__name__, str(exc), getattr(exc, "status", None))
        self._outputs(call.client_index).utility_results.append(result)
        self._flush(force_stats=True)


def core_info(core: EngineCore | PoolingEngineCore) -> CoreInfo:
    return CoreInfo(
        pooling=core.pooling_info if isinstance(core, PoolingEngineCore) else None,
        model_name=core.model_name,
        max_model_len=core.max_model_len,
        vocab_size=core.vocab_size,
        eos_token_ids=sorted(core.eos_token_ids),
        enable_lora=core.lora_manager is not None,
        async_scheduling=core.async_scheduling,
        device=str(core.device),
    )


def build_core(config: EngineConfig) -> EngineCore | PoolingEngineCore:
    """The generation core, or the pooling core for ``--runner pooling``."""
    if config.runner == "pooling":
        return PoolingEngineCore.from_config(config)
    return EngineCore(config)


def run_engine_core(config: EngineConfig, addresses: CoreAddresses, ready: Connection, log_level: int = logging.INFO) -> None:
    """The engine-core process's entry point: build the core, say ready (or why not), loop."""
    parent = os.getppid()
    die_with_parent()
    ignore_termination_signals()
    set_process_title("tidal-engine: engine-core")
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s [engine-core] %(message)s")
    try:
        core = build_core(config)
        proc = EngineCoreProc(core, addresses, parent_pid=parent)
    except BaseException as exc:  # noqa: BLE001 - the parent shows it and exits
        ready.send(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        ready.close()
        raise SystemExit(1) from None
    ready.send(("ready", msgspec.msgpack.encode(core_info(core)), ""))
    ready.close()
    proc.run()
