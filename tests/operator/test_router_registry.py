"""The router's registry: pure updates from LLMService and Pod watch events."""

from __future__ import annotations

import asyncio

from tidal_operator import labels as L
from tidal_operator.router.registry import (
    Registry, RegistryState, SecretRef, apply_llmservice_event, apply_pod_event,
    observe_sleep_state, parse_adapters_annotation, replace_llmservices, replace_pods,
)
from tidal_operator.secret_refs import secret_value

from router_upstreams import llmservice, pod


def _state(*events: tuple[str, str, dict]) -> RegistryState:
    state = RegistryState()
    for kind, event_type, obj in events:
        apply = apply_llmservice_event if kind == "llm" else apply_pod_event
        state = apply(state, {"type": event_type, "object": obj})
    return state


def test_served_name_defaults_to_metadata_name_and_can_be_overridden() -> None:
    state = _state(("llm", "ADDED", llmservice("qwen")), ("llm", "ADDED", llmservice("smol", served_name="smollm2")))
    assert state.lookup("qwen").llmservice == "qwen"
    assert state.lookup("smollm2").llmservice == "smol"
    assert state.lookup("smol") is None
    assert state.model_names() == ["qwen", "smollm2"]


def test_llmservice_fields_are_read() -> None:
    state = _state(("llm", "ADDED", llmservice("m", adapters=("sql", "chat"), strategy="prefixHash", secret="keys",
                                                namespace="team")))
    entry = state.lookup("m")
    assert entry.namespace == "team"
    assert entry.adapters == frozenset({"sql", "chat"})
    assert entry.routing_strategy == "prefixHash"
    assert entry.api_key_secret == SecretRef("team", "keys", "api-key")
    assert entry.adapter is None
    by_adapter = state.lookup("sql")
    assert by_adapter.llmservice == "m" and by_adapter.adapter == "sql" and by_adapter.model_name == "sql"


def test_llmservice_modified_and_deleted() -> None:
    state = _state(("llm", "ADDED", llmservice("m")), ("llm", "MODIFIED", llmservice("m", served_name="renamed")))
    assert state.lookup("m") is None and state.lookup("renamed") is not None
    state = apply_llmservice_event(state, {"type": "DELETED", "object": llmservice("m")})
    assert state.lookup("renamed") is None
    # Bookmarks and errors change nothing.
    assert apply_llmservice_event(state, {"type": "BOOKMARK", "object": {"metadata": {}}}) is state


def test_unknown_strategy_falls_back_to_least_load() -> None:
    state = _state(("llm", "ADDED", llmservice("m", strategy="random")))
    assert state.lookup("m").routing_strategy == "leastLoad"


def test_pod_becomes_replica_with_url_readiness_and_sleep_state() -> None:
    state = _state(("llm", "ADDED", llmservice("m")),
                   ("pod", "ADDED", pod("m-0", "m", 8123, ip="10.0.0.5")),
                   ("pod", "ADDED", pod("m-1", "m", 8000, ready=False)),
                   ("pod", "ADDED", pod("m-2", "m", 8000, sleep_state=L.SLEEP_LEVEL_2)),
                   ("pod", "ADDED", pod("m-3", "m", 8000, ip=None)),
                   ("pod", "ADDED", pod("m-4", "m", 8000, deleting=True)))
    replicas = {r.pod_name: r for r in state.lookup("m").replicas}
    assert replicas["m-0"].url == "http://10.0.0.5:8123" and replicas["m-0"].routable
    assert not replicas["m-1"].ready and not replicas["m-1"].routable
    assert replicas["m-2"].sleep_state == "asleep-2" and replicas["m-2"].wakeable and not replicas["m-2"].routable
    assert replicas["m-3"].url is None and not replicas["m-3"].routable
    assert replicas["m-4"].deleting and not replicas["m-4"].routable
    assert [r.pod_name for r in state.lookup("m").routable()] == ["m-0"]
    assert [r.pod_name for r in state.lookup("m").wakeable()] == ["m-2"]


def test_port_defaults_to_8000_without_a_port_named_http() -> None:
    obj = pod("m-0", "m", 9999)
    obj["spec"]["containers"][0]["ports"] = [{"name": "grpc", "containerPort": 9000}]
    state = _state(("pod", "ADDED", obj))
    assert state.pods[("default", "m-0")].url == "http://127.0.0.1:8000"


def test_pods_without_the_llmservice_label_are_ignored_and_deletes_remove() -> None:
    stray = pod("other", "m", 8000)
    del stray["metadata"]["labels"][L.LLMSERVICE]
    state = _state(("pod", "ADDED", stray), ("pod", "ADDED", pod("m-0", "m", 8000)))
    assert list(state.pods) == [("default", "m-0")]
    state = apply_pod_event(state, {"type": "DELETED", "object": pod("m-0", "m", 8000)})
    assert not state.pods


def test_pods_of_a_model_appear_before_or_after_its_llmservice() -> None:
    state = _state(("pod", "ADDED", pod("m-0", "m", 8000)), ("llm", "ADDED", llmservice("m")))
    assert [r.pod_name for r in state.lookup("m").replicas] == ["m-0"]


def test_adapters_annotation_formats() -> None:
    assert parse_adapters_annotation(None) is None
    assert parse_adapters_annotation("sql, chat") == frozenset({"sql", "chat"})
    assert parse_adapters_annotation('["sql", {"name": "chat"}]') == frozenset({"sql", "chat"})
    assert parse_adapters_annotation("") == frozenset()
    assert parse_adapters_annotation("[not json") is None


