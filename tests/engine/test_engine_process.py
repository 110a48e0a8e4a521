"""The served path's process split: API server(s) and the engine core in their own processes.

`tidal-engine serve` runs here as a real subprocess (the tiny random Llama with SmolLM2's
tokenizer, so it starts in seconds) and is driven with the `openai` client. Its greedy
answers must equal the offline engine's (which runs the core in-process), with two API
servers, n > 1, logprobs, structured outputs and LoRA. Then the failure cases: a dead
engine core fails requests and /health and ends the server; a SIGKILLed server leaves
no process behind.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from test_lora_server import adapter_root  # noqa: E402
from test_server_support import free_port, tiny_model_dir, wait_for_health, wait_until  # noqa: E402

from tidal_engine import LLM, SamplingParams  # noqa: E402
from tidal_engine.server.metrics import metric_value  # noqa: E402

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "One, two, three,", "def fibonacci(n):", "Once upon a time"]


def engine_command(*extra: str) -> list[str]:
    script = Path(sys.executable).parent / "tidal-engine"
    base = [str(script)] if script.exists() else [shutil.which("tidal-engine") or "tidal-engine"]
    return base + ["serve", tiny_model_dir(), "--served-model-name", "tiny", "--dtype", "float32", "--device", "cpu",
                   "--kv-cache-memory-bytes", "16M", "--max-num-seqs", "64", *extra]


class Served:
    """`tidal-engine serve` in a subprocess of its own process group."""

    def __init__(self, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"tidal-split-{self.port}.log"
        self.log = open(self.log_path, "w+b")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        env.pop("TIDAL_API_KEY", None)
        self.process = subprocess.Popen(engine_command(*extra, "--port", str(self.port)), env=env,
                                        stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_for_health(self.url, 240, self.process)
        except Exception:
            self.stop()
            raise RuntimeError(f"server failed to start:\n{self.output()[-4000:]}") from None

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.log.close()


def processes_in_group(pgid: int) -> dict[int, str]:
    """pid → command line (what `ps` shows, titles included) of the live processes in a group."""
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            fields = stat[stat.rfind(")") + 2 :].split()
            if fields[0] == "Z" or int(fields[2]) != pgid:
                continue
            found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except (OSError, ValueError, IndexError):
            continue
    return found


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(model=tiny_model_dir(), dtype="float32", device="cpu", kv_cache_memory_bytes=16 << 20,
               enable_lora=True, max_lora_rank=8, lora_modules={"good": str(adapter_root() / "good")})


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    live = Served("--api-server-count", "2", "--enable-lora", "--max-lora-rank", "8",
                  "--lora-modules", f"good={adapter_root() / 'good'}", "--enable-sleep-mode")
    yield live
    live.stop()


def test_ps_shows_the_api_servers_and_the_engine_core(served: Served) -> None:
    titles = list(processes_in_group(served.process.pid).values())
    assert any("tidal-engine: engine-core" in t for t in titles), titles
    assert any("tidal-engine: api-server 0" in t for t in titles), titles
    assert any("tidal-engine: api-server 1" in t for t in titles), titles
    assert any("tidal-engine: api-server-manager" in t for t in titles), titles


def test_plain_and_streamed_equal_the_offline_engine(served: Served, offline: LLM) -> None:
    client = served.client()
    for prompt in PROMPTS:
        expected = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
        plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True})
        streamed = "".join(
            c.choices[0].text
            for c in client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                               extra_body={"ignore_eos": True})
            if c.choices
        )
        assert plain.choices[0].text == expected.outputs[0].text == streamed
        assert plain.usage.completion_tokens == 12


def test_n_and_logprobs_equal_the_offline_engine(served: Served, offline: LLM) -> None:
    params = SamplingParams(n=3, temperature=0.9, seed=7, max_tokens=10, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    expected = offline.generate([PROMPTS[0]], params)[0]
    answer = served.client().completions.create(model="tiny", prompt=PROMPTS[0], n=3, temperature=0.9, seed=7,
                                                max_tokens=10, logprobs=2,
                                                extra_body={"ignore_eos": True, "prompt_logprobs": 1})
    got = sorted(answer.choices, key=lambda c: c.index)
    # The prompt's logprobs cross the core/API-server split too (with sample 0's first token).
    assert expected.prompt_logprobs is not None
    served_prompt = got[0].model_extra["prompt_logprobs"]
    assert len(served_prompt) == len(expected.prompt_logprobs) and served_prompt[0] is None
    for entry, position, token in zip(served_prompt[1:], expected.prompt_logprobs[1:], expected.prompt_token_ids[1:]):
        assert entry[str(token)]["logprob"] == pytest.approx(position[token].logprob, abs=1e-4)
    assert [c.text for c in got] == [o.text for o in expected.outputs]
    for choice, output in zip(got, expected.outputs):
        assert choice.logprobs is not None and len(choice.logprobs.token_logprobs) == 10
        want = [pos[tid].logprob for pos, tid in zip(output.logprobs, output.token_ids)]
        assert choice.logprobs.token_logprobs == pytest.approx(want, abs=1e-4)
        assert all(len(top) >= 2 for top in choice.logprobs.top_logprobs)


def test_structured_output_through_the_split(served: Served) -> None:
    answer = served.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "yes or no?"}], max_tokens=8, temperature=0,
        extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}},
    )
    assert answer.choices[0].message.content in {"yes", "no", "maybe"}


def test_lora_answers_equal_the_offline_engine(served: Served, offline: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    with_adapter = offline.generate([PROMPTS[1]], params, lora_name="good")[0].outputs[0].text
    base = offline.generate([PROMPTS[1]], params)[0].outputs[0].text
    client = served.client()
    served_adapter = client.completions.create(model="good", prompt=PROMPTS[1], max_tokens=10, temperature=0,
                                               extra_body={"ignore_eos": True}).choices[0].text
    assert served_adapter == with_adapter
    assert with_adapter != base
    assert "good" in [m.id for m in client.models.list().data]


def test_stop_string_ends_the_sample_in_the_api_server(served: Served, offline: LLM) -> None:
    full = offline.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].outputs[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert stop.strip(), full
    answer = served.client().completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=16, temperature=0,
                                                stop=[stop], extra_body={"ignore_eos": True})
    assert answer.choices[0].finish_reason == "stop"
    assert answer.choices[0].text == full[: full.index(stop)]


def test_64_concurrent_streams_all_finish(served: Served) -> None:
    client = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=300)

    async def one(i: int) -> int:
        tokens = 0
        stream = await client.completions.create(model="tiny", prompt=f"{PROMPTS[i % 4]} {i}", max_tokens=16,
                                                 temperature=0.8, seed=i, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        finish = None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        assert finish == "length"
        return tokens

    async def run() -> list[int]:
        try:
            return await asyncio.gather(*(one(i) for i in range(64)))
        finally:
            await client.close()

    assert asyncio.run(run()) == [16] * 64
    # Each API server records the requests it served; the engine's counters come from the core.
    text = httpx.get(f"{served.url}/metrics", timeout=10).text
    assert (metric_value(text, "tidal:e2e_request_latency_seconds_count", model_name="tiny") or 0) > 0
    assert (metric_value(text, "tidal:time_to_first_token_seconds_count", model_name="tiny") or 0) > 0
    assert (metric_value(text, "tidal:generation_tokens_total", model_name="tiny") or 0) >= 64 * 16


def test_sleep_through_one_api_server_refuses_on_both(served: Served) -> None:
    client = served.client()
    assert httpx.post(f"{served.url}/sleep?level=1", timeout=60).status_code == 200
    # Both API servers learn the state from the core (each answers some connections).
    for _ in range(4):
        with httpx.Client() as fresh:
            assert fresh.get(f"{served.url}/is_sleeping", timeout=10).json()["is_sleeping"] is True
    with pytest.raises(openai.APIStatusError) as refused:
        client.completions.create(model="tiny", prompt="hi", max_tokens=2)
    assert refused.value.status_code == 503
    assert httpx.post(f"{served.url}/wake_up", timeout=60).status_code == 200
    assert wait_until(lambda: httpx.get(f"{served.url}/is_sleeping", timeout=10).json()["is_sleeping"] is False, 10)
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=2).usage.completion_tokens == 2


def test_bad_input_is_a_400_through_the_split(served: Served) -> None:
    client = served.client()
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt=[10**9], max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x" * 50, max_tokens=2,
                                  extra_body={"structured_outputs": {"regex": "("}})
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=2).usage.completion_tokens == 2


def core_pid(server: Served) -> int:
    pids = [pid for pid, cmd in processes_in_group(server.process.pid).items() if "tidal-engine: engine-core" in cmd]
    assert len(pids) == 1, processes_in_group(server.process.pid)
    return pids[0]


def test_a_dead_engine_core_fails_requests_and_health_then_the_server_exits() -> None:
    server = Served()
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
        stream = client.completions.create(model="tiny", prompt="hello", max_tokens=200, stream=True,
                                           extra_body={"ignore_eos": True, "min_tokens": 200})
        first = next(iter(stream))  # the request is in flight now
        assert first is not None
        os.kill(core_pid(server), signal.SIGKILL)
        with pytest.raises((openai.APIError, httpx.HTTPError)) as failed:
            for _ in stream:
                pass
        assert "engine" in str(failed.value).lower() or isinstance(failed.value, (openai.APIError, httpx.HTTPError))
        # /health fails (503 while it exits, then nothing listens) and the process ends non-zero.
        def health_fails() -> bool:
            try:
                return httpx.get(f"{server.url}/health", timeout=2).status_code == 503
            except httpx.HTTPError:
                return True

        assert wait_until(health_fails, 30)
        assert server.process.wait(60) != 0
        assert "engine core" in server.output()
    finally:
        server.stop()


def test_sigkill_of_the_main_process_leaves_no_child_behind() -> None:
    server = Served("--api-server-count", "2")
    group = server.process.pid
    try:
        children = set(processes_in_group(group)) - {group}
        assert len(children) >= 3  # the core and two API servers (plus multiprocessing helpers)
        os.kill(group, signal.SIGKILL)
        server.process.wait(30)
        assert wait_until(lambda: not processes_in_group(group), 30), processes_in_group(group)
    finally:
        server.stop()
