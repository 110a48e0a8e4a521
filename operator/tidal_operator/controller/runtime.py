"""Explicit composition of the operator: one Kube client, the reconciler, the resync loop, the
builtin autoscaler and the LoRA adapter sync, wired together here and nowhere else.

The autoscaler's latest decision feeds the reconciler (`Reconciler.desired_replicas`), and a
new decision re-plans the Pods at once (`on_change`). Every loop is one operator-wide task,
not a kopf daemon or timer (those would put kopf's finalizer on every LLMService), and each
pauses while another operator replica is active (`PeeringGate`).
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from ..adapters_sync import AdapterSync, AdapterSyncLoop
from ..api.types import OperatorConfig
from ..kube import Kube
from ..scaling.controller import AutoscalerRuntime, KubeClusterApi, ScalingConfig
from .reconciler import Reconciler
from ..loops import run_rounds
from .resync import resync_loop
from .router_secrets import sync_router_secrets

ROUTER_NAMESPACE_ENV = "TIDAL_ROUTER_NAMESPACE"  # where the router runs: its key copies go there
ROUTER_SECRETS_INTERVAL_S = 10.0  # a rotated engine or client key reaches the router within this

log = logging.getLogger(__name__)


@dataclass
class OperatorRuntime:
    kube: Kube
    config: OperatorConfig
    reconciler: Reconciler
    autoscaler: AutoscalerRuntime
    adapters: AdapterSyncLoop
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    @classmethod
    def compose(cls, kube: Kube, config: OperatorConfig, scaling: ScalingConfig) -> "OperatorRuntime":
        cluster = KubeClusterApi(kube)
        reconciler = Reconciler(kube, config)
        autoscaler = AutoscalerRuntime(cluster, scaling,
                                       on_change=lambda ns, name: reconciler.run(ns, name, ensure_service=False))
        reconciler.desired_replicas = autoscaler.desired_replicas
        adapters = AdapterSyncLoop(AdapterSync(cluster, operator_config=config))
        return cls(kube, config, reconciler, autoscaler, adapters)

    def start(self, active: Callable[[], Awaitable[bool]], *, resync_s: float) -> None:
        """Start the background loops; `active` gates each round."""
        namespace = self.config.namespace
        self._tasks = [
            asyncio.create_task(resync_loop(self.reconciler, active, full_every_s=resync_s,
                                            unsettled_every_s=min(5.0, resync_s), namespace=namespace)),
            asyncio.create_task(self.autoscaler.run(namespace=namespace, active=active)),
            asyncio.create_task(self.adapters.run(namespace=namespace, active=active)),
        ]
        router_namespace = os.environ.get(ROUTER_NAMESPACE_ENV)
        if router_namespace:  # the router reads its keys from copies there, nowhere else
            self._tasks.append(asyncio.create_task(run_rounds(
                lambda: sync_router_secrets(self.kube, router_namespace, namespace), ROUTER_SECRETS_INTERVAL_S,
                what="router secrets", active=active)))

    async def sync_adapters(self, namespace: str, name: str) -> None:
        """spec.lora changed: sync that LLMService now rather than at the next round."""
        llm = await self.kube.get_llmservice(namespace, name)
        if llm is None:
            return
        try:
            await self.adapters.sync.sync(llm)
        except Exception as exc:  # noqa: BLE001 - the interval loop retries; never block kopf's handler
            log.warning("adapter sync of %s/%s failed: %r", namespace, name, exc)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        await self.adapters.sync.aclose()
        await self.autoscaler.aclose()
        await self.kube.close()

