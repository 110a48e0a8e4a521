"""`tidal dev`'s process management: the local stack as background processes under `.tidal/`.

    .tidal/
      kubeconfig            points kubectl (and everything else) at the emulated API server
      api-key               the router's client key, generated once
      stack.json            URLs of the API server and the router
      pids/<component>.pid  controlplane, operator, router
      engines.json          process groups of the engine containers (kept by the control plane)
      logs/<component>.log  and logs/<namespace>/<pod>/<container>.log (the kubelet's)

Three processes, each in its own session so `tidal dev up` can return:
- controlplane: the emulated API server and the local kubelet in one event loop (the engines
  are its children, each in its own process group);
- operator: `tidal operator --standalone` against the kubeconfig, reading held demand from
  the routers' Leases in `default` (TIDAL_ROUTER_DEMAND_NAMESPACE), so scale-from-zero works;
- router: `tidal router` on loopback, with the key from `.tidal/api-key`, publishing its held
  demand there (`--demand-leases default`) and reading the operator's copies of engine and
  client keys there (`--keys-namespace default`).
`down()` stops them (the control plane's kubelet stops the engines) and then kills any engine
process group still alive, so nothing is left behind even after a crash.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import secrets
import shlex
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import yaml

from .. import labels as L

log = logging.getLogger(__name__)
Obj = dict[str, Any]

COMPONENTS = ("controlplane", "operator", "router")
DEV_PRE_STOP_SLEEP_S = 1
REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_CRDS = REPO_ROOT / "crds"
DEFAULT_EXAMPLE = REPO_ROOT / "examples" / "quickstart.yaml"


class StackError(RuntimeError):
    """Something `tidal dev` can't do, with a message for the user."""


@dataclass(frozen=True)
class Paths:
    root: Path

    @property
    def kubeconfig(self) -> Path:
        return self.root / "kubeconfig"

    @property
    def api_key(self) -> Path:
        return self.root / "api-key"

    @property
    def stack(self) -> Path:
        return self.root / "stack.json"

    @property
    def engines(self) -> Path:
        return self.root / "engines.json"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def pidfile(self, component: str) -> Path:
        return self.root / "pids" / f"{component}.pid"

    def log(self, component: str) -> Path:
        return self.logs / f"{component}.log"


# --- processes ----------------------------------------------------------------------------------

def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped by its parent) is not alive for our purposes.
    with contextlib.suppress(OSError):
        if Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z"):
            return False
    return True


def read_pid(paths: Paths, component: str) -> int | None:
    try:
        pid = int(paths.pidfile(component).read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if pid_alive(pid) else None


def _spawn(paths: Paths, component: str, argv: list[str], env: dict[str, str] | None = None) -> int:
    paths.logs.mkdir(parents=True, exist_ok=True)
    paths.pidfile(component).parent.mkdir(parents=True, exist_ok=True)
    with open(paths.log(component), "ab") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})}, cwd=os.getcwd(), start_new_session=True)
    paths.pidfile(component).write_text(f"{proc.pid}\n")
    return proc.pid


def _stop_pid(pid: int, timeout_s: float) -> None:
    """SIGTERM the process group, SIGKILL it after `timeout_s`."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks (/proc/<pid>/stat field 22): with the pid, it
    identifies one process, so a recycled pid is never mistaken for an engine we started."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def engine_pids(paths: Paths) -> dict[str, tuple[int, int | None]]:
    """pod key -> (process group id, start time) of its container, as last recorded."""
    try:
        return {k: (int(v[0]), v[1]) for k, v in json.loads(paths.engines.read_text()).items()}
    except (OSError, ValueError, TypeError, IndexError):
        return {}


# --- HTTP helpers (stdlib only: `tidal dev` must work before anything else is running) ----------

def _http(method: str, url: str, body: Any = None, content_type: str = "application/json",
          timeout: float = 10.0) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": content_type, "Accept": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            raw = response.read()
            return response.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            return exc.code, json.loads(raw)
        except ValueError:
            return exc.code, raw.decode(errors="replace")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_free(host: str, port: int) -> bool:
    """Whether a server could listen on the port now. SO_REUSEADDR, as the servers themselves
    set it: connections in TIME_WAIT from a stack just stopped don't make the port taken."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


