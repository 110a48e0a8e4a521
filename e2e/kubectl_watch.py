"""`kubectl get WHAT -w --output-watch-events -o json` in the background: every event, in the
order the API server sent it, with the time it arrived (so tests can order events and steps)."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from typing import Any, Callable, Mapping

Event = tuple[float, str, dict[str, Any]]  # (arrival time, ADDED|MODIFIED|DELETED, object)


class KubectlWatch:
    clock: Callable[[], float] = staticmethod(time.monotonic)

    def __init__(self, env: Mapping[str, str], *what: str) -> None:
        self.events: list[Event] = []
        self._lock = threading.Lock()
        self._proc = subprocess.Popen(["kubectl", "get", *what, "-w", "--output-watch-events", "-o", "json"],
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=dict(env))
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        # kubectl prints one pretty-printed JSON object per event: decode them as they complete.
        decoder = json.JSONDecoder()
        buffer = ""
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            buffer += line
            while buffer.strip():
                try:
                    event, end = decoder.raw_decode(buffer.lstrip())
                except ValueError:
                    break
                buffer = buffer.lstrip()[end:]
                with self._lock:
                    self.events.append((self.clock(), event["type"], event["object"]))

    def snapshot(self, since: float = float("-inf")) -> list[Event]:
        with self._lock:
            return [e for e in self.events if e[0] >= since]

    def stop(self) -> None:
        self._proc.terminate()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._thread.join(5)

    def __enter__(self) -> "KubectlWatch":
        return self

    def __exit__(self, *_: Any) -> None:
        self.stop()
