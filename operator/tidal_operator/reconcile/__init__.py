"""Pure reconciliation logic: spec -> manifests, observed Pods -> plan, observed -> status.
controller/ does the I/O and calls these."""

from .manifests import engine_args, pod_manifest, pod_name, service_manifest, spec_hash
from .pods import PodPlan, PodToCreate, PodView, plan_pods
from .status import compute_status, desired_replicas

__all__ = ["PodPlan", "PodToCreate", "PodView", "compute_status", "desired_replicas", "engine_args",
           "pod_manifest", "pod_name", "plan_pods", "service_manifest", "spec_hash"]
