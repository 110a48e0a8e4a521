"""Whether this operator replica is the active one, for the loops kopf does not pause."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Mapping

import kopf

from ..kube import Kube
from .env import ENV_NAMESPACE


@dataclass
class PeeringGate:
    """Read from kopf's peering object the way kopf decides it (a live peer with a higher or
    equal priority pauses us). kopf pauses its own watches by itself; this gates the resync,
    autoscaling and adapter-sync loops, which kopf does not know about."""

    kube: Kube
    settings: kopf.OperatorSettings
    identity: str | None

    async def active(self) -> bool:
        peering = self.settings.peering
        if peering.standalone:
            return True
        namespace = None if peering.clusterwide else os.environ.get(ENV_NAMESPACE)
        if not peering.clusterwide and namespace is None:
            return True
        try:
            obj = await self.kube.get_peering(peering.name, namespace)
        except Exception:  # noqa: BLE001 - no peering CRDs: kopf runs standalone, and so do we
            return True
        now = datetime.now(timezone.utc)
        for ident, info in ((obj or {}).get("status") or {}).items():
            if ident == self.identity or not isinstance(info, Mapping):
                continue
            try:
                seen = datetime.fromisoformat(str(info.get("lastseen")))
                seen = seen if seen.tzinfo else seen.replace(tzinfo=timezone.utc)
                alive = seen + timedelta(seconds=int(info.get("lifetime", 60))) > now
                priority = int(info.get("priority", 0))
            except (TypeError, ValueError):
                continue
            # Without our own identity, an equal priority may be ourselves: only yield to higher.
            if alive and (priority > peering.priority or (priority == peering.priority and self.identity)):
                return False
        return True
