"""Operator scale: reconcile N LLMServices to Ready, then delete them all, on `tidal dev`
with the kubelet in fake_ready mode (Pods become Ready without running an engine), so this
measures the operator and the API round-trips, not model loading.

    .venv/bin/python benchmarks/operator_scale.py [--count 100] [--out benchmarks/results/operator_scale.json]

Timings:
- create_to_ready_s: from the first create until every LLMService reports phase Ready for its
  current generation (status.observedGeneration);
- delete_s: from the first delete until no LLMService and no engine Pod is left (the Pods go by
  ownerReference garbage collection).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "operator"))

from tidal_operator import labels as L  # noqa: E402
from tidal_operator.dev.stack import UpOptions, down, up  # noqa: E402

LLM_PATH = f"/apis/{L.GROUP}/{L.VERSION}/namespaces/default/{L.PLURAL}"


def http(method: str, url: str, body: Any = None) -> Any:
    request = urllib.request.Request(url, data=json.dumps(body).encode() if body is not None else None,
                                     method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read() or b"null")


def llmservice(i: int) -> dict[str, Any]:
    return {"apiVersion": L.API_VERSION, "kind": L.KIND, "metadata": {"name": f"scale-{i:03d}"},
            "spec": {"model": {"uri": "bundled://smollm2-135m"}, "replicas": 1}}


def wait(predicate: Any, timeout_s: float, what: str) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise SystemExit(f"timed out after {timeout_s}s: {what}")
        time.sleep(0.1)
    return time.monotonic()


def all_ready(api: str, count: int) -> bool:
    items = http("GET", api + LLM_PATH)["items"]
    return len(items) == count and all(
        (o.get("status") or {}).get("phase") == "Ready"
        and (o.get("status") or {}).get("observedGeneration") == o["metadata"]["generation"] for o in items)


def all_gone(api: str) -> bool:
    pods = http("GET", f"{api}/api/v1/namespaces/default/pods?labelSelector={L.LLMSERVICE}")["items"]
    return not http("GET", api + LLM_PATH)["items"] and not pods


def commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True, cwd=ROOT).stdout
        return sha + ("-dirty" if dirty.strip() else "")
    except OSError:
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=100)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "operator_scale.json")
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="tidal-scale-") as tmp:
        state = Path(tmp)
        with open(os.devnull, "w") as quiet:
            stack = up(UpOptions(files=[], state_dir=state, router=False, fake_engines=True, apply=False), out=quiet)
        api = stack["api"]
        try:
            # Creates in parallel, as `kubectl apply -f dir/` from a few clients would.
            start = time.monotonic()
            with ThreadPoolExecutor(8) as pool:
                list(pool.map(lambda i: http("POST", api + LLM_PATH, llmservice(i)), range(args.count)))
            created = time.monotonic()
            ready = wait(lambda: all_ready(api, args.count), args.timeout, "every LLMService Ready")

            delete_start = time.monotonic()
            with ThreadPoolExecutor(8) as pool:
                list(pool.map(lambda i: http("DELETE", f"{api}{LLM_PATH}/scale-{i:03d}"), range(args.count)))
            gone = wait(lambda: all_gone(api), args.timeout, "every LLMService and Pod gone")
        finally:
            with open(os.devnull, "w") as quiet:
                down(state, out=quiet)

    result = {
        "benchmark": "operator_scale",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": commit(),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "setup": "tidal dev: emulated API server + local kubelet (fake_ready) + `tidal operator --standalone` "
                 "as separate processes; 1 replica per LLMService; creates/deletes from 8 client threads",
        "llmservices": args.count,
        "create_requests_s": round(created - start, 3),
        "create_to_ready_s": round(ready - start, 3),
        "delete_s": round(gone - delete_start, 3),
        "llmservices_per_s_to_ready": round(args.count / (ready - start), 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
