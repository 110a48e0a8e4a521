"""The LoRA controller against two real tiny engine servers (in-process uvicorn, --enable-lora):
spec changes load and unload adapters in every replica, a replica that lost its adapters gets
them back, bad adapters give per-adapter errors, a condition and Events, and Pods are only
ever annotated (never restarted)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Mapping

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

from test_lora_server import adapter_root  # noqa: E402
from test_server_support import API_KEY, LiveServer, make_engine  # noqa: E402

from tidal_operator import labels as L  # noqa: E402
from tidal_operator.adapters_sync import AdapterSync, AdapterSyncLoop  # noqa: E402
from tidal_operator.api.types import OperatorConfig  # noqa: E402
from tidal_operator.engine_client import EngineClient  # noqa: E402
from tidal_operator.reconcile.adapters import parse_annotation  # noqa: E402

PODS = {"m-abc-0": "10.0.0.1", "m-abc-1": "10.0.0.2"}


class FakeCluster:
    """Just the ClusterApi calls the sync makes, over in-memory objects."""

    def __init__(self, llm: dict[str, Any], pods: list[dict[str, Any]]) -> None:
        self.llm = llm
        self.pods = {p["metadata"]["name"]: p for p in pods}
        self.events: list[tuple[str, str, str]] = []
        self.pod_patches = 0

    async def list_llmservices(self, namespace: str | None = None) -> list[dict[str, Any]]:
        return [self.llm]

    async def get_llmservice(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.llm

    async def list_pods(self, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        assert label_selector == L.selector_string("m")
        return list(self.pods.values())

    async def patch_pod(self, namespace: str, name: str, patch: Mapping[str, Any]) -> None:
        self.pod_patches += 1
        meta = self.pods[name]["metadata"]
        meta.setdefault("annotations", {}).update(patch["metadata"]["annotations"])

    async def apply_llmservice_status(self, namespace: str, name: str, status: Mapping[str, Any], *,
                                      manager: str) -> None:
        # What the API server's apply does to these two fields: conditions merge by type.
        assert manager == "tidal-operator-adapters"
        current = self.llm.setdefault("status", {})
        mine = {c["type"] for c in status.get("conditions") or []}
        kept = [c for c in current.get("conditions") or [] if c["type"] not in mine]
        current.update({**status, "conditions": kept + list(status.get("conditions") or [])})

    async def post_event(self, involved: Mapping[str, Any], *, type_: str, reason: str, message: str) -> None:
        self.events.append((type_, reason, message))

    async def read_secret(self, namespace: str, name: str) -> dict[str, Any] | None:
        return {"stringData": {"api-key": API_KEY}} if name == "engine-key" else None


def pod(name: str, ready: bool = True) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}",
                     "labels": {L.APP_NAME: L.APP_NAME_VALUE, L.LLMSERVICE: "m"}, "annotations": {}},
        "status": {"phase": "Running", "podIP": PODS[name],
                   "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def llmservice(adapters: list[dict[str, str]]) -> dict[str, Any]:
    return {"apiVersion": "tidal.dev/v1alpha1", "kind": "LLMService",
            "metadata": {"name": "m", "namespace": "default", "uid": "u", "generation": 2},
            "spec": {"model": {"uri": "bundled://smollm2-135m"},
                     "auth": {"apiKeySecretRef": {"name": "engine-key"}},
                     "lora": {"maxAdapters": 2, "maxRank": 8, "adapters": adapters}}}


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, LiveServer]]:
    root = str(adapter_root())
    servers = {name: LiveServer(make_engine(enable_lora=True, max_loras=2, max_lora_rank=8,
                                            allowed_lora_roots=[root]), api_key=API_KEY)
               for name in PODS}
    for server in servers.values():
        server.__enter__()
    yield servers
    for server in servers.values():
        server.__exit__(None, None, None)


def make_sync(cluster: FakeCluster, engines: dict[str, LiveServer]) -> AdapterSync:
    by_ip = {ip: engines[name].url for name, ip in PODS.items()}

    def client(base_url: str, api_key: str | None) -> EngineClient:
        assert api_key == API_KEY  # read from the auth Secret
        ip = base_url.removeprefix("http://").rsplit(":", 1)[0]
        return EngineClient(by_ip[ip], api_key, timeout_s=30)

    return AdapterSync(cluster, operator_config=OperatorConfig(allowed_file_roots=(str(adapter_root()),)),
                       client_factory=client)


def served(server: LiveServer) -> set[str]:
    with server.client(headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        return {m["id"] for m in c.get("/v1/models").json()["data"] if m.get("parent")}


def answer(server: LiveServer, model: str) -> int:
    with server.client(headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        return c.post("/v1/completions", json={"model": model, "prompt": [1, 2, 3], "max_tokens": 2}).status_code


def uri(name: str) -> str:
    return f"file://{adapter_root() / name}"


async def test_spec_changes_load_and_unload_in_every_replica(engines: dict[str, LiveServer]) -> None:
    cluster = FakeCluster(llmservice([{"name": "sql", "uri": uri("good")}]), [pod("m-abc-0"), pod("m-abc-1")])
    sync = make_sync(cluster, engines)

    outcome = await sync.sync(cluster.llm)
    assert outcome is not None and outcome.loaded == {"m-abc-0": ["sql"], "m-abc-1": ["sql"]}
    for name, server in engines.items():
        assert served(server) == {"sql"} and answer(server, "sql") == 200
        assert parse_annotation(cluster.pods[name]["metadata"]["annotations"][L.ADAPTERS]) == {"sql": uri("good")}
    status = cluster.llm["status"]
    assert status["adapters"][0]["loadedReplicas"] == 2
    assert [c for c in status["conditions"] if c["type"] == "AdaptersReady"][0]["status"] == "True"

    # Nothing to do: no engine calls change anything, no Pod patch, no new Events.
    patches, events = cluster.pod_patches, len(cluster.events)
    outcome = await sync.sync(cluster.llm)
    assert outcome is not None and not outcome.loaded and not outcome.unloaded
    assert cluster.pod_patches == patches and len(cluster.events) == events

    # Add one good and three bad adapters: the good one loads, each bad one reports why.
    cluster.llm["spec"]["lora"]["adapters"] += [
        {"name": "chat", "uri": uri("other")},
        {"name": "big", "uri": uri("rank32")},
        {"name": "hub", "uri": "hf://org/some-lora"},
        {"name": "escape", "uri": uri("escape-link")},
    ]
    outcome = await sync.sync(cluster.llm)
    assert outcome is not None
    for name, server in engines.items():
        assert served(server) == {"sql", "chat"}
        assert answer(server, "chat") == 200 and answer(server, "sql") == 200  # the others keep working
        assert set(outcome.errors[name]) == {"big", "escape"}
    by_name = {e["name"]: e for e in cluster.llm["status"]["adapters"]}
    assert "rank 32 exceeds the maximum LoRA rank 8" in by_name["big"]["errors"][0]
    assert by_name["big"]["replicas"][0]["state"] == "Failed"
    assert "outside the allowed roots" in by_name["escape"]["errors"][0]
    assert "need a download" in by_name["hub"]["errors"][0] and by_name["hub"]["loadedReplicas"] == 0
    assert by_name["chat"]["loadedReplicas"] == 2 and by_name["chat"]["errors"] == []
    condition = [c for c in cluster.llm["status"]["conditions"] if c["type"] == "AdaptersReady"][0]
    assert condition["status"] == "False" and condition["reason"] == "AdapterLoadFailed"
    warnings = [e for e in cluster.events if e[0] == "Warning"]
    assert len(warnings) == 5 and all(e[1] == "AdapterLoadFailed" for e in warnings)  # big×2, escape×2, hub

    # The same errors again: no duplicate Events.
    await sync.sync(cluster.llm)
    assert len([e for e in cluster.events if e[0] == "Warning"]) == 5

    # Remove sql and the bad ones: unloaded everywhere, 404 for it, annotations follow.
    cluster.llm["spec"]["lora"]["adapters"] = [{"name": "chat", "uri": uri("other")}]
    outcome = await sync.sync(cluster.llm)
    assert outcome is not None and outcome.unloaded == {"m-abc-0": ["sql"], "m-abc-1": ["sql"]}
    for name, server in engines.items():
        assert served(server) == {"chat"} and answer(server, "sql") == 404
        assert set(parse_annotation(cluster.pods[name]["metadata"]["annotations"][L.ADAPTERS])) == {"chat"}
    condition = [c for c in cluster.llm["status"]["conditions"] if c["type"] == "AdaptersReady"][0]
    assert condition["status"] == "True"

    # A replica that lost its adapters (a restarted engine) gets them back on the next sync.
    with engines["m-abc-1"].client(headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        assert c.post("/v1/unload_lora_adapter", json={"lora_name": "chat"}).status_code == 200
    await AdapterSyncLoop(sync).sync_all()
    assert served(engines["m-abc-1"]) == {"chat"}

    # A changed URI for the same name is a reload.
    cluster.llm["spec"]["lora"]["adapters"] = [{"name": "chat", "uri": uri("good")}]
    outcome = await sync.sync(cluster.llm)
    assert outcome is not None and outcome.unloaded == outcome.loaded == {"m-abc-0": ["chat"], "m-abc-1": ["chat"]}
    with engines["m-abc-0"].client(headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        roots = {m["id"]: m["root"] for m in c.get("/v1/models").json()["data"]}
    assert roots["chat"] == str(adapter_root() / "good")

    # Clean up for other tests in this module.
    cluster.llm["spec"]["lora"]["adapters"] = []
    await sync.sync(cluster.llm)
    assert all(served(s) == set() for s in engines.values())


async def test_unready_replica_is_announced_with_no_adapters(engines: dict[str, LiveServer]) -> None:
    cluster = FakeCluster(llmservice([{"name": "sql", "uri": uri("good")}]), [pod("m-abc-0"), pod("m-abc-1", ready=False)])
    cluster.pods["m-abc-1"]["metadata"]["annotations"][L.ADAPTERS] = '[{"name":"sql","uri":"x"}]'  # stale
    sync = make_sync(cluster, engines)
    outcome = await sync.sync(cluster.llm)
    assert outcome is not None and outcome.loaded == {"m-abc-0": ["sql"]}
    assert parse_annotation(cluster.pods["m-abc-1"]["metadata"]["annotations"][L.ADAPTERS]) == {}
    entry = cluster.llm["status"]["adapters"][0]
    assert entry["loadedReplicas"] == 1
    assert {r["pod"]: r["state"] for r in entry["replicas"]} == {"m-abc-0": "Loaded", "m-abc-1": "Pending"}
    cluster.llm["spec"]["lora"]["adapters"] = []
    await sync.sync(cluster.llm)


async def test_adding_lora_leaves_the_old_pods_of_the_roll_alone(engines: dict[str, LiveServer]) -> None:
    # spec.lora was just added: m-old (an older spec hash, its engine started without
    # --enable-lora) is being replaced. It is not asked to load anything, so no "LoRA is not
    # enabled" Warning; it is announced with no adapters so the router sends it none.
    old = pod("m-abc-1")
    old["metadata"]["name"] = "m-old-0"
    old["metadata"]["annotations"][L.SPEC_HASH] = "0123456789"
    old["spec"] = {"containers": [{"name": "engine", "args": ["serve", "--model", "/models/m"]}]}
    cluster = FakeCluster(llmservice([{"name": "sql", "uri": uri("good")}]), [pod("m-abc-0"), old])
    sync = make_sync(cluster, engines)
    outcome = await sync.sync(cluster.llm)
    assert outcome is not None and outcome.loaded == {"m-abc-0": ["sql"]} and outcome.errors == {}
    assert [e for e in cluster.events if e[0] == "Warning"] == []
    assert parse_annotation(cluster.pods["m-old-0"]["metadata"]["annotations"][L.ADAPTERS]) == {}
    assert [r["pod"] for r in cluster.llm["status"]["adapters"][0]["replicas"]] == ["m-abc-0"]
    cluster.llm["spec"]["lora"]["adapters"] = []
    await sync.sync(cluster.llm)


async def test_conditions_written_meanwhile_are_not_reverted(engines: dict[str, LiveServer]) -> None:
    import copy

    cluster = FakeCluster(llmservice([{"name": "sql", "uri": uri("good")}]), [pod("m-abc-0")])
    seen_by_sync = copy.deepcopy(cluster.llm)  # the sync works from this older read...
    validated = {"type": "Validated", "status": "False", "reason": "InvalidSpec", "message": "bad"}
    cluster.llm.setdefault("status", {})["conditions"] = [validated]  # ...while a reconcile writes this
    await make_sync(cluster, engines).sync(seen_by_sync)
    conditions = {c["type"]: c for c in cluster.llm["status"]["conditions"]}
    assert conditions["Validated"] == validated
    assert conditions["AdaptersReady"]["status"] == "True"
    cluster.llm["spec"]["lora"]["adapters"] = []
    await make_sync(cluster, engines).sync(cluster.llm)


async def test_no_lora_spec_is_left_alone(engines: dict[str, LiveServer]) -> None:
    llm = llmservice([])
    del llm["spec"]["lora"]
    cluster = FakeCluster(llm, [pod("m-abc-0")])
    assert await make_sync(cluster, engines).sync(llm) is None
    assert cluster.pod_patches == 0 and "status" not in llm


def test_engine_unreachable_counts_as_not_ready() -> None:
    async def run() -> None:
        cluster = FakeCluster(llmservice([{"name": "sql", "uri": uri("good")}]), [pod("m-abc-0")])

        def client(base_url: str, api_key: str | None) -> EngineClient:
            return EngineClient("http://127.0.0.1:9", api_key, timeout_s=1, http=httpx.AsyncClient())

        sync = AdapterSync(cluster, operator_config=OperatorConfig(allowed_file_roots=(str(adapter_root()),)),
                           client_factory=client)
        outcome = await sync.sync(cluster.llm)
        assert outcome is not None and not outcome.loaded
        assert parse_annotation(cluster.pods["m-abc-0"]["metadata"]["annotations"][L.ADAPTERS]) == {}
        assert cluster.llm["status"]["adapters"][0]["replicas"][0]["state"] == "Pending"

    import asyncio

    asyncio.run(run())
