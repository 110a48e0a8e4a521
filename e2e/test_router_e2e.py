"""The router's acceptance on `tidal dev`, with real engines (SmolLM2-135M on CPU), the real
kubectl and the real `openai` client.

Two LLMServices, three engine processes in all:
- `alpha`: 2 replicas, an engine API key from a Secret (clients never see it), leastLoad,
  later patched to prefixHash. Load spreading, prefix affinity and replica failure run on it;
- `beta`: 1 replica with `--enable-sleep-mode` passed as an extra engine flag. No `spec.sleep`
  on purpose: the operator's idle loop then leaves it alone, so every wake_up the engine gets
  comes from the router (the counts below are the router's own).

The tests share one stack (the `models` fixture applies both and waits for Ready) and run in
file order: the prefix test switches alpha to prefixHash, the failure test kills one of its
engines and then deletes alpha, so the sleep test has the CPU to itself. Every wait is on
something observable (status, the router's answers, /metrics, a process), with a deadline;
requests use max_tokens <= 8.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Iterator

import httpx
import pytest
import yaml

import router_support as rs

ALPHA, BETA = "alpha", "beta"
ENGINE_KEY = "e2e-alpha-engine-key"  # alpha's engines require it; only the router has it
READY_BOUND_S = 180  # three engines loading at once on 2 shared cores
MODELS = {
    ALPHA: {"replicas": 2, "auth": {"apiKeySecretRef": {"name": "alpha-engine-key"}},
            "routing": {"strategy": "leastLoad"}},
    BETA: {"replicas": 1, "engine": {"args": ["--enable-sleep-mode"]}},
}
# A long shared system prompt (well over the router's 256 hashed characters, and many 16-token
# KV blocks), as an application with a fixed instruction block would send.
SYSTEM_PROMPT = " ".join([
    "You are the support assistant of Tidal, a Kubernetes-native serving system for large language models.",
    "Answer in one short sentence. Be precise, be polite, never invent facts, and say so when you do not know.",
    "Tidal runs engines as Pods, routes every request through one OpenAI-compatible endpoint,",
    "balances load across replicas, keeps prompts that share a prefix on the replica that cached it,",
    "wakes sleeping engines on demand and scales from zero when requests arrive for an idle model.",
    "Users are operators and application developers; they care about latency, cost and reliability.",
] * 2)


def llmservice(name: str, extra: dict[str, Any]) -> dict[str, Any]:
    # One thread per engine: three engines share 2 cores.
    engine = {"kvCacheMemory": "128Mi", "startupTimeoutSeconds": 300,
              "env": [{"name": "OMP_NUM_THREADS", "value": "1"}]}
    engine.update(extra.get("engine", {}))
    spec = {"model": {"uri": "bundled://smollm2-135m", "maxModelLen": 1024}, **extra, "engine": engine}
    return {"apiVersion": "tidal.dev/v1alpha1", "kind": "LLMService", "metadata": {"name": name}, "spec": spec}


def pod_names(stack: Any, llm: str) -> set[str]:
    return {p["metadata"]["name"] for p in stack.pods(llm) if rs.pod_ready(p)}


def engine_url(stack: Any, pod: str) -> str:
    return f"http://{stack.get('pod', pod)['status']['podIP']}:8000"


def router_metrics(stack: Any) -> Any:
    return rs.scrape(stack.router_url, stack.api_key)


@pytest.fixture(scope="module")
def timings() -> Iterator[dict[str, float]]:
    out: dict[str, float] = {}
    yield out
    print("\nrouter e2e timings: " + ", ".join(f"{k} {v:.1f}s" for k, v in out.items()))


@pytest.fixture(scope="module")
def models(real_stack: Any, timings: dict[str, float]) -> None:
    """alpha's engine-key Secret, alpha and beta applied with kubectl, all Ready."""
    started = time.monotonic()
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "alpha-engine-key"},
              "stringData": {"api-key": ENGINE_KEY}}
    docs = [secret] + [llmservice(name, extra) for name, extra in MODELS.items()]
    real_stack.kubectl("apply", "-f", "-", input="\n---\n".join(yaml.safe_dump(d) for d in docs))
    for name in MODELS:
        real_stack.wait_ready(name, READY_BOUND_S)
    timings["apply to 3 engines Ready"] = time.monotonic() - started


