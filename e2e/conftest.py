"""End-to-end fixtures: a `tidal dev` stack per test module, driven with the real kubectl.

Each module gets its own stack (`tidal dev up --no-apply`, its own state dir and ports) and
tears it down with `tidal dev down`. Waits are bounded and synchronise on what the API
reports (kubectl wait, watches), never on fixed sleeps.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from kubectl_watch import KubectlWatch

ROOT = Path(__file__).resolve().parents[1]
K8S_VERSION = "1.33"  # what kubernetes-validate checks generated objects against
QUESTION = "What is the capital of France?"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if str(item.fspath).startswith(str(Path(__file__).parent)):
            item.add_marker(pytest.mark.slow)


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.2) -> Any:
    """Poll `predicate` until truthy, failing with `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:g}s: {what}")
        time.sleep(interval_s)


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Stack:
    state_dir: Path
    router_port: int | None
    env: dict[str, str] = field(default_factory=dict)

    @property
    def kubeconfig(self) -> Path:
        return self.state_dir / "kubeconfig"

    @property
    def api_key(self) -> str:
        return (self.state_dir / "api-key").read_text().strip()

    @property
    def router_url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"

    def tidal(self, *args: str, timeout: float = 120) -> str:
        result = subprocess.run([sys.executable, "-m", "tidal_operator.cli", "dev", "--state-dir",
                                 str(self.state_dir), *args], capture_output=True, text=True, timeout=timeout,
                                cwd=ROOT, env=self.env)
        assert result.returncode == 0, f"tidal dev {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"
        return result.stdout

    def kubectl(self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60) -> str:
        result = subprocess.run(["kubectl", *args], capture_output=True, text=True, input=input, timeout=timeout,
                                env=self.env, cwd=ROOT)
        if check:
            assert result.returncode == 0, f"kubectl {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"
        return result.stdout + (result.stderr if not check else "")

    def get(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", *args, "-o", "json"))

    def pods(self, llm: str) -> list[dict[str, Any]]:
        return self.get("pods", "-l", f"tidal.dev/llmservice={llm}")["items"]

    def llm(self, name: str) -> dict[str, Any]:
        return self.get("llm", name)

    def condition(self, name: str, type_: str) -> dict[str, Any]:
        status = self.llm(name).get("status") or {}
        return next((c for c in status.get("conditions") or [] if c["type"] == type_), {})

    def events(self, name: str) -> list[dict[str, Any]]:
        return self.get("events", "--field-selector", f"involvedObject.name={name}")["items"]

    def wait_ready(self, name: str, timeout_s: float) -> dict[str, Any]:
        """Ready, and the status is about the current generation."""
        def ready() -> dict[str, Any] | None:
            llm = self.llm(name)
            s = llm.get("status") or {}
            ok = s.get("phase") == "Ready" and s.get("observedGeneration") == llm["metadata"]["generation"]
            return llm if ok else None
        return wait_for(ready, timeout_s, f"LLMService {name} Ready", interval_s=0.5)

    # The helpers below are reached through the fixture (test modules can't import this
    # conftest by name: the repository root has a conftest.py of its own).
    wait_for = staticmethod(lambda *a, **k: wait_for(*a, **k))
    chat = staticmethod(lambda *a, **k: chat(*a, **k))
    validate_generated = staticmethod(lambda objs: validate_generated(objs))

    def watch_pods(self, selector: str) -> KubectlWatch:
        return KubectlWatch(self.env, "pods", "-l", selector)

    def engine_pids(self) -> dict[str, int]:
        try:
            return {k: v[0] for k, v in json.loads((self.state_dir / "engines.json").read_text()).items()}
        except (OSError, ValueError):
            return {}


def chat(url: str, model: str, key: str | None = None, timeout: float = 120) -> str:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": QUESTION}],
                       "max_tokens": 24, "temperature": 0}).encode()
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(f"{url}/v1/chat/completions", data=body, headers=headers, method="POST")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return str(json.loads(response.read())["choices"][0]["message"]["content"])


def _stack(tmp_path_factory: pytest.TempPathFactory, *args: str, router: bool) -> Iterator[Stack]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed")
    state = tmp_path_factory.mktemp("tidal-dev")
    port = free_port() if router else None
    env = {**os.environ, "KUBECONFIG": str(state / "kubeconfig")}
    stack = Stack(state, port, env)
    up = ["up", "--no-apply", *args] + (["--router-port", str(port)] if router else ["--no-router"])
    try:
        stack.tidal(*up)
        yield stack
    finally:
        stack.tidal("down", timeout=180)


@pytest.fixture(scope="module")
def dev_up_args() -> tuple[str, ...]:
    """More `tidal dev up` arguments for `real_stack`: a module overrides this fixture for its own."""
    return ()


@pytest.fixture(scope="module")
def real_stack(tmp_path_factory: pytest.TempPathFactory, dev_up_args: tuple[str, ...]) -> Iterator[Stack]:
    """Real engines (`tidal-engine serve` processes) and the router."""
    yield from _stack(tmp_path_factory, *dev_up_args, router=True)


@pytest.fixture(scope="module")
def fake_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The kubelet marks Pods Ready without running anything: cheap, for operator behaviour."""
    yield from _stack(tmp_path_factory, "--fake-engines", router=False)


def validate_generated(objs: list[dict[str, Any]]) -> None:
    """Objects the operator made (Pods, Services) against the official schemas. The status,
    written by the kubelet / API server, and server-set metadata are not the operator's."""
    import kubernetes_validate

    for obj in objs:
        clean = {k: v for k, v in obj.items() if k != "status"}
        kubernetes_validate.validate(clean, K8S_VERSION, strict=True)