# --- applying manifests ---------------------------------------------------------------------------

def _resource_paths(api_url: str) -> dict[tuple[str, str], tuple[str, bool]]:
    """(apiVersion, kind) -> (collection path prefix, namespaced), from discovery."""
    out: dict[tuple[str, str], tuple[str, bool]] = {}
    _, core = _http("GET", f"{api_url}/api/v1")
    group_versions = [("v1", "/api/v1", core)]
    _, groups = _http("GET", f"{api_url}/apis")
    for group in groups.get("groups", []):
        for version in group.get("versions", []):
            gv = version["groupVersion"]
            _, listing = _http("GET", f"{api_url}/apis/{gv}")
            group_versions.append((gv, f"/apis/{gv}", listing))
    for gv, prefix, listing in group_versions:
        for res in (listing or {}).get("resources", []):
            if "/" not in res["name"]:
                out[(gv, res["kind"])] = (f"{prefix}/{{ns}}{res['name']}", bool(res.get("namespaced")))
    return out


def apply_files(api_url: str, files: Iterable[Path], namespace: str = "default") -> list[Obj]:
    """Server-side apply every document of `files` (what `kubectl apply --server-side` does).
    Returns the applied objects."""
    paths = _resource_paths(api_url)
    applied = []
    for file in files:
        for doc in yaml.safe_load_all(Path(file).read_text()):
            if not isinstance(doc, dict):
                continue
            key = (doc.get("apiVersion", ""), doc.get("kind", ""))
            if key not in paths:
                raise StackError(f"{file}: the API server does not serve {key[1]} ({key[0]})")
            template, namespaced = paths[key]
            meta = doc.setdefault("metadata", {})
            ns = meta.setdefault("namespace", namespace) if namespaced else None
            collection = template.format(ns=f"namespaces/{ns}/" if ns else "")
            url = f"{api_url}{collection}/{meta['name']}?fieldManager=tidal-dev&force=true"
            code, answer = _http("PATCH", url, doc, content_type="application/apply-patch+yaml")
            if code >= 300:
                message = answer.get("message") if isinstance(answer, dict) else answer
                raise StackError(f"{file}: applying {key[1]} {meta['name']} failed: HTTP {code}: {message}")
            applied.append(answer)
    return applied


# --- up / down / status ----------------------------------------------------------------------------

@dataclass
class UpOptions:
    files: list[Path]
    state_dir: Path
    api_port: int = 0
    router_port: int = 8080
    router: bool = True
    fake_engines: bool = False
    # Run this instead of `tidal-engine` in engine Pods (engine stand-ins for benchmarks).
    engine_command: tuple[str, ...] = ()
    apply: bool = True
    wait_s: float = 300.0
    crds: Path = DEFAULT_CRDS
    # Directories file:// LoRA adapters may come from (the operator's --allowed-file-root).
    allowed_file_roots: tuple[Path, ...] = ()


def _python() -> str:
    return sys.executable


def _wait(what: str, check: Any, timeout_s: float, log_path: Path | None = None) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    hint = f" (see {log_path})" if log_path else ""
    raise StackError(f"timed out after {timeout_s:g}s waiting for {what}{hint}")


def _api_url(paths: Paths) -> str | None:
    try:
        return str(json.loads(paths.stack.read_text())["api"])
    except (OSError, ValueError, KeyError):
        return None


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:
            return bool(response.status == 200)
    except (OSError, ValueError):
        return False


DEMAND_NAMESPACE = "default"  # `tidal dev`'s router namespace: its demand Lease and its key copies


