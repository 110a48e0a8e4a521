"""A local "kubelet" for `tidal dev`: runs each Pod's containers as local processes.

It watches Pods on the (emulated) API server, adopts every Pod that is unscheduled or bound
to its node name, and for each one:
- gives it its own loopback address 127.0.0.N, so every pod can listen on the same port;
- starts `command + args` (the image is ignored) with the container's env resolved
  (values, secretKeyRef, configMapKeyRef, fieldRef, envFrom) and `$(VAR)` references expanded
  as Kubernetes does; output goes to `<state_dir>/logs/<ns>/<pod>/<container>.log`;
- runs startup/readiness/liveness probes (httpGet, tcpSocket, exec) and reports phase,
  conditions, podIP, containerStatuses and restarts (CrashLoopBackOff with backoff);
- on deletion runs preStop hooks, SIGTERM, waits the grace period, SIGKILL, then confirms the
  delete with gracePeriodSeconds=0 (stopping the kubelet itself skips preStop);
`fake_ready=True` runs nothing and marks pods Running and Ready at once (benchmarks, unit tests).
`engine_command` runs that instead of `tidal-engine` (same arguments): engine stand-ins that
serve HTTP, for benchmarks of the router and operator in front of them.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import aiohttp

from .objects import now_iso

log = logging.getLogger(__name__)
Obj = dict[str, Any]

# Loopback addresses in use by live pods, across every kubelet of this process.
_ips_in_use: set[int] = set()


def _allocate_ip(first: int) -> tuple[int, str]:
    index = first
    while index in _ips_in_use or index % 256 in (0, 255):
        index += 1
    _ips_in_use.add(index)
    return index, f"127.0.{index >> 8}.{index & 255}"


_VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.\-]*)\)")


def pod_network_address(arg: str, pod_ip: str) -> str:
    """Local processes share the host's network, so each Pod gets its own loopback address
    instead of a network namespace. "Every address in the Pod" (0.0.0.0) is that address:
    binding the host's 0.0.0.0 would make every engine of the same port collide."""
    return pod_ip if arg == "0.0.0.0" else arg