def test_openai_client_plain_and_streamed_for_two_models(real_stack: Any, models: None,
                                                         timings: dict[str, float]) -> None:
    started = time.monotonic()
    client = rs.openai_client(real_stack.router_url, real_stack.api_key)
    listed = {m.id for m in client.models.list().data}
    assert {ALPHA, BETA} <= listed, listed

    for name in MODELS:
        pods = pod_names(real_stack, name)
        assert len(pods) == MODELS[name]["replicas"], pods
        raw = client.chat.completions.with_raw_response.create(
            model=name, messages=rs.messages("What is the capital of France?"), max_tokens=8, temperature=0)
        plain = raw.parse()
        assert raw.headers[rs.REPLICA_HEADER] in pods  # this model's own engine answered
        assert plain.model == name and plain.choices[0].message.content.strip()
        assert plain.usage is not None and plain.usage.completion_tokens <= 8

        raw = client.chat.completions.with_raw_response.create(
            model=name, messages=rs.messages("What is the capital of France?"), max_tokens=8, temperature=0,
            stream=True)
        assert raw.headers[rs.REPLICA_HEADER] in pods
        assert raw.headers["content-type"].startswith("text/event-stream")
        chunks = list(raw.parse())
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert len(chunks) >= 2 and all(c.model == name for c in chunks)
        # Greedy: streamed through the router, the same text as the plain answer.
        assert streamed == plain.choices[0].message.content, (streamed, plain.choices[0].message.content)

    # An unknown model: OpenAI-style 404 naming the models there are.
    import openai
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="nope", messages=rs.messages("hi"), max_tokens=1)
    assert ALPHA in str(missing.value) and BETA in str(missing.value)
    timings["openai plain+stream"] = time.monotonic() - started


def test_auth_no_key_and_wrong_key_401_right_key_200(real_stack: Any, models: None) -> None:
    import openai

    url = real_stack.router_url
    body = {"model": ALPHA, "messages": rs.messages("Say hi."), "max_tokens": 2}
    no_key = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert no_key.status_code == 401
    assert no_key.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 401

    with pytest.raises(openai.AuthenticationError) as wrong:
        rs.openai_client(url, "not-the-key").chat.completions.create(**body)
    assert wrong.value.status_code == 401

    right = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60,
                       headers={"authorization": f"Bearer {real_stack.api_key}"})
    assert right.status_code == 200, right.text

    # The engines want their own key, which only the router holds: neither no key nor the
    # client's key opens an alpha engine directly.
    engine = engine_url(real_stack, sorted(pod_names(real_stack, ALPHA))[0])
    assert httpx.post(f"{engine}/v1/chat/completions", json=body, timeout=60).status_code == 401
    assert httpx.post(f"{engine}/v1/chat/completions", json=body, timeout=60,
                      headers={"authorization": f"Bearer {real_stack.api_key}"}).status_code == 401


def test_a_labelled_secret_opens_its_namespace_only_until_it_is_deleted(real_stack: Any, models: None) -> None:
    # Namespace client keys found by label: the operator copies them into the router's
    # namespace (a 10 s round), the router watches the copies. alpha and beta live in default.
    url, tenant_key, other_key = real_stack.router_url, "e2e-tenant-default", "e2e-tenant-team-x"
    docs = [{"apiVersion": "v1", "kind": "Secret", "stringData": {"app": key},
             "metadata": {"name": "tenant-keys", "namespace": ns, "labels": {"tidal.dev/client-keys": "true"}}}
            for ns, key in (("default", tenant_key), ("team-x", other_key))]
    real_stack.kubectl("apply", "-f", "-", input="\n---\n".join(yaml.safe_dump(d) for d in docs))

    def listed(key: str) -> list[str] | None:
        r = httpx.get(f"{url}/v1/models", headers={"authorization": f"Bearer {key}"}, timeout=10)
        return sorted(m["id"] for m in r.json()["data"]) if r.status_code == 200 else None

    def chat(key: str) -> httpx.Response:
        return httpx.post(f"{url}/v1/chat/completions", timeout=60, headers={"authorization": f"Bearer {key}"},
                          json={"model": BETA, "messages": rs.messages("Say hi."), "max_tokens": 2})

    real_stack.wait_for(lambda: listed(tenant_key) is not None and listed(other_key) is not None, 40,
                        "both labelled Secrets' keys accepted by the router")
    assert {ALPHA, BETA} <= set(listed(tenant_key) or [])
    assert listed(other_key) == []  # team-x has no models, and sees none of default's
    assert chat(other_key).status_code == 404
    assert chat(tenant_key).status_code == 200
    real_stack.kubectl("delete", "secret", "tenant-keys", "-n", "default")
    real_stack.wait_for(lambda: listed(tenant_key) is None, 40, "the deleted Secret's key revoked")
    assert chat(tenant_key).status_code == 401
    assert listed(other_key) == []
    real_stack.kubectl("delete", "secret", "tenant-keys", "-n", "team-x")