def up(options: UpOptions, out: Any = sys.stdout) -> dict[str, Any]:
    """Start whatever is not running yet, apply the files, wait for Ready, print how to reach
    it. Idempotent: a second `up` reuses the running stack."""
    paths = Paths(options.state_dir.resolve())
    paths.root.mkdir(parents=True, exist_ok=True)
    if not paths.api_key.exists():
        paths.api_key.write_text(secrets.token_urlsafe(24) + "\n")
        paths.api_key.chmod(0o600)
    api_key = paths.api_key.read_text().strip()

    # 1. The control plane (API server + kubelet).
    if read_pid(paths, "controlplane") is None:
        with contextlib.suppress(OSError):
            paths.stack.unlink()
        argv = [_python(), "-m", "tidal_operator.dev.stack", "controlplane", "--state-dir", str(paths.root),
                "--port", str(options.api_port), "--crds", str(options.crds)]
        if options.fake_engines:
            argv.append("--fake-engines")
        if options.engine_command:
            argv += ["--engine-command", shlex.join(options.engine_command)]
        _spawn(paths, "controlplane", argv)
        print(f"starting the control plane (logs: {paths.log('controlplane')})", file=out)
    api = _wait("the API server", lambda: (u := _api_url(paths)) and _healthy(f"{u}/readyz") and u, 60,
                paths.log("controlplane"))

    # 2. The operator, standalone (one replica; no peering objects in the dev cluster). It reads
    # the router's held demand (scale from zero) from the router this stack runs, with the key.
    if read_pid(paths, "operator") is None:
        operator_env: dict[str, str] = {}
        if options.router:  # every router's held demand, from their Leases
            operator_env = {"TIDAL_ROUTER_DEMAND_NAMESPACE": DEMAND_NAMESPACE,
                            "TIDAL_ROUTER_NAMESPACE": DEMAND_NAMESPACE}  # and key copies for the router
        roots = [arg for root in options.allowed_file_roots for arg in ("--allowed-file-root", str(root.resolve()))]
        # One second of preStop is plenty here: the router sees a Pod's deletion through its
        # watch within milliseconds (a real cluster's endpoint propagation needs the default 5).
        _spawn(paths, "operator", [_python(), "-m", "tidal_operator.cli", "operator", "--standalone",
                                   "--kubeconfig", str(paths.kubeconfig), "--resync-seconds", "30",
                                   "--pre-stop-sleep-seconds", str(DEV_PRE_STOP_SLEEP_S), *roots],
               env=operator_env)
        print(f"starting the operator (logs: {paths.log('operator')})", file=out)

    # 3. The router, with the generated key (through the environment, not argv: ps shows argv).
    router_url = None
    if options.router:
        state = json.loads(paths.stack.read_text())
        if read_pid(paths, "router") is None:
            if not port_free("127.0.0.1", options.router_port):
                raise StackError(f"port {options.router_port} is taken: pass --router-port")
            _spawn(paths, "router", [_python(), "-m", "tidal_operator.cli", "router", "--kubeconfig",
                                     str(paths.kubeconfig), "--host", "127.0.0.1",
                                     "--port", str(options.router_port), "--log-level", "warning",
                                     "--demand-leases", DEMAND_NAMESPACE, "--keys-namespace", DEMAND_NAMESPACE],
                   env={"TIDAL_ROUTER_API_KEY": api_key})
            state["router"] = f"http://127.0.0.1:{options.router_port}"
            paths.stack.write_text(json.dumps(state))
            print(f"starting the router (logs: {paths.log('router')})", file=out)
        router_url = state.get("router")
        if router_url:
            _wait("the router", lambda: _healthy(f"{router_url}/health"), 60, paths.log("router"))

    # 4. Apply and wait.
    applied: list[Obj] = []
    if options.apply and options.files:
        applied = apply_files(api, options.files)
        for obj in applied:
            print(f"applied {obj['kind']} {obj['metadata'].get('namespace', '')}/{obj['metadata']['name']}", file=out)
    llms = [o for o in applied if o.get("kind") == L.KIND]
    ready = [wait_ready(api, o["metadata"]["namespace"], o["metadata"]["name"], options.wait_s, paths, out)
             for o in llms]

    print(f"\nexport KUBECONFIG={paths.kubeconfig}   # then: kubectl get llm,pods", file=out)
    for llm in ready:
        model = (llm.get("status") or {}).get("servedModelName") or llm["metadata"]["name"]
        print(f"\n{llm['metadata']['name']} is Ready. Ask it:", file=out)
        print(curl_line(model, router_url, paths, llm), file=out)
    return {"api": api, "router": router_url, "kubeconfig": str(paths.kubeconfig), "ready": ready}


