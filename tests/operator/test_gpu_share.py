"""spec.gpuShare: the typed field, its validation, what it does to the engine's command line,
and the pure plan of which members to put to sleep so that a requested one can wake."""

from __future__ import annotations

from typing import Any

import pytest

from tidal_operator.api import LLMServiceSpec, validate_spec
from tidal_operator.reconcile.manifests import engine_args, spec_hash
from tidal_operator.router.gpu_share import Member, plan_switch

MODEL = {"uri": "bundled://smollm2-135m"}


def spec(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, **extra}


def reasons(raw: dict[str, Any]) -> set[str]:
    return {p.reason for p in validate_spec(raw, name="a", namespace="ns")}


# --- the field and its validation -----------------------------------------------------------

def test_share_defaults_to_engine_utilization_then_the_whole_device() -> None:
    assert LLMServiceSpec.from_body(spec()).gpu_share_fraction is None
    assert LLMServiceSpec.from_body(spec(gpuShare={"group": "g"})).gpu_share_fraction == 1.0
    assert LLMServiceSpec.from_body(spec(gpuShare={"group": "g"},
                                         engine={"gpuMemoryUtilization": 0.4})).gpu_share_fraction == 0.4
    assert LLMServiceSpec.from_body(spec(gpuShare={"group": "g", "memoryFraction": 0.3})).gpu_share_fraction == 0.3


@pytest.mark.parametrize("bad, reason", [
    ({"gpuShare": {"group": "Not_A_Label"}}, "InvalidField"),
    ({"gpuShare": {"group": "g", "memoryFraction": 0}}, "OutOfRange"),
    ({"gpuShare": {"group": "g", "memoryFraction": 1.5}}, "OutOfRange"),
    ({"gpuShare": {}}, "MissingField"),
    ({"gpuShare": {"group": "g", "memoryFraction": 0.5}, "engine": {"gpuMemoryUtilization": 0.6}}, "InvalidGPUShare"),
    ({"gpuShare": {"group": "g"}, "replicas": 2}, "InvalidGPUShare"),
    ({"gpuShare": {"group": "g"}, "autoscaling": {"maxReplicas": 1, "target": 1}}, "InvalidGPUShare"),
    ({"gpuShare": {"group": "g"}, "parallelism": {"tensor": 2}}, "InvalidGPUShare"),
])
def test_bad_gpu_share_specs_are_refused_with_a_reason(bad: dict[str, Any], reason: str) -> None:
    assert reason in reasons(spec(**bad))


def test_a_valid_member_passes() -> None:
    assert reasons(spec(gpuShare={"group": "pair", "memoryFraction": 0.6}, replicas=1)) == set()


# --- the engine -------------------------------------------------------------------------------

def test_a_member_sleeps_and_takes_its_share_of_the_device() -> None:
    argv = engine_args(LLMServiceSpec.from_body(spec(gpuShare={"group": "g", "memoryFraction": 0.45})), "a")
    assert "--enable-sleep-mode" in argv
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.45"
    plain = engine_args(LLMServiceSpec.from_body(spec()), "a")
    assert "--enable-sleep-mode" not in plain and "--gpu-memory-utilization" not in plain


def test_joining_or_changing_a_group_replaces_the_pod() -> None:
    base = spec()
    assert spec_hash(base) != spec_hash(spec(gpuShare={"group": "g"}))
    assert spec_hash(spec(gpuShare={"group": "g"})) != spec_hash(spec(gpuShare={"group": "h"}))


# --- the switch plan ----------------------------------------------------------------------------

def test_nothing_sleeps_while_the_group_fits() -> None:
    members = [Member("a", 0.45, awake=True), Member("b", 0.45, awake=False)]
    assert plan_switch(members, "b").outcome == "ready"
    assert plan_switch(members, "b").wake == "b"
    assert plan_switch(members, "a").wake is None


def test_the_least_recently_used_awake_member_sleeps_first() -> None:
    members = [Member("a", 0.5, awake=True, last_used=10), Member("b", 0.5, awake=True, last_used=5),
               Member("c", 0.5, awake=False)]
    plan = plan_switch(members, "c")
    assert (plan.outcome, plan.sleep, plan.wake) == ("sleep_then_wake", ("b",), "c")


def test_as_many_sleep_as_needed_and_no_more() -> None:
    members = [Member("a", 0.3, awake=True, last_used=1), Member("b", 0.3, awake=True, last_used=2),
               Member("c", 0.3, awake=True, last_used=3), Member("big", 0.7, awake=False)]
    assert plan_switch(members, "big").sleep == ("a", "b")


