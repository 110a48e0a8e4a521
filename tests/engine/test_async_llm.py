"""AsyncLLM against a real engine-core process (ZeroMQ, msgpack), with the scripted worker.

The core process is the real one (launcher.start_engine_core → core_proc); only the model
is replaced by ``ScriptedExecutor``, so these tests exercise the process split itself:
acks and refusals, deltas → outputs, two API-server clients on one core, stop strings
ended from the API server side, aborts, sleep, and the death of the core.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from scripted_executor import expected_tokens  # noqa: E402
from tiny_models import make_tiny_model  # noqa: E402
from tiny_tokenizer import EOS_ID, save_byte_tokenizer  # noqa: E402

from tidal_engine.config import EngineConfig  # noqa: E402
from tidal_engine.engine.async_engine import EngineDeadError, EngineSleepingError  # noqa: E402
from tidal_engine.engine.async_llm import AsyncLLM  # noqa: E402
from tidal_engine.engine.core_proc import CoreAddresses  # noqa: E402
from tidal_engine.lora.adapter import LoRAError  # noqa: E402
from tidal_engine.models.loader import resolve_model  # noqa: E402
from tidal_engine.sampling_params import SamplingParams  # noqa: E402
from tidal_engine.server.launcher import EngineStartError, start_engine_core  # noqa: E402

PROMPT = [101, 102, 103, 104, 105]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-async-llm")
    make_tiny_model("qwen3", folder, eos_token_id=EOS_ID, bos_token_id=None, max_position_embeddings=256)
    save_byte_tokenizer(folder, vocab_size=1000)
    return folder


class Split:
    """One core process and ``clients`` AsyncLLM front ends, as `serve --api-server-count N` builds them."""

    def __init__(self, model_dir: Path, clients: int = 1, executor: str = "ScriptedExecutor") -> None:
        self.workdir = tempfile.mkdtemp(prefix="tidal-split-test-")
        self.addresses = CoreAddresses(f"ipc://{self.workdir}/in", [f"ipc://{self.workdir}/out{i}" for i in range(clients)])
        self.config = EngineConfig(model=str(model_dir), device="cpu", dtype="float32", max_model_len=128,
                                   enable_sleep_mode=True, distributed_executor_backend=f"scripted_executor:{executor}")
        self.process, info = start_engine_core(self.config, self.addresses)
        tokenizer = resolve_model(str(model_dir)).load_tokenizer()
        self.clients = [AsyncLLM(tokenizer, info, self.addresses, i, enable_sleep_mode=True,
                                 core_process=self.process if i == 0 else None) for i in range(clients)]

    def start(self) -> None:
        for client in self.clients:
            client.start()

    async def stop(self) -> None:
        for client in reversed(self.clients):
            await client.shutdown(5)
        if self.process.is_alive():
            self.process.kill()
        self.process.join(10)


@pytest.fixture()
async def split(model_dir: Path) -> AsyncIterator[Split]:
    live = Split(model_dir, clients=2)
    live.start()
    yield live
    await live.stop()


async def final(client: AsyncLLM, request_id: str, prompt: Any = PROMPT, params: SamplingParams = GREEDY) -> Any:
    last = None
    async for output in client.generate(prompt, params, request_id):
        last = output
    return last


async def test_two_api_servers_share_one_core(split: Split) -> None:
    a, b = split.clients
    prompts = {f"r{i}": [100 + i, 200 + i, 300 + i] for i in range(8)}
    results = await asyncio.gather(*(final(a if i % 2 else b, rid, p) for i, (rid, p) in enumerate(prompts.items())))
    for output, (rid, prompt) in zip(results, prompts.items()):
        assert output.request_id == rid and output.finished
        assert output.outputs[0].token_ids == expected_tokens(prompt, 12)
        assert output.outputs[0].finish_reason == "length"
    stats = await a.get_stats()
    assert stats.generation_tokens_total == 8 * 12
    assert a.num_in_flight == b.num_in_flight == 0


async def test_outputs_are_cumulative_and_n_samples_fan_out(split: Split) -> None:
    # Samples 1 and 2 start a step after sample 0 (they share its cached prompt) and end
    # together, in one step: both final deltas must reach the API server.
    seen: list[int] = []
    async for output in split.clients[0].generate(PROMPT, SamplingParams(n=3, temperature=0, max_tokens=6, ignore_eos=True), "n3"):
        seen.append(len(output.outputs[0].token_ids))
    assert seen == sorted(seen) and seen[-1] == 6
    assert [o.token_ids for o in output.outputs] == [expected_tokens(PROMPT, 6)] * 3
    assert [o.finish_reason for o in output.outputs] == ["length"] * 3


async def test_bad_input_is_refused_before_streaming(split: Split) -> None:
    client = split.clients[0]
    with pytest.raises(ValueError, match="out of the vocabulary"):
        await client.add_request("bad", [5000], GREEDY)
    with pytest.raises(ValueError, match="maximum context length"):
        await client.add_request("long", list(range(100, 300)), GREEDY)
    # Found in the core (which knows the adapters): the same exception type and status come back.
    with pytest.raises(LoRAError, match="does not exist") as unknown:
        await client.add_request("adapter", PROMPT, GREEDY, lora_name="nope")
    assert unknown.value.status == 404
    assert (await final(client, "fine")).finished  # the engine keeps serving


async def test_stop_string_ends_the_sample_and_the_core_forgets_it(split: Split) -> None:
    client = split.clients[0]
    text = client.tokenizer.decode(expected_tokens(PROMPT, 12))
    stop = text[5:7]
    output = await final(client, "stop", PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]))
    assert output.outputs[0].finish_reason == "stop" and output.outputs[0].stop_reason == stop
    assert output.outputs[0].text == text[: text.index(stop)]
    stats = await client.get_stats()
    assert stats.num_running == 0 and stats.num_waiting == 0


async def test_a_consumer_that_leaves_aborts_its_request(model_dir: Path) -> None:
    live = Split(model_dir, executor="SlowScriptedExecutor")
    live.start()
    try:
        client = live.clients[0]
        stream = await client.add_request("leaver", PROMPT, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
        outputs = client.iterate(stream)
        async for _ in outputs:
            break  # the consumer goes away after its first output...
        await outputs.aclose()  # ...and its generator is closed (as a cancelled handler's is)
        assert client.num_in_flight == 0
        for _ in range(200):
            stats = await client.get_stats()
            if stats.num_running == 0:
                break
        assert stats.num_running == 0 and stats.num_waiting == 0
    finally:
        await live.stop()


async def test_sleep_refuses_new_requests_on_every_client(split: Split) -> None:
    a, b = split.clients
    await a.sleep(1)
    assert await a.is_sleeping()
    assert await b.is_sleeping()  # asked of the core, not of b's (possibly older) snapshot
    with pytest.raises(EngineSleepingError):
        await a.add_request("zz", PROMPT, GREEDY)
    with pytest.raises(EngineSleepingError):  # the other API server's snapshot says so, or the core refuses
        await b.add_request("zz2", PROMPT, GREEDY)
    await a.wake_up()
    assert not await a.is_sleeping()
    assert not await b.is_sleeping()
    assert (await final(b, "after")).finished


async def test_a_killed_core_fails_waiting_requests_and_health(model_dir: Path) -> None:
    live = Split(model_dir, clients=2, executor="SlowScriptedExecutor")
    live.start()
    died: list[BaseException] = []
    live.clients[0].on_dead = died.append
    try:
        client = live.clients[0]
        stream = await client.add_request("victim", PROMPT, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
        other = await live.clients[1].add_request("victim2", PROMPT, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
        assert live.process.pid is not None
        os.kill(live.process.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            async for _ in client.iterate(stream):
                pass
        with pytest.raises(EngineDeadError):  # the API server that does not own the core notices too
            async for _ in live.clients[1].iterate(other):
                pass
        assert not client.is_healthy and not live.clients[1].is_healthy
        assert died and isinstance(died[0], EngineDeadError)
        with pytest.raises(EngineDeadError):
            await client.add_request("late", PROMPT, GREEDY)
    finally:
        await live.stop()


def test_a_core_that_cannot_start_says_why(model_dir: Path) -> None:
    config = EngineConfig(model=str(model_dir), device="cpu", max_model_len=100000)
    workdir = tempfile.mkdtemp(prefix="tidal-split-test-")
    with pytest.raises(EngineStartError, match="max_model_len"):
        start_engine_core(config, CoreAddresses(f"ipc://{workdir}/in", [f"ipc://{workdir}/out0"]))


async def test_stats_are_fresh_when_the_last_answer_arrives(split: Split) -> None:
    # The step that leaves the core idle sends its stats with the last deltas: /metrics (which
    # reads the snapshot) shows no running request and no KV in use as soon as the answer is in.
    client = split.clients[0]
    await final(client, "warm")
    for i in range(3):
        output = await final(client, f"fresh{i}", [100 + i] * 40)
        assert output.finished
        stats = client.snapshot.stats
        assert stats.num_running == 0 and stats.num_waiting == 0
        assert stats.kv_cache_usage == 0.0
        assert stats.generation_tokens_total == 12 * (i + 2)
