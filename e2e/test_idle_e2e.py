"""End to end with a real engine: idle → asleep (the engine says so), then a request through
the router wakes it and gets the same greedy answer as before the sleep.

Real pieces: `tidal-engine serve smollm2-135m` on CPU, the emulated API server, the router
(watching the API server, with the Kubernetes wake lease), and the autoscaling loop
(AutoscalerRuntime, reading the router's held demand). The Pod object is written by the test
(the engine runs as a plain process, not through the kubelet). Waits are on conditions, with
deadlines, never fixed sleeps.
"""

from __future__ import annotations

import asyncio
import base64
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

import httpx
import pytest

from tidal_operator import labels as L

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
NS = "default"
ENGINE_KEY = "e2e-engine-key"
CLIENT_KEY = "e2e-client-key"
MERGE = "application/merge-patch+json"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def eventually(check: Callable[[], Awaitable[bool]], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            pytest.fail(f"not reached within {timeout}s: {what}")
        await asyncio.sleep(0.1)


@pytest.fixture
async def engine_port(tmp_path: Path) -> AsyncIterator[int]:
    if not (ROOT / "engine" / "tidal_engine" / "server" / "app.py").exists():
        pytest.skip("the engine server is not there")
    exe = shutil.which("tidal-engine", path=str(Path(sys.executable).parent))
    command = [exe] if exe else [sys.executable, "-m", "tidal_engine.cli"]
    port = free_port()
    log_path = tmp_path / "engine.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(
            [*command, "serve", "smollm2-135m", "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
             "--served-model-name", "smollm2", "--enable-sleep-mode", "--max-model-len", "512",
             "--kv-cache-memory-bytes", "64M", "--disable-log-requests"],
            env={**os.environ, "OMP_NUM_THREADS": "1", "TIDAL_API_KEY": ENGINE_KEY},
            stdout=log, stderr=subprocess.STDOUT)
        try:
            async with httpx.AsyncClient() as client:
                async def healthy() -> bool:
                    if process.poll() is not None:
                        pytest.skip(f"the engine did not start: {log_path.read_text()[-2000:]}")
                    try:
                        return (await client.get(f"http://127.0.0.1:{port}/health")).status_code == 200
                    except httpx.TransportError:
                        return False
                await eventually(healthy, "engine healthy", timeout=600)
            yield port
        finally:
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


