"""Replica picking under skewed load: p50/p99 latency of least-load and prefix-hash as they
were (this router's own counts only) against the same strategies reading the engines' load.

    .venv/bin/python benchmarks/router_picking.py [--requests 600] [--clients 6] [--background 6]
        [--out benchmarks/results/router_picking.json]

Setup (one process, one asyncio loop, everything on 127.0.0.1):
- two engine stand-ins (benchmarks/queue_engine.py), each a raw ASGI app served by uvicorn,
  modelled as a queue: `--slots` requests run at once, each for `--service-ms`; the rest wait
  in FIFO order, so a request's latency rises with the queue depth it finds. /metrics reports
  what a real engine reports (tidal:num_requests_running, tidal:num_requests_waiting,
  tidal:kv_cache_usage_perc = the running share of the slots);
- the real router app (create_app, served by uvicorn as `tidal router` serves it) with an
  injected Registry: one LLMService, two Ready Pods pointing at the stand-ins;
- skew: `--background` closed-loop clients send straight to replica 0 the whole time (what
  another router replica's or a direct client's traffic looks like to this router: load it
  cannot count itself);
- measured: `--clients` closed-loop clients through the router, `--requests` requests in all
  per arm, each with one of 8 system prompts (so prefixHash has prefixes to keep together).

Arms (a fresh router app each, same engines): leastLoad and prefixHash with
engine_load_interval_s=0 (the picker before this change: this router's outstanding requests
only), then both with the engines' /metrics read every `--interval` seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, AsyncIterator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "operator"))

import httpx  # noqa: E402
import uvicorn  # noqa: E402

from queue_engine import QueueEngine  # noqa: E402  (this directory is on sys.path when run as a script)

MODEL = "bench"
KEY = "bench-client-key"
PROMPTS = [f"You are assistant number {i}. " * 12 for i in range(8)]


@contextlib.asynccontextmanager
async def serve(app: Any) -> AsyncIterator[int]:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", access_log=False))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        await task
        sock.close()


def router_app(ports: list[int], strategy: str, interval_s: float) -> Any:
    from tidal_operator import labels as L
    from tidal_operator.router import Registry, RouterConfig, create_app

    registry = Registry()
    registry.apply_llmservice_event({"type": "ADDED", "object": {
        "metadata": {"name": MODEL, "namespace": "bench"},
        "spec": {"model": {"uri": "bundled://x"}, "routing": {"strategy": strategy}}}})
    for i, port in enumerate(ports):
        registry.apply_pod_event({"type": "ADDED", "object": {
            "metadata": {"name": f"{MODEL}-{i}", "namespace": "bench", "resourceVersion": "1",
                         "labels": {L.LLMSERVICE: MODEL}},
            "spec": {"containers": [{"name": "engine", "ports": [{"name": "http", "containerPort": port}]}]},
            "status": {"phase": "Running", "podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}}})
    return create_app(registry, RouterConfig(api_keys=(KEY,), engine_load_interval_s=interval_s))


async def background(url: str, stop: asyncio.Event, model: str = MODEL) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        while not stop.is_set():
            await client.post("/v1/chat/completions", json={"model": model, "messages": []})


async def measured(url: str, clients: int, requests: int, model: str = MODEL) -> tuple[list[float], Counter[str]]:
    """`clients` closed-loop clients through the router, `requests` in all; (latencies in ms,
    requests per replica as the router's x-tidal-replica header names it)."""
    latencies: list[float] = []
    replicas: Counter[str] = Counter()
    sent = 0

    async def client_loop(index: int) -> None:
        nonlocal sent
        async with httpx.AsyncClient(base_url=url, timeout=60, headers={"authorization": f"Bearer {KEY}"}) as c:
            while sent < requests:
                sent += 1
                body = {"model": model, "messages": [{"role": "system", "content": PROMPTS[sent % len(PROMPTS)]},
                                                     {"role": "user", "content": f"question {sent}"}]}
                start = time.perf_counter()
                r = await c.post("/v1/chat/completions", json=body)
                latencies.append((time.perf_counter() - start) * 1000)
                r.raise_for_status()
                replicas[r.headers["x-tidal-replica"]] += 1

    await asyncio.gather(*(client_loop(i) for i in range(clients)))
    return latencies, replicas


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    engines = [QueueEngine("replica-0", args.slots, args.service_ms / 1000),
               QueueEngine("replica-1", args.slots, args.service_ms / 1000)]
    arms = [("leastLoad (own counts only, before)", "leastLoad", 0.0),
            ("prefixHash (own counts only, before)", "prefixHash", 0.0),
            ("leastLoad + engine load (new scorer)", "leastLoad", args.interval),
            ("prefixHash + engine load (new scorer, prefix affinity)", "prefixHash", args.interval)]
    out: dict[str, Any] = {}
    async with contextlib.AsyncExitStack() as stack:
        ports = [await stack.enter_async_context(serve(e)) for e in engines]
        for label, strategy, interval in arms * args.rounds:
            stop = asyncio.Event()
            noise = [asyncio.create_task(background(f"http://127.0.0.1:{ports[0]}", stop))
                     for _ in range(args.background)]
            async with serve(router_app(ports, strategy, interval)) as router_port:
                await asyncio.sleep(0.5)  # the background queue builds up (and the scorer reads it once)
                latencies, replicas = await measured(f"http://127.0.0.1:{router_port}", args.clients, args.requests)
            stop.set()
            await asyncio.gather(*noise)
            arm = out.setdefault(label, {"strategy": strategy, "engine_load_interval_s": interval,
                                         "latencies": [], "replicas": Counter()})
            arm["latencies"] += latencies
            arm["replicas"].update(replicas)
            print(f"{label}: p50 {percentile(latencies, 50):.1f} ms, p99 {percentile(latencies, 99):.1f} ms, "
                  f"{dict(replicas)}", flush=True)
    return summarize_arms(out)


def summarize_arms(out: dict[str, Any]) -> dict[str, Any]:
    """Each arm's latencies (ms) → requests, p50/p90/p99, mean; replica counts sorted."""
    for arm in out.values():
        lat = arm.pop("latencies")
        arm.update(requests=len(lat), p50_ms=round(percentile(lat, 50), 1), p90_ms=round(percentile(lat, 90), 1),
                   p99_ms=round(percentile(lat, 99), 1), mean_ms=round(statistics.fmean(lat), 1),
                   replicas=dict(sorted(arm["replicas"].items())))
    return out


def commit() -> str:
    sha = os.environ.get("TIDAL_COMMIT")
    if sha:
        return sha
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    except OSError:
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=600, help="measured requests per arm and round")
    parser.add_argument("--clients", type=int, default=6, help="concurrent clients through the router")
    parser.add_argument("--background", type=int, default=6, help="concurrent clients straight to replica 0")
    parser.add_argument("--slots", type=int, default=4, help="requests an engine runs at once")
    parser.add_argument("--service-ms", type=float, default=200.0, help="time one request runs")
    parser.add_argument("--interval", type=float, default=0.1, help="engine /metrics interval of the scorer arms")
    parser.add_argument("--rounds", type=int, default=2, help="each arm runs this many times, interleaved")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "router_picking.json")
    args = parser.parse_args()
    load_start = [round(x, 2) for x in os.getloadavg()]
    arms = asyncio.run(run(args))
    result = {
        "benchmark": "router_picking",
        "command": " ".join([".venv/bin/python", "benchmarks/router_picking.py", *sys.argv[1:]]),
        "date": os.environ.get("TIDAL_BENCH_DATE") or datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": commit(),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "load_average_at_start": load_start, "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
                    "note": "a shared machine: other jobs may run on the same cores"},
        "setup": {k: v for k, v in vars(args).items() if k != "out"},
        "arms": arms,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(arms, indent=2))


if __name__ == "__main__":
    main()
