"""AsyncLLMEngine on its own: one loop thread, per-request queues, aborts, sleep, shutdown."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from test_server_support import make_engine  # noqa: E402

from tidal_engine.engine.async_engine import (  # noqa: E402
    AsyncLLMEngine,
    EngineDeadError,
    EngineShuttingDownError,
    EngineSleepingError,
    FinishedRequest,
)
from tidal_engine.sampling_params import SamplingParams  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(params=[False, True], ids=["sync-steps", "async-scheduling"])
def engine(request: pytest.FixtureRequest) -> Any:
    # Both step modes: with async scheduling (the CUDA default) step() returns the outputs
    # of the step launched by the previous call while the next one runs.
    async_engine = make_engine(async_scheduling=request.param)
    async_engine.start()
    yield async_engine
    if async_engine.is_running:
        asyncio.run(async_engine.shutdown(5))


def slow_steps(engine: AsyncLLMEngine, delay_s: float) -> None:
    raw = engine.engine
    step = raw.step

    def slow_step() -> Any:
        time.sleep(delay_s)
        return step()

    raw.step = slow_step  # type: ignore[method-assign]


async def collect(engine: AsyncLLMEngine, prompt: str, request_id: str, params: SamplingParams = GREEDY) -> Any:
    last = None
    async for output in engine.generate(prompt, params, request_id):
        last = output
    return last


async def test_concurrent_requests_share_one_loop_thread(engine: AsyncLLMEngine) -> None:
    threads: set[str] = set()
    step = engine.engine.step

    def recording_step() -> Any:
        threads.add(threading.current_thread().name)
        return step()

    engine.engine.step = recording_step  # type: ignore[method-assign]
    outputs = await asyncio.gather(*(collect(engine, f"Prompt {i}", f"r{i}") for i in range(8)))
    assert all(o.finished and len(o.outputs[0].token_ids) == 8 for o in outputs)
    assert threads == {"tidal-engine-loop"}
    assert engine.snapshot.peak_running > 1 or engine.snapshot.stats.max_num_running_seen > 1


async def test_outputs_are_cumulative_and_end_finished(engine: AsyncLLMEngine) -> None:
    seen: list[int] = []
    async for output in engine.generate("Hello", GREEDY, "cumulative"):
        seen.append(len(output.outputs[0].token_ids))
    assert seen == sorted(seen) and seen[-1] == 8


async def test_bad_input_raises_before_streaming(engine: AsyncLLMEngine) -> None:
    with pytest.raises(ValueError, match="maximum context length"):
        await engine.add_request("too-long", [1] * 400, GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        slow_steps(engine, 0.02)
        stream = await engine.add_request("dup", "x", SamplingParams(max_tokens=50, ignore_eos=True))
        try:
            await engine.add_request("dup", "y", GREEDY)
        finally:
            engine.abort(stream.request_id)
    assert await collect(engine, "still fine", "after")


async def test_cancelled_consumer_aborts_request(engine: AsyncLLMEngine) -> None:
    slow_steps(engine, 0.01)
    finished: list[FinishedRequest] = []
    engine.add_finished_listener(finished.append)

    async def consume() -> None:
        async for _ in engine.generate("Talk", SamplingParams(max_tokens=200, ignore_eos=True), "cancel-me"):
            pass

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(200):
        if not engine.engine.has_unfinished_requests():
            break
        await asyncio.sleep(0.01)
    assert not engine.engine.has_unfinished_requests()
    assert engine.num_in_flight == 0
    assert [f.finish_reasons for f in finished] == [["abort"]]
    assert (await engine.get_stats()).kv_cache_usage == 0


async def test_sleep_refuses_then_wake_serves_again(engine: AsyncLLMEngine) -> None:
    before = await collect(engine, "Same answer", "before")
    await asyncio.gather(engine.sleep(2), engine.sleep(1), engine.sleep(2))  # serialised, idempotent
    assert await engine.is_sleeping()
    with pytest.raises(EngineSleepingError):
        await engine.add_request("asleep", "x", GREEDY)
    await asyncio.gather(engine.wake_up(), engine.wake_up())
    assert not await engine.is_sleeping()
    after = await collect(engine, "Same answer", "after")
    assert after.outputs[0].text == before.outputs[0].text


async def test_sleep_wait_drains_and_abort_aborts(engine: AsyncLLMEngine) -> None:
    slow_steps(engine, 0.005)
    long = SamplingParams(max_tokens=40, ignore_eos=True)
    drained = asyncio.create_task(collect(engine, "Drain me", "drain", long))
    await asyncio.sleep(0.05)
    await engine.sleep(1, "wait")
    result = await drained
    assert result.outputs[0].finish_reason == "length" and len(result.outputs[0].token_ids) == 40
    await engine.wake_up()

    aborted = asyncio.create_task(collect(engine, "Abort me", "abort", SamplingParams(max_tokens=200, ignore_eos=True)))
    await asyncio.sleep(0.05)
    await engine.sleep(1, "abort")
    result = await aborted
    assert result.finished and result.outputs[0].finish_reason == "abort"
    assert engine.engine.is_sleeping()


async def test_sleep_disabled_is_an_error() -> None:
    engine = make_engine(enable_sleep_mode=False)
    engine.start()
    try:
        with pytest.raises(ValueError, match="enable-sleep-mode"):
            await engine.sleep(1)
    finally:
        await engine.shutdown(5)


async def test_loop_death_fails_requests_and_health() -> None:
    engine = make_engine()

    def broken_step() -> Any:
        raise RuntimeError("boom")

    engine.engine.step = broken_step  # type: ignore[method-assign]
    engine.start()
    with pytest.raises(EngineDeadError):
        await collect(engine, "x", "dies")
    assert not engine.is_healthy
    with pytest.raises(EngineDeadError):
        await engine.add_request("later", "x", GREEDY)
    await engine.shutdown(1)


async def test_shutdown_drains_in_flight_requests() -> None:
    engine = make_engine()
    engine.start()
    slow_steps(engine, 0.005)
    task = asyncio.create_task(collect(engine, "Finish me", "drain", SamplingParams(max_tokens=30, ignore_eos=True)))
    await asyncio.sleep(0.05)
    await engine.shutdown(timeout_s=30)
    result = await task
    assert result.outputs[0].finish_reason == "length"
    assert not engine.is_running
    with pytest.raises((EngineShuttingDownError, EngineDeadError)):
        await engine.add_request("late", "x", GREEDY)


async def test_shutdown_timeout_aborts_the_rest() -> None:
    engine = make_engine()
    engine.start()
    slow_steps(engine, 0.02)
    task = asyncio.create_task(collect(engine, "Too long", "slow", SamplingParams(max_tokens=200, ignore_eos=True)))
    await asyncio.sleep(0.1)
    started = time.monotonic()
    await engine.shutdown(timeout_s=0.3)
    assert time.monotonic() - started < 5
    result = await task
    assert result.outputs[0].finish_reason == "abort"