async def test_idle_engine_sleeps_and_a_request_through_the_router_wakes_it(engine_port: int,
                                                                             tmp_path: Path) -> None:
    import uvicorn
    from kubernetes_asyncio import client as k8s

    from tidal_operator.controller.router_secrets import engine_key_copy
    from tidal_operator.dev import start_apiserver, write_kubeconfig
    from tidal_operator.kube import Kube, load_configuration
    from tidal_operator.router import Registry, RouterConfig, create_app
    from tidal_operator.router.registry import KubernetesWatcher
    from tidal_operator.router.waker import KubernetesWakeLease
    from tidal_operator.scaling.controller import AutoscalerRuntime, KubeClusterApi, ScalingConfig

    handle = await start_apiserver("127.0.0.1", 0, crd_dir=ROOT / "crds")
    kubeconfig = str(write_kubeconfig(tmp_path / "kubeconfig", handle.url))
    kube = await Kube.connect(kubeconfig)
    router_api = k8s.ApiClient(await load_configuration(kubeconfig))
    tasks: list[asyncio.Task[Any]] = []
    runtime: AutoscalerRuntime | None = None
    watcher: KubernetesWatcher | None = None
    server: uvicorn.Server | None = None
    try:
        # --- the cluster: a Secret, an LLMService with a short idle window, its one Pod ---
        await kube.request("POST", f"/api/v1/namespaces/{NS}/secrets", body={
            "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "engine-key", "namespace": NS},
            "data": {"api-key": base64.b64encode(ENGINE_KEY.encode()).decode()}})
        llm = await kube.request("POST", f"/apis/{L.GROUP}/{L.VERSION}/namespaces/{NS}/{L.PLURAL}", body={
            "apiVersion": L.API_VERSION, "kind": L.KIND, "metadata": {"name": "smollm2", "namespace": NS},
            "spec": {"model": {"uri": "bundled://smollm2-135m", "servedName": "smollm2"},
                     "engine": {"port": engine_port}, "auth": {"apiKeySecretRef": {"name": "engine-key"}},
                     "autoscaling": {"minReplicas": 1, "maxReplicas": 1, "metric": "requestsInFlight",
                                     "target": 4},
                     "sleep": {"afterIdleSeconds": 2, "level": 1}}})
        # What the operator would write: the router's copy of the engine key (the router reads
        # Secrets in its own namespace only), and a Pod the LLMService controls.
        await kube.request("POST", f"/api/v1/namespaces/{NS}/secrets",
                           body=engine_key_copy(llm, "engine-key", "api-key", ENGINE_KEY))
        owner = {"apiVersion": L.API_VERSION, "kind": L.KIND, "name": "smollm2",
                 "uid": llm["metadata"]["uid"], "controller": True}
        pod = "smollm2-e2e-0"
        await kube.request("POST", f"/api/v1/namespaces/{NS}/pods", body={
            "apiVersion": "v1", "kind": "Pod", "metadata": {
                "name": pod, "namespace": NS, "annotations": {L.SPEC_HASH: "e2e"}, "ownerReferences": [owner],
                "labels": {**L.selector_labels("smollm2"), L.SLEEP_STATE: L.SLEEP_AWAKE}},
            "spec": {"containers": [{"name": "engine", "image": "x",
                                     "ports": [{"name": "http", "containerPort": engine_port}]}]}})
        await kube.request("PATCH", f"/api/v1/namespaces/{NS}/pods/{pod}/status", content_type=MERGE, body={
            "status": {"phase": "Running", "podIP": "127.0.0.1",
                       "conditions": [{"type": "Ready", "status": "True"}]}})

        # --- the router, watching the API server ---
        registry = Registry()
        watcher = KubernetesWatcher(registry, router_api, keys_namespace=NS)
        await watcher.start()
        await asyncio.wait_for(watcher.synced.wait(), 30)
        app = create_app(registry, RouterConfig(api_keys=(CLIENT_KEY,), hold_timeout_s=120),
                         wake_lease=KubernetesWakeLease(router_api))
        router_port = free_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=router_port, log_level="warning"))
        tasks.append(asyncio.create_task(server.serve()))
        router_url = f"http://127.0.0.1:{router_port}"

        async with httpx.AsyncClient(timeout=120, headers={"authorization": f"Bearer {CLIENT_KEY}"}) as client:
            async def router_up() -> bool:
                try:
                    return (await client.get(router_url + "/health")).status_code == 200
                except httpx.TransportError:
                    return False
            await eventually(router_up, "router serving")

            async def ask() -> str:
                response = await client.post(router_url + "/v1/chat/completions", json={
                    "model": "smollm2", "temperature": 0, "max_tokens": 8,
                    "messages": [{"role": "user", "content": "What is the capital of France?"}]})
                assert response.status_code == 200, response.text
                return response.json()["choices"][0]["message"]["content"]

            before = await ask()
            assert before.strip()

            # --- the loop: idle for 2s → asleep ---
            runtime = AutoscalerRuntime(KubeClusterApi(kube), ScalingConfig(
                interval_s=0.5, router_urls=(router_url,), router_api_key=CLIENT_KEY))
            tasks.append(asyncio.create_task(runtime.run(NS)))
            engine = httpx.AsyncClient(base_url=f"http://127.0.0.1:{engine_port}",
                                       headers={"authorization": f"Bearer {ENGINE_KEY}"})
            try:
                async def asleep() -> bool:
                    meta = (await kube.request("GET", f"/api/v1/namespaces/{NS}/pods/{pod}"))["metadata"]
                    status = (await kube.get_llmservice(NS, "smollm2") or {}).get("status") or {}
                    sleeping = (await engine.get("/is_sleeping")).json()["is_sleeping"]
                    return (meta["labels"][L.SLEEP_STATE] == L.SLEEP_LEVEL_1 and sleeping
                            and status.get("sleepingReplicas") == 1)
                await eventually(asleep, "the idle replica asleep (label, engine and status)")

                # --- a request through the router wakes it and is answered, the same way ---
                # The loop stops here: with a 2 s window it could put the replica back to sleep
                # before the checks below on a slow machine. The wake is the router's alone.
                loop_task = tasks[-1]
                loop_task.cancel()
                await asyncio.gather(loop_task, return_exceptions=True)
                after = await ask()
                assert after == before
                assert not (await engine.get("/is_sleeping")).json()["is_sleeping"]

                async def awake_label() -> bool:
                    meta = (await kube.request("GET", f"/api/v1/namespaces/{NS}/pods/{pod}"))["metadata"]
                    return meta["labels"][L.SLEEP_STATE] == L.SLEEP_AWAKE
                await eventually(awake_label, "the Pod labelled awake again")
            finally:
                await engine.aclose()
        status = (await kube.get_llmservice(NS, "smollm2") or {}).get("status") or {}
        assert status.get("desiredReplicas") == 1  # minReplicas 1: slept, never removed
    finally:
        if server is not None:
            server.should_exit = True  # the router's task ends by itself
        for task in tasks[1:]:
            task.cancel()  # the autoscaling loop runs until cancelled
        await asyncio.gather(*tasks, return_exceptions=True)
        if runtime is not None:
            await runtime.aclose()
        if watcher is not None:
            await watcher.stop()
        await router_api.close()
        await kube.close()
        await handle.stop()
