"""`tidal-engine serve`: start the engine-core process, then the API server(s).

Process tree (titles as `ps` shows them)::

    tidal-engine: api-server            (--api-server-count 1: the main process)
      └─ tidal-engine: engine-core      (scheduler, KV cache, executor, workers)

    tidal-engine: api-server-manager    (--api-server-count N > 1)
      ├─ tidal-engine: engine-core
      └─ tidal-engine: api-server 0..N-1  (one shared port, SO_REUSEPORT)

The core and the API servers talk over ZeroMQ IPC sockets in a private temporary folder.
Children die with their parent (PR_SET_PDEATHSIG), so a SIGKILLed main process leaves no
core or worker behind. SIGTERM drains the API servers first; then the core is stopped.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import tempfile
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import msgspec

from tidal_engine.config import EngineConfig
from tidal_engine.engine.core_proc import CoreAddresses, run_engine_core
from tidal_engine.engine.messages import CoreInfo
from tidal_engine.engine.process_utils import die_with_parent, set_process_title
from tidal_engine.server.app import ServerSettings, run_server

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 3600.0  # weights can take long to load; a dead core is noticed at once


class EngineStartError(RuntimeError):
    """The engine core could not start (the message says why)."""


def start_engine_core(config: EngineConfig, addresses: CoreAddresses) -> tuple[BaseProcess, CoreInfo]:
    """Spawn the core and wait until it has loaded the model (or failed to)."""
    return wait_for_engine_core(*spawn_engine_core(config, addresses))


def spawn_engine_core(config: EngineConfig, addresses: CoreAddresses) -> tuple[BaseProcess, Connection]:
    """Start the core process; its readiness (or failure) arrives on the returned pipe."""
    ctx = multiprocessing.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=run_engine_core, args=(config, addresses, writer, logging.getLogger().level),
                       name="tidal-engine-core")
    proc.start()
    writer.close()
    return proc, reader


def wait_for_engine_core(proc: BaseProcess, reader: Connection) -> tuple[BaseProcess, CoreInfo]:
    """Wait until the spawned core has loaded the model; raises EngineStartError if it failed."""
    ready = multiprocessing.connection.wait([reader, proc.sentinel], timeout=READY_TIMEOUT_S)
    if reader in ready:
        try:
            kind, payload, details = reader.recv()
        except EOFError:
            kind, payload, details = "error", "the engine core exited before it was ready", ""
    else:
        kind, payload, details = "error", "the engine core exited before it was ready", ""
    if kind != "ready":
        proc.join(10)
        if proc.is_alive():
            proc.kill()
        if details:
            logger.debug("engine core start-up failure:\n%s", details)
        raise EngineStartError(payload if isinstance(payload, str) else "the engine core failed to start")
    return proc, msgspec.msgpack.decode(payload, type=CoreInfo)


def serve(config: EngineConfig, settings: ServerSettings, api_server_count: int = 1) -> int:
    """Run the server until it is stopped; returns the process exit status."""
    if api_server_count < 1:
        raise ValueError("--api-server-count must be >= 1")
    workdir = tempfile.mkdtemp(prefix="tidal-engine-")
    addresses = CoreAddresses(
        input=f"ipc://{workdir}/core-inputs",
        outputs=[f"ipc://{workdir}/api-server-{i}" for i in range(api_server_count)],
    )
    core = None
    try:
        core, reader = spawn_engine_core(config, addresses)
        # One API server runs here: its tokenizer loads while the core loads the model. A failure
        # is raised once the core has answered, so a core that cannot start is still reported first.
        prepared: PreparedAPIServer | Exception | None = None
        if api_server_count == 1:
            try:
                prepared = prepare_api_server(config, settings)
            except Exception as exc:  # noqa: BLE001 - re-raised below
                prepared = exc
        core, info = wait_for_engine_core(core, reader)
        if isinstance(prepared, Exception):
            raise prepared
        logger.info("engine core ready (pid %d): %s on %s, max_model_len %d",
                    core.pid, info.model_name, info.device, info.max_model_len)
        if prepared is not None:
            set_process_title("tidal-engine: api-server")
            return run_api_server(config, settings, info, addresses, 0, core_process=core, prepared=prepared)
        return _manage_api_servers(config, settings, info, addresses, core)
    finally:
        if core is not None and core.is_alive():
            core.kill()  # only reached after a drain, or when the server itself failed
            core.join(10)
        shutil.rmtree(workdir, ignore_errors=True)


@dataclasses.dataclass
class PreparedAPIServer:
    """What an API server loads before it can serve: the tokenizer and the settings with the
    generation config's sampling defaults."""

    tokenizer: Any
    settings: ServerSettings