def curl_line(model: str, router_url: str | None, paths: Paths, llm: Obj) -> str:
    # temperature 0: a small model sampled at 1 answers this wrong more often than not.
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "What is the capital of France?"}],
                       "max_tokens": 32, "temperature": 0})
    if router_url:
        return (f"curl -s {router_url}/v1/chat/completions -H \"Authorization: Bearer $(cat {paths.api_key})\" "
                f"-H 'Content-Type: application/json' -d '{body}'")
    endpoints = (llm.get("status") or {}).get("podEndpoints") or [{"url": "http://<pod-ip>:8000/v1"}]
    return f"curl -s {endpoints[0]['url']}/chat/completions -H 'Content-Type: application/json' -d '{body}'"


def wait_ready(api: str, namespace: str, name: str, timeout_s: float, paths: Paths, out: Any) -> Obj:
    """Poll until the LLMService says Ready (bounded). On timeout, say why it isn't."""
    url = f"{api}/apis/{L.GROUP}/{L.VERSION}/namespaces/{namespace}/{L.PLURAL}/{name}"
    deadline = time.monotonic() + timeout_s
    last_phase = None
    llm: Obj = {}
    print(f"waiting up to {timeout_s:g}s for {namespace}/{name} to be Ready", file=out, flush=True)
    while time.monotonic() < deadline:
        code, llm = _http("GET", url)
        status = (llm or {}).get("status") or {} if code == 200 else {}
        if status.get("phase") != last_phase and status.get("phase"):
            last_phase = status["phase"]
            print(f"  {name}: {last_phase} {status.get('replicasText', '')}", file=out, flush=True)
        if status.get("phase") == "Ready" and status.get("observedGeneration") == llm["metadata"].get("generation"):
            return llm
        time.sleep(0.5)
    conditions = "; ".join(f"{c.get('type')}={c.get('status')} ({c.get('reason')}: {c.get('message')})"
                           for c in ((llm or {}).get("status") or {}).get("conditions") or [])
    raise StackError(f"{namespace}/{name} is not Ready after {timeout_s:g}s: {conditions or 'no status yet'}. "
                     f"Pod logs: {paths.logs}/{namespace}/; operator log: {paths.log('operator')}")


def down(state_dir: Path, out: Any = sys.stdout) -> list[str]:
    """Stop everything `up` started, engines included. Returns what was stopped."""
    paths = Paths(state_dir.resolve())
    stopped = []
    # Router and operator first, so nothing reacts to the control plane going away.
    for component, grace in (("router", 10.0), ("operator", 10.0), ("controlplane", 45.0)):
        pid = read_pid(paths, component)
        if pid is not None:
            _stop_pid(pid, grace)
            stopped.append(component)
        with contextlib.suppress(OSError):
            paths.pidfile(component).unlink()
    # Engines the control plane could not stop (it was killed, say): their process groups.
    for key, (pgid, started) in engine_pids(paths).items():
        if pid_alive(pgid) and _start_time(pgid) == started:
            _stop_pid(pgid, 10.0)
            stopped.append(f"engine {key}")
    for leftover in (paths.engines, paths.stack):
        with contextlib.suppress(OSError):
            leftover.unlink()
    print("stopped: " + (", ".join(stopped) if stopped else "nothing was running"), file=out)
    return stopped


def status(state_dir: Path, out: Any = sys.stdout) -> dict[str, Any]:
    paths = Paths(state_dir.resolve())
    components = {c: read_pid(paths, c) for c in COMPONENTS}
    for component, pid in components.items():
        print(f"{component:13s} {'running (pid ' + str(pid) + ')' if pid else 'stopped'}", file=out)
    api = _api_url(paths)
    llms: list[Obj] = []
    if api and components["controlplane"]:
        code, listing = _http("GET", f"{api}/apis/{L.GROUP}/{L.VERSION}/{L.PLURAL}")
        llms = (listing or {}).get("items", []) if code == 200 else []
        print(f"\nAPI server    {api}  (KUBECONFIG={paths.kubeconfig})", file=out)
        with contextlib.suppress(OSError, ValueError):
            router = json.loads(paths.stack.read_text()).get("router")
            if router:
                print(f"router        {router}  (key: {paths.api_key})", file=out)
        for llm in llms:
            s = llm.get("status") or {}
            print(f"  {llm['metadata']['namespace']}/{llm['metadata']['name']}: {s.get('phase', '?')} "
                  f"{s.get('replicasText', '')} {s.get('endpoint', '')}", file=out)
    return {"components": components, "api": api, "llmservices": llms}


