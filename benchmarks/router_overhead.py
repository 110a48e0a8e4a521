"""Router overhead: the latency `tidal router` adds over calling an engine directly, and
1,000 concurrent streaming requests through it.

    .venv/bin/python benchmarks/router_overhead.py [--requests 2000] [--streams 1000]
        [--out benchmarks/results/router_overhead.json]

Setup (three processes on this machine, all on 127.0.0.1):
- upstream: a minimal engine stand-in that answers at once: uvicorn serving a raw ASGI app
  that speaks the engine's `POST /v1/chat/completions` (a fixed chat.completion, or an SSE
  stream of 1 role chunk + 8 one-token chunks + `data: [DONE]`), with no model behind it;
- router: the real router app (`tidal_operator.router.create_app`: auth, routing, proxying,
  metrics) served by uvicorn exactly as `tidal router` serves it. Its Registry is injected
  with one LLMService and one Ready Pod pointing at the upstream, instead of being fed by a
  Kubernetes watch: the watch only fills the registry and is not on the request path;
- client: this script.

Measurements:
1. latency: sequential requests over a keep-alive connection (stdlib http.client, little
   client overhead), alternating direct → upstream and through the router (order swapped
   every other request), after a warm-up. Non-streamed and streamed (time to the end of the
   stream). `added_ms` = router percentile − direct percentile; `added_paired_ms` are the
   percentiles of (router − direct) over adjacent pairs; `added_median_per_round_ms` the
   median difference in each of 5 rounds (the machine is shared: this shows how steady it was).
2. concurrency: N streaming requests started at once through the router (aiohttp client,
   one connection each). The upstream holds every stream after its first chunk until N
   streams are open at the same time (or 60 s pass), so `peak_open_at_upstream` = N proves
   all N were in flight through the router together; then each gets its tokens and [DONE].
   An error is anything but HTTP 200 with the replica header, 10 data events and [DONE].
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "operator"))

MODEL = "bench"
KEY = "bench-client-key"
TOKENS = 8  # content chunks per stream
CHAT_BODY = {"model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}],
             "max_tokens": TOKENS, "temperature": 0}


# --- the upstream: an engine stand-in that answers at once ------------------------------------

def _completion() -> bytes:
    return json.dumps({
        "id": "chatcmpl-bench", "object": "chat.completion", "created": 0, "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Paris is the capital of France."},
                     "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 9, "completion_tokens": TOKENS, "total_tokens": 9 + TOKENS}}).encode()


def _chunk(delta: dict[str, str], finish: str | None = None) -> bytes:
    payload = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
               "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


class Upstream:
    """Raw ASGI (no framework): the least server-side time we can get from uvicorn."""

    def __init__(self) -> None:
        self.completion = _completion()
        self.first = _chunk({"role": "assistant", "content": ""})
        self.tokens = [_chunk({"content": f" t{i}"}, "length" if i == TOKENS - 1 else None) for i in range(TOKENS)]
        self.open = 0
        self.peak = 0
        self.streams = 0
        self.target = 0
        self.gate: asyncio.Event | None = None
        self.released_by = ""

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        path = scope["path"]
        if path == "/v1/chat/completions":
            request = json.loads(body)
            if request.get("stream"):
                await self._stream(send)
            else:
                await self._send(send, 200, self.completion)
        elif path == "/bench/arm":  # the next `target` streams wait until all are open at once
            arm = json.loads(body)
            self.target, self.peak, self.streams, self.released_by = int(arm["target"]), 0, 0, ""
            self.gate = asyncio.Event()
            asyncio.get_running_loop().call_later(float(arm["timeout_s"]), self._release, "timeout")
            await self._send(send, 200, b"{}")
        elif path == "/bench/stats":
            await self._send(send, 200, json.dumps({"peak_open": self.peak, "streams": self.streams,
                                                    "released_by": self.released_by}).encode())
        else:  # /health and anything else
            await self._send(send, 200, b'{"status":"ok"}')

    def _release(self, why: str) -> None:
        if self.gate is not None and not self.gate.is_set():
            self.released_by = why
            self.gate.set()

    @staticmethod
    async def _send(send: Any, status: int, body: bytes) -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def _stream(self, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": self.first, "more_body": True})
        gate = self.gate
        if gate is not None and not gate.is_set():
            self.open += 1
            self.streams += 1
            self.peak = max(self.peak, self.open)
            if self.open >= self.target:
                self._release("target")
            try:
                await gate.wait()
            finally:
                self.open -= 1
        for token in self.tokens:
            await send({"type": "http.response.body", "body": token, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


def serve_upstream(port: int) -> None:
    import uvicorn

    uvicorn.run(Upstream(), host="127.0.0.1", port=port, log_level="warning", access_log=False, lifespan="off",
                backlog=4096)


# --- the router, with an injected registry ------------------------------------------------------

def router_registry(upstream_port: int) -> Any:
    from tidal_operator import labels as L
    from tidal_operator.router import Registry

    registry = Registry()
    registry.apply_llmservice_event({"type": "ADDED", "object": {
        "apiVersion": L.API_VERSION, "kind": L.KIND, "metadata": {"name": MODEL, "namespace": "default"},
        "spec": {"model": {"uri": "bundled://smollm2-135m"}, "routing": {"strategy": "leastLoad"}}}})
    registry.apply_pod_event({"type": "ADDED", "object": {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": f"{MODEL}-0", "namespace": "default", "resourceVersion": "1",
                     "labels": {L.LLMSERVICE: MODEL, L.SLEEP_STATE: L.SLEEP_AWAKE}},
        "spec": {"containers": [{"name": "engine", "ports": [{"name": "http", "containerPort": upstream_port}]}]},
        "status": {"phase": "Running", "podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}}})
    return registry


def serve_router(port: int, upstream_port: int) -> None:
    import uvicorn

    from tidal_operator.router import RouterConfig, create_app

    app = create_app(router_registry(upstream_port), RouterConfig(api_keys=(KEY,)))
    # As run_router() serves it (tidal_operator/router/app.py), plus a backlog for the burst.
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=30, backlog=4096))
    asyncio.run(server.serve())


# --- the client ---------------------------------------------------------------------------------

def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.DEVNULL, stderr=None)


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{url}: the process exited ({proc.returncode})")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise SystemExit(f"{url} not healthy after {timeout_s}s")


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def summary(values_s: list[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values_s]
    return {"median": round(statistics.median(ms), 3), "p99": round(percentile(ms, 99), 3),
            "mean": round(statistics.fmean(ms), 3)}


class Caller:
    """One keep-alive connection; `call()` returns the seconds from send to the last byte."""

    def __init__(self, port: int, stream: bool) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        self.body = json.dumps({**CHAT_BODY, "stream": stream}).encode()
        self.headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
        self.stream = stream

    def call(self) -> float:
        start = time.perf_counter()
        self.conn.request("POST", "/v1/chat/completions", body=self.body, headers=self.headers)
        response = self.conn.getresponse()
        data = response.read()
        took = time.perf_counter() - start
        if response.status != 200 or (self.stream and not data.endswith(b"data: [DONE]\n\n")):
            raise SystemExit(f"unexpected answer {response.status}: {data[:200]!r}")
        return took


def measure_latency(upstream_port: int, router_port: int, n: int, stream: bool, warmup: int,
                    rounds: int) -> dict[str, Any]:
    """`n` pairs in `rounds` rounds; the per-round medians show how steady the machine was."""
    direct, routed = Caller(upstream_port, stream), Caller(router_port, stream)
    for _ in range(warmup):
        direct.call()
        routed.call()
    d: list[float] = []
    r: list[float] = []
    per_round: list[float] = []
    size = max(1, n // rounds)
    for i in range(size * rounds):
        if i % 2 == 0:
            d.append(direct.call())
            r.append(routed.call())
        else:
            r.append(routed.call())
            d.append(direct.call())
        if (i + 1) % size == 0:
            per_round.append(round((statistics.median(r[-size:]) - statistics.median(d[-size:])) * 1000, 3))
    ds, rs = summary(d), summary(r)
    paired = [(b - a) for a, b in zip(d, r)]
    return {"requests_each": len(d), "direct_ms": ds, "router_ms": rs,
            "added_ms": {"median": round(rs["median"] - ds["median"], 3), "p99": round(rs["p99"] - ds["p99"], 3)},
            "added_paired_ms": {"median": round(statistics.median(paired) * 1000, 3),
                                "p99": round(percentile(paired, 99) * 1000, 3)},
            "added_median_per_round_ms": per_round}


def http_json(method: str, url: str, body: Any = None, key: str | None = None) -> Any:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url, data=json.dumps(body).encode() if body is not None else None,
                                     method=method, headers=headers)
    with urllib.request.urlopen(request, timeout=30) as response:
        raw = response.read()
        return json.loads(raw) if response.headers.get_content_type() == "application/json" else raw.decode()


def router_counts(router_url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out = {"requests_200": 0.0, "requests_other": 0.0, "upstream_errors": 0.0, "retries": 0.0}
    for family in text_string_to_metric_families(http_json("GET", f"{router_url}/metrics", key=KEY)):
        for s in family.samples:
            if s.name == "tidal_router_requests_total":
                out["requests_200" if s.labels.get("status") == "200" else "requests_other"] += s.value
            elif s.name == "tidal_router_upstream_errors_total":
                out["upstream_errors"] += s.value
            elif s.name == "tidal_router_retries_total":
                out["retries"] += s.value
    return out


async def burst(router_url: str, n: int) -> tuple[list[float], list[str], float]:
    import aiohttp

    body = {**CHAT_BODY, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    errors: list[str] = []
    durations: list[float] = []

    async def one(session: aiohttp.ClientSession) -> None:
        start = time.perf_counter()
        try:
            async with session.post(f"{router_url}/v1/chat/completions", json=body, headers=headers) as response:
                data = await response.read()
                events = [line for line in data.split(b"\n") if line.startswith(b"data: ")]
                if response.status != 200:
                    errors.append(f"HTTP {response.status}: {data[:200]!r}")
                elif response.headers.get("x-tidal-replica") != f"{MODEL}-0":
                    errors.append(f"replica header {response.headers.get('x-tidal-replica')!r}")
                elif len(events) != TOKENS + 2 or events[-1] != b"data: [DONE]" or b'"error"' in data:
                    errors.append(f"incomplete stream: {len(events)} events, last {events[-1:]!r}")
                else:
                    durations.append(time.perf_counter() - start)
        except Exception as exc:  # any client-side failure counts as an error
            errors.append(repr(exc))

    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=180)) as session:
        start = time.perf_counter()
        await asyncio.gather(*(one(session) for _ in range(n)))
        wall = time.perf_counter() - start
    return durations, errors, wall


def commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True, cwd=ROOT).stdout
        return sha + ("-dirty" if dirty.strip() else "")
    except OSError:
        return "unknown"


def machine() -> dict[str, Any]:
    import httpx
    import uvicorn

    cpu_model = "unknown"
    try:
        cpu_model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                         if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem_gb = None
    try:
        mem_gb = round(int(Path("/proc/meminfo").read_text().split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    extras = []
    for name in ("uvloop", "httptools"):
        try:
            __import__(name)
            extras.append(name)
        except ImportError:
            pass
    return {"cpus": os.cpu_count(), "cpu_model": cpu_model, "memory_gb": mem_gb, "platform": platform.platform(),
            "python": platform.python_version(), "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
            "uvicorn": uvicorn.__version__, "httpx": httpx.__version__,
            "uvicorn_speedups": extras or "none (asyncio loop, h11 parser)",
            "note": "a shared machine: other jobs may run on the same cores"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="role")
    up = sub.add_parser("upstream")
    up.add_argument("--port", type=int, required=True)
    rt = sub.add_parser("router")
    rt.add_argument("--port", type=int, required=True)
    rt.add_argument("--upstream-port", type=int, required=True)
    parser.add_argument("--requests", type=int, default=2000, help="latency samples per path and mode")
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5, help="latency rounds (their medians are reported)")
    parser.add_argument("--streams", type=int, default=1000, help="concurrent streaming requests")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "router_overhead.json")
    args = parser.parse_args()
    if args.role == "upstream":
        serve_upstream(args.port)
        return
    if args.role == "router":
        serve_router(args.port, args.upstream_port)
        return

    info = machine()
    upstream_port, router_port = free_port(), free_port()
    upstream_url, router_url = f"http://127.0.0.1:{upstream_port}", f"http://127.0.0.1:{router_port}"
    procs = [spawn("upstream", "--port", str(upstream_port)),
             spawn("router", "--port", str(router_port), "--upstream-port", str(upstream_port))]
    try:
        wait_healthy(upstream_url, procs[0])
        wait_healthy(router_url, procs[1])
        latency = {mode: measure_latency(upstream_port, router_port, args.requests, stream, args.warmup, args.rounds)
                   for mode, stream in (("non_stream", False), ("stream", True))}
        print(json.dumps(latency, indent=2), flush=True)

        before = router_counts(router_url)
        http_json("POST", f"{upstream_url}/bench/arm", {"target": args.streams, "timeout_s": 60})
        durations, errors, wall = asyncio.run(burst(router_url, args.streams))
        gate = http_json("GET", f"{upstream_url}/bench/stats")
        after = router_counts(router_url)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()

    concurrency = {
        "requests": args.streams, "errors": len(errors), "error_samples": errors[:5],
        "peak_open_at_upstream": gate["peak_open"], "released_by": gate["released_by"],
        "wall_s": round(wall, 3),
        "duration_ms": summary(durations) if durations else None,
        "router_metrics_delta": {k: after[k] - before[k] for k in after},
    }
    result = {
        "benchmark": "router_overhead",
        "command": " ".join([".venv/bin/python", "benchmarks/router_overhead.py", *sys.argv[1:]]),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": commit(),
        "machine": info,
        "setup": ("3 local processes on 127.0.0.1: an engine stand-in that answers at once (uvicorn + raw ASGI "
                  "speaking POST /v1/chat/completions: a fixed chat.completion, or SSE role chunk + 8 token "
                  "chunks + [DONE]); the real router app (create_app, served by uvicorn as `tidal router` "
                  "serves it) with an injected Registry of one LLMService and one Ready Pod pointing at the "
                  "stand-in (no Kubernetes watch: it is not on the request path); this client. Latency: "
                  "sequential keep-alive requests (http.client), direct and routed alternating. Concurrency: "
                  "aiohttp, one connection per stream, all started at once; the stand-in holds each stream "
                  "after its first chunk until all are open."),
        "latency": latency,
        "concurrent_streams": concurrency,
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(concurrency, indent=2))
    if errors or gate["peak_open"] < args.streams:
        raise SystemExit(f"{len(errors)} errors; peak {gate['peak_open']} of {args.streams} streams open at once")


if __name__ == "__main__":
    main()
