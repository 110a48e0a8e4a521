"""The autoscaling loop against the emulated API server, with TEST UPSTREAM engines.

Pods are created as the operator would (labels, spec-hash annotation) and marked Ready with
a podIP through /status, no kubelet: each test engine (test_scaling_engine_client's
ScalingTestEngine, a real HTTP server) listens on its Pod's IP (127.0.0.N) and the
LLMService's port. Time is a fake clock passed to the loop, so windows of minutes take no time.
"""

from __future__ import annotations

import base64
import contextlib
from pathlib import Path
from typing import Any, AsyncIterator

import pytest
from fastapi import FastAPI

from tidal_operator import labels as L
from tidal_operator.dev import start_apiserver, write_kubeconfig
from tidal_operator.kube import MANAGER_ADAPTERS, MANAGER_AUTOSCALER, MANAGER_RECONCILER, Kube
from tidal_operator.scaling.controller import (
    AutoscalerRuntime, KubeClusterApi, RouterDemandClient, ScalingConfig, ServiceAutoscaler, parse_ts,
)
from tidal_operator.scaling.idle import IDLE_SINCE_ANNOTATION
from tidal_operator.scaling.scraper import Scraper

from test_scaling_engine_client import KEY, ScalingTestEngine, listening, serve_engine

ROOT = Path(__file__).resolve().parents[2]
NS = "default"
T0 = 1_750_000_000.0


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


class Cluster:
    """The emulated API server, the handlers' Kube on it, and helpers to fake Pods."""

    def __init__(self, kube: Kube) -> None:
        self.kube = kube
        self.api = KubeClusterApi(kube)

    async def llm(self, name: str, *, port: int, autoscaling: dict[str, Any] | None = None,
                  sleep: dict[str, Any] | None = None, status: dict[str, Any] | None = None,
                  extra: dict[str, Any] | None = None) -> dict[str, Any]:
        spec: dict[str, Any] = {"model": {"uri": "bundled://smollm2-135m"}, "engine": {"port": port},
                                "auth": {"apiKeySecretRef": {"name": "engine-key"}}, **(extra or {})}
        if autoscaling is not None:
            spec["autoscaling"] = autoscaling
        if sleep is not None:
            spec["sleep"] = sleep
        body = {"apiVersion": L.API_VERSION, "kind": L.KIND, "metadata": {"name": name, "namespace": NS},
                "spec": spec}
        created = await self.kube.request("POST", f"/apis/{L.GROUP}/{L.VERSION}/namespaces/{NS}/{L.PLURAL}",
                                          body=body)
        if status:
            await self.kube.patch_llmservice_status(NS, name, status)
        return created

    async def secret(self) -> None:
        await self.kube.request("POST", f"/api/v1/namespaces/{NS}/secrets", body={
            "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "engine-key", "namespace": NS},
            "data": {"api-key": base64.b64encode(KEY.encode()).decode()}})

    async def pod(self, llm: str, index: int, ip: str, *, sleep_state: str = L.SLEEP_AWAKE, ready: bool = True,
                  annotations: dict[str, str] | None = None) -> str:
        name = f"{llm}-abc-{index}"
        body = {"apiVersion": "v1", "kind": "Pod", "metadata": {
            "name": name, "namespace": NS,
            "labels": {**L.selector_labels(llm), L.SLEEP_STATE: sleep_state, L.REPLICA_INDEX: str(index)},
            "annotations": {L.SPEC_HASH: "abc", **(annotations or {})}},
            "spec": {"containers": [{"name": "engine", "image": "x"}]}}
        await self.kube.request("POST", f"/api/v1/namespaces/{NS}/pods", body=body)
        await self.kube.request("PATCH", f"/api/v1/namespaces/{NS}/pods/{name}/status", content_type=MERGE, body={
            "status": {"phase": "Running", "podIP": ip,
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}})
        return name

    async def status(self, name: str) -> dict[str, Any]:
        return (await self.kube.get_llmservice(NS, name) or {}).get("status") or {}

    async def pod_meta(self, name: str) -> dict[str, Any]:
        return (await self.kube.request("GET", f"/api/v1/namespaces/{NS}/pods/{name}"))["metadata"]

    async def events(self, name: str) -> list[tuple[str, str]]:
        items = (await self.kube.request("GET", f"/api/v1/namespaces/{NS}/events"))["items"]
        return [(e["reason"], e["message"]) for e in items if e["involvedObject"]["name"] == name]