# --- the control-plane process -------------------------------------------------------------------

def _loopback_blocks_in_use() -> set[int]:
    """X of every 127.0.X.Y (Y >= 2) with a listening TCP socket: the Pod addresses of other
    `tidal dev` stacks' engines. Linux (/proc/net/tcp); elsewhere, none known."""
    blocks: set[int] = set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            fields = line.split()
            if len(fields) < 4 or fields[3] != "0A":  # 0A: LISTEN
                continue
            with contextlib.suppress(ValueError, struct.error):
                # The kernel prints the address as a native-order u32 in hex.
                a, b, c, d = struct.pack("=I", int(fields[1].split(":")[0], 16))
                if a == 127 and b == 0 and d >= 2:
                    blocks.add(c)
    return blocks


def first_pod_ip(api_port: int, in_use: set[int] | None = None, *, fake_engines: bool = False) -> int:
    """The kubelet's first Pod address, as an index into 127.0.0.0/16 (127.0.X.Y = X*256+Y).

    Every kubelet counts from its first address, so two stacks on one machine (`make up`
    left running during the tests, say) would give their engines the same 127.0.0.N:port:
    one engine fails to bind, and the other stack's engine answers its probes and requests.
    So a stack that runs engines takes a /24 of its own, 127.0.X.0 with X >= 1, picked by its
    API server's (random) port among those no listening socket uses yet. Fake engines bind
    nothing: they keep 127.0.0.x."""
    if fake_engines:
        return 2
    busy = _loopback_blocks_in_use() if in_use is None else in_use
    free = [block for block in range(1, 255) if block not in busy] or list(range(1, 255))
    return free[api_port % len(free)] * 256 + 2


async def _serve_controlplane(state_dir: Path, port: int, crds: Path, fake_engines: bool,
                              engine_command: tuple[str, ...] = ()) -> None:
    from .apiserver import start_apiserver
    from .kubeconfig import write_kubeconfig
    from .kubelet import LocalKubelet

    paths = Paths(state_dir)
    handle = await start_apiserver("127.0.0.1", port, crds, log_dir=paths.logs)
    kubelet = LocalKubelet(handle.url, state_dir=paths.root, fake_ready=fake_engines, workdir=Path.cwd(),
                           first_ip=first_pod_ip(handle.port, fake_engines=fake_engines),
                           engine_command=engine_command)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await kubelet.start()
        write_kubeconfig(paths.kubeconfig, handle.url)
        # Written last: `up` takes stack.json as the sign that the control plane is ready.
        paths.stack.write_text(json.dumps({"api": handle.url}))
        log.info("API server on %s, kubelet %s", handle.url, "fake_ready" if fake_engines else "running engines")
        while not stop.is_set():
            _record_engines(paths, kubelet)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
    finally:
        await kubelet.stop()  # kills every engine process
        with contextlib.suppress(OSError):
            paths.engines.unlink()
        await handle.stop()


def _record_engines(paths: Paths, kubelet: Any) -> None:
    """Keep engines.json current, so `down` can kill engines even if this process died."""
    pids = {f"{r.key}/{name}": [pid, _start_time(pid)] for r in list(kubelet.pods.values())
            for name, pid in r.pids().items()}
    text = json.dumps(pids, sort_keys=True)
    if not paths.engines.exists() or paths.engines.read_text() != text:
        tmp = paths.engines.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(paths.engines)


def main(argv: list[str] | None = None) -> None:
    """`python -m tidal_operator.dev.stack controlplane ...` (what `tidal dev up` spawns)."""
    parser = argparse.ArgumentParser(prog="tidal_operator.dev.stack")
    sub = parser.add_subparsers(dest="command", required=True)
    cp = sub.add_parser("controlplane")
    cp.add_argument("--state-dir", type=Path, required=True)
    cp.add_argument("--port", type=int, default=0)
    cp.add_argument("--crds", type=Path, default=DEFAULT_CRDS)
    cp.add_argument("--fake-engines", action="store_true")
    cp.add_argument("--engine-command", default="", help="shell words run instead of tidal-engine")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(_serve_controlplane(args.state_dir.resolve(), args.port, args.crds, args.fake_engines,
                                    tuple(shlex.split(args.engine_command))))


if __name__ == "__main__":
    main()
