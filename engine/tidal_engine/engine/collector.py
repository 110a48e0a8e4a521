"""Python's cyclic garbage collector around an engine's build.

Building an engine allocates hundreds of thousands of long-lived objects (the imports, the
model's modules, the KV block pool): each allocation burst triggers collections, and a full
one walks every tracked object (a few tenths of a second with torch and transformers loaded).
Nothing built then is garbage, so the collector waits until the engine is up; objects freed
by reference counting are freed as always.

After the build a GPU engine also freezes the heap it leaves: the next full collection would
walk all of it again, and on the H200 that one walk stalled a running 8B batch for 0.27 s (8%
of the run; benchmarks/results/h200-2026-12-01f-lead). Frozen objects are never walked again.
Shutting the engine down unfreezes them, so an engine dropped later can still be collected.
Each API server process freezes its start-up heap the same way while it serves.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """The collector off inside (process-wide), back as it was on the way out, errors included."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def freeze_heap() -> None:
    """Collect the garbage there is now, then move every surviving object out of the collector's
    reach (``gc.freeze``): later collections walk only what is allocated after this."""
    gc.collect()
    gc.freeze()


def unfreeze_heap() -> None:
    """Hand the frozen objects back to the collector (into its oldest generation)."""
    gc.unfreeze()


__all__ = ["collector_paused", "freeze_heap", "unfreeze_heap"]
