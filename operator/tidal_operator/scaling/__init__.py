"""Autoscaling from engine metrics and the idle policy (docs/autoscaling.md).

decide.py and idle.py are pure; scraper.py and controller.py do the I/O.
"""

from .decide import Decision, Reading, ScalingState, decide_replicas, metric_value, replicas_needed
from .idle import IDLE_SINCE_ANNOTATION, IdleAction, ReplicaIdleView, plan_idle
from .scraper import Scraper, ScrapeTarget

__all__ = [
    "Decision", "IDLE_SINCE_ANNOTATION", "IdleAction", "Reading", "ReplicaIdleView", "ScalingState", "ScrapeTarget",
    "Scraper", "decide_replicas", "metric_value", "plan_idle", "replicas_needed",
]