MERGE = "application/merge-patch+json"


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    handle = await start_apiserver("127.0.0.1", 0, crd_dir=ROOT / "crds")
    kube = await Kube.connect(str(write_kubeconfig(tmp_path / "kubeconfig", handle.url)))
    c = Cluster(kube)
    await c.secret()
    try:
        yield c
    finally:
        await kube.close()
        await handle.stop()


@contextlib.asynccontextmanager
async def engines(*specs: ScalingTestEngine) -> AsyncIterator[int]:
    """Serve the engines on 127.0.0.2, .3, ... all on one port (as Pods of one LLMService)."""
    probe = listening("127.0.0.2")
    port = probe.getsockname()[1]
    probe.close()
    async with contextlib.AsyncExitStack() as stack:
        for i, e in enumerate(specs):
            await stack.enter_async_context(serve_engine(e, f"127.0.0.{i + 2}", port))
        yield port


@contextlib.asynccontextmanager
async def scaler_for(cluster: Cluster, name: str, clock: Clock, **kw: Any) -> AsyncIterator[ServiceAutoscaler]:
    scraper = Scraper(timeout_s=kw.pop("timeout_s", 2.0), concurrency=4)
    try:
        yield ServiceAutoscaler(NS, name, cluster.api, scraper, kw.pop("demand", None),
                                ScalingConfig(interval_s=1, drain_timeout_s=10, wake_timeout_s=10), clock=clock, **kw)
    finally:
        await scraper.aclose()


class FixedDemand:
    def __init__(self, held: int | None = 0) -> None:
        self.value = held

    async def held(self, namespace: str, llmservice: str) -> int | None:
        return self.value


AUTOSCALING = {"minReplicas": 1, "maxReplicas": 3, "metric": "requestsInFlight", "target": 4,
               "scaleDownDelaySeconds": 30}


@pytest.mark.parametrize("prefix", ["tidal:", "vllm:"])  # the engine's --metrics-prefix
async def test_burst_scales_up_with_reason_history_event_and_replan(cluster: Cluster, prefix: str) -> None:
    engine = ScalingTestEngine(running=4, waiting=5, metrics_prefix=prefix)
    replans: list[tuple[str, str]] = []

    async def on_change(ns: str, name: str) -> None:
        replans.append((ns, name))

    async with engines(engine) as port:
        await cluster.llm("m", port=port, autoscaling=AUTOSCALING, status={"desiredReplicas": 1})
        await cluster.pod("m", 0, "127.0.0.2")
        clock = Clock()
        async with scaler_for(cluster, "m", clock, on_change=on_change) as scaler:
            result = await scaler.tick()
    assert result.decision is not None and result.decision.desired == 3
    status = await cluster.status("m")
    assert status["desiredReplicas"] == 3
    assert parse_ts(status["lastScaleTime"]) == T0
    [entry] = status["scalingHistory"]
    assert entry["from"] == 1 and entry["to"] == 3 and "requestsInFlight 9" in entry["reason"]
    assert any(r == "ScaledUp" and "1 -> 3" in m for r, m in await cluster.events("m"))
    assert replans == [(NS, "m")]
    assert set(engine.auth_seen) == {f"Bearer {KEY}"}  # scraped with the key from the Secret


