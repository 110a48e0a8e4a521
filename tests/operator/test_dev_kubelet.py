"""The local kubelet: pods as local processes on their own loopback IPs."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import aiohttp
import pytest

from tidal_operator.dev import ApiServerHandle, LocalKubelet, start_apiserver

Obj = dict[str, Any]


class Cluster:
    def __init__(self, handle: ApiServerHandle, kubelet: LocalKubelet, session: aiohttp.ClientSession) -> None:
        self.handle, self.kubelet, self.session = handle, kubelet, session
        self.ns = "default"

    async def create(self, kind: str, body: Obj) -> Obj:
        async with self.session.post(f"/api/v1/namespaces/{self.ns}/{kind}", json=body) as response:
            assert response.status == 201, await response.text()
            return await response.json()

    async def delete_pod(self, name: str) -> None:
        async with self.session.delete(f"/api/v1/namespaces/{self.ns}/pods/{name}") as response:
            assert response.status == 200, await response.text()

    async def pod_log(self, name: str) -> str:
        async with self.session.get(f"/api/v1/namespaces/{self.ns}/pods/{name}/log") as response:
            return await response.text()

    async def wait_pod(self, name: str, check: Callable[[Obj | None], bool], timeout: float = 20) -> Obj | None:
        """Follow the pod's watch stream until `check(pod)` holds; `None` stands for "deleted"."""
        selector = {"fieldSelector": f"metadata.name={name}"}
        async with self.session.get(f"/api/v1/namespaces/{self.ns}/pods", params=selector) as response:
            listing = await response.json()
        current = listing["items"][0] if listing["items"] else None
        if check(current):
            return current
        params = {**selector, "watch": "1", "resourceVersion": listing["metadata"]["resourceVersion"],
                  "timeoutSeconds": str(int(timeout) + 1)}

        async def follow() -> Obj | None:
            async with self.session.get(f"/api/v1/namespaces/{self.ns}/pods", params=params) as response:
                async for line in response.content:
                    event = json.loads(line)
                    pod = None if event["type"] == "DELETED" else event["object"]
                    if check(pod):
                        return pod
            raise AssertionError(f"pod {name} never matched")

        return await asyncio.wait_for(follow(), timeout)


