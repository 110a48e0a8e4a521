"""A GPU-share group's switch time on one GPU (issue 22): from a request for the sleeping member
to its first token, through the router.

    python3 benchmarks/gpu_share_switch_bench.py --model FOLDER --json OUT.json [--util 0.45] \\
        [--declared-share 0.6] [--rounds 6] [--settle-s 5] [--cache-dir DIR] [--logs DIR]

What runs:
- two ``tidal-engine serve`` processes of the same checkpoint, served as ``a`` and ``b``, each with
  ``--enable-sleep-mode --gpu-memory-utilization UTIL``, the second started once the first answers
  /health (they share the device);
- the router app (``tidal_operator.router.create_app``: the proxy and the GroupSwitcher) in this
  process, with both as members of one ``gpuShare`` group, fed to its registry as the LLMService
  and Pod objects the Kubernetes watch would deliver. Each member is declared to take
  ``--declared-share`` of the GPU, so that at most one may be awake and the router takes turns
  (at 0.45 each both would fit and it would never switch);
- after ``--settle-s`` (the engines prepare their host buffers for sleep after start-up), alternating
  streaming completions (a, b, a, ...) through the router. For each, the seconds from sending it
  to its first token: the router puts the awake member to sleep (level 1), wakes the requested one,
  then forwards. A second request to the member now awake gives the time to first token without a
  switch. After every answer each engine's /is_sleeping is read: exactly one may be awake.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PROMPT = " ".join(f"t{100 + i}" for i in range(64))  # the benchmark checkpoints' word-level tokenizer
KEY = "bench-key"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_engine(name: str, args: argparse.Namespace, port: int) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "tidal_engine.cli", "serve", args.model, "--port", str(port), "--host", "127.0.0.1",
           "--served-model-name", name, "--gpu-memory-utilization", str(args.util), "--enable-sleep-mode",
           "--max-model-len", str(args.max_model_len), "--dtype", args.dtype, "--disable-log-requests"]
    if args.cache_dir:
        cmd += ["--cache-dir", args.cache_dir]
    if args.load_format != "auto":
        cmd += ["--load-format", args.load_format]
    log = open(Path(args.logs) / f"switch-engine-{name}.log", "wb") if args.logs else subprocess.DEVNULL
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


async def wait_healthy(http: Any, port: int, proc: subprocess.Popen[bytes], timeout: float) -> float:
    started = time.perf_counter()
    while time.perf_counter() - started < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the engine on port {port} exited with {proc.returncode}")
        try:
            if (await http.get(f"http://127.0.0.1:{port}/health", timeout=2)).status_code == 200:
                return time.perf_counter() - started
        except Exception:  # noqa: BLE001 - not listening yet
            pass
        await asyncio.sleep(0.1)
    raise TimeoutError(f"the engine on port {port} was not healthy after {timeout} s")


def member(name: str, share: float) -> dict[str, Any]:
    from tidal_operator import labels as L

    return {"apiVersion": L.API_VERSION, "kind": L.KIND, "metadata": {"name": name, "namespace": "default"},
            "spec": {"model": {"uri": "bundled://smollm2-135m", "servedName": name},
                     "gpuShare": {"group": "bench", "memoryFraction": share}}}


def pod(name: str, service: str, port: int) -> dict[str, Any]:
    from tidal_operator import labels as L

    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "default", "resourceVersion": "1", "annotations": {},
                         "labels": {L.LLMSERVICE: service, L.SLEEP_STATE: L.SLEEP_AWAKE}},
            "spec": {"containers": [{"name": "engine", "ports": [{"name": "http", "containerPort": port}]}]},
            "status": {"phase": "Running", "podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}}


async def first_token(client: Any, model: str, max_tokens: int) -> dict[str, Any]:
    """Send one streaming completion through the router; seconds to its first token and to its end."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "stream": True, "temperature": 0.0,
            "ignore_eos": True}
    started = time.perf_counter()
    ttft = None
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body, timeout=300) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{model}: HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if any(c.get("text") for c in chunk.get("choices", [])):
                tokens += 1
                if ttft is None:
                    ttft = time.perf_counter() - started
    return {"model": model, "first_token_s": ttft, "total_s": time.perf_counter() - started, "chunks": tokens}