async def test_the_autoscaler_applies_its_own_fields_and_leaves_other_managers_alone(cluster: Cluster) -> None:
    """Server-side apply as its own field manager: the reconcile's and the adapter sync's
    fields and conditions stay as they were, and its own fields are recorded as its own."""
    engine = ScalingTestEngine(running=4, waiting=5)
    async with engines(engine) as port:
        await cluster.llm("m", port=port, autoscaling=AUTOSCALING)
        ready = {"type": "Ready", "status": "True", "reason": "ReplicasReady",
                 "lastTransitionTime": "2025-06-15T00:00:00Z"}
        adapters = {"type": "AdaptersReady", "status": "True", "reason": "NoAdapters",
                    "lastTransitionTime": "2025-06-15T00:00:00Z"}
        await cluster.kube.apply_llmservice_status(NS, "m", {"phase": "Ready", "sleepingReplicas": 0,
                                                             "conditions": [ready]}, manager=MANAGER_RECONCILER)
        await cluster.kube.apply_llmservice_status(NS, "m", {"adapters": [], "conditions": [adapters]},
                                                   manager=MANAGER_ADAPTERS)
        await cluster.pod("m", 0, "127.0.0.2")
        async with scaler_for(cluster, "m", Clock()) as scaler:
            assert (await scaler.tick()).decision.desired == 3
            assert (await scaler.tick()).status_patch is None  # nothing changed: no write
    llm = await cluster.kube.get_llmservice(NS, "m")
    status = llm["status"]
    assert status["desiredReplicas"] == 3 and status["scalingHistory"][-1]["to"] == 3
    assert status["phase"] == "Ready" and status["adapters"] == []
    assert status["conditions"] == [ready, adapters]
    owned = {e["manager"]: e for e in llm["metadata"]["managedFields"] if e.get("subresource") == "status"}
    mine = owned[MANAGER_AUTOSCALER]
    assert mine["operation"] == "Apply"
    assert {"f:desiredReplicas", "f:lastScaleTime", "f:scalingHistory", "f:sleepingReplicas"} \
        <= set(mine["fieldsV1"]["f:status"])
    assert "f:conditions" not in mine["fieldsV1"]["f:status"]
    assert "f:phase" in owned[MANAGER_RECONCILER]["fieldsV1"]["f:status"]

    # The reconcile's next apply, without the autoscaler's fields, removes none of them.
    await cluster.kube.apply_llmservice_status(NS, "m", {"phase": "Progressing", "sleepingReplicas": 0,
                                                         "conditions": [ready]}, manager=MANAGER_RECONCILER)
    status = await cluster.status("m")
    assert status["desiredReplicas"] == 3 and status["lastScaleTime"] and len(status["scalingHistory"]) == 1


async def test_scale_down_waits_for_the_delay_and_survives_a_restart(cluster: Cluster) -> None:
    e0, e1 = ScalingTestEngine(running=1), ScalingTestEngine(running=0)
    history = [{"time": "2025-06-15T00:00:00Z", "from": 1, "to": 2, "reason": "earlier burst"}]
    async with engines(e0, e1) as port:
        await cluster.llm("m", port=port, autoscaling=AUTOSCALING, status={
            "desiredReplicas": 2, "lastScaleTime": "2025-06-15T00:00:00Z", "scalingHistory": history})
        await cluster.pod("m", 0, "127.0.0.2")
        await cluster.pod("m", 1, "127.0.0.3")
        clock = Clock()
        async with scaler_for(cluster, "m", clock) as scaler:
            for _ in range(3):  # t = 0, 10, 20: low load, but the 30s window isn't observed yet
                assert not (await scaler.tick()).decision.changed
                clock.now += 10
        # The operator restarts at t=30: a new loop, no metric history, everything else from status.
        async with scaler_for(cluster, "m", clock) as scaler:
            first = await scaler.tick()
            assert first.decision.desired == 2 and "fewer than 30s" in first.decision.reason
            assert (await cluster.status("m"))["desiredReplicas"] == 2
            e0.running = 20  # a spike is a real scale-up, even right after the restart ...
            clock.now += 10
            spike = await scaler.tick()
            assert spike.decision.desired == 3
            e0.running = 1  # ... and the way back down needs the full delay of low readings
            for step in range(4):
                clock.now += 10
                result = await scaler.tick()
            assert result.decision.desired == 1, result.decision.reason
    status = await cluster.status("m")
    assert [(h["from"], h["to"]) for h in status["scalingHistory"]] == [(1, 2), (2, 3), (3, 1)]
    assert status["scalingHistory"][0] == history[0]


async def test_unknown_scrape_blocks_scale_down(cluster: Cluster) -> None:
    broken = ScalingTestEngine(metrics_status=500)
    async with engines(ScalingTestEngine(), broken) as port:
        await cluster.llm("m", port=port, autoscaling={**AUTOSCALING, "scaleDownDelaySeconds": 0},
                          status={"desiredReplicas": 2})
        await cluster.pod("m", 0, "127.0.0.2")
        await cluster.pod("m", 1, "127.0.0.3")
        async with scaler_for(cluster, "m", Clock()) as scaler:
            result = await scaler.tick()
            assert result.metrics["m-abc-1"] is None
            assert result.decision.desired == 2 and "unknown" in result.decision.reason
            broken.metrics_status = 200
            assert (await scaler.tick()).decision.desired == 1


