"""Workers: one per device rank; each owns a ModelRunner and its requests' state (worker.py)."""

from tidal_engine.worker.worker import Worker, WorkerStep

__all__ = ["Worker", "WorkerStep"]