def prepare_api_server(config: EngineConfig, settings: ServerSettings) -> PreparedAPIServer:
    if config.runner == "pooling":  # embeddings and scores: the pooling model's tokenizer, no sampling
        from tidal_engine.server.pooling import load_pooling_tokenizer

        return PreparedAPIServer(load_pooling_tokenizer(config), settings)
    from tidal_engine.models.loader import load_tokenizer

    from tidal_engine.server.generation_config import load_sampling_defaults

    tokenizer = load_tokenizer(config.model, config.tokenizer, config.cache_dir)
    defaults = load_sampling_defaults(settings.generation_config, config.model)
    return PreparedAPIServer(tokenizer, dataclasses.replace(settings, default_sampling={**defaults, **settings.default_sampling}))


def run_api_server(
    config: EngineConfig,
    settings: ServerSettings,
    info: CoreInfo,
    addresses: CoreAddresses,
    index: int,
    core_process: BaseProcess | None = None,
    reuse_port: bool = False,
    prepared: PreparedAPIServer | None = None,
) -> int:
    prepared = prepared or prepare_api_server(config, settings)
    if info.pooling is not None:  # a pooling core (embeddings, scores): its own API
        from tidal_engine.server.pooling import run_pooling_api_server

        return run_pooling_api_server(settings, info, addresses, index, prepared.tokenizer, core_process,
                                      enable_sleep_mode=config.enable_sleep_mode, reuse_port=reuse_port)
    from tidal_engine.engine.async_llm import AsyncLLM

    settings = prepared.settings
    engine = AsyncLLM(prepared.tokenizer, info, addresses, index, enable_sleep_mode=config.enable_sleep_mode,
                      core_process=core_process)
    return run_server(engine, settings, reuse_port=reuse_port)


def _api_server_main(config: EngineConfig, settings: ServerSettings, info_bytes: bytes,
                     addresses: CoreAddresses, index: int, log_level: int) -> None:
    die_with_parent()
    set_process_title(f"tidal-engine: api-server {index}")
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s %(name)s [api-server {index}] %(message)s")
    info = msgspec.msgpack.decode(info_bytes, type=CoreInfo)
    raise SystemExit(run_api_server(config, settings, info, addresses, index, reuse_port=True))


def _manage_api_servers(config: EngineConfig, settings: ServerSettings, info: CoreInfo,
                        addresses: CoreAddresses, core: BaseProcess) -> int:
    set_process_title("tidal-engine: api-server-manager")
    ctx = multiprocessing.get_context("spawn")
    servers = [
        ctx.Process(target=_api_server_main, name=f"tidal-api-server-{i}",
                    args=(config, settings, msgspec.msgpack.encode(info), addresses, i, logging.getLogger().level))
        for i in range(len(addresses.outputs))
    ]
    for proc in servers:
        proc.start()

    def forward(signum: int, _frame: object) -> None:
        for proc in servers:
            if proc.is_alive() and proc.pid is not None:
                os.kill(proc.pid, signal.SIGTERM)  # each drains its own requests

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    status = 0
    alive = {proc.sentinel: proc for proc in servers}
    while alive:
        ended = multiprocessing.connection.wait([core.sentinel, *alive])
        if core.sentinel in ended:
            logger.error("the engine core exited (code %s); stopping the API servers", core.exitcode)
            forward(signal.SIGTERM, None)
            for proc in alive.values():
                proc.join(30)
            return 1
        for sentinel in ended:
            proc = alive.pop(sentinel)
            proc.join()
            if proc.exitcode != 0:
                logger.error("%s exited with code %s; stopping the others", proc.name, proc.exitcode)
                status = 1
                forward(signal.SIGTERM, None)
    return status