@pytest.mark.parametrize("prefix", ["tidal:", "vllm:"])  # the engine's --metrics-prefix
async def test_idle_replica_sleeps_deepens_then_goes_to_zero(cluster: Cluster, prefix: str) -> None:
    engine = ScalingTestEngine(metrics_prefix=prefix)
    async with engines(engine) as port:
        await cluster.llm("m", port=port, status={"desiredReplicas": 1},
                          autoscaling={**AUTOSCALING, "minReplicas": 0},
                          sleep={"afterIdleSeconds": 10, "level": 1, "deepAfterSeconds": 20,
                                 "removeAfterSeconds": 40})
        pod = await cluster.pod("m", 0, "127.0.0.2")
        clock = Clock()
        async with scaler_for(cluster, "m", clock) as scaler:
            await scaler.tick()  # t=0: idle from now
            assert parse_ts((await cluster.pod_meta(pod))["annotations"][IDLE_SINCE_ANNOTATION]) == T0
            clock.now += 10
            await scaler.tick()  # t=10: level 1, drained first
            assert engine.calls == [("sleep", {"level": 1, "mode": "wait"})]
            assert (await cluster.pod_meta(pod))["labels"][L.SLEEP_STATE] == L.SLEEP_LEVEL_1
            assert (await cluster.status("m"))["sleepingReplicas"] == 1
            assert (await cluster.status("m"))["desiredReplicas"] == 1  # sleeping, not scaled away
            clock.now += 10
            await scaler.tick()  # t=20: level 2
            assert engine.calls[-1] == ("sleep", {"level": 2, "mode": "wait"})
            assert (await cluster.pod_meta(pod))["labels"][L.SLEEP_STATE] == L.SLEEP_LEVEL_2
            clock.now += 10
            assert not (await scaler.tick()).decision.changed  # t=30
            clock.now += 10
            result = await scaler.tick()  # t=40: removed (minReplicas 0 allows it)
            assert [a.kind for a in result.actions] == ["remove"]
    status = await cluster.status("m")
    assert status["desiredReplicas"] == 0 and status["sleepingReplicas"] == 0
    assert status["scalingHistory"][-1]["to"] == 0 and "removeAfterSeconds" in status["scalingHistory"][-1]["reason"]
    reasons = [r for r, _ in await cluster.events("m")]
    assert reasons.count("ReplicaSleeping") == 2 and "ScaledDown" in reasons and "RemovingIdleReplica" in reasons


async def test_demand_wakes_a_sleeper_and_scales_from_zero(cluster: Cluster) -> None:
    engine = ScalingTestEngine(sleep_level=1)
    demand = FixedDemand(2)
    async with engines(engine) as port:
        await cluster.llm("m", port=port, autoscaling={**AUTOSCALING, "minReplicas": 0},
                          sleep={"afterIdleSeconds": 10}, status={"desiredReplicas": 1})
        pod = await cluster.pod("m", 0, "127.0.0.2", sleep_state=L.SLEEP_LEVEL_1,
                                annotations={IDLE_SINCE_ANNOTATION: "2025-06-15T00:00:00.000Z"})
        async with scaler_for(cluster, "m", Clock(), demand=demand) as scaler:
            result = await scaler.tick()
        assert [a.kind for a in result.actions if a.kind in ("wake", "sleep")] == ["wake"]
        assert engine.calls == [("wake_up", {"tags": []})]
        meta = await cluster.pod_meta(pod)
        assert meta["labels"][L.SLEEP_STATE] == L.SLEEP_AWAKE and IDLE_SINCE_ANNOTATION not in meta["annotations"]
        assert any(r == "ReplicaWoken" for r, _ in await cluster.events("m"))

    # A GPU-share member: held demand doesn't make the operator wake it (the router's group
    # switch does, after making room), so the group never has more awake than fit.
    await cluster.llm("g", port=port, sleep={"afterIdleSeconds": 10},
                      extra={"replicas": 1, "gpuShare": {"group": "pair", "memoryFraction": 0.6}})
    await cluster.pod("g", 0, "127.0.0.3", sleep_state=L.SLEEP_LEVEL_1,
                      annotations={IDLE_SINCE_ANNOTATION: "2025-06-15T00:00:00.000Z"})
    engine.calls.clear()
    async with scaler_for(cluster, "g", Clock(), demand=demand) as scaler:
        result = await scaler.tick()
    assert [a.kind for a in result.actions if a.kind == "wake"] == [] and engine.calls == []

    # Zero replicas and two held requests: one replica at once.
    await cluster.llm("z", port=port, autoscaling={**AUTOSCALING, "minReplicas": 0,
                                                   "scaleUpStabilizationSeconds": 300},
                      status={"desiredReplicas": 0})
    async with scaler_for(cluster, "z", Clock(), demand=demand) as scaler:
        result = await scaler.tick()
    status = await cluster.status("z")
    assert status["desiredReplicas"] == 1
    assert "2 request(s) held by the router at zero replicas" in status["scalingHistory"][-1]["reason"]


