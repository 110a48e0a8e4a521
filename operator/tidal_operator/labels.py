"""The label and annotation contract: the single place that names them.

The operator writes these on every engine Pod; the router, the autoscaler, people with
`kubectl -l` and the docs (docs/labels.md) all read them. Change a name here and only here.
"""

from __future__ import annotations

from typing import Final, Literal

GROUP: Final = "tidal.dev"
VERSION: Final = "v1alpha1"
API_VERSION: Final = f"{GROUP}/{VERSION}"
KIND: Final = "LLMService"
PLURAL: Final = "llmservices"

# --- labels (selectable) ---------------------------------------------------------------
APP_NAME: Final = "app.kubernetes.io/name"
APP_INSTANCE: Final = "app.kubernetes.io/instance"
APP_COMPONENT: Final = "app.kubernetes.io/component"
MANAGED_BY: Final = "app.kubernetes.io/managed-by"
LLMSERVICE: Final = "tidal.dev/llmservice"
REPLICA_INDEX: Final = "tidal.dev/replica-index"
SLEEP_STATE: Final = "tidal.dev/sleep-state"

APP_NAME_VALUE: Final = "tidal-engine"
COMPONENT_VALUE: Final = "engine"
MANAGED_BY_VALUE: Final = "tidal-operator"

# --- annotations (not selectable; free-form values) ------------------------------------
SPEC_HASH: Final = "tidal.dev/spec-hash"
ADAPTERS: Final = "tidal.dev/adapters"

# Held demand: each router replica keeps a coordination.k8s.io Lease labelled ROUTER_DEMAND in
# its own namespace, whose HELD_DEMAND annotation lists what it holds per LLMService (JSON:
# [{"namespace", "llmservice", "held"}]); the autoscaler sums the unexpired ones.
ROUTER_DEMAND: Final = "tidal.dev/router-demand"
HELD_DEMAND: Final = "tidal.dev/held-demand"

# Values of tidal.dev/sleep-state. The idle controller moves a Pod awake -> asleep-1 ->
# asleep-2; the router reads it to know it must wake a replica before sending to it.
SleepState = Literal["awake", "asleep-1", "asleep-2"]
SLEEP_AWAKE: Final = "awake"
SLEEP_LEVEL_1: Final = "asleep-1"
SLEEP_LEVEL_2: Final = "asleep-2"
SLEEP_STATES: Final = (SLEEP_AWAKE, SLEEP_LEVEL_1, SLEEP_LEVEL_2)

# Keys users may not set through spec.podTemplate: the operator owns them, and letting a
# user override tidal.dev/llmservice would detach Pods from their LLMService.
RESERVED_PREFIXES: Final = ("tidal.dev/",)
RESERVED_KEYS: Final = frozenset({APP_NAME, APP_INSTANCE, APP_COMPONENT, MANAGED_BY})

# Labels that other controllers legitimately change on a running Pod, so drift repair
# must not "restore" them.
MUTABLE_LABELS: Final = frozenset({SLEEP_STATE})
MUTABLE_ANNOTATIONS: Final = frozenset({ADAPTERS})


def is_reserved_key(key: str) -> bool:
    """True for label/annotation keys the operator owns on engine Pods."""
    return key in RESERVED_KEYS or key.startswith(RESERVED_PREFIXES)


def selector_labels(llm_name: str) -> dict[str, str]:
    """The labels that select all engine Pods of one LLMService (Service selector too)."""
    return {APP_NAME: APP_NAME_VALUE, LLMSERVICE: llm_name}


def selector_string(llm_name: str) -> str:
    """The same selector in `kubectl -l` / labelSelector query form."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(llm_name).items()))
