"""The engine core's tokenizer, loaded on a thread while the workers start.

Loading it is mostly importing transformers (1.4 of its 1.9 s on the H200 host), Python that
holds the GIL. The workers' start-up releases the GIL whenever it waits (safetensors reads,
device copies and synchronisations, Triton compiles): the load fills those gaps instead of
standing before them. While the load runs, the interpreter switches threads every
``SWITCH_INTERVAL_S`` instead of every 5 ms, so a start-up thread that gave the GIL up for a
device call waits a fraction of a millisecond, not 5 ms, to get it back; the old interval
returns when the load ends.

The core needs the tokenizer only for grammars, bad words, reasoning markers and the EOS id
it adds to the config's; ``result()`` is taken once the workers are up (or at once when a
draft model needs it before them).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any

SWITCH_INTERVAL_S = 0.0005


class TokenizerLoad:
    alongside = True  # False: load in the caller's thread, as before (benchmarks compare both)

    def __init__(self, load: Callable[[], Any]) -> None:
        self._load = load
        self._value: Any = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._switch_interval: float | None = None
        self.seconds = 0.0  # the load's own duration
        if not self.alongside:
            self._run()
            return
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch_interval, SWITCH_INTERVAL_S))
        self._thread = threading.Thread(target=self._run, name="tidal-tokenizer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        started = time.perf_counter()
        try:
            self._value = self._load()
        except BaseException as exc:  # handed to result()'s caller
            self._error = exc
        finally:
            if self._switch_interval is not None:  # nothing competes for the GIL on our account any more
                sys.setswitchinterval(self._switch_interval)
            self.seconds = time.perf_counter() - started
            self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def result(self) -> Any:
        """The tokenizer (waiting for it); the load's own exception if it failed."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._value


__all__ = ["SWITCH_INTERVAL_S", "TokenizerLoad"]