async def test_label_follows_what_the_engine_reports(cluster: Cluster) -> None:
    engine = ScalingTestEngine(sleep_level=0, running=1)  # the router woke it; the label lags
    async with engines(engine) as port:
        await cluster.llm("m", port=port, sleep={"afterIdleSeconds": 100})
        pod = await cluster.pod("m", 0, "127.0.0.2", sleep_state=L.SLEEP_LEVEL_2)
        async with scaler_for(cluster, "m", Clock()) as scaler:
            result = await scaler.tick()
    assert result.decision is None  # fixed replicas: the idle policy only
    assert (await cluster.pod_meta(pod))["labels"][L.SLEEP_STATE] == L.SLEEP_AWAKE
    assert engine.calls == []
    status = await cluster.status("m")
    assert "desiredReplicas" not in status and status["sleepingReplicas"] == 0


async def test_failed_sleep_puts_the_label_back(cluster: Cluster) -> None:
    engine = ScalingTestEngine(sleep_enabled=False)
    async with engines(engine) as port:
        await cluster.llm("m", port=port, sleep={"afterIdleSeconds": 1})
        pod = await cluster.pod("m", 0, "127.0.0.2",
                                annotations={IDLE_SINCE_ANNOTATION: "2025-06-15T00:00:00.000Z"})
        async with scaler_for(cluster, "m", Clock()) as scaler:
            await scaler.tick()
    assert engine.calls == [("sleep", {"level": 1, "mode": "wait"})]
    assert (await cluster.pod_meta(pod))["labels"][L.SLEEP_STATE] == L.SLEEP_AWAKE
    assert any(r == "SleepFailed" for r, _ in await cluster.events("m"))


async def test_hpa_mode_is_left_to_the_hpa(cluster: Cluster) -> None:
    async with engines(ScalingTestEngine(running=50)) as port:
        await cluster.llm("m", port=port, autoscaling={**AUTOSCALING, "mode": "hpa"})
        await cluster.pod("m", 0, "127.0.0.2")
        async with scaler_for(cluster, "m", Clock()) as scaler:
            result = await scaler.tick()
    assert result.decision is None and result.status_patch is None
    assert "desiredReplicas" not in await cluster.status("m")


async def test_runtime_ticks_every_autoscaled_service_and_feeds_the_handlers_hook(cluster: Cluster) -> None:
    from router_upstreams import serve  # a real HTTP router stand-in for /debug/demand

    router = FastAPI()

    @router.get("/debug/demand")
    async def debug_demand() -> dict[str, Any]:
        return {"demand": [{"namespace": NS, "llmservice": "cold", "held": 3}], "wakeCalls": 0}

    async with serve(router) as router_port:
        await cluster.llm("cold", port=1, autoscaling={**AUTOSCALING, "minReplicas": 0},
                          status={"desiredReplicas": 0})
        await cluster.llm("fixed", port=1)
        runtime = AutoscalerRuntime(cluster.api, ScalingConfig(interval_s=1,
                                                               router_urls=(f"http://127.0.0.1:{router_port}",)))
        try:
            assert isinstance(runtime.demand, RouterDemandClient)
            await runtime.tick_all(NS)
            assert set(runtime.services) == {(NS, "cold")}  # "fixed" needs no loop
            llm = await cluster.kube.get_llmservice(NS, "cold")
            from tidal_operator.api.types import LLMServiceSpec
            spec = LLMServiceSpec.from_body(llm["spec"])
            assert await runtime.desired_replicas(llm, spec, []) == 1
            assert llm["status"]["desiredReplicas"] == 1
        finally:
            await runtime.aclose()


