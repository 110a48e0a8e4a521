"""Multi-LoRA end to end on `tidal dev` with real engines (SmolLM2-135M on CPU, two replicas),
the real kubectl and the router:

1. an LLMService with `spec.lora` (no adapters yet) is Ready;
2. adding an adapter to `spec.lora.adapters` makes it answer through the router within
   ADAPTER_BOUND_S of the patch, with an answer that differs from the base model's, and
   restarts no Pod (same names and uids, and the Pod watch saw no Pod come or go);
3. bad adapters (a path that does not exist, a rank above `maxRank`, a path outside the
   allowed roots) each get a clear error from the engine API, and a Failed state per replica,
   the `AdaptersReady=False` condition and a Warning Event on the LLMService, while the good
   adapter and the base model keep answering;
4. removing the adapters gives 404 for the adapter through the router, the engines unload
   it, and status says so.
`status.adapters` is read from a watch of the LLMService: every status written after the
first adapter change names each replica's state.

The operator allows file:// adapters under a tmp dir through TIDAL_ALLOWED_FILE_ROOTS, which
`tidal dev up` passes on to the operator it starts (and the operator to the engines'
--allowed-lora-roots). The tests share one stack and run in file order. Waits synchronise
on HTTP answers and the API (watches, polls with deadlines), never on fixed sleeps.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from lora_support import (  # noqa: E402
    ObjectWatch,
    answer,
    ask,
    error_message,
    get_json,
    llmservice,
    post_json,
    write_peft_adapter,
)

NAME = "smollm2-lora"
REPLICAS = 2
MAX_RANK = 8
QUESTION = "What is the capital of France?"
ENGINE_READY_BOUND_S = 180  # apply → Ready, two real engines starting together on 2 shared CPU cores
ADAPTER_BOUND_S = 30  # spec change → the adapter answers (or 404s) through the router
STATUS_BOUND_S = 30  # spec change → status, conditions and Events say so

# Shared between the tests of this module (they build on each other, in file order).
STATE: dict[str, Any] = {}


@pytest.fixture(scope="module", autouse=True)
def adapter_dirs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """The adapters, and the operator's allowed file root. Autouse, so it runs before the
    module's `real_stack`: the operator that `tidal dev up` starts inherits the variable."""
    root = tmp_path_factory.mktemp("lora-root")
    outside = tmp_path_factory.mktemp("lora-outside")
    dirs = {
        "root": root,
        # rank 8 on q/v/down of all 30 layers: changes SmolLM2's greedy answer
        "french": write_peft_adapter(root / "french", rank=8, alpha=32, seed=7),
        # rank 16 > maxRank 8 (one small module: the rank check comes first anyway)
        "too-big": write_peft_adapter(root / "too-big", rank=16, alpha=32, seed=8,
                                      modules={"self_attn.q_proj": (576, 576)}, layers=1),
        # a valid adapter, but not under the allowed root
        "outside": write_peft_adapter(outside / "secret", rank=4, alpha=8, seed=9),
        "missing": root / "missing",  # never written
    }
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIDAL_ALLOWED_FILE_ROOTS", str(root))
        yield dirs


@pytest.fixture(scope="module")
def stack(real_stack: Any) -> Iterator[Any]:
    """The stack, with watches on the engine Pods and the LLMService from the start."""
    pods = real_stack.watch_pods(f"tidal.dev/llmservice={NAME}")
    llms = ObjectWatch(real_stack.env, "llmservices")
    real_stack.pod_watch, real_stack.llm_watch = pods, llms
    try:
        yield real_stack
    finally:
        pods.stop()
        llms.stop()


# --- helpers ---------------------------------------------------------------------------------

def uri(path: Path) -> str:
    return f"file://{path}"


def set_adapters(stack: Any, adapters: list[dict[str, str]]) -> float:
    """Replace spec.lora.adapters (a merge patch replaces the list); when it was sent."""
    started = time.monotonic()
    stack.kubectl("patch", "llm", NAME, "--type=merge", "-p", json.dumps({"spec": {"lora": {"adapters": adapters}}}))
    return started


def router_ask(stack: Any, model: str) -> tuple[int, Any]:
    return ask(stack.router_url, model, QUESTION, stack.api_key)


def engine_urls(stack: Any) -> dict[str, str]:
    return {p["metadata"]["name"]: f"http://{p['status']['podIP']}:8000" for p in stack.pods(NAME)}


def engine_adapters(url: str) -> dict[str, dict[str, Any]]:
    """What an engine serves besides its base model: the /v1/models entries with a parent."""
    return {m["id"]: m for m in get_json(f"{url}/v1/models")["data"] if m.get("parent")}


