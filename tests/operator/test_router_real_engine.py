"""The router in front of a real engine process (`tidal-engine serve smollm2-135m` on CPU),
driven by the real `openai` client: plain and streamed chat, then sleep/wake through the router."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import AsyncIterator

import httpx
import pytest

from tidal_operator import labels as L
from tidal_operator.router import Registry
from tidal_operator.router.registry import SecretRef

from router_upstreams import CLIENT_KEY, closed_port, llmservice, pod, run_router_for_test

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
ENGINE_KEY = "real-engine-key"
STARTUP_DEADLINE_S = 600


def _engine_command() -> list[str] | None:
    if not (ROOT / "engine" / "tidal_engine" / "server" / "app.py").exists():
        return None
    exe = shutil.which("tidal-engine", path=str(Path(sys.executable).parent)) or shutil.which("tidal-engine")
    return [exe] if exe else [sys.executable, "-m", "tidal_engine.cli"]


@pytest.fixture
async def engine_port(tmp_path: Path) -> AsyncIterator[int]:
    command = _engine_command()
    if command is None:
        pytest.skip("engine/tidal_engine/server/app.py does not exist yet")
    openai = pytest.importorskip("openai")
    del openai
    port = closed_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TIDAL_API_KEY": ENGINE_KEY}
    log = (tmp_path / "engine.log").open("w")  # a file, not a pipe nobody drains
    process = subprocess.Popen(
        [*command, "serve", "smollm2-135m", "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
         "--served-model-name", "smollm2", "--enable-sleep-mode", "--max-model-len", "512",
         "--kv-cache-memory-bytes", "64M", "--disable-log-requests"],
        env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + STARTUP_DEADLINE_S
        async with httpx.AsyncClient() as client:
            while True:  # wait for the engine to load: a startup barrier, not a fixed delay
                if process.poll() is not None:
                    output = (tmp_path / "engine.log").read_text()
                    pytest.skip(f"the real engine did not start (exit {process.returncode}): {output[-2000:]}")
                try:
                    if (await client.get(f"http://127.0.0.1:{port}/health")).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    pytest.fail(f"engine not healthy within {STARTUP_DEADLINE_S}s")
                await asyncio.sleep(0.5)
        yield port
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


async def test_openai_client_through_the_router_and_wake_on_demand(engine_port: int) -> None:
    import openai

    registry = Registry()
    registry.apply_llmservice_event({"type": "ADDED", "object": llmservice("smol", served_name="smollm2",
                                                                           secret="smol-key")})
    registry.apply_pod_event({"type": "ADDED", "object": pod("smol-0", "smol", engine_port)})
    registry.set_secret(SecretRef("default", "smol-key"), ENGINE_KEY)
    async with run_router_for_test(registry) as router:
        client = openai.AsyncOpenAI(base_url=f"{router.url}/v1", api_key=CLIENT_KEY, max_retries=0)
        messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
        plain = await client.chat.completions.create(model="smollm2", messages=messages, max_tokens=8,
                                                     temperature=0)
        assert "Paris" in plain.choices[0].message.content
        stream = await client.chat.completions.create(model="smollm2", messages=messages, max_tokens=8,
                                                      temperature=0, stream=True)
        pieces = [chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices]
        assert len(pieces) > 1 and "Paris" in "".join(pieces)

        engine = httpx.AsyncClient(base_url=f"http://127.0.0.1:{engine_port}",
                                   headers={"authorization": f"Bearer {ENGINE_KEY}"}, timeout=60)
        async with engine:
            # 1) Asleep while its label still says awake: the engine's 503 makes the router wake it.
            assert (await engine.post("/sleep", params={"level": 1})).status_code == 200
            answer = await client.chat.completions.create(model="smollm2", messages=messages, max_tokens=8,
                                                          temperature=0)
            assert "Paris" in answer.choices[0].message.content
            assert (await engine.get("/is_sleeping")).json() == {"is_sleeping": False}

            # 2) Asleep and labelled so: 5 concurrent requests are held behind one wake_up.
            assert (await engine.post("/sleep", params={"level": 1})).status_code == 200
            registry.apply_pod_event({"type": "MODIFIED", "object": pod(
                "smol-0", "smol", engine_port, sleep_state=L.SLEEP_LEVEL_1, resource_version="2")})
            wakes_before = router.app.state.waker.wake_calls
            answers = await asyncio.gather(*(client.chat.completions.create(
                model="smollm2", messages=messages, max_tokens=4, temperature=0) for _ in range(5)))
            assert all(a.choices[0].message.content for a in answers)
            assert router.app.state.waker.wake_calls - wakes_before == 1