def test_adapter_routing_prefers_announced_adapters() -> None:
    state = _state(("llm", "ADDED", llmservice("m", adapters=("sql", "chat"))),
                   ("pod", "ADDED", pod("m-0", "m", 8000, adapters="sql")),
                   ("pod", "ADDED", pod("m-1", "m", 8000, adapters="")),
                   ("pod", "ADDED", pod("m-2", "m", 8000)))  # no annotation: assumed to have all
    assert [r.pod_name for r in state.lookup("sql").routable()] == ["m-0", "m-2"]
    assert [r.pod_name for r in state.lookup("chat").routable()] == ["m-2"]
    assert len(state.lookup("m").routable()) == 3


def test_relist_replaces_everything() -> None:
    state = _state(("llm", "ADDED", llmservice("a")), ("llm", "ADDED", llmservice("b")),
                   ("pod", "ADDED", pod("a-0", "a", 8000)), ("pod", "ADDED", pod("a-1", "a", 8000)))
    state = replace_llmservices(state, [llmservice("b")])
    state = replace_pods(state, [pod("a-1", "a", 8000)])
    assert state.model_names() == ["b"]
    assert list(state.pods) == [("default", "a-1")]


def test_observed_sleep_state_holds_until_the_pod_changes() -> None:
    state = _state(("llm", "ADDED", llmservice("m")),
                   ("pod", "ADDED", pod("m-0", "m", 8000, sleep_state=L.SLEEP_LEVEL_1, resource_version="5")))
    replica = state.lookup("m").replicas[0]
    state = observe_sleep_state(state, replica, L.SLEEP_AWAKE)
    assert state.lookup("m").routable()
    # The same version again (a resync) keeps the override...
    state = apply_pod_event(state, {"type": "MODIFIED", "object": pod("m-0", "m", 8000, sleep_state=L.SLEEP_LEVEL_1,
                                                                      resource_version="5")})
    assert state.lookup("m").routable()
    # ...a new version (the idle controller slept it again) wins.
    state = apply_pod_event(state, {"type": "MODIFIED", "object": pod("m-0", "m", 8000, sleep_state=L.SLEEP_LEVEL_1,
                                                                      resource_version="6")})
    assert not state.lookup("m").routable() and state.lookup("m").wakeable()


def test_same_served_name_in_two_namespaces_resolves_deterministically() -> None:
    state = _state(("llm", "ADDED", llmservice("m", namespace="zeta")), ("llm", "ADDED", llmservice("m", namespace="alpha")))
    assert state.lookup("m").namespace == "alpha"


def test_secret_values_are_decoded() -> None:
    assert secret_value({"data": {"api-key": "c2VjcmV0Cg=="}}, "api-key") == "secret"
    assert secret_value({"stringData": {"api-key": "plain"}}, "api-key") == "plain"
    assert secret_value({"data": {}}, "api-key") is None


async def test_registry_notifies_waiters_and_keeps_engine_keys_out_of_state() -> None:
    registry = Registry()
    version = registry.version
    waiter = asyncio.create_task(registry.wait_changed(version))
    await asyncio.sleep(0)
    assert not waiter.done()
    registry.apply_llmservice_event({"type": "ADDED", "object": llmservice("m", secret="s")})
    await asyncio.wait_for(waiter, 5)
    entry = registry.lookup("m")
    assert registry.engine_api_key(entry) is None
    registry.set_secret(entry.api_key_secret, "engine-key")
    assert registry.engine_api_key(entry) == "engine-key"
    assert "engine-key" not in repr(registry.state)


def test_a_name_two_llmservices_claim_goes_to_the_first_and_only_to_pods_it_owns() -> None:
    def owned(obj: dict, uid: str, created: str) -> dict:
        obj["metadata"].update(uid=uid, creationTimestamp=created)
        return obj

    def controlled_by(p: dict, uid: str | None) -> dict:
        if uid:
            p["metadata"]["ownerReferences"] = [{"kind": L.KIND, "name": "x", "uid": uid, "controller": True}]
        return p

    first = owned(llmservice("a", served_name="shared", namespace="team-b"), "uid-a", "2026-01-01T00:00:00Z")
    later = owned(llmservice("b", served_name="shared", namespace="team-a"), "uid-b", "2026-02-01T00:00:00Z")
    state = _state(("llm", "ADDED", later), ("llm", "ADDED", first),
                   ("pod", "ADDED", controlled_by(pod("a-0", "a", 8000, namespace="team-b"), "uid-a")),
                   # labelled like a replica of "a", but not controlled by it: no traffic, no key
                   ("pod", "ADDED", controlled_by(pod("impostor", "a", 8000, namespace="team-b"), None)),
                   ("pod", "ADDED", controlled_by(pod("b-0", "b", 8000, namespace="team-a"), "uid-b")))
    entry = state.lookup("shared")
    assert (entry.namespace, entry.llmservice) == ("team-b", "a")  # created first, though sorted later
    assert [r.pod_name for r in entry.replicas] == ["a-0"]

    from tidal_operator.router import models_payload

    registry = Registry(state)
    listed = [(m["id"], m["tidal"]["namespace"]) for m in models_payload(registry)["data"]]
    assert listed == [("shared", "team-b")]
