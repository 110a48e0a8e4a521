"""The operator's background loops (autoscaling, adapter sync): one round every interval."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

log = logging.getLogger("tidal.operator")


async def run_rounds(
    one_round: Callable[[], Awaitable[None]],
    interval_s: float,
    *,
    what: str,
    active: Callable[[], Awaitable[bool]] | None = None,
) -> None:
    """Run `one_round` every `interval_s` until cancelled. `active`: skip rounds while another
    operator replica leads. A failing round is logged and the loop goes on (API hiccups)."""
    while True:
        started = time.monotonic()
        try:
            if active is None or await active():
                await one_round()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("%s round failed: %r", what, exc)
        await asyncio.sleep(max(0.0, interval_s - (time.monotonic() - started)))
