"""The API server's side of a pooling engine core: ``AsyncLLM`` plus ``encode``.

Texts are tokenized in the API server (server/pooling.py); each input goes to the core as its
own ``EngineCoreRequest`` with pooling parameters, is scheduled there with the others, and
comes back as one ``PooledOutput``. Sleep, wake, stats, health and core death are
AsyncLLM's, unchanged.

``LocalPoolingCore`` runs the core's real loop (``EngineCoreProc``) on a thread of this
process, over the same ZeroMQ messages: the server's tests and the benchmark's in-process path
use it to skip spawning a process.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import tempfile
import threading
import time
from dataclasses import asdict
from multiprocessing.process import BaseProcess
from typing import Any

import torch

from tidal_engine.engine.async_engine import EngineShuttingDownError, EngineSleepingError
from tidal_engine.engine.async_llm import AsyncLLM, _rebuild_error
from tidal_engine.engine.core_proc import CoreAddresses, EngineCoreProc, core_info
from tidal_engine.engine.messages import AbortRequests, CoreInfo, EngineCoreOutputs, EngineCoreRequest
from tidal_engine.pooling.core import PoolingEngineCore
from tidal_engine.pooling.params import PoolingModelInfo
from tidal_engine.pooling.runner import PoolingInput

_ids = itertools.count()


class PoolingClient(AsyncLLM):
    def __init__(self, tokenizer: Any, info: CoreInfo, addresses: CoreAddresses, client_index: int = 0, *,
                 enable_sleep_mode: bool = False, core_process: BaseProcess | None = None) -> None:
        super().__init__(tokenizer, info, addresses, client_index, enable_sleep_mode=enable_sleep_mode,
                         core_process=core_process)
        if info.pooling is None:
            raise ValueError("the engine core runs a generative model, not a pooling one")
        values = dict(info.pooling)
        values["labels"] = tuple(values["labels"])
        self.pooling_info = PoolingModelInfo(**values)
        self._pooled: dict[str, asyncio.Future[torch.Tensor]] = {}
        self._prefix = f"pool-{os.getpid()}-{client_index}-"

    async def encode(self, items: list[PoolingInput]) -> list[torch.Tensor]:
        """Pooled outputs of ``items``, in order. They join the core's queue together (FCFS);
        a caller that goes away aborts those not done."""
        self._check_accepting()
        loop = asyncio.get_running_loop()
        ids = [f"{self._prefix}{next(_ids)}" for _ in items]
        futures = []
        for request_id, item in zip(ids, items, strict=True):
            future: asyncio.Future[torch.Tensor] = loop.create_future()
            self._pooled[request_id] = future
            futures.append(future)
            self._send(EngineCoreRequest(
                request_id=request_id, prompt_token_ids=item.token_ids, params={}, arrival_time=time.time(),
                client_index=self.client_index, pooling_params=asdict(item.params), token_type_ids=item.token_type_ids,
            ))
        assert self._drained is not None
        self._drained.clear()
        try:
            return list(await asyncio.gather(*futures))
        except BaseException:
            unfinished = [i for i, f in zip(ids, futures, strict=True) if not f.done()]
            if unfinished and self._dead is None:
                self._send(AbortRequests(unfinished))
            for future in futures:
                if future.done() and not future.cancelled():
                    future.exception()  # retrieved: a sibling's failure is not "never retrieved"
            raise
        finally:
            for request_id in ids:
                self._pooled.pop(request_id, None)
            if not self._pooled and not self._streams:
                self._drained.set()

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """AsyncLLM's drain, pooling requests included: they finish (or are aborted at the
        timeout) before the core stops."""
        if self._pooled and self._dead is None and self._drained is not None:
            self._refusal = EngineShuttingDownError
            try:
                await asyncio.wait_for(self._drained.wait(), timeout=timeout_s)
            except asyncio.TimeoutError:
                self._send(AbortRequests(list(self._pooled)))
                self._die(EngineShuttingDownError("the server is shutting down"))
        await super().shutdown(timeout_s)

    @property
    def num_in_flight(self) -> int:
        return len(self._streams) + len(self._pooled)

    def _handle(self, out: EngineCoreOutputs) -> None:
        for pooled in out.pooled:
            future = self._pooled.get(pooled.request_id)
            if future is None or future.done():
                continue
            if pooled.error is not None:
                future.set_exception(RuntimeError(pooled.error))
            else:
                future.set_result(torch.frombuffer(bytearray(pooled.data), dtype=torch.float32))
        for request_id, (kind, message, status) in out.rejected.items():
            future = self._pooled.get(request_id)
            if future is not None and not future.done():
                future.set_exception(_rebuild_error(kind, message, status))
        for request_id in out.aborted:  # the core ended it: a sleep with mode "abort"
            future = self._pooled.get(request_id)
            if future is not None and not future.done():
                future.set_exception(EngineSleepingError("aborted: the engine was put to sleep"))
        super()._handle(out)

    def _die(self, error: Any) -> None:
        for future in self._pooled.values():
            if not future.done():
                future.set_exception(error)
        super()._die(error)


class LocalPoolingCore:
    """A pooling core and its loop on a thread of this process, with a client bound to it."""

    def __init__(self, core: PoolingEngineCore) -> None:
        self.core = core
        self._workdir = tempfile.mkdtemp(prefix="tidal-pooling-")
        addresses = CoreAddresses(input=f"ipc://{self._workdir}/in", outputs=[f"ipc://{self._workdir}/out"])
        self._proc = EngineCoreProc(core, addresses)
        self._thread = threading.Thread(target=self._proc.run, name="tidal-pooling-core", daemon=True)
        self.client = _LocalClient(core.tokenizer, core_info(core), addresses,
                                   enable_sleep_mode=core.enable_sleep_mode, owner=self)
        self._thread.start()

    def stop(self) -> None:
        self._proc.stopping = True
        self._thread.join(30)
        shutil.rmtree(self._workdir, ignore_errors=True)


class _LocalClient(PoolingClient):
    def __init__(self, *args: Any, owner: LocalPoolingCore, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._owner = owner

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        await super().shutdown(timeout_s)
        await asyncio.to_thread(self._owner.stop)