def test_tools_and_responses_pass_through_the_router(real_stack: Any, models: None) -> None:
    """Tool calls (tool_choice required, plain and streamed) and the Responses API
    (responses.create and responses.stream) reach the engine through the router unchanged."""
    client = rs.openai_client(real_stack.router_url, real_stack.api_key)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"], "additionalProperties": False}}}
    question = rs.messages("What is the weather in Paris?")
    plain = client.chat.completions.create(model=ALPHA, messages=question, tools=[tool], tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=40, temperature=0)
    (call,) = plain.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    arguments = ""
    for chunk in client.chat.completions.create(model=ALPHA, messages=question, tools=[tool], tool_choice="required",
                                                parallel_tool_calls=False, max_tokens=40, temperature=0, stream=True):
        for piece in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            arguments += piece.function.arguments or ""
    assert arguments == call.function.arguments

    created = client.responses.create(model=ALPHA, input="What is the capital of France?", max_output_tokens=8,
                                      temperature=0, store=False)
    assert created.output_text
    with client.responses.stream(model=ALPHA, input="What is the capital of France?", max_output_tokens=8,
                                 temperature=0, store=False) as stream:
        events = list(stream)
    assert events[0].type == "response.created"
    assert events[-1].response.output_text == created.output_text


def test_least_load_spreads_40_concurrent_requests_over_both_replicas(real_stack: Any, models: None,
                                                                     timings: dict[str, float]) -> None:
    pods = pod_names(real_stack, ALPHA)

    async def burst() -> list[rs.Answer]:
        async with httpx.AsyncClient(timeout=httpx.Timeout(180.0)) as client:
            return await asyncio.gather(*(rs.ask(client, real_stack.router_url, real_stack.api_key, ALPHA,
                                                 f"Request {i}: name a fruit.", stream=i % 4 == 0)
                                          for i in range(40)))

    started = time.monotonic()
    answers = asyncio.run(burst())
    timings["40 concurrent"] = time.monotonic() - started
    failed = [a for a in answers if a.status != 200 or a.error]
    assert not failed, failed[:3]
    per_replica = rs.counts(answers)
    print(f"40 concurrent requests, per replica: {per_replica}")
    assert set(per_replica) == pods
    # Least outstanding requests keeps the two within a few of each other.
    assert min(per_replica.values()) >= 12, per_replica


def test_prefix_hash_keeps_a_shared_system_prompt_on_one_replica_and_its_cache_hits(
        real_stack: Any, models: None, timings: dict[str, float]) -> None:
    started = time.monotonic()
    real_stack.kubectl("patch", "llm", ALPHA, "--type=merge", "-p",
                       json.dumps({"spec": {"routing": {"strategy": "prefixHash"}}}))
    url, key = real_stack.router_url, real_stack.api_key

    # The router has the new strategy once back-to-back requests with one prompt stop taking
    # turns: leastLoad breaks the tie between two idle replicas round-robin, so under it no two
    # consecutive requests land on the same replica.
    async def probe_until_sticky() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            deadline = time.monotonic() + 30
            last: list[str | None] = []
            while time.monotonic() < deadline:
                answer = await rs.ask(client, url, key, ALPHA, "ping", max_tokens=1)
                assert answer.status == 200, answer
                last = (last + [answer.replica])[-3:]
                if len(last) == 3 and len(set(last)) == 1:
                    return
            pytest.fail(f"the router did not switch {ALPHA} to prefixHash within 30s")
    asyncio.run(probe_until_sticky())

    pods = sorted(pod_names(real_stack, ALPHA))
    engines = {p: engine_url(real_stack, p) for p in pods}
    hits = "tidal:prefix_cache_hits_total"
    before = {p: rs.metric(rs.scrape(u, ENGINE_KEY), hits) for p, u in engines.items()}

    async def sequential() -> list[rs.Answer]:
        out = []
        async with httpx.AsyncClient(timeout=120) as client:
            for i, question in enumerate(["How do I deploy a model?", "What does the router do?",
                                          "Can an engine sleep?", "How are replicas balanced?",
                                          "What happens when a replica dies?", "Is there an API key?"]):
                out.append(await rs.ask(client, url, key, ALPHA, question, system=SYSTEM_PROMPT,
                                        stream=i % 2 == 1))
        return out
    answers = asyncio.run(sequential())
    assert all(a.status == 200 and not a.error for a in answers), answers
    per_replica = rs.counts(answers)
    print(f"prefixHash, 6 requests sharing a {len(SYSTEM_PROMPT)}-character system prompt: {per_replica}")
    (home,) = per_replica  # all on one replica
    other = next(p for p in pods if p != home)

    after = {p: rs.metric(rs.scrape(u, ENGINE_KEY), hits) for p, u in engines.items()}
    gained = {p: after[p] - before[p] for p in pods}
    print(f"prefix-cache hit tokens gained: {gained}")
    # Requests 2..6 find the system prompt's blocks (~200 tokens) already cached.
    assert gained[home] >= 5 * 128, gained
    assert gained[other] == 0, gained
    timings["prefixHash"] = time.monotonic() - started


