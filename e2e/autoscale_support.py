"""Helpers for e2e/test_autoscale_e2e.py: a ledger of every client request, a burst of
concurrent clients, kubectl watches of the LLMService and its Pods with the time each event
arrived, the engines' and the router's own reports, and killing the `tidal dev` operator.

Plain functions and classes, no fixtures (the stack fixture lives in e2e/conftest.py).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kubectl_watch import KubectlWatch

QUESTION = "What is the capital of France?"
IDLE_SINCE = "tidal.dev/idle-since"
SLEEP_STATE = "tidal.dev/sleep-state"

Obj = dict[str, Any]


# --- requests: every one the scenario sends, and how it ended ---------------------------------

@dataclass
class Answer:
    what: str  # which step sent it
    started: float  # time.time()
    ended: float = 0.0
    status: int | None = None  # None: no HTTP answer at all
    text: str = ""
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


@dataclass
class Ledger:
    """Every request the scenario sends through the router (thread-safe)."""

    answers: list[Answer] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, answer: Answer) -> None:
        with self._lock:
            self.answers.append(answer)

    def failed(self) -> list[Answer]:
        with self._lock:
            return [a for a in self.answers if not a.ok]

    def __len__(self) -> int:
        with self._lock:
            return len(self.answers)


def ask(router_url: str, key: str, model: str, ledger: Ledger, what: str, *, max_tokens: int = 8,
        ignore_eos: bool = False, timeout: float = 240.0) -> Answer:
    """One greedy chat completion through the router, recorded in `ledger` however it ends."""
    answer = Answer(what, time.time())
    body: Obj = {"model": model, "messages": [{"role": "user", "content": QUESTION}],
                 "max_tokens": max_tokens, "temperature": 0}
    if ignore_eos:
        body["ignore_eos"] = True  # a fixed length: a burst request stays in flight for a while
    try:
        response = httpx.post(f"{router_url}/v1/chat/completions", json=body, timeout=timeout,
                              headers={"authorization": f"Bearer {key}"})
        answer.status = response.status_code
        if response.status_code == 200:
            answer.text = str(response.json()["choices"][0]["message"]["content"])
        else:
            answer.error = response.text[:500]
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        answer.error = repr(exc)
    answer.ended = time.time()
    ledger.add(answer)
    return answer


class Burst:
    """`workers` clients, each sending its next request as soon as the previous one is
    answered, until stop(): exactly `workers` requests in flight at any moment, which is what
    a requestsInFlight target of 1 scales on."""

    def __init__(self, router_url: str, key: str, model: str, ledger: Ledger, *, workers: int,
                 max_tokens: int) -> None:
        self._stop = threading.Event()
        self._args = (router_url, key, model, ledger)
        self.max_tokens = max_tokens
        self.answers: list[Answer] = []
        self._threads = [threading.Thread(target=self._run, daemon=True, name=f"burst-{i}")
                         for i in range(workers)]
        for thread in self._threads:
            thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.answers.append(ask(*self._args, "burst", max_tokens=self.max_tokens, ignore_eos=True))

    def stop(self, timeout: float = 120.0) -> None:
        """Stop sending; returns when every request sent has been answered."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout)
        assert not any(t.is_alive() for t in self._threads), "a burst request never came back"

    @property
    def running(self) -> bool:
        return any(t.is_alive() for t in self._threads)


# --- watches: every version of the objects, in the order the API server sent them ------------

class Watch(KubectlWatch):
    """A watch whose events keep the wall-clock time they arrived, to line up with status times."""

    clock = staticmethod(time.time)


def status_of(obj: Obj) -> Obj:
    return obj.get("status") or {}


def history(obj: Obj) -> list[Obj]:
    return list(status_of(obj).get("scalingHistory") or [])


def parse_time(value: str) -> float:
    """An RFC 3339 time as the operator writes it ("...Z", optionally with milliseconds)."""
    return datetime.fromisoformat(value.replace("Z", "+00:00")).astimezone(timezone.utc).timestamp()


def pod_ready(pod: Obj) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in status_of(pod).get("conditions") or [])


def live_pods(events: Iterable[tuple[float, str, Obj]]) -> Iterable[tuple[float, set[str]]]:
    """The set of live (not deleted, not terminating) Pods after each watch event."""
    live: set[str] = set()
    for at, kind, obj in events:
        name = obj["metadata"]["name"]
        if kind == "DELETED" or obj["metadata"].get("deletionTimestamp"):
            live.discard(name)
        else:
            live.add(name)
        yield at, set(live)


# --- the engines and the router, as they report themselves -----------------------------------

def engine_get(pod: Obj, port: int, path: str, key: str, timeout: float = 10.0) -> httpx.Response:
    """GET straight to one engine Pod (its loopback address on `tidal dev`), with its key."""
    return httpx.get(f"http://{status_of(pod)['podIP']}:{port}{path}", timeout=timeout,
                     headers={"authorization": f"Bearer {key}"})


def engine_sleeping(pod: Obj, port: int, key: str) -> bool:
    response = engine_get(pod, port, "/is_sleeping", key)
    response.raise_for_status()
    return bool(response.json()["is_sleeping"])


def metric_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def metric_sum(samples: Mapping[tuple[str, tuple[tuple[str, str], ...]], float], name: str,
               where: Callable[[dict[str, str]], bool] = lambda _: True) -> float:
    return sum(v for (n, labels), v in samples.items() if n == name and where(dict(labels)))


def router_get(router_url: str, key: str, path: str) -> httpx.Response:
    response = httpx.get(router_url + path, headers={"authorization": f"Bearer {key}"}, timeout=10)
    response.raise_for_status()
    return response


def router_demand(router_url: str, key: str, llmservice: str, namespace: str = "default") -> Obj:
    """This LLMService's entry of the router's /debug/demand (what the autoscaler reads)."""
    demand = router_get(router_url, key, "/debug/demand").json()
    for d in demand.get("demand") or []:
        if d.get("llmservice") == llmservice and d.get("namespace") == namespace:
            return {**d, "wakeCalls": demand.get("wakeCalls", 0)}
    return {"held": 0, "totalHeld": 0, "wakeCalls": demand.get("wakeCalls", 0)}


# --- the operator process of the `tidal dev` stack ---------------------------------------------

def operator_pid(state_dir: Path) -> int | None:
    try:
        pid = int((state_dir / "pids" / "operator.pid").read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if alive(pid) else None


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is gone for our purposes
        return not Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z")
    except OSError:
        return False


def kill_operator(state_dir: Path, timeout_s: float = 30.0) -> int:
    """SIGKILL the operator (a crash: no cleanup handlers run). `tidal dev` started it in a
    session of its own, so its process group is its pid. Returns the pid, once it is gone."""
    pid = operator_pid(state_dir)
    assert pid is not None, "the operator of the tidal dev stack is not running"
    os.killpg(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while alive(pid):
        assert time.monotonic() < deadline, f"operator {pid} still alive {timeout_s:g}s after SIGKILL"
        time.sleep(0.05)
    return pid
