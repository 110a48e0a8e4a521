"""Executors: how the engine core reaches its workers (base.py is the contract, plan.py the messages).

``create_executor(config, source, device, dtype)`` picks the implementation from
``config.distributed_executor_backend``: ``"uni"`` (default) runs one Worker in the calling
process; ``"mp"`` runs one worker process per rank and talks to them over ZeroMQ.
"""

from __future__ import annotations

from typing import Any

from tidal_engine.executor.base import Executor, PendingStep

__all__ = ["Executor", "PendingStep", "create_executor"]


def create_executor(config: Any, source: Any = None, device: Any = None, dtype: Any = None, **worker_kwargs: Any) -> Executor:
    """The executor for ``config`` (``distributed_executor_backend``: "uni" or "mp").

    ``source`` (a ModelSource), ``device`` and ``dtype`` are resolved from the config when
    left out. ``worker_kwargs`` go to each ``Worker`` (tests: ``sampler_factory``)."""
    backend = getattr(config, "distributed_executor_backend", None) or "uni"
    if backend == "uni":
        from tidal_engine.executor.uniproc import UniprocExecutor

        return UniprocExecutor(config, source, device, dtype, **worker_kwargs)
    if backend == "mp":
        from tidal_engine.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config, source, device, dtype, **worker_kwargs)
    raise ValueError(f"distributed_executor_backend must be 'uni' or 'mp', got {backend!r}")