def test_killed_engine_later_requests_succeed_on_the_other_replica(real_stack: Any, models: None,
                                                                   timings: dict[str, float]) -> None:
    started = time.monotonic()
    url, key = real_stack.router_url, real_stack.api_key
    pods = sorted(pod_names(real_stack, ALPHA))
    assert len(pods) == 2
    retries_before = rs.metric(router_metrics(real_stack), "tidal_router_retries_total", model=ALPHA)
    errors_before = rs.metric(router_metrics(real_stack), "tidal_router_upstream_errors_total", model=ALPHA)
    victim = pods[0]
    survivor = pods[1]
    # How the engine process is found: the `tidal dev` kubelet's state dir (engines.json),
    # cross-checked with /proc (see router_support.engine_process_group).
    pgid = rs.engine_process_group(real_stack.state_dir, "default", victim)

    gone_at: list[float] = []  # when the process was seen gone (its sockets closed)
    noticed_at: list[float] = []  # when the router's upstream-error count was first seen to move

    def upstream_errors() -> float:
        return rs.metric(router_metrics(real_stack), "tidal_router_upstream_errors_total", model=ALPHA)

    async def watch_router() -> None:
        while await asyncio.to_thread(upstream_errors) <= errors_before:
            await asyncio.sleep(0.02)
        noticed_at.append(time.monotonic())

    async def scenario() -> tuple[rs.Workers, float]:
        # Distinct prompts (prefixHash is on): both replicas get work. 4 plain clients and 2
        # streaming ones, back to back.
        workers = rs.Workers(url, key, ALPHA)
        tasks = [asyncio.create_task(workers.run(i, stream=i >= 4)) for i in range(6)]

        async def until(check: Any, what: str, timeout: float) -> None:
            deadline = time.monotonic() + timeout
            while not check():
                if time.monotonic() > deadline or any(t.done() for t in tasks):
                    pytest.fail(f"timed out: {what}")
                await asyncio.sleep(0.05)

        await until(lambda: {a.replica for a in workers.answers} >= set(pods), "both replicas answering", 60)
        rs.kill_process_group(pgid)
        killed_at = time.monotonic()
        watcher = asyncio.create_task(watch_router())
        await until(lambda: rs.process_gone(pgid), "the engine process gone", 10)
        gone_at.append(time.monotonic())
        await until(lambda: sum(1 for a in workers.answers if a.started > killed_at) >= 12,
                    "12 requests after the kill", 90)
        workers.stop.set()
        await asyncio.gather(*tasks)
        watcher.cancel()
        return workers, killed_at

    workers, killed_at = asyncio.run(scenario())
    answers = workers.answers
    # Until the router has seen the engine fail, a pooled keep-alive connection to it may still
    # look alive to the router, whatever this test saw of the process.
    noticed = max(gone_at[0], noticed_at[0]) if noticed_at else gone_at[0]
    after = [a for a in answers if a.started > noticed]
    in_flight = [a for a in answers if a.started <= killed_at < a.ended]
    print(f"replica failure: {len(answers)} requests, {len(in_flight)} in flight at the kill "
          f"({rs.counts(in_flight)}), after it: {rs.counts(after)}")
    # A request the dead engine had already received is not replayed (it might be what
    # killed it): it may end in a 502. Every other request succeeds: those that found the
    # engine gone (connection refused) were re-sent to the survivor.
    # Sent while the engine was dying (until its process was seen gone and the router had seen
    # it fail, a pooled connection may still have looked alive to the router): a 502 is allowed
    # for those.
    cut = [a for a in answers if a.started <= noticed and a.replica in (None, victim)]
    assert all(a.status == 200 or (a in cut and a.status == 502) for a in answers), \
        [a for a in answers if a.status != 200][:3]
    plain = [a for a in answers if not a.stream and a.status == 200]
    assert all(not a.error and a.text for a in plain), [a for a in plain if a.error][:3]
    # A stream that was already flowing from the dead engine ends with an error event (and
    # [DONE]); every other stream completed.
    for a in answers:
        if a.stream and a.status == 200:
            assert a.done and (not a.error_event or (a in in_flight and a.replica == victim)), a
    assert all(a.replica == survivor for a in after), rs.counts(after)
    retries = rs.metric(router_metrics(real_stack), "tidal_router_retries_total", model=ALPHA) - retries_before
    print(f"router retries after the kill: {retries:g}; streams cut mid-way: "
          f"{sum(1 for a in answers if a.error_event)}")
    # The router saw the engine fail (a broken connection: 502, not replayed; or a refused one:
    # re-sent, counted in retries), and every request after the kill went to the survivor.
    errors = rs.metric(router_metrics(real_stack), "tidal_router_upstream_errors_total", model=ALPHA) - errors_before
    assert errors >= 1
    assert all("not re-sent" in (a.error or "") for a in cut if a.status == 502), \
        [a.error for a in cut if a.status == 502 and "not re-sent" not in (a.error or "")]
    timings["replica failure"] = time.monotonic() - started
    # alpha is done: free its CPU (the kubelet would restart the killed engine) for beta.
    real_stack.kubectl("delete", "llm", ALPHA, "--wait=false")


