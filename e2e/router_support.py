"""Helpers for e2e/test_router_e2e.py: the router as a client sees it (the real `openai`
client and plain HTTP), the engines' and the router's /metrics, and killing an engine
process of the `tidal dev` kubelet.

Plain functions, no fixtures (the stack fixture lives in e2e/conftest.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import httpx
from prometheus_client.parser import text_string_to_metric_families

REPLICA_HEADER = "x-tidal-replica"


# --- clients ------------------------------------------------------------------------------

def openai_client(base_url: str, key: str, *, timeout: float = 120.0) -> Any:
    """The real `openai` client against the router. max_retries=0: the client's own retries
    would hide a 5xx or a refused connection from the router, which the tests must see."""
    import openai

    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0, timeout=timeout)


def async_openai_client(base_url: str, key: str, *, timeout: float = 120.0) -> Any:
    import openai

    return openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0, timeout=timeout)


def messages(question: str, system: str | None = None) -> list[dict[str, str]]:
    out = [{"role": "system", "content": system}] if system else []
    return out + [{"role": "user", "content": question}]


@dataclass
class Answer:
    """One request through the router, as the client saw it."""

    started: float
    ended: float = 0.0
    status: int | None = None  # None: no HTTP answer at all (connection error)
    replica: str | None = None
    text: str = ""
    stream: bool = False
    error_event: bool = False  # a stream that ended with the router's `upstream_error` event
    done: bool = False  # a stream that ended with data: [DONE]
    error: str | None = None


async def ask(client: httpx.AsyncClient, url: str, key: str, model: str, question: str, *, stream: bool = False,
              system: str | None = None, max_tokens: int = 8) -> Answer:
    """POST /v1/chat/completions (greedy), read the whole answer, never raise."""
    answer = Answer(started=time.monotonic(), stream=stream)
    body = {"model": model, "messages": messages(question, system), "max_tokens": max_tokens, "temperature": 0,
            "stream": stream}
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body,
                                 headers={"authorization": f"Bearer {key}"}) as response:
            answer.status = response.status_code
            answer.replica = response.headers.get(REPLICA_HEADER)
            if not stream or response.status_code != 200:
                raw = await response.aread()
                if response.status_code == 200:
                    answer.text = json.loads(raw)["choices"][0]["message"]["content"] or ""
                else:
                    answer.error = raw.decode(errors="replace")[:500]
            else:
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: "):]
                    if data == "[DONE]":
                        answer.done = True
                        continue
                    event = json.loads(data)
                    if "error" in event:
                        answer.error_event = True
                        answer.error = json.dumps(event["error"])[:500]
                        continue
                    for choice in event.get("choices") or []:
                        answer.text += (choice.get("delta") or {}).get("content") or ""
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        answer.error = repr(exc)
    answer.ended = time.monotonic()
    return answer


def router_json(url: str, key: str, path: str) -> Any:
    response = httpx.get(f"{url}{path}", headers={"authorization": f"Bearer {key}"}, timeout=10)
    response.raise_for_status()
    return response.json()


# --- metrics ------------------------------------------------------------------------------

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str, key: str | None = None, timeout: float = 10.0) -> Samples:
    """GET {url}/metrics → {(sample name, sorted labels): value}."""
    headers = {"authorization": f"Bearer {key}"} if key else {}
    response = httpx.get(f"{url}/metrics", headers=headers, timeout=timeout)
    response.raise_for_status()
    out: Samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def metric(samples: Samples, name: str, **labels: str) -> float:
    """The sum of `name` over every series whose labels include `labels` (0 when none)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


# --- engine processes -----------------------------------------------------------------------

def engine_process_group(state_dir: Path, namespace: str, pod: str, container: str = "engine") -> int:
    """The process group of a Pod's container, as the `tidal dev` kubelet runs it.

    The control plane keeps `<state dir>/engines.json`: `"<namespace>/<pod>/<container>":
    [pid, start time in clock ticks]`, where pid is the container process, started in a new
    session, so it is also its process group id. Cross-checked against /proc: the same start
    time (so a recycled pid is never hit) and a `tidal-engine serve` command line (what the
    operator put in the Pod spec) or the title the server gives itself.
    """
    table = json.loads((state_dir / "engines.json").read_text())
    pid, started = table[f"{namespace}/{pod}/{container}"]
    stat = Path(f"/proc/{pid}/stat").read_text()
    assert int(stat.rsplit(") ", 1)[1].split()[19]) == started, f"pid {pid} is not {pod}'s engine any more"
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    # `tidal-engine serve ...`, retitled by the server to "tidal-engine: api-server[-manager]".
    assert cmdline.startswith(b"tidal-engine: api-server") or (
        any(part.endswith(b"tidal-engine") for part in cmdline.split(b"\0")) and b"serve" in cmdline.split(b"\0")
    ), cmdline
    assert os.getpgid(pid) == pid
    return int(pid)


def kill_process_group(pgid: int) -> None:
    """SIGKILL, as an OOM kill or a crash would: no drain, no goodbye to open connections."""
    os.killpg(pgid, signal.SIGKILL)


def process_gone(pgid: int) -> bool:
    """Every process of the group has exited (zombies not yet reaped count as exited).

    The whole group, not its leader alone: the API server's workers and the engine core are
    its children, and a child still closing its sockets can still take a request on a pooled
    connection after the leader is already a zombie.
    """
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _ppid, group = stat_file.read_text().rsplit(") ", 1)[1].split()[:3]
        except (OSError, IndexError, ValueError):
            continue  # exited while we looked
        if int(group) == pgid and state != "Z":
            return False
    return True


# --- small things ---------------------------------------------------------------------------

def pod_ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def counts(answers: Iterable[Answer]) -> dict[str, int]:
    out: dict[str, int] = {}
    for a in answers:
        out[a.replica or "(none)"] = out.get(a.replica or "(none)", 0) + 1
    return out


@dataclass
class Workers:
    """Clients sending requests back to back until stopped; every answer is kept."""

    url: str
    key: str
    model: str
    answers: list[Answer] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self, index: int, stream: bool) -> None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(120.0)) as client:
            n = 0
            while not self.stop.is_set():
                n += 1
                self.answers.append(await ask(client, self.url, self.key, self.model,
                                              f"Client {index}, question {n}: name a colour.", stream=stream))
