"""benchmarks/serve_bench.py: its statistics on known timestamps, and the load generator
against a fake OpenAI streaming server (raw asyncio, in the test's own event loop).
Counts only: nothing here asserts a duration."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "serve_bench.py"
_spec = importlib.util.spec_from_file_location("serve_bench", _PATH)
sb = importlib.util.module_from_spec(_spec)
sys.modules["serve_bench"] = sb  # dataclasses look their module up by name
_spec.loader.exec_module(sb)


# ------------------------------------------------------------------ pure functions

def test_percentile_matches_linear_interpolation():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert sb.percentile(xs, 0) == 1.0
    assert sb.percentile(xs, 50) == 3.0
    assert sb.percentile(xs, 100) == 5.0
    assert sb.percentile(xs, 90) == pytest.approx(4.6)  # numpy.percentile([1..5], 90)
    assert sb.percentile(xs, 99) == pytest.approx(4.96)
    assert sb.percentile([7.0], 99) == 7.0
    assert sb.percentile([], 50) is None
    assert sb.percentile(list(range(101)), 37) == pytest.approx(37.0)


def test_itl_and_tpot_from_chunk_timestamps():
    times = [0.10, 0.15, 0.25, 0.30]
    assert sb.itls(times) == pytest.approx([0.05, 0.10, 0.05])
    assert sb.itls([0.1]) == []
    # 4 chunks carrying 7 tokens: TPOT counts tokens, ITL counts chunks.
    assert sb.tpot(0.10, 0.30, 7) == pytest.approx(0.20 / 6)
    assert sb.tpot(0.10, 0.10, 1) is None
    assert sb.tpot(None, 0.3, 5) is None


def test_parse_sse_line():
    assert sb.parse_sse_line(b'data: {"a": 1}\n') == {"a": 1}
    assert sb.parse_sse_line("data: [DONE]") == "[DONE]"
    assert sb.parse_sse_line("") is None
    assert sb.parse_sse_line(": keep-alive") is None
    assert sb.parse_sse_line("event: x") is None


def _chunk(text: str = "", finish: str | None = None, usage: dict | None = None, choices: bool = True) -> dict:
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish}] if choices else [], "usage": usage}


def test_feed_events_usage_counts_tokens_and_chunks_give_ttft_itl():
    r = sb.RequestResult(prompt_len=4)
    assert not sb.feed_event(r, _chunk(""), 0.05)  # empty text: neither TTFT nor a chunk
    assert not sb.feed_event(r, _chunk("a b"), 0.10)  # two tokens in one chunk
    assert not sb.feed_event(r, _chunk(" c"), 0.20)
    assert not sb.feed_event(r, _chunk(" d", finish="length"), 0.40)
    assert not sb.feed_event(r, _chunk(choices=False, usage={"prompt_tokens": 4, "completion_tokens": 4}), 0.41)
    assert sb.feed_event(r, "[DONE]", 0.42)
    sb.finish(r, 0.42)
    assert r.ok and r.error is None
    assert r.ttft == 0.10 and r.chunk_times == [0.10, 0.20, 0.40]
    assert r.output_tokens == 4 and r.usage_reported and r.finish_reason == "length"
    s = sb.summarize([r], duration=1.0, expected_output_len=4)
    assert s["completed"] == 1 and s["failed"] == 0 and s["wrong_output_len"] == 0
    assert s["output_tokens"] == 4 and s["content_chunks"] == 3 and s["tokens_per_chunk"] == pytest.approx(4 / 3)
    assert s["ttft_ms"]["p50"] == pytest.approx(100.0)
    assert s["tpot_ms"]["p50"] == pytest.approx((0.42 - 0.10) / 3 * 1e3)
    assert s["itl_ms"]["n"] == 2 and s["itl_ms"]["max"] == pytest.approx(200.0)
    assert s["e2e_ms"]["mean"] == pytest.approx(420.0)
    assert s["output_throughput"] == pytest.approx(4.0)


def test_without_usage_tokens_are_chunks_and_errors_are_counted():
    r = sb.RequestResult()
    sb.feed_event(r, _chunk("x"), 0.1)
    sb.feed_event(r, _chunk("y"), 0.2)
    sb.finish(r, 0.3)
    assert r.ok and r.output_tokens == 2 and not r.usage_reported
    bad = sb.RequestResult()
    assert sb.feed_event(bad, {"error": {"message": "engine died", "code": 500}}, 0.1)
    sb.finish(bad, 0.1)
    empty = sb.finish(sb.RequestResult(), 0.2)
    s = sb.summarize([r, bad, empty, sb.finish(sb.RequestResult(), 0.3)], duration=2.0, expected_output_len=3)
    assert s["completed"] == 1 and s["failed"] == 3
    assert s["errors"] == {"stream ended without content": 2, "engine died": 1}
    assert s["usage_missing"] == 1 and s["wrong_output_len"] == 1
    assert s["request_throughput"] == pytest.approx(0.5)


def test_prompts_are_seeded_and_in_range():
    a = sb.make_prompts(3, 50, 1000, "7:0:4")
    assert a == sb.make_prompts(3, 50, 1000, "7:0:4")
    assert a != sb.make_prompts(3, 50, 1000, "7:1:4")
    assert all(len(p) == 50 and all(100 <= t < 900 for t in p) for p in a)
    with pytest.raises(ValueError):
        sb.make_prompts(1, 1, 150, 0)


def test_sweep_plan_and_payload():
    args = sb.parse_args(["--sweep", "1,16,64", "--sweep-min-prompts", "8", "--sweep-max-prompts", "100"])
    assert sb.run_plan(args) == [(1, 8), (16, 32), (64, 100)]
    assert sb.run_plan(sb.parse_args(["--num-prompts", "9", "--max-concurrency", "3"])) == [(3, 9)]
    greedy = sb.build_payload("m", [1, 2], 8, 0.0, None, None)
    assert greedy["ignore_eos"] and greedy["stream"] and greedy["stream_options"] == {"include_usage": True}
    assert greedy["max_tokens"] == 8 and greedy["temperature"] == 0.0 and "top_p" not in greedy and "top_k" not in greedy
    sampled = sb.build_payload("m", [1], 8, 0.8, 0.95, 50, {"seed": 3})
    assert (sampled["top_p"], sampled["top_k"], sampled["seed"]) == (0.95, 50, 3)


# ------------------------------------------------------------------ a fake server

class FakeOpenAI:
    """Minimal HTTP/1.1 server: GET /v1/models and streamed POST /v1/completions, one token per
    chunk except that the first two tokens share a chunk. Prompts whose first id is in
    ``fail_ids`` get a 500, in ``hang_ids`` a stream that stalls after one chunk, in
    ``midstream_error_ids`` an error event after one chunk."""

    def __init__(self, fail_ids=(), hang_ids=(), midstream_error_ids=()) -> None:
        self.fail_ids, self.hang_ids, self.midstream_error_ids = set(fail_ids), set(hang_ids), set(midstream_error_ids)
        self.bodies: list[dict[str, Any]] = []
        self.auth: list[str | None] = []
        self.release = asyncio.Event()
        self.server: asyncio.AbstractServer | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        self.release.set()
        self.server.close()
        await self.server.wait_closed()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await self.one_request(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def one_request(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        line = await reader.readline()
        if not line:
            return False
        method, path, _ = line.decode().split(" ", 2)
        headers = {}
        while (h := await reader.readline()) not in (b"\r\n", b"\n", b""):
            k, v = h.decode().split(":", 1)
            headers[k.strip().lower()] = v.strip()
        body = await reader.readexactly(int(headers.get("content-length", 0)))
        self.auth.append(headers.get("authorization"))

        def plain(status: str, obj: Any) -> None:
            data = json.dumps(obj).encode()
            writer.write(f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(data)}\r\n\r\n".encode() + data)

        if method == "GET" and path == "/v1/models":
            plain("200 OK", {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})
            await writer.drain()
            return True
        req = json.loads(body)
        self.bodies.append(req)
        first = req["prompt"][0]
        if first in self.fail_ids:
            plain("500 Internal Server Error", {"error": {"message": "injected failure", "code": 500}})
            await writer.drain()
            return True
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")

        async def event(obj: Any) -> None:
            writer.write(b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n")
            await writer.drain()
            await asyncio.sleep(0)

        n = req["max_tokens"]
        texts = [f" t{i}" for i in range(n)]
        chunks = [texts[0] + texts[1]] + texts[2:] if n >= 2 else texts
        await event(_chunk(""))  # an empty first event: not the first token
        for i, text in enumerate(chunks):
            await event(_chunk(text, finish="length" if i == len(chunks) - 1 else None))
            if first in self.hang_ids:
                await self.release.wait()
                return False
            if first in self.midstream_error_ids:
                await event({"error": {"message": "injected mid-stream error", "code": 500}})
                await event(b"[DONE]")
                return False
        await event(_chunk(choices=False, usage={"prompt_tokens": len(req["prompt"]), "completion_tokens": n}))
        await event(b"[DONE]")
        return False  # Connection: close


def _clients() -> list[str]:
    out = ["httpx"]
    try:
        import aiohttp  # noqa: F401

        out.append("aiohttp")
    except ImportError:
        pass
    return out


@pytest.mark.parametrize("client", _clients())
async def test_load_against_fake_server_counts_everything(client, tmp_path):
    num, conc, in_len, out_len = 12, 4, 8, 5
    prompts = sb.make_prompts(num, in_len, 1000, f"3:0:{conc}")  # what run 0 of seed 3 sends
    fake = FakeOpenAI(fail_ids=[prompts[2][0]], hang_ids=[prompts[5][0]], midstream_error_ids=[prompts[7][0]])
    assert len({p[0] for p in prompts}) == num  # the first ids pick out single prompts
    base = await fake.start()
    try:
        out = tmp_path / "res.json"
        args = sb.parse_args([
            "--base-url", base, "--input-len", str(in_len), "--output-len", str(out_len),
            "--num-prompts", str(num), "--max-concurrency", str(conc), "--vocab-size", "1000", "--seed", "3",
            "--num-warmup", "2", "--warmup-output-len", "3", "--request-timeout", "1.0", "--client", client,
            "--api-key", "sekret", "--temperature", "0.8", "--top-p", "0.95", "--top-k", "50",
            "--save-requests", "--out", str(out),
        ])
        report = await sb.bench(args, log=lambda s: None)
    finally:
        await fake.stop()

    assert "error" not in report and report["model"] == "fake-model"
    assert report["parameters"]["api_key"] == "***" and "sekret" not in json.dumps(report)
    assert set(fake.auth) == {"Bearer sekret"}
    assert report["warmup"]["completed"] == 2
    warm, timed = fake.bodies[:2], fake.bodies[2:]
    assert [b["max_tokens"] for b in warm] == [3, 3]
    assert len(timed) == num and sorted(b["prompt"] for b in timed) == sorted(prompts)
    assert all(b["top_k"] == 50 and b["top_p"] == 0.95 and b["temperature"] == 0.8 and b["ignore_eos"]
               and b["model"] == "fake-model" for b in fake.bodies)

    (run,) = report["runs"]
    assert run["requests"] == num and run["completed"] == num - 3 and run["failed"] == 3
    errors = run["errors"]
    assert sum(errors.values()) == 3
    assert any("HTTP 500" in e and "injected failure" in e for e in errors)
    assert any("timeout" in e for e in errors)
    assert "injected mid-stream error" in errors
    assert run["output_tokens"] == (num - 3) * out_len and run["wrong_output_len"] == 0 and run["usage_missing"] == 0
    assert run["content_chunks"] == (num - 3) * (out_len - 1)
    assert run["tokens_per_chunk"] == pytest.approx(out_len / (out_len - 1))
    assert run["ttft_ms"]["n"] == num - 3 and run["tpot_ms"]["n"] == num - 3
    assert run["itl_ms"]["n"] == (num - 3) * (out_len - 2)
    assert 1 <= run["max_in_flight"] <= conc
    per = run["per_request"]
    assert len(per) == num and [r["ok"] for r in per].count(False) == 3
    assert not per[2]["ok"] and not per[5]["ok"] and not per[7]["ok"]


@contextmanager
def fake_in_thread(**kwargs: Any):
    """A FakeOpenAI on an event loop of its own thread, for code that runs its own loop."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    fake = FakeOpenAI(**kwargs)
    base = asyncio.run_coroutine_threadsafe(fake.start(), loop).result(10)
    try:
        yield fake, base
    finally:
        asyncio.run_coroutine_threadsafe(fake.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_main_sweep_writes_json_and_table(tmp_path, capsys):
    out = tmp_path / "sweep.json"
    with fake_in_thread() as (fake, base):
        rc = sb.main(["--base-url", base, "--model", "m", "--input-len", "4", "--output-len", "3", "--sweep", "1,2",
                      "--sweep-min-prompts", "3", "--num-warmup", "0", "--out", str(out), "--label", "t"])
    assert rc == 0
    report = json.loads(out.read_text())
    assert [(r["concurrency"], r["requests"], r["completed"]) for r in report["runs"]] == [(1, 3, 3), (2, 4, 4)]
    assert report["date_utc"].endswith("Z") and report["base_url"] == base and report["label"] == "t"
    assert report["parameters"]["sweep"] == "1,2" and "serve_bench" in report["command"]
    # Each run draws its own prompts: no prefix shared between runs.
    prompts = [tuple(b["prompt"]) for b in fake.bodies]
    assert len(set(prompts)) == len(prompts) == 7
    table = capsys.readouterr().out
    assert "out tok/s" in table and "TPOT p50/p90/p99 ms" in table


def test_main_exit_code_on_failures(tmp_path):
    prompts = sb.make_prompts(2, 4, 32000, "0:0:2")
    with fake_in_thread(fail_ids=[prompts[0][0]]) as (_fake, base):
        rc = sb.main(["--base-url", base, "--input-len", "4", "--output-len", "3", "--num-prompts", "2",
                      "--max-concurrency", "2", "--num-warmup", "0", "--out", str(tmp_path / "r.json")])
    assert rc == 1
    (run,) = json.loads((tmp_path / "r.json").read_text())["runs"]
    assert (run["completed"], run["failed"]) == (1, 1)


async def test_unreachable_server_is_a_clean_error():
    args = sb.parse_args(["--base-url", "http://127.0.0.1:9", "--num-prompts", "2", "--max-concurrency", "2",
                          "--num-warmup", "0", "--client", "httpx", "--model", "m", "--input-len", "4"])
    report = await sb.bench(args, log=lambda s: None)
    (run,) = report["runs"]
    assert run["failed"] == 2 and run["completed"] == 0 and run["output_throughput"] == 0.0
    args.model = None  # model discovery fails first: a report-level error, no runs
    report = await sb.bench(args, log=lambda s: None)
    assert "error" in report and report["runs"] == []