def test_sleeping_replica_is_woken_once_for_concurrent_requests(real_stack: Any, models: None,
                                                                timings: dict[str, float]) -> None:
    started = time.monotonic()
    url, key = real_stack.router_url, real_stack.api_key
    (pod,) = pod_names(real_stack, BETA)
    engine = engine_url(real_stack, pod)

    def wakes() -> float:
        return rs.metric(router_metrics(real_stack), "tidal_router_wakeups_total", llmservice=BETA, result="sent")

    def sleep_engine() -> None:
        # Through the engine's own API, on the Pod IP. The Pod's sleep-state label still says
        # awake (no controller relabels it): the router learns it from the engine's 503.
        answer = httpx.post(f"{engine}/sleep", params={"level": 1}, timeout=60).json()
        assert answer["is_sleeping"] is True, answer
        assert httpx.get(f"{engine}/is_sleeping", timeout=10).json()["is_sleeping"] is True

    client = rs.openai_client(url, key)
    wakes_0 = wakes()
    sleep_engine()
    first = client.chat.completions.with_raw_response.create(
        model=BETA, messages=rs.messages("What is the capital of France?"), max_tokens=8, temperature=0)
    assert first.headers[rs.REPLICA_HEADER] == pod
    assert first.parse().choices[0].message.content.strip()
    assert httpx.get(f"{engine}/is_sleeping", timeout=10).json()["is_sleeping"] is False
    assert wakes() - wakes_0 == 1
    timings["one request wakes"] = time.monotonic() - started

    sleep_engine()
    wakes_1 = wakes()

    async def ten() -> tuple[list[Any], int]:
        # While they run, read how many requests the router holds at once (its queue).
        most_held = 0
        burst_done = asyncio.Event()

        async def watch_queue() -> None:
            nonlocal most_held
            async with httpx.AsyncClient(timeout=10, headers={"authorization": f"Bearer {key}"}) as http:
                while not burst_done.is_set():
                    demand = (await http.get(f"{url}/debug/demand")).json()["demand"]
                    most_held = max([most_held] + [d["held"] for d in demand if d["llmservice"] == BETA])
                    await asyncio.sleep(0.01)

        aclient = rs.async_openai_client(url, key)
        watcher = asyncio.create_task(watch_queue())
        try:
            return await asyncio.gather(*(aclient.chat.completions.create(
                model=BETA, messages=rs.messages(f"Question {i}: what is 2 + {i}?"), max_tokens=4, temperature=0)
                for i in range(10))), most_held
        finally:
            burst_done.set()
            await watcher
            await aclient.close()
    answers, most_held = asyncio.run(ten())
    assert len(answers) == 10 and all(a.choices[0].message.content is not None for a in answers)
    print(f"10 concurrent requests on a sleeping replica: up to {most_held} held at once during the wake, "
          f"wake_up calls: {wakes() - wakes_1:g}")
    assert wakes() - wakes_1 == 1
    assert most_held >= 2  # they really waited on the one wake together
    assert httpx.get(f"{engine}/is_sleeping", timeout=10).json()["is_sleeping"] is False
    timings["sleep/wake"] = time.monotonic() - started