async def awake_members(http: Any, ports: dict[str, int]) -> list[str]:
    out = []
    for name, port in ports.items():
        state = (await http.get(f"http://127.0.0.1:{port}/is_sleeping", timeout=10)).json()
        if not state["is_sleeping"]:
            out.append(name)
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import httpx
    import uvicorn

    from tidal_operator.router import Registry, RouterConfig, create_app

    ports = {"a": free_port(), "b": free_port()}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    result: dict[str, Any] = {"util": args.util, "declared_share": args.declared_share, "settle_s": args.settle_s}
    async with httpx.AsyncClient() as http:
        try:
            for name, port in ports.items():  # one after the other: each sizes its KV cache from free memory
                procs[name] = start_engine(name, args, port)
                result[f"engine_{name}_ready_s"] = await wait_healthy(http, port, procs[name], args.start_timeout)
            registry = Registry()
            for name in ports:
                registry.apply_llmservice_event({"type": "ADDED", "object": member(name, args.declared_share)})
            for name, port in ports.items():
                registry.apply_pod_event({"type": "ADDED", "object": pod(f"{name}-0", name, port)})
            app = create_app(registry, RouterConfig(api_keys=(KEY,), engine_load_interval_s=0))
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
            serving = asyncio.create_task(server.serve(sockets=[sock]))
            await asyncio.sleep(args.settle_s)
            base = f"http://127.0.0.1:{sock.getsockname()[1]}"
            rounds: list[dict[str, Any]] = []
            async with httpx.AsyncClient(base_url=base, headers={"authorization": f"Bearer {KEY}"}) as client:
                try:
                    for i in range(args.rounds + 1):  # the first only makes room (both start awake)
                        model = "ab"[i % 2]
                        switched = await first_token(client, model, args.max_tokens)
                        awake_after = await awake_members(http, ports)
                        again = await first_token(client, model, args.max_tokens)
                        rounds.append({"switch": switched, "no_switch": again, "awake_after": awake_after})
                        print(json.dumps(rounds[-1]), flush=True)
                finally:
                    server.should_exit = True
                    await asyncio.wait_for(serving, 10)
                    sock.close()
            switcher = app.state.switcher
            result["switches"] = [list(map(str, s)) for s in switcher.switches]
            result["rounds"] = rounds
            timed = [r["switch"]["first_token_s"] for r in rounds[1:]]
            result["switch_first_token_s"] = {"min": min(timed), "median": sorted(timed)[len(timed) // 2],
                                              "max": max(timed)} if timed else None
            result["no_switch_first_token_s_median"] = sorted(r["no_switch"]["first_token_s"] for r in rounds)[
                len(rounds) // 2]
            result["at_most_one_awake"] = all(len(r["awake_after"]) == 1 for r in rounds)
            result["every_request_answered"] = all(r[k]["chunks"] > 0 for r in rounds for k in ("switch", "no_switch"))
        finally:
            for proc in procs.values():
                proc.terminate()
            for proc in procs.values():
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--json", required=True)
    parser.add_argument("--util", type=float, default=0.45)
    parser.add_argument("--declared-share", type=float, default=0.6)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--settle-s", type=float, default=5.0)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    parser.add_argument("--start-timeout", type=float, default=180.0)
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--logs", default=None, help="a folder for the engines' logs")
    args = parser.parse_args()
    started = time.perf_counter()
    result = asyncio.run(run(args))
    result.update(command="python3 benchmarks/gpu_share_switch_bench.py " + " ".join(sys.argv[1:]),
                  commit=os.environ.get("TIDAL_COMMIT") or "unknown",
                  date=os.environ.get("TIDAL_BENCH_DATE") or time.strftime("%Y-%m-%d"),
                  wall_s=time.perf_counter() - started)
    Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps({k: v for k, v in result.items() if k != "rounds"}, default=str))


if __name__ == "__main__":
    main()
