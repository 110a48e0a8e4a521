"""A GPU-share group on `tidal dev`: two SmolLM2-135M LLMServices (CPU engines) in one group,
each needing 0.6 of the device, so only one fits awake. Requests alternate through the
router; every one is answered by the model it named, and after each answer exactly that
model's engine is awake (read from the engines' own /is_sleeping). Then concurrent requests
for both: all answered, one engine awake at the end.

No `spec.sleep` on the members, so every sleep and wake comes from the router's group switch.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import yaml

import router_support as rs

MEMBERS = ("left", "right")
READY_BOUND_S = 180


def member(name: str) -> dict[str, Any]:
    return {"apiVersion": "tidal.dev/v1alpha1", "kind": "LLMService", "metadata": {"name": name},
            "spec": {"model": {"uri": "bundled://smollm2-135m", "maxModelLen": 512},
                     "gpuShare": {"group": "pair", "memoryFraction": 0.6},
                     "engine": {"kvCacheMemory": "64Mi", "startupTimeoutSeconds": 300,
                                "env": [{"name": "OMP_NUM_THREADS", "value": "1"}]}}}


def awake(stack: Any) -> list[str]:
    """The members whose engine says it is awake, in MEMBERS order."""
    out = []
    for name in MEMBERS:
        (pod,) = [p for p in stack.pods(name) if rs.pod_ready(p)]
        answer = httpx.get(f"http://{pod['status']['podIP']}:8000/is_sleeping", timeout=10).json()
        if not answer["is_sleeping"]:
            out.append(name)
    return out


def test_two_members_take_turns_and_every_request_is_answered(real_stack: Any) -> None:
    started = time.monotonic()
    real_stack.kubectl("apply", "-f", "-", input="\n---\n".join(yaml.safe_dump(member(n)) for n in MEMBERS))
    for name in MEMBERS:
        real_stack.wait_ready(name, READY_BOUND_S)
    ready_s = time.monotonic() - started
    url, key = real_stack.router_url, real_stack.api_key

    async def alternate() -> list[tuple[str, rs.Answer, list[str]]]:
        out = []
        async with httpx.AsyncClient(timeout=httpx.Timeout(120.0)) as client:
            for model in ["left", "right", "left", "right", "right", "left"]:
                answer = await rs.ask(client, url, key, model, "Name a colour.", max_tokens=4)
                out.append((model, answer, awake(real_stack)))
        return out

    for model, answer, now_awake in asyncio.run(alternate()):
        assert answer.status == 200, answer.error
        assert answer.replica is not None and answer.replica.startswith(f"{model}-")
        assert now_awake == [model], (model, now_awake)  # the other one was put to sleep

    async def together() -> list[rs.Answer]:
        async with httpx.AsyncClient(timeout=httpx.Timeout(120.0)) as client:
            return await asyncio.gather(*(rs.ask(client, url, key, m, f"Question {i}.", max_tokens=4)
                                          for i, m in enumerate(["left", "right"] * 3)))

    answers = asyncio.run(together())
    assert [a.status for a in answers] == [200] * 6, [a.error for a in answers]
    assert all(a.replica and a.replica.startswith(m) for a, m in zip(answers, ["left", "right"] * 3))
    assert len(awake(real_stack)) == 1
    print(f"\ngpu-share e2e: 2 engines Ready in {ready_s:.1f}s, all in {time.monotonic() - started:.1f}s")