def pod_ids(stack: Any) -> dict[str, str]:
    return {p["metadata"]["name"]: p["metadata"]["uid"] for p in stack.pods(NAME)}


def adapters_status(stack: Any) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in (stack.llm(NAME).get("status") or {}).get("adapters") or []}


def states(entry: dict[str, Any]) -> dict[str, str]:
    return {r["pod"]: r["state"] for r in entry.get("replicas") or []}


def warnings(stack: Any, reason: str) -> list[str]:
    return [e.get("message", "") for e in stack.events(NAME) if e.get("reason") == reason and e.get("type") == "Warning"]


def assert_no_pod_restarted(stack: Any) -> None:
    """The same Pods (names and uids) as when the LLMService became Ready, and the watch saw
    none of them deleted or replaced, and no other Pod created, since then."""
    assert pod_ids(stack) == STATE["pods"]
    assert stack.engine_pids() == STATE["pids"]  # the same engine processes, too
    since = STATE["ready_at"]
    for at, kind, obj in stack.pod_watch.events:
        meta = obj["metadata"]
        if at < since:
            continue
        assert meta["name"] in STATE["pods"] and meta["uid"] == STATE["pods"][meta["name"]], (kind, meta["name"])
        assert kind != "DELETED" and not meta.get("deletionTimestamp"), (kind, meta["name"])
        restarts = [c.get("restartCount", 0) for c in (obj.get("status") or {}).get("containerStatuses") or []]
        assert not any(restarts), (meta["name"], restarts)


# --- the tests -------------------------------------------------------------------------------

def test_llmservice_with_lora_is_ready(stack: Any, adapter_dirs: dict[str, Path]) -> None:
    started = time.monotonic()
    stack.kubectl("apply", "-f", "-", input=json.dumps(llmservice(
        NAME, replicas=REPLICAS, max_adapters=2, max_rank=MAX_RANK)))
    stack.wait_ready(NAME, ENGINE_READY_BOUND_S)
    print(f"\n{NAME}: {REPLICAS} replicas Ready in {time.monotonic() - started:.1f}s")
    STATE["ready_at"] = time.monotonic()
    STATE["pods"] = pod_ids(stack)
    STATE["pids"] = stack.engine_pids()
    assert len(STATE["pids"]) == REPLICAS, STATE["pids"]
    assert len(STATE["pods"]) == REPLICAS

    # The engines run with LoRA on, confined to the model volumes and the allowed root.
    for pod in stack.pods(NAME):
        args = pod["spec"]["containers"][0]["args"]
        assert "--enable-lora" in args and args[args.index("--max-lora-rank") + 1] == str(MAX_RANK)
        assert str(adapter_dirs["root"]) in args[args.index("--allowed-lora-roots") + 1:]
    # Nothing to load yet: the controller says so.
    cond = stack.wait_for(lambda: (c := stack.condition(NAME, "AdaptersReady")) and c["status"] == "True" and c,
                          STATUS_BOUND_S, "AdaptersReady=True (NoAdapters)")
    assert cond["reason"] == "NoAdapters"

    status, body = router_ask(stack, NAME)
    assert status == 200, body
    STATE["base"] = answer(body)
    assert STATE["base"].strip()
    status, body = router_ask(stack, "french")
    assert status == 404 and "does not exist" in error_message(body), body