async def test_demand_held_on_any_router_replica_scales_from_zero(cluster: Cluster) -> None:
    # Two router replicas publish their held demand in Leases; only the second holds a request
    # for "cold". Asking one router (the Service) could miss it; the Leases cannot.
    from tidal_operator.router.demand_lease import DemandLeasePublisher
    from tidal_operator.router.metrics import RouterMetrics
    from tidal_operator.router.registry import Registry
    from tidal_operator.router.waker import DemandBook
    from tidal_operator.scaling.router_demand import LeaseDemandClient

    await cluster.llm("cold", port=1, autoscaling={**AUTOSCALING, "minReplicas": 0}, status={"desiredReplicas": 0})
    registry = Registry()
    registry.apply_llmservice_event({"type": "ADDED", "object": await cluster.kube.get_llmservice(NS, "cold")})
    books = [DemandBook(RouterMetrics(), 10), DemandBook(RouterMetrics(), 10)]
    books[1].hold(registry.lookup("cold"))
    for i, book in enumerate(books):
        await DemandLeasePublisher(cluster.kube.api, NS, f"router-{i}", book).publish()
    runtime = AutoscalerRuntime(cluster.api, ScalingConfig(interval_s=1, router_demand_namespace=NS))
    try:
        assert isinstance(runtime.demand, LeaseDemandClient)
        await runtime.tick_all(NS)
        llm = await cluster.kube.get_llmservice(NS, "cold")
        assert llm["status"]["desiredReplicas"] == 1
        assert "held by the router" in llm["status"]["scalingHistory"][-1]["reason"]
    finally:
        await runtime.aclose()


async def test_router_demand_client_sums_routers_and_any_failure_is_unknown() -> None:
    from router_upstreams import closed_port, serve

    def router(held: int) -> FastAPI:
        app = FastAPI()

        @app.get("/debug/demand")
        async def debug_demand() -> dict[str, Any]:
            return {"demand": [{"namespace": NS, "llmservice": "a", "held": held}]}

        return app

    async with serve(router(2)) as p1, serve(router(3)) as p2:
        client = RouterDemandClient([f"http://127.0.0.1:{p1}", f"http://127.0.0.1:{p2}"], ttl_s=0)
        try:
            assert await client.held(NS, "a") == 5
            assert await client.held(NS, "b") == 0
        finally:
            await client.aclose()
        broken = RouterDemandClient([f"http://127.0.0.1:{p1}", f"http://127.0.0.1:{closed_port()}"], ttl_s=0)
        try:
            assert await broken.held(NS, "a") is None
        finally:
            await broken.aclose()


async def test_a_decision_replans_pods_through_the_handlers_reconcile(cluster: Cluster) -> None:
    """With the handlers' real reconcile: 1 Pod under load → 3 Pods, and a later reconcile
    keeps the autoscaler's count (Reconciler.desired_replicas) without writing it itself."""
    from tidal_operator.api.types import OperatorConfig
    from tidal_operator.controller.reconciler import Reconciler

    async with engines(ScalingTestEngine(running=9)) as port:
        await cluster.llm("m", port=port, autoscaling=AUTOSCALING)
        runtime = AutoscalerRuntime(cluster.api, ScalingConfig(interval_s=1))
        reconciler = Reconciler(cluster.kube, OperatorConfig(), desired_replicas=runtime.desired_replicas)
        runtime.on_change = lambda ns, name: reconciler.run(ns, name, ensure_service=False)
        try:
            await reconciler.run(NS, "m")
            # One writer: with the autoscaler running, the reconcile leaves desiredReplicas to it.
            assert "desiredReplicas" not in await cluster.status("m")
            [pod] = await cluster.kube.list_pods(NS, L.selector_string("m"))
            # The kubelet's part: the Pod runs, Ready, on the test engine's address.
            await cluster.kube.request(
                "PATCH", f"/api/v1/namespaces/{NS}/pods/{pod['metadata']['name']}/status", content_type=MERGE,
                body={"status": {"phase": "Running", "podIP": "127.0.0.2",
                                 "conditions": [{"type": "Ready", "status": "True"}]}})
            await runtime.tick_all(NS)
            assert len(await cluster.kube.list_pods(NS, L.selector_string("m"))) == 3
            await reconciler.run(NS, "m")
            status = await cluster.status("m")
            assert status["desiredReplicas"] == 3 and status["scalingHistory"][-1]["to"] == 3
        finally:
            await runtime.aclose()
