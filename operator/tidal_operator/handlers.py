"""kopf wiring only: which events trigger what. The work is in controller/ (composed in
controller/runtime.py) and the pure decisions in reconcile/, api/ and scaling/.

    kopf run -m tidal_operator.handlers --all-namespaces     # or: tidal operator

Triggers of one reconcile pass (controller/llmservice.py) for one LLMService:
- it is created, its spec changes, or the operator starts (`on.create/update/resume`);
- one of its Pods changes or goes (`on.event` for Pods owned by an LLMService);
- the resync loop, started here (controller/resync.py).
No on.delete handler, timer or daemon: kopf would add its finalizer for those.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import kopf

from . import labels as L
from .controller.env import ENV_KUBECONFIG, config_from_env, resync_seconds
from .controller.ownership import owner_name
from .controller.peering import PeeringGate
from .controller.runtime import OperatorRuntime
from .kube import Kube
from .scaling.controller import scaling_config_from_env

# Set by `tidal operator` before kopf starts (kopf's identity, for the peering gate).
OPERATOR_IDENTITY: str | None = os.environ.get("POD_ID")


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """An explicit $KUBECONFIG (what `tidal operator --kubeconfig` sets) is read now; the
    official client would have read it at import time. Otherwise kopf's usual login:
    in-cluster service account, or ~/.kube/config through the client library."""
    if os.environ.get(ENV_KUBECONFIG):
        return kopf.login_with_kubeconfig(**kwargs)
    return kopf.login_via_client(**kwargs)


def configure_kopf(settings: kopf.OperatorSettings) -> None:
    """kopf settings the operator needs (label_selectors: kopf 1.45 or later)."""
    # Watch only engine Pods: the label every operator-made Pod has. A Pod whose label is
    # edited away leaves the selection, which the watch reports (DELETED), so it is still seen.
    settings.watching.label_selectors["v1", "pods"] = L.LLMSERVICE
    # kopf's own per-handler events: only failures (ours are posted by the reconcile).
    settings.posting.level = logging.WARNING
    # Handlers block on API calls only; keep the retry of a failed reconcile quick.
    settings.batching.error_delays = (1, 2, 5, 10, 30, 60)


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    configure_kopf(settings)
    config = config_from_env()
    kube = await Kube.connect(os.environ.get(ENV_KUBECONFIG) or None)
    runtime = OperatorRuntime.compose(kube, config, scaling_config_from_env())
    resync = resync_seconds()
    runtime.start(PeeringGate(kube, settings, OPERATOR_IDENTITY).active, resync_s=resync)
    memo.runtime = runtime
    logger.info("tidal operator: default image %s, resync every %ss", config.default_engine_image, resync)


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    runtime: OperatorRuntime | None = getattr(memo, "runtime", None)
    if runtime is not None:
        await runtime.stop()


@kopf.on.resume(L.GROUP, L.VERSION, L.PLURAL)
@kopf.on.create(L.GROUP, L.VERSION, L.PLURAL)
@kopf.on.update(L.GROUP, L.VERSION, L.PLURAL)
async def llmservice_changed(namespace: str, name: str, memo: kopf.Memo, **_: Any) -> None:
    """Created, spec changed, or found at start-up: reconcile it. An API error raises, and
    kopf retries the handler with backoff."""
    await memo.runtime.reconciler.run(namespace, name)


@kopf.on.update(L.GROUP, L.VERSION, L.PLURAL, field="spec.lora")
async def lora_spec_changed(namespace: str, name: str, memo: kopf.Memo, **_: Any) -> None:
    """No Pod restarts for an adapter change (the list is outside the spec hash): sync now."""
    await memo.runtime.sync_adapters(namespace, name)


def _owned_by_llmservice(body: kopf.Body, **_: Any) -> bool:
    return owner_name(body) is not None


@kopf.on.event("", "v1", "pods", when=_owned_by_llmservice)
async def engine_pod_event(body: kopf.Body, namespace: str, memo: kopf.Memo, **_: Any) -> None:
    """Any change to an engine Pod (it became Ready, failed, was deleted or edited): reconcile
    its LLMService, found through the ownerReference."""
    owner = owner_name(body)
    assert owner is not None
    # A Pod whose labels were edited leaves the label-selected watch (DELETED, with its previous
    # content): the reconcile finds it by ownerReference and puts the labels back.
    await memo.runtime.reconciler.run(namespace, owner, ensure_service=False)