def expand_refs(text: str, variables: Mapping[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion: known names are replaced, unknown ones kept, `$$` escapes."""
    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return variables[name] if name in variables else match.group(0)
    return _VAR_REF.sub(replace, text)


class ConfigError(Exception):
    """A referenced Secret/ConfigMap/key is missing: the container waits (CreateContainerConfigError)."""


class ContainerRuntime:
    """One container: its process, probes and the state reported in containerStatuses."""

    def __init__(self, pod: "PodRuntime", spec: Obj) -> None:
        self.pod, self.spec, self.name = pod, spec, spec["name"]
        self.state: Obj = {"waiting": {"reason": "ContainerCreating"}}
        self.last_state: Obj = {}
        self.ready = False
        self.started = False
        self.restart_count = 0
        self.proc: asyncio.subprocess.Process | None = None
        self.stopping = False

    def status(self) -> Obj:
        return {"name": self.name, "image": self.spec.get("image", ""), "imageID": "",
                "containerID": f"local://{self.proc.pid}" if self.proc else "",
                "ready": self.ready, "started": self.started, "restartCount": self.restart_count,
                "state": self.state, "lastState": self.last_state}

    async def supervise(self, env: dict[str, str], argv: list[str]) -> None:
        """Run, watch, restart per restartPolicy, until the pod stops or the container is done."""
        policy = self.pod.pod["spec"].get("restartPolicy", "Always")
        backoff = self.pod.kubelet.backoff_base_s
        while not self.stopping:
            began = time.monotonic()
            exit_code, reason = await self._run_once(env, argv)
            if self.stopping:
                return
            finished = {"exitCode": exit_code, "reason": reason, "startedAt": self.state.get("running", {}).get(
                "startedAt", now_iso()), "finishedAt": now_iso()}
            if exit_code != 0 and self.spec.get("terminationMessagePolicy") == "FallbackToLogsOnError":
                finished["message"] = self._log_tail()
            self.ready = self.started = False
            self.state = {"terminated": finished}
            if policy == "Never" or (policy == "OnFailure" and exit_code == 0):
                await self.pod.sync_status()
                return
            if time.monotonic() - began > 10 * self.pod.kubelet.backoff_max_s:
                backoff = self.pod.kubelet.backoff_base_s  # it ran long enough: forgive earlier crashes
            self.last_state = {"terminated": finished}
            self.restart_count += 1  # counted as soon as the restart is scheduled, as kubectl shows it
            self.state = {"waiting": {"reason": "CrashLoopBackOff",
                                      "message": f"back-off {backoff:g}s restarting failed container={self.name}"}}
            await self.pod.sync_status()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.pod.kubelet.backoff_max_s)

    def _log_tail(self, max_bytes: int = 2048, max_lines: int = 80) -> str:
        """The kubelet's FallbackToLogsOnError message: the log's end, at most 2048 bytes or 80 lines."""
        try:
            data = (self.pod.log_dir / f"{self.name}.log").read_bytes()[-max_bytes:]
        except OSError:
            return ""
        return "\n".join(data.decode(errors="replace").splitlines()[-max_lines:])

    async def _run_once(self, env: dict[str, str], argv: list[str]) -> tuple[int, str]:
        log_path = self.pod.log_dir / f"{self.name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log_file:
            try:
                self.proc = await asyncio.create_subprocess_exec(
                    *argv, env=env, cwd=self.pod.kubelet.workdir_for(self.spec), stdin=asyncio.subprocess.DEVNULL,
                    stdout=log_file, stderr=asyncio.subprocess.STDOUT, start_new_session=True)
            except OSError as exc:
                log_file.write(f"failed to start {argv!r}: {exc}\n".encode())
                return 128, "StartError"
        self.state = {"running": {"startedAt": now_iso()}}
        has_startup = "startupProbe" in self.spec
        self.started = not has_startup
        self.ready = self.started and "readinessProbe" not in self.spec
        await self.pod.sync_status()
        probes = asyncio.create_task(self._probes())
        try:
            exit_code = await self.proc.wait()
        finally:
            probes.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await probes
        # A negative code is death by signal; Kubernetes reports 128 + signal number.
        exit_code = 128 - exit_code if exit_code < 0 else exit_code
        return exit_code, "Completed" if exit_code == 0 else "Error"

    async def _probes(self) -> None:
        if "startupProbe" in self.spec:
            if not await self._probe_loop("startup", self.spec["startupProbe"]):
                return
            self.started = True
            self.ready = "readinessProbe" not in self.spec
            await self.pod.sync_status()
        loops = [self._probe_loop(kind, self.spec[f"{kind}Probe"]) for kind in ("readiness", "liveness")
                 if f"{kind}Probe" in self.spec]
        if loops:
            await asyncio.gather(*loops)

    async def _probe_loop(self, kind: str, probe: Obj) -> bool:
        """Returns True when a startup probe passes; readiness/liveness loop until cancelled."""
        await asyncio.sleep(float(probe.get("initialDelaySeconds", 0)))
        period = float(probe.get("periodSeconds", 10))
        failure_threshold = int(probe.get("failureThreshold", 3))
        success_threshold = int(probe.get("successThreshold", 1))
        successes = failures = 0
        while True:
            ok = await self.pod.kubelet.run_probe(probe, self.pod, self.spec)
            successes, failures = (successes + 1, 0) if ok else (0, failures + 1)
            if kind == "startup" and ok:
                return True
            if kind == "readiness":
                if ok and successes >= success_threshold and not self.ready:
                    self.ready = True
                    await self.pod.sync_status()
                elif not ok and failures >= failure_threshold and self.ready:
                    self.ready = False
                    await self.pod.sync_status()
            if kind in ("startup", "liveness") and failures >= failure_threshold:
                log.info("%s probe failed for %s/%s: restarting", kind, self.pod.key, self.name)
                await self.terminate(float(self.pod.pod["spec"].get("terminationGracePeriodSeconds", 30)),
                                     pre_stop=False)
                return False
            await asyncio.sleep(period)

    async def terminate(self, grace_s: float, *, pre_stop: bool = True) -> None:
        """preStop hook (best effort), SIGTERM to the process group, SIGKILL after the grace period."""
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        deadline = time.monotonic() + grace_s
        hook = (self.spec.get("lifecycle") or {}).get("preStop")
        if pre_stop and hook and "sleep" in hook:
            # The `sleep` action (Kubernetes 1.30+): a pause that lets endpoints and routers
            # stop sending to this Pod before it gets SIGTERM.
            await asyncio.sleep(min(float(hook["sleep"].get("seconds", 0)), grace_s))
        elif pre_stop and hook:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.pod.kubelet.run_probe(hook, self.pod, self.spec), max(grace_s, 0.1))
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)
            try:
                await asyncio.wait_for(proc.wait(), max(deadline - time.monotonic(), 0.0) + 0.05
                                       if sig == signal.SIGTERM else None)
                break
            except asyncio.TimeoutError:
                continue
        # Reap stragglers the main process left in its group.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)


class PodRuntime:
    """One adopted Pod: its address, containers and status reporting."""

    def __init__(self, kubelet: "LocalKubelet", pod: Obj) -> None:
        self.kubelet, self.pod = kubelet, pod
        meta = pod["metadata"]
        self.namespace, self.name, self.uid = meta["namespace"], meta["name"], meta["uid"]
        self.key = f"{self.namespace}/{self.name}"
        self.ip_index, self.ip = _allocate_ip(kubelet.first_ip)
        self.log_dir = kubelet.state_dir / "logs" / self.namespace / self.name
        self.containers = [ContainerRuntime(self, c) for c in pod["spec"].get("containers", [])]
        self.start_time = now_iso()
        self.stop_requested = asyncio.Event()
        self.gone_from_api = False  # the object is already removed: nothing to confirm
        self.task: asyncio.Task[None] | None = None
        self._status_lock = asyncio.Lock()
        self._written: Obj | None = None
        self._transitions: dict[str, tuple[str, str]] = {}
        self._config_error: str | None = None
        self._supervisors: list[asyncio.Task[None]] = []

    def pids(self) -> dict[str, int]:
        return {c.name: c.proc.pid for c in self.containers if c.proc is not None}

    # --- status ----------------------------------------------------------------------------------

    def _phase(self) -> str:
        states = [c.state for c in self.containers]
        if self._supervisors and all(t.done() for t in self._supervisors) and states and all(
                "terminated" in s for s in states):
            return "Succeeded" if all(s["terminated"]["exitCode"] == 0 for s in states) else "Failed"
        if any("running" in s for s in states) or any(c.restart_count or c.last_state for c in self.containers):
            return "Running"
        return "Pending"

    def _condition(self, kind: str, ok: bool) -> Obj:
        value = "True" if ok else "False"
        previous = self._transitions.get(kind)
        if previous is None or previous[0] != value:
            self._transitions[kind] = (value, now_iso())
        return {"type": kind, "status": value, "lastProbeTime": None,
                "lastTransitionTime": self._transitions[kind][1]}

    def build_status(self) -> Obj:
        all_ready = bool(self.containers) and all(c.ready for c in self.containers)
        statuses = [c.status() for c in self.containers]
        if self._config_error:
            for status in statuses:
                status["state"] = {"waiting": {"reason": "CreateContainerConfigError", "message": self._config_error}}
        return {
            "phase": self._phase(),
            "conditions": [self._condition("PodReadyToStartContainers", True), self._condition("Initialized", True),
                           self._condition("Ready", all_ready), self._condition("ContainersReady", all_ready),
                           self._condition("PodScheduled", True)],
            "hostIP": "127.0.0.1", "hostIPs": [{"ip": "127.0.0.1"}],
            "podIP": self.ip, "podIPs": [{"ip": self.ip}],
            "startTime": self.start_time, "qosClass": "BestEffort",
            "containerStatuses": statuses,
        }

    async def sync_status(self, status: Obj | None = None) -> None:
        async with self._status_lock:
            status = status or self.build_status()
            if status == self._written:
                return
            self._written = status
            await self.kubelet.patch_pod_status(self.namespace, self.name, status)

    # --- lifecycle -------------------------------------------------------------------------------

    async def run(self) -> None:
        try:
            if self.kubelet.fake_ready:
                await self._run_fake()
            else:
                await self._run_real()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("pod %s failed in the kubelet", self.key)
            await self.stop_requested.wait()
        finally:
            await self._shutdown()

    async def _run_fake(self) -> None:
        for container in self.containers:
            container.state = {"running": {"startedAt": now_iso()}}
            container.ready = container.started = True
        await self.sync_status()
        await self.stop_requested.wait()

    async def _run_real(self) -> None:
        await self.sync_status()
        prepared: list[tuple[ContainerRuntime, dict[str, str], list[str]]] = []
        while not prepared:
            try:
                for container in self.containers:
                    env, variables = await self.kubelet.container_env(self.pod, container.spec, self.ip)
                    argv = [pod_network_address(expand_refs(str(a), variables), self.ip)
                            for a in self.kubelet.command_line(container.spec)]
                    if not argv:
                        raise ConfigError(f"container {container.name} has no command: images are not run locally")
                    prepared.append((container, env, argv))
                self._config_error = None
            except ConfigError as exc:
                prepared = []
                self._config_error = str(exc)
                await self.sync_status()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.stop_requested.wait(), 1.0)
                if self.stop_requested.is_set():
                    return
        self._supervisors = [asyncio.create_task(c.supervise(env, argv)) for c, env, argv in prepared]
        stop_wait = asyncio.create_task(self.stop_requested.wait())
        await asyncio.wait([stop_wait, *self._supervisors], return_when=asyncio.FIRST_COMPLETED)
        while not self.stop_requested.is_set() and not all(t.done() for t in self._supervisors):
            await asyncio.wait([stop_wait, *self._supervisors], return_when=asyncio.FIRST_COMPLETED)
        if not self.stop_requested.is_set():
            await self.sync_status()  # terminal phase: Succeeded or Failed
            await self.stop_requested.wait()
        stop_wait.cancel()

    async def _shutdown(self) -> None:
        meta = self.pod["metadata"]
        grace = meta.get("deletionGracePeriodSeconds")
        if grace is None:
            grace = self.pod["spec"].get("terminationGracePeriodSeconds", 30)
        for container in self.containers:
            container.stopping = True
        # When the whole local cluster stops, no router is left to drain away from: skip preStop.
        pre_stop = not self.kubelet.stopping
        await asyncio.gather(*(c.terminate(float(grace), pre_stop=pre_stop) for c in self.containers),
                             return_exceptions=True)
        for task in self._supervisors:
            task.cancel()
        await asyncio.gather(*self._supervisors, return_exceptions=True)
        _ips_in_use.discard(self.ip_index)
        if not self.gone_from_api and not self.kubelet.stopping:
            await self.kubelet.confirm_deletion(self.namespace, self.name, self.uid)


class LocalKubelet:
    """Runs the Pods of the API server at `server_url` as local processes (see module docstring)."""

    def __init__(self, server_url: str, *, node_name: str = "tidal-dev", state_dir: str | Path = ".tidal/dev",
                 workdir: str | Path | None = None, fake_ready: bool = False, namespace: str | None = None,
                 backoff_base_s: float = 10.0, backoff_max_s: float = 300.0, first_ip: int = 2,
                 extra_env: Mapping[str, str] | None = None, engine_command: Sequence[str] = ()) -> None:
        self.server_url = server_url.rstrip("/")
        self.node_name = node_name
        self.state_dir = Path(state_dir)
        self.workdir = Path(workdir) if workdir else Path.cwd()
        self.fake_ready = fake_ready
        self.namespace = namespace
        self.backoff_base_s, self.backoff_max_s = backoff_base_s, backoff_max_s
        self.first_ip = first_ip
        self.extra_env = dict(extra_env or {})
        self.engine_command = list(engine_command)
        self.pods: dict[str, PodRuntime] = {}  # by uid
        self.stopping = False
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None
        self._synced = asyncio.Event()

    # --- public ----------------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect, register the Node, and begin running pods; returns after the first sync."""
        self._session = aiohttp.ClientSession(self.server_url, read_bufsize=1 << 22,
                                              timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        await self._register_node()
        self._task = asyncio.create_task(self._watch_forever())
        await asyncio.wait_for(self._synced.wait(), 30)

    async def stop(self) -> None:
        """Kill every pod's processes (no API writes: the server may already be gone)."""
        self.stopping = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for runtime in list(self.pods.values()):
            runtime.stop_requested.set()
        await asyncio.gather(*(r.task for r in self.pods.values() if r.task), return_exceptions=True)
        self.pods.clear()
        if self._session is not None:
            await self._session.close()

    def find(self, namespace: str, name: str) -> PodRuntime | None:
        return next((r for r in self.pods.values() if r.namespace == namespace and r.name == name), None)

    def workdir_for(self, container: Obj) -> Path:
        wanted = container.get("workingDir")
        if wanted and Path(wanted).is_absolute() and Path(wanted).is_dir():
            return Path(wanted)
        return self.workdir

    # --- API calls -------------------------------------------------------------------------------

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "LocalKubelet.start() first"
        return self._session

    async def _register_node(self) -> None:
        node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": self.node_name, "labels": {
            "kubernetes.io/hostname": self.node_name, "kubernetes.io/os": sys.platform}}}
        async with self.session.post("/api/v1/nodes", json=node) as response:
            if response.status not in (201, 409):
                log.warning("could not register node %s: HTTP %s", self.node_name, response.status)
                return
        status = {"status": {"conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                                             "lastTransitionTime": now_iso()}],
                             "addresses": [{"type": "InternalIP", "address": "127.0.0.1"},
                                           {"type": "Hostname", "address": self.node_name}]}}
        await self._patch(f"/api/v1/nodes/{self.node_name}/status", status)

    async def _patch(self, path: str, body: Obj) -> int:
        async with self.session.patch(path, data=json.dumps(body),
                                      headers={"Content-Type": "application/merge-patch+json"}) as response:
            await response.read()
            return response.status

    async def patch_pod_status(self, namespace: str, name: str, status: Obj) -> None:
        with contextlib.suppress(aiohttp.ClientError):
            await self._patch(f"/api/v1/namespaces/{namespace}/pods/{name}/status", {"status": status})

    async def confirm_deletion(self, namespace: str, name: str, uid: str) -> None:
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": 0,
                "preconditions": {"uid": uid}}
        with contextlib.suppress(aiohttp.ClientError):
            async with self.session.delete(f"/api/v1/namespaces/{namespace}/pods/{name}", json=body) as response:
                await response.read()

    async def _get_data(self, kind: str, namespace: str, name: str, optional: bool) -> dict[str, str] | None:
        async with self.session.get(f"/api/v1/namespaces/{namespace}/{kind}/{name}") as response:
            if response.status == 404:
                if optional:
                    return None
                raise ConfigError(f'{kind[:-1]} "{name}" not found')
            response.raise_for_status()
            obj = await response.json()
        data = dict(obj.get("data") or {})
        if kind == "secrets":
            return {k: base64.b64decode(v).decode(errors="replace") for k, v in data.items()}
        return data

    def command_line(self, container: Obj) -> list[str]:
        """`command + args`, with `engine_command` in place of a leading `tidal-engine`."""
        command = [str(a) for a in container.get("command") or []]
        if self.engine_command and command[:1] == ["tidal-engine"]:
            command = [*self.engine_command, *command[1:]]
        return [*command, *(str(a) for a in container.get("args") or [])]

    # --- env -------------------------------------------------------------------------------------

    async def container_env(self, pod: Obj, container: Obj, ip: str) -> tuple[dict[str, str], dict[str, str]]:
        """(process environment, the variables `$(VAR)` may reference)."""
        meta = pod["metadata"]
        venv_bin = str(Path(sys.executable).parent)
        env = dict(os.environ)
        env["PATH"] = os.pathsep.join([venv_bin, env.get("PATH", "")])
        env.update(self.extra_env)
        variables: dict[str, str] = {"TIDAL_POD_IP": ip, "TIDAL_POD_NAME": meta["name"],
                                     "TIDAL_POD_NAMESPACE": meta["namespace"]}
        for source in container.get("envFrom") or []:
            prefix = source.get("prefix", "")
            for kind, ref_key in (("configmaps", "configMapRef"), ("secrets", "secretRef")):
                ref = source.get(ref_key)
                if ref:
                    data = await self._get_data(kind, meta["namespace"], ref["name"], ref.get("optional", False))
                    variables.update({prefix + k: v for k, v in (data or {}).items()})
        for var in container.get("env") or []:
            value = await self._env_value(pod, var, ip, variables)
            if value is not None:
                variables[var["name"]] = value
        env.update(variables)
        env["HOSTNAME"] = meta["name"]
        return env, variables

    async def _env_value(self, pod: Obj, var: Obj, ip: str, variables: dict[str, str]) -> str | None:
        if "valueFrom" not in var:
            return expand_refs(str(var.get("value", "")), variables)
        source = var["valueFrom"]
        namespace = pod["metadata"]["namespace"]
        for kind, ref_key in (("secrets", "secretKeyRef"), ("configmaps", "configMapKeyRef")):
            if ref_key in source:
                ref = source[ref_key]
                data = await self._get_data(kind, namespace, ref["name"], ref.get("optional", False))
                if data is None or ref["key"] not in data:
                    if ref.get("optional", False):
                        return None
                    raise ConfigError(f'couldn\'t find key {ref["key"]} in {kind[:-1]} {namespace}/{ref["name"]}')
                return data[ref["key"]]
        if "fieldRef" in source:
            return self._field_ref(pod, source["fieldRef"]["fieldPath"], ip)
        return ""  # resourceFieldRef: there are no resource limits locally

    def _field_ref(self, pod: Obj, path: str, ip: str) -> str:
        meta = pod["metadata"]
        if match := re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path):
            return str((meta.get(match.group(1)) or {}).get(match.group(2), ""))
        values = {
            "metadata.name": meta["name"], "metadata.namespace": meta["namespace"], "metadata.uid": meta["uid"],
            "spec.nodeName": self.node_name, "spec.serviceAccountName": pod["spec"].get("serviceAccountName", ""),
            "status.podIP": ip, "status.podIPs": ip, "status.hostIP": "127.0.0.1", "status.hostIPs": "127.0.0.1",
        }
        return values.get(path, "")

    # --- probes and hooks ------------------------------------------------------------------------

    async def run_probe(self, probe: Obj, pod: PodRuntime, container: Obj) -> bool:
        timeout = float(probe.get("timeoutSeconds", 1))
        try:
            if "httpGet" in probe:
                action = probe["httpGet"]
                port = self._port(action.get("port"), container)
                url = f"{action.get('scheme', 'HTTP').lower()}://{action.get('host') or pod.ip}:{port}" \
                      f"{action.get('path', '/')}"
                headers = {h["name"]: h["value"] for h in action.get("httpHeaders") or []}
                async with self.session.get(url, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                    return 200 <= r.status < 400
            if "tcpSocket" in probe:
                action = probe["tcpSocket"]
                port = self._port(action.get("port"), container)
                _, writer = await asyncio.wait_for(asyncio.open_connection(action.get("host") or pod.ip, port), timeout)
                writer.close()
                return True
            if "exec" in probe:
                env, _ = await self.container_env(pod.pod, container, pod.ip)
                proc = await asyncio.create_subprocess_exec(
                    *probe["exec"]["command"], env=env, cwd=self.workdir_for(container),
                    stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
                try:
                    return await asyncio.wait_for(proc.wait(), timeout) == 0
                except asyncio.TimeoutError:
                    proc.kill()
                    await proc.wait()
                    return False
        except (OSError, aiohttp.ClientError, asyncio.TimeoutError, ConfigError):
            return False
        return False

    @staticmethod
    def _port(port: Any, container: Obj) -> int:
        if isinstance(port, str) and not port.isdigit():
            for item in container.get("ports") or []:
                if item.get("name") == port:
                    return int(item["containerPort"])
            raise OSError(f"no container port named {port}")
        return int(port)

    # --- watch loop ------------------------------------------------------------------------------

    def _pods_path(self) -> str:
        return f"/api/v1/namespaces/{self.namespace}/pods" if self.namespace else "/api/v1/pods"

    async def _watch_forever(self) -> None:
        while not self.stopping:
            try:
                async with self.session.get(self._pods_path()) as response:
                    response.raise_for_status()
                    listing = await response.json()
                live = set()
                for pod in listing["items"]:
                    live.add(pod["metadata"]["uid"])
                    await self._on_pod(pod)
                for uid in set(self.pods) - live:
                    self._on_gone(uid)
                self._synced.set()
                await self._watch(listing["metadata"]["resourceVersion"])
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the server restarted or went away: retry
                log.debug("kubelet watch failed: %r", exc)
                await asyncio.sleep(0.5)

    async def _watch(self, resource_version: str) -> None:
        params = {"watch": "1", "resourceVersion": resource_version, "allowWatchBookmarks": "true",
                  "timeoutSeconds": "300"}
        async with self.session.get(self._pods_path(), params=params) as response:
            response.raise_for_status()
            async for line in response.content:
                if not line.strip():
                    continue
                event = json.loads(line)
                kind, pod = event["type"], event["object"]
                if kind == "ERROR":
                    return  # e.g. 410 Gone: relist
                if kind in ("ADDED", "MODIFIED"):
                    await self._on_pod(pod)
                elif kind == "DELETED":
                    self._on_gone(pod["metadata"]["uid"])

    async def _on_pod(self, pod: Obj) -> None:
        meta, spec = pod["metadata"], pod.get("spec") or {}
        node = spec.get("nodeName")
        if node and node != self.node_name:
            return
        uid = meta["uid"]
        runtime = self.pods.get(uid)
        if runtime is None:
            if pod.get("status", {}).get("phase") in ("Succeeded", "Failed"):
                return  # finished before we (re)started: do not run it again
            if meta.get("deletionTimestamp"):
                # Nothing runs for it (any more): just let the delete finish.
                if meta.get("deletionGracePeriodSeconds", 0) != 0:
                    await self.confirm_deletion(meta["namespace"], meta["name"], uid)
                return
            if not node:
                # Act as the scheduler: binding makes deletion graceful, waiting for us.
                await self._patch(f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                                  {"spec": {"nodeName": self.node_name}})
                pod = {**pod, "spec": {**spec, "nodeName": self.node_name}}
            runtime = PodRuntime(self, pod)
            self.pods[uid] = runtime
            runtime.task = asyncio.create_task(runtime.run())
            runtime.task.add_done_callback(lambda _t, uid=uid: self.pods.pop(uid, None))
        else:
            runtime.pod = pod
        if meta.get("deletionTimestamp"):
            runtime.stop_requested.set()

    def _on_gone(self, uid: str) -> None:
        runtime = self.pods.get(uid)
        if runtime is not None:
            runtime.gone_from_api = True
            runtime.stop_requested.set()
