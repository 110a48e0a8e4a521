"""Python's cyclic garbage collector paused while an engine is built.

Building an engine allocates hundreds of thousands of long-lived objects (the imports, the
model's modules, the KV block pool): each allocation burst triggers collections, and a full
one walks every tracked object (a few tenths of a second with torch and transformers loaded).
Nothing built then is garbage, so the collector waits until the engine is up; objects freed
by reference counting are freed as always.
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


__all__ = ["collector_paused"]