def test_adding_an_adapter_answers_through_the_router_without_a_restart(stack: Any,
                                                                        adapter_dirs: dict[str, Path]) -> None:
    STATE["first_change"] = sent = set_adapters(stack, [{"name": "french", "uri": uri(adapter_dirs["french"])}])

    def served() -> Any:
        status, body = router_ask(stack, "french")
        return body if status == 200 else None  # held or refused until a replica announces it
    body = stack.wait_for(served, ADAPTER_BOUND_S, f"the adapter answering through the router "
                          f"within {ADAPTER_BOUND_S}s of the spec change")
    took = time.monotonic() - sent
    print(f"\nadapter added → answered through the router in {took:.1f}s (bound {ADAPTER_BOUND_S}s)")
    assert took <= ADAPTER_BOUND_S
    assert body["model"] == "french"
    STATE["french"] = answer(body)
    assert STATE["french"] != STATE["base"]  # the adapter is applied, not just routed to the base

    # Every replica: loaded in the engine, announced to the router, Loaded in status.
    def all_loaded() -> Any:
        entry = adapters_status(stack).get("french") or {}
        cond = stack.condition(NAME, "AdaptersReady")
        ok = (entry.get("loadedReplicas") == REPLICAS and states(entry) == {p: "Loaded" for p in STATE["pods"]}
              and not entry.get("errors") and cond.get("status") == "True" and cond.get("reason") == "AllLoaded")
        return entry if ok else None
    entry = stack.wait_for(all_loaded, STATUS_BOUND_S, "status.adapters: french Loaded in every replica")
    assert entry["uri"] == uri(adapter_dirs["french"])
    for pod_name, url in engine_urls(stack).items():
        served_by_engine = engine_adapters(url)
        assert set(served_by_engine) == {"french"}, (pod_name, served_by_engine)
        assert served_by_engine["french"]["parent"] == NAME
    for pod in stack.pods(NAME):
        annotated = json.loads(pod["metadata"]["annotations"]["tidal.dev/adapters"])
        assert annotated == [{"name": "french", "uri": uri(adapter_dirs["french"])}]
    models = get_json(f"{stack.router_url}/v1/models", stack.api_key)  # the router lists it, with its parent
    assert {"id": "french", "parent": NAME}.items() <= next(m for m in models["data"] if m["id"] == "french").items()

    # The base model is unaffected, and the same answer comes back through the adapter again.
    status, body = router_ask(stack, NAME)
    assert status == 200 and answer(body) == STATE["base"], body
    status, body = router_ask(stack, "french")
    assert status == 200 and answer(body) == STATE["french"], body
    loaded_events = [e for e in stack.events(NAME) if e.get("reason") == "AdaptersLoaded"]
    assert {p for p in STATE["pods"] if any(p in e["message"] for e in loaded_events)} == set(STATE["pods"])
    assert_no_pod_restarted(stack)


BAD = {
    # name: (what the engine API says, what status / the Event says)
    "missing": ("does not exist", "does not exist"),
    "too-big": (f"rank 16 exceeds the maximum LoRA rank {MAX_RANK}", f"rank 16 exceeds the maximum LoRA rank {MAX_RANK}"),
    # The operator refuses it before any engine sees it; the engine refuses it too.
    "outside": ("outside the allowed roots", "file:// adapters are only allowed under"),
}


