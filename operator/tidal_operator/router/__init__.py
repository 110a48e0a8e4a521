"""Tidal's router: one OpenAI-compatible endpoint for every model in the cluster.

It routes by `model` (an LLMService's served name or one of its LoRA adapters), balances on
the engines' own load (least load, or prefix-affine consistent hashing with bounded load),
re-sends a request only when it never reached an engine,
and holds requests while it wakes a sleeping engine or waits for a new Pod. See docs/router.md.
"""

from tidal_operator.router.app import ApiKeys, create_app, main, models_payload, run_router
from tidal_operator.router.proxy import RouterConfig
from tidal_operator.router.registry import (
    KubernetesWatcher, ModelEntry, Registry, RegistryState, Replica, apply_llmservice_event, apply_pod_event,
)

__all__ = [
    "ApiKeys", "KubernetesWatcher", "ModelEntry", "Registry", "RegistryState", "Replica", "RouterConfig",
    "apply_llmservice_event", "apply_pod_event", "create_app", "main", "models_payload", "run_router",
]
