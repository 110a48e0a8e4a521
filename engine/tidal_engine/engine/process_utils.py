"""Small process helpers: titles that `ps` shows, and children that die with their parent."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

import setproctitle

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def set_process_title(title: str) -> None:
    """What `ps` and `top` show for this process (e.g. "tidal-engine: engine-core")."""
    setproctitle.setproctitle(title)


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux), so a SIGKILLed
    server leaves no engine core or worker behind. Elsewhere, callers also poll the parent."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            logger.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
    except OSError as exc:  # no libc symbol: fall back to polling the parent
        logger.warning("cannot set the parent-death signal: %s", exc)


def parent_alive(original_parent: int) -> bool:
    """False once the parent that started us is gone (we were re-parented)."""
    return os.getppid() == original_parent


def ignore_termination_signals() -> None:
    """Children leave SIGTERM/SIGINT to the parent, which drains and then stops them: a
    Pod deletion signals the whole process group, and the core must outlive the drain."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
