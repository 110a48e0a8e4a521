"""Replica picking under skewed load, in `tidal dev`: p50/p99 latency of least-load and
prefix-hash as they were (this router's own counts only) against the new scorer (the same
strategies reading the engines' own load from /metrics), at 2 replicas.

    .venv/bin/python benchmarks/router_picking_dev.py [--requests 600] [--rounds 2]
        [--out benchmarks/results/router_picking_dev.json]

Setup, all on this machine (CPU only):
- `tidal dev up --no-router --engine-command "<python> benchmarks/queue_engine.py --slots S
  --service-ms T"`: the emulated API server, the local kubelet and the operator. The operator
  makes the engine Pods as for any LLMService; the kubelet runs the queue-model stand-in
  (benchmarks/queue_engine.py: `--slots` requests at once, each `--service-ms`, the rest
  FIFO, so latency rises with queue depth; /metrics as a real engine) in place of
  `tidal-engine`, each Pod on its own 127.0.0.N with probes;
- two LLMServices of 2 replicas each: `bench-ll` (routing leastLoad) and `bench-ph`
  (prefixHash);
- per arm, a fresh `tidal router` process (`--kubeconfig` of the stack: it lists and watches
  the LLMServices and Pods as in a cluster), with `--engine-load-interval 0` (the picker before
  the change: its own outstanding requests only) or the default (the new scorer);
- skew: `--background` closed-loop clients send straight to replica 0's Pod IP the whole time
  (load this router cannot count itself: another router replica's or a direct client's);
- measured: `--clients` closed-loop clients through the router, `--requests` per arm and
  round, each with one of 8 system prompts (prefixHash has prefixes to keep together).
Arms are interleaved over `--rounds`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "operator"))

import httpx  # noqa: E402

from router_picking import KEY, background, commit, measured, percentile, summarize_arms  # noqa: E402

MODELS = {"bench-ll": "leastLoad", "bench-ph": "prefixHash"}


def manifest() -> str:
    docs = [{"apiVersion": "tidal.dev/v1alpha1", "kind": "LLMService", "metadata": {"name": name},
             "spec": {"model": {"uri": "bundled://smollm2-135m"}, "replicas": 2, "routing": {"strategy": strategy}}}
            for name, strategy in MODELS.items()]
    return "\n---\n".join(json.dumps(d) for d in docs)


def tidal_dev(state: Path, *args: str, timeout: float = 300) -> None:
    subprocess.run([sys.executable, "-m", "tidal_operator.cli", "dev", "--state-dir", str(state), *args],
                   cwd=ROOT, check=True, timeout=timeout, stdout=subprocess.DEVNULL)


def replica_urls(api: str, model: str) -> list[tuple[str, str]]:
    """(Pod name, URL) of the model's Ready Pods, by name."""
    url = f"{api}/api/v1/namespaces/default/pods?labelSelector=tidal.dev/llmservice={model}"
    with urllib.request.urlopen(url, timeout=10) as response:
        pods = json.loads(response.read())["items"]
    ready = [p for p in pods if any(c["type"] == "Ready" and c["status"] == "True"
                                    for c in (p.get("status") or {}).get("conditions") or [])]
    return sorted((p["metadata"]["name"], f"http://{p['status']['podIP']}:8000") for p in ready)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_router(state: Path, port: int, interval: float | None) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "tidal_operator.cli", "router", "--kubeconfig", str(state / "kubeconfig"),
            "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    if interval is not None:
        argv += ["--engine-load-interval", str(interval)]
    return subprocess.Popen(argv, cwd=ROOT, env={**os.environ, "TIDAL_ROUTER_API_KEY": KEY})