@pytest.fixture
async def cluster(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[Cluster]:
    fake = bool(getattr(request, "param", False))
    handle = await start_apiserver(log_dir=tmp_path / "logs")
    kubelet = LocalKubelet(handle.url, state_dir=tmp_path, workdir=tmp_path, fake_ready=fake, backoff_base_s=0.2,
                           backoff_max_s=1.0, first_ip=2 + (os.getpid() % 200) * 256)
    await kubelet.start()
    async with aiohttp.ClientSession(handle.url) as session:
        yield Cluster(handle, kubelet, session)
    await kubelet.stop()
    await handle.stop()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def ready(pod: Obj | None) -> bool:
    conditions = (pod or {}).get("status", {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
async def test_http_pod_becomes_ready_and_is_killed_on_delete(cluster: Cluster, tmp_path: Path) -> None:
    port = free_port()
    marker = tmp_path / "prestop-ran"
    pod = {"metadata": {"name": "web"}, "spec": {"terminationGracePeriodSeconds": 5, "containers": [{
        "name": "http", "image": "ignored",
        "command": [sys.executable, "-m", "http.server"], "args": [str(port), "--bind", "0.0.0.0"],
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "ports": [{"name": "http", "containerPort": port}],
        "readinessProbe": {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1},
        "livenessProbe": {"tcpSocket": {"port": port}, "periodSeconds": 1},
        "lifecycle": {"preStop": {"exec": {"command": [sys.executable, "-c", f"open({str(marker)!r}, 'w')"]}}},
    }]}}
    await cluster.create("pods", pod)
    running = await cluster.wait_pod("web", ready)
    assert running is not None
    status = running["status"]
    assert status["phase"] == "Running" and status["podIP"].startswith("127.0.") and status["podIP"] != "127.0.0.1"
    assert status["containerStatuses"][0]["ready"] and "running" in status["containerStatuses"][0]["state"]
    assert running["spec"]["nodeName"] == "tidal-dev"

    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://{status['podIP']}:{port}/") as response:
            assert response.status == 200
        # 0.0.0.0 in a Pod means its own addresses: locally, its loopback address only, so
        # engines on the same port don't collide on the host.
        with pytest.raises(aiohttp.ClientConnectionError):
            async with session.get(f"http://127.0.0.1:{port}/"):
                pass
    assert "GET / HTTP" in await cluster.pod_log("web")

    pid = cluster.kubelet.find("default", "web").pids()["http"]  # type: ignore[union-attr]
    await cluster.delete_pod("web")
    await cluster.wait_pod("web", lambda p: p is None)
    assert not pid_alive(pid)
    assert marker.exists()


@pytest.mark.slow
async def test_crash_loop_and_failed_pods(cluster: Cluster) -> None:
    crash = [sys.executable, "-c", "import sys; print('starting'); sys.exit('cannot run this: the reason')"]
    await cluster.create("pods", {"metadata": {"name": "loop"}, "spec": {
        "containers": [{"name": "c", "image": "x", "command": crash, "terminationMessagePolicy": "FallbackToLogsOnError"}]}})
    await cluster.create("pods", {"metadata": {"name": "once"}, "spec": {
        "restartPolicy": "Never", "containers": [{"name": "c", "image": "x", "command": crash}]}})

    def crash_looping(pod: Obj | None) -> bool:
        for status in (pod or {}).get("status", {}).get("containerStatuses") or []:
            waiting = status["state"].get("waiting", {})
            if status["restartCount"] >= 1 and waiting.get("reason") == "CrashLoopBackOff":
                return status["lastState"]["terminated"]["exitCode"] == 1
        return False

    looping = await cluster.wait_pod("loop", crash_looping)
    assert looping is not None and looping["status"]["phase"] == "Running"
    # FallbackToLogsOnError: the log's tail is the termination message, as the kubelet does.
    last = looping["status"]["containerStatuses"][0]["lastState"]["terminated"]
    assert last["message"].splitlines()[-1] == "cannot run this: the reason"
    failed = await cluster.wait_pod("once", lambda p: (p or {}).get("status", {}).get("phase") == "Failed")
    assert failed is not None
    terminated = failed["status"]["containerStatuses"][0]["state"]["terminated"]
    assert terminated["exitCode"] == 1 and terminated["reason"] == "Error" and "message" not in terminated
    await cluster.delete_pod("once")  # a finished pod is removed at once
    await cluster.wait_pod("once", lambda p: p is None)


@pytest.mark.slow
async def test_env_from_secret_and_var_expansion(cluster: Cluster) -> None:
    await cluster.create("secrets", {"metadata": {"name": "creds"}, "stringData": {"token": "s3cret"}})
    await cluster.create("configmaps", {"metadata": {"name": "settings"}, "data": {"MODE": "dev"}})
    script = "import os; print('token=' + os.environ['TOKEN'], 'mode=' + os.environ['MODE'], os.environ['TIDAL_POD_IP'])"
    await cluster.create("pods", {"metadata": {"name": "envy"}, "spec": {"restartPolicy": "Never", "containers": [{
        "name": "c", "image": "x", "command": [sys.executable, "-c", script + "; print('$(GREETING)', '$$(KEPT)')"],
        "envFrom": [{"configMapRef": {"name": "settings"}}],
        "env": [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}},
                {"name": "GREETING", "value": "hello-$(MODE)"}],
    }]}})
    done = await cluster.wait_pod("envy", lambda p: (p or {}).get("status", {}).get("phase") == "Succeeded")
    assert done is not None
    log = await cluster.pod_log("envy")
    assert f"token=s3cret mode=dev {done['status']['podIP']}" in log
    assert "hello-dev $(KEPT)" in log


@pytest.mark.slow
async def test_missing_secret_waits_with_config_error(cluster: Cluster) -> None:
    await cluster.create("pods", {"metadata": {"name": "nosecret"}, "spec": {"containers": [{
        "name": "c", "image": "x", "command": [sys.executable, "-c", "pass"],
        "env": [{"name": "T", "valueFrom": {"secretKeyRef": {"name": "absent", "key": "k"}}}]}]}})

    def config_error(pod: Obj | None) -> bool:
        statuses = (pod or {}).get("status", {}).get("containerStatuses") or []
        return bool(statuses) and statuses[0]["state"].get("waiting", {}).get("reason") == "CreateContainerConfigError"

    pod = await cluster.wait_pod("nosecret", config_error)
    assert pod is not None and pod["status"]["phase"] == "Pending"
    await cluster.delete_pod("nosecret")
    await cluster.wait_pod("nosecret", lambda p: p is None)


@pytest.mark.parametrize("cluster", [True], indirect=True)
async def test_fake_ready_mode(cluster: Cluster) -> None:
    names = [f"fake-{i}" for i in range(20)]
    for name in names:
        await cluster.create("pods", {"metadata": {"name": name}, "spec": {
            "containers": [{"name": "engine", "image": "x"}]}})
    pods = await asyncio.gather(*(cluster.wait_pod(name, ready) for name in names))
    ips = {pod["status"]["podIP"] for pod in pods if pod}
    assert len(ips) == 20 and all(ip.startswith("127.0.") for ip in ips)
    await cluster.delete_pod("fake-0")
    await cluster.wait_pod("fake-0", lambda p: p is None)
    assert cluster.kubelet.find("default", "fake-0") is None


def test_engine_command_replaces_only_tidal_engine() -> None:
    # `tidal dev up --engine-command`: an engine stand-in gets the engine's own arguments.
    kubelet = LocalKubelet("http://127.0.0.1:1", engine_command=["python", "stand_in.py", "--slots", "4"])
    engine = {"command": ["tidal-engine", "serve"], "args": ["bundled://m", "--port", "8000"]}
    assert kubelet.command_line(engine) == ["python", "stand_in.py", "--slots", "4", "serve", "bundled://m",
                                            "--port", "8000"]
    assert kubelet.command_line({"command": ["sleep"], "args": ["5"]}) == ["sleep", "5"]
    assert LocalKubelet("http://127.0.0.1:1").command_line(engine) == ["tidal-engine", "serve", "bundled://m",
                                                                       "--port", "8000"]


@pytest.mark.slow
async def test_stopping_the_kubelet_kills_pods_without_their_pre_stop_hooks(cluster: Cluster, tmp_path: Path) -> None:
    """The whole local cluster is going down, so there is no router to drain away from."""
    marker = tmp_path / "prestop-ran"
    await cluster.create("pods", {"metadata": {"name": "idle"}, "spec": {"terminationGracePeriodSeconds": 30, "containers": [{
        "name": "c", "image": "x", "command": [sys.executable, "-c", "import time; time.sleep(600)"],
        "lifecycle": {"preStop": {"exec": {"command": [sys.executable, "-c", f"open({str(marker)!r}, 'w')"]}}},
    }]}})
    await cluster.wait_pod("idle", lambda p: "running" in ((p or {}).get("status", {}).get("containerStatuses")
                                                          or [{"state": {}}])[0]["state"])
    pid = cluster.kubelet.find("default", "idle").pids()["c"]  # type: ignore[union-attr]
    await cluster.kubelet.stop()
    assert not pid_alive(pid)
    assert not marker.exists()
