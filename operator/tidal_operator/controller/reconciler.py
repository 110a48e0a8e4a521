"""One reconcile pass at a time per LLMService, and coalesced bursts of triggers."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from ..api.types import OperatorConfig
from ..kube import Kube
from .llmservice import DesiredReplicasFn, Outcome, reconcile

Key = tuple[str, str]  # (namespace, name) of an LLMService


@dataclass
class Reconciler:
    """Runs `reconcile()` for one LLMService at a time. A trigger that finds another one
    already queued for the same LLMService returns at once, because the queued pass starts
    later and reads everything fresh. `desired_replicas`: the builtin autoscaler's decision,
    when one runs (see runtime.py)."""

    kube: Kube
    config: OperatorConfig
    desired_replicas: DesiredReplicasFn | None = None
    # LLMServices not yet Ready or invalid: the resync loop revisits them often.
    unsettled: set[Key] = field(default_factory=set)
    _locks: dict[Key, asyncio.Lock] = field(default_factory=dict)
    _queued: set[Key] = field(default_factory=set)

    async def run(self, namespace: str, name: str, *, ensure_service: bool = True) -> Outcome | None:
        key = (namespace, name)
        if key in self._queued:
            return None
        self._queued.add(key)
        lock = self._locks.setdefault(key, asyncio.Lock())
        try:
            async with lock:
                self._queued.discard(key)
                outcome = await reconcile(self.kube, self.config, namespace, name,
                                          ensure_service=ensure_service, desired_replicas_fn=self.desired_replicas)
                if outcome is None or outcome.converged:
                    self.unsettled.discard(key)
                else:
                    self.unsettled.add(key)
                return outcome
        finally:
            self._queued.discard(key)