def wait_routable(url: str, model: str, timeout_s: float = 60) -> None:
    """The router is ready and lists the model (its watches have listed the cluster)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ready = httpx.get(f"{url}/ready", timeout=2).status_code == 200
            models = httpx.get(f"{url}/v1/models", headers={"authorization": f"Bearer {KEY}"}, timeout=2)
            if ready and model in {m["id"] for m in models.json().get("data", [])}:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"router at {url} never listed {model}")


async def run_arm(api: str, state: Path, model: str, interval: float | None, args: argparse.Namespace,
                  ) -> tuple[list[float], Counter[str]]:
    replicas = replica_urls(api, model)
    assert len(replicas) == 2, replicas
    port = free_port()
    router = start_router(state, port, interval)
    try:
        url = f"http://127.0.0.1:{port}"
        await asyncio.to_thread(wait_routable, url, model)
        stop = asyncio.Event()
        noise = [asyncio.create_task(background(replicas[0][1], stop, model)) for _ in range(args.background)]
        await asyncio.sleep(1.0)  # the background queue builds up (and the scorer reads it at least once)
        latencies, counts = await measured(url, args.clients, args.requests, model)
        stop.set()
        await asyncio.gather(*noise)
        return latencies, counts
    finally:
        router.terminate()
        router.wait(timeout=30)


async def run(api: str, state: Path, args: argparse.Namespace) -> dict[str, Any]:
    from tidal_operator.router import RouterConfig

    default_interval = RouterConfig.engine_load_interval_s
    arms = [("leastLoad (own counts only, before)", "bench-ll", 0.0),
            ("prefixHash (own counts only, before)", "bench-ph", 0.0),
            ("leastLoad + engine load (new scorer)", "bench-ll", None),
            ("prefixHash + engine load (new scorer, prefix affinity)", "bench-ph", None)]
    out: dict[str, Any] = {}
    for label, model, interval in arms * args.rounds:
        latencies, counts = await run_arm(api, state, model, interval, args)
        arm = out.setdefault(label, {"strategy": MODELS[model], "llmservice": model,
                                     "engine_load_interval_s": default_interval if interval is None else interval,
                                     "latencies": [], "replicas": Counter()})
        arm["latencies"] += latencies
        arm["replicas"].update(counts)
        print(f"{label}: p50 {percentile(latencies, 50):.1f} ms, p99 {percentile(latencies, 99):.1f} ms, "
              f"{dict(counts)}", flush=True)
    return summarize_arms(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=600, help="measured requests per arm and round")
    parser.add_argument("--clients", type=int, default=6, help="concurrent clients through the router")
    parser.add_argument("--background", type=int, default=6, help="concurrent clients straight to replica 0")
    parser.add_argument("--slots", type=int, default=4, help="requests an engine runs at once")
    parser.add_argument("--service-ms", type=float, default=200.0, help="time one request runs")
    parser.add_argument("--rounds", type=int, default=2, help="each arm runs this many times, interleaved")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "router_picking_dev.json")
    args = parser.parse_args()
    load_start = [round(x, 2) for x in os.getloadavg()]
    engine = [sys.executable, str(ROOT / "benchmarks" / "queue_engine.py"), "--slots", str(args.slots),
              "--service-ms", str(args.service_ms)]
    with tempfile.TemporaryDirectory(prefix="tidal-bench-") as tmp:
        state = Path(tmp) / "state"
        files = Path(tmp) / "bench.yaml"
        files.write_text(manifest())
        tidal_dev(state, "up", "-f", str(files), "--no-router", "--timeout", "180",
                  "--engine-command", shlex.join(engine))
        try:
            api = json.loads((state / "stack.json").read_text())["api"]
            arms = asyncio.run(run(api, state, args))
        finally:
            tidal_dev(state, "down")
    result = {
        "benchmark": "router_picking_dev",
        "command": " ".join([".venv/bin/python", "benchmarks/router_picking_dev.py", *sys.argv[1:]]),
        "date": os.environ.get("TIDAL_BENCH_DATE") or datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": commit(),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "load_average_at_start": load_start, "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
                    "note": "a shared machine: other jobs may run on the same cores"},
        "setup": {**{k: v for k, v in vars(args).items() if k != "out"}, "where": "tidal dev (CPU)",
                  "engines": "benchmarks/queue_engine.py run by the tidal dev kubelet in place of tidal-engine",
                  "router": "a tidal router process per arm, watching the tidal dev API server"},
        "arms": arms,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(arms, indent=2))


if __name__ == "__main__":
    main()