def test_two_members_that_each_need_most_of_the_device_take_turns() -> None:
    a, b = Member("a", 0.6, awake=True, last_used=1), Member("b", 0.6, awake=False)
    assert plan_switch([a, b], "b").sleep == ("a",)
    # An awake member over capacity (both started awake): the other one is put to sleep.
    both = [Member("a", 0.6, awake=True, last_used=2), Member("b", 0.6, awake=True, last_used=1)]
    assert plan_switch(both, "a") == plan_switch(both, "a")  # deterministic
    assert plan_switch(both, "a").sleep == ("b",) and plan_switch(both, "a").wake is None


def test_a_busy_member_is_not_cut_off_unless_preemption_is_allowed() -> None:
    members = [Member("a", 0.6, awake=True, last_used=1, busy=True), Member("b", 0.6, awake=False)]
    assert plan_switch(members, "b").outcome == "wait"
    assert plan_switch(members, "b", preempt_busy=True).sleep == ("a",)


def test_idle_members_go_before_busy_ones_even_if_used_more_recently() -> None:
    members = [Member("busy", 0.4, awake=True, last_used=1, busy=True), Member("idle", 0.4, awake=True, last_used=9),
               Member("new", 0.4, awake=False)]
    assert plan_switch(members, "new").sleep == ("idle",)


def test_a_member_larger_than_the_device_is_impossible_and_an_unknown_one_an_error() -> None:
    assert plan_switch([Member("a", 1.0, awake=True)], "a", capacity=0.5).outcome == "impossible"
    with pytest.raises(KeyError):
        plan_switch([Member("a", 0.5, awake=True)], "zzz")


# --- the router: a GPU-share group on the request path (fake engines) ---------------------------

def _member(name: str, share: float) -> dict[str, Any]:
    from router_upstreams import llmservice

    obj = llmservice(name)
    obj["spec"]["gpuShare"] = {"group": "pair", "memoryFraction": share}
    return obj


def _awake(engines: Any) -> list[str]:
    return [e.name for e in engines if not e.sleeping]


async def test_the_router_sleeps_the_other_member_before_it_wakes_the_requested_one() -> None:
    import asyncio

    from tidal_operator.router import Registry

    from router_upstreams import FakeEngine, pod, run_router_for_test, serve_engines

    a, b = FakeEngine("a-0"), FakeEngine("b-0")  # both start awake, as Pods do, and don't fit together
    async with serve_engines(a, b):
        registry = Registry()
        for obj in (_member("a", 0.6), _member("b", 0.6)):
            registry.apply_llmservice_event({"type": "ADDED", "object": obj})
        registry.apply_pod_event({"type": "ADDED", "object": pod("a-0", "a", a.port)})
        registry.apply_pod_event({"type": "ADDED", "object": pod("b-0", "b", b.port)})
        async with run_router_for_test(registry, engine_load_interval_s=0) as router:
            for model in ["a", "b", "a", "b", "b", "a"]:  # alternating, and a repeat
                r = await router.client.post("/v1/chat/completions", json={"model": model, "messages": []})
                assert r.status_code == 200 and r.json()["replica"] == f"{model}-0"
                assert _awake([a, b]) == [f"{model}-0"]  # the other one was put to sleep first
            # Concurrent requests for both members: every one answered, one switch at a time.
            bodies = [{"model": m, "messages": []} for m in ["a", "b"] * 4]
            answers = await asyncio.gather(*(router.client.post("/v1/chat/completions", json=x) for x in bodies))
            assert [x.status_code for x in answers] == [200] * 8
            assert [x.json()["replica"] for x in answers] == [f"{x['model']}-0" for x in bodies]
            assert len(_awake([a, b])) == 1
            switcher = router.app.state.switcher
            # Every switch slept before it woke, and never woke a member while another was awake.
            assert switcher.switches[0] == (("b",), None)  # the first request only made room
            assert all(len(slept) == 1 and woken is not None for slept, woken in list(switcher.switches)[1:])
            assert a.sleep_calls + b.sleep_calls == len(switcher.switches)


async def test_members_that_fit_together_both_stay_awake_and_other_models_are_untouched() -> None:
    from tidal_operator.router import Registry

    from router_upstreams import FakeEngine, llmservice, pod, run_router_for_test, serve_engines

    a, b, c = FakeEngine("a-0"), FakeEngine("b-0"), FakeEngine("c-0")
    async with serve_engines(a, b, c):
        registry = Registry()
        for obj in (_member("a", 0.45), _member("b", 0.45), llmservice("c")):
            registry.apply_llmservice_event({"type": "ADDED", "object": obj})
        for name, engine in (("a", a), ("b", b), ("c", c)):
            registry.apply_pod_event({"type": "ADDED", "object": pod(f"{name}-0", name, engine.port)})
        async with run_router_for_test(registry, engine_load_interval_s=0) as router:
            for model in ["a", "b", "c", "a"]:
                r = await router.client.post("/v1/chat/completions", json={"model": model, "messages": []})
                assert r.status_code == 200
            assert _awake([a, b, c]) == ["a-0", "b-0", "c-0"]
            assert a.sleep_calls == b.sleep_calls == c.sleep_calls == 0
