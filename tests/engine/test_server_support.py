"""Shared helpers for the server tests (no tests here).

The in-process tests serve a tiny random Llama that uses SmolLM2's tokenizer and chat
template, so requests go through the real LLMEngine in milliseconds. `LiveServer` runs
uvicorn in a thread, which gives real HTTP (streaming, disconnects) without a subprocess.
"""

from __future__ import annotations

import functools
import os
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import uvicorn

sys.path.insert(0, str(Path(__file__).parent))

from tidal_engine.config import EngineConfig  # noqa: E402
from tidal_engine.engine.async_engine import AsyncLLMEngine  # noqa: E402
from tidal_engine.server.app import ServerSettings, build_app  # noqa: E402

TINY_MAX_MODEL_LEN = 256
API_KEY = "test-secret-key"


@functools.cache
def tiny_model_dir() -> str:
    """A tiny random Llama with SmolLM2's tokenizer, built once per test process."""
    from tiny_models import make_tiny_model

    from tidal_engine.models.loader import resolve_model

    folder = Path(tempfile.mkdtemp(prefix="tidal-server-tiny-"))
    tokenizer = resolve_model("smollm2-135m").load_tokenizer()
    make_tiny_model("llama", folder, vocab_size=len(tokenizer), max_position_embeddings=TINY_MAX_MODEL_LEN)
    tokenizer.save_pretrained(folder)
    return str(folder)


def make_engine(**overrides: Any) -> AsyncLLMEngine:
    import torch

    from tidal_engine.engine.llm_engine import LLMEngine

    torch.set_num_threads(1)
    options: dict[str, Any] = dict(
        model=tiny_model_dir(),
        served_model_name="tiny",
        dtype="float32",
        device="cpu",
        kv_cache_memory_bytes=8 << 20,
        enable_sleep_mode=True,
    )
    options.update(overrides)
    config = EngineConfig(**options)
    return AsyncLLMEngine(LLMEngine(config), enable_sleep_mode=config.enable_sleep_mode)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_health(base_url: str, deadline_s: float, process: Any = None) -> None:
    """Poll /health until 200; fail fast if the server process exits."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"server exited with code {process.returncode}")
        try:
            if httpx.get(f"{base_url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{base_url} not healthy after {deadline_s}s")


class LiveServer:
    """uvicorn in a background thread around an in-process engine."""

    def __init__(self, engine: AsyncLLMEngine, **settings: Any) -> None:
        self.engine = engine
        self.port = free_port()
        self.settings = ServerSettings(host="127.0.0.1", port=self.port, **settings)
        self.app = build_app(engine, self.settings)
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning",
                                lifespan="on", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        wait_for_health(self.url, 30)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def client(self, **kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60, **kwargs)

    def raw_engine(self) -> Any:
        return self.engine.engine


@contextmanager
def live_server(**settings: Any) -> Iterator[LiveServer]:
    engine_overrides = settings.pop("engine", {})
    with LiveServer(make_engine(**engine_overrides), **settings) as server:
        yield server


def wait_until(predicate: Any, timeout_s: float = 10.0, interval_s: float = 0.02) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(interval_s)
    return bool(predicate())


os.environ.setdefault("OMP_NUM_THREADS", "1")