def test_bad_adapters_give_clear_errors_a_condition_and_events(stack: Any, adapter_dirs: dict[str, Path]) -> None:
    paths = {name: adapter_dirs[name] for name in BAD}
    # 1. The engine API, directly (each replica): a clear 400 each, nothing registered.
    for pod_name, url in engine_urls(stack).items():
        for name, (engine_says, _) in BAD.items():
            status, body = post_json(f"{url}/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(paths[name])})
            assert status == 400 and engine_says in error_message(body), (pod_name, name, status, body)
            assert body["error"]["type"] == "invalid_request_error" and body["error"]["code"] == 400, body
        assert set(engine_adapters(url)) == {"french"}

    # 2. Through the LLMService: the good adapter stays, three bad ones join it.
    good = {"name": "french", "uri": uri(adapter_dirs["french"])}
    set_adapters(stack, [good, *({"name": n, "uri": uri(p)} for n, p in paths.items())])

    def reported() -> Any:
        entries = adapters_status(stack)
        cond = stack.condition(NAME, "AdaptersReady")
        if cond.get("status") != "False" or cond.get("reason") != "AdapterLoadFailed":
            return None
        if states(entries.get("french") or {}) != {p: "Loaded" for p in STATE["pods"]}:
            return None
        for name in BAD:
            if states(entries.get(name) or {}) != {p: "Failed" for p in STATE["pods"]}:
                return None
        return entries, cond
    entries, cond = stack.wait_for(reported, STATUS_BOUND_S, "status: the bad adapters Failed in every replica, "
                                   "french still Loaded, AdaptersReady=False")
    for name, (_, status_says) in BAD.items():
        entry = entries[name]
        assert entry["loadedReplicas"] == 0 and entry["errors"], entry
        assert all(status_says in r["message"] for r in entry["replicas"]), entry
        assert any(status_says in e for e in entry["errors"]), entry
        assert f"{name}: " in cond["message"], cond
    assert entries["french"]["loadedReplicas"] == REPLICAS and not entries["french"]["errors"]

    # A Warning Event per bad adapter, with the reason in it.
    def events_posted() -> Any:
        messages = warnings(stack, "AdapterLoadFailed")
        return messages if all(any(m.startswith(f"adapter {n}:") and says in m for m in messages)
                               for n, (_, says) in BAD.items()) else None
    stack.wait_for(events_posted, STATUS_BOUND_S, "a Warning Event AdapterLoadFailed for each bad adapter")
    # The out-of-roots URI also fails validation: Validated=False and an InvalidSpec Event,
    # and the running Pods are left alone.
    validated = stack.wait_for(lambda: (c := stack.condition(NAME, "Validated")).get("status") == "False" and c,
                               STATUS_BOUND_S, "Validated=False for the out-of-roots URI")
    assert "spec.lora.adapters[3].uri" in validated["message"], validated
    stack.wait_for(lambda: any("spec.lora.adapters[3].uri" in m for m in warnings(stack, "InvalidSpec")),
                   STATUS_BOUND_S, "an InvalidSpec Event naming the out-of-roots URI")

    # Nothing bad reached the engines; the good adapter and the base model keep working.
    for pod_name, url in engine_urls(stack).items():
        assert set(engine_adapters(url)) == {"french"}, pod_name
    status, body = router_ask(stack, "french")
    assert status == 200 and answer(body) == STATE["french"], body
    status, body = router_ask(stack, NAME)
    assert status == 200 and answer(body) == STATE["base"], body
    assert_no_pod_restarted(stack)


def test_removing_the_adapters_gives_404_and_unloads_them(stack: Any) -> None:
    sent = set_adapters(stack, [])

    def refused() -> Any:
        status, body = router_ask(stack, "french")
        return body if status == 404 else None
    body = stack.wait_for(refused, ADAPTER_BOUND_S, f"404 for the removed adapter within {ADAPTER_BOUND_S}s")
    took = time.monotonic() - sent
    print(f"\nadapter removed → 404 through the router in {took:.1f}s (bound {ADAPTER_BOUND_S}s)")
    assert "does not exist" in error_message(body), body

    # The engines unloaded it (not only the router forgot it): a direct request 404s too.
    def unloaded() -> bool:
        return all(not engine_adapters(url) for url in engine_urls(stack).values())
    stack.wait_for(unloaded, STATUS_BOUND_S, "every engine unloaded the adapter")
    for url in engine_urls(stack).values():
        status, body = ask(url, "french", QUESTION)
        assert status == 404 and "does not exist" in error_message(body), body

    def settled() -> bool:
        llm = stack.llm(NAME)
        s = llm.get("status") or {}
        conds = {c["type"]: c for c in s.get("conditions") or []}
        return (s.get("adapters") == [] and conds.get("AdaptersReady", {}).get("reason") == "NoAdapters"
                and conds.get("Validated", {}).get("status") == "True" and s.get("phase") == "Ready"
                and s.get("observedGeneration") == llm["metadata"]["generation"])
    stack.wait_for(settled, STATUS_BOUND_S, "status: no adapters, AdaptersReady=True, Validated=True, Ready")
    unloaded_events = [e for e in stack.events(NAME) if e.get("reason") == "AdaptersUnloaded"]
    assert {p for p in STATE["pods"] if any(p in e["message"] and "french" in e["message"]
                                            for e in unloaded_events)} == set(STATE["pods"])

    status, body = router_ask(stack, NAME)
    assert status == 200 and answer(body) == STATE["base"], body
    assert_no_pod_restarted(stack)


def test_status_showed_each_replicas_state_throughout(stack: Any) -> None:
    """Every status the LLMService had after the first adapter change (from the watch): each
    adapter entry names the state of every replica; and the states went Loaded for the good
    adapter and Failed for the bad ones."""
    seen: dict[str, set[str]] = {}
    snapshots = 0
    for at, kind, obj in stack.llm_watch.snapshot():
        if at < STATE["first_change"] or kind == "DELETED" or obj["metadata"]["name"] != NAME:
            continue
        entries = (obj.get("status") or {}).get("adapters")
        if entries is None:
            continue
        snapshots += 1
        # The controller's condition is never dropped by another writer (the reconcile
        # rewrites `conditions` whole, also while the spec is invalid).
        types = [c["type"] for c in obj["status"].get("conditions") or []]
        assert types.count("AdaptersReady") == 1, (obj["metadata"].get("resourceVersion"), types)
        for entry in entries:
            assert set(states(entry)) == set(STATE["pods"]), entry
            assert set(states(entry).values()) <= {"Loaded", "Failed", "Pending"}, entry
            assert entry["loadedReplicas"] == sum(s == "Loaded" for s in states(entry).values()), entry
            seen.setdefault(entry["name"], set()).update(states(entry).values())
    assert snapshots >= 3, snapshots
    assert "Loaded" in seen["french"]
    assert all(seen[name] == {"Failed"} for name in BAD), seen
