"""Seconds per start-up phase of a model runner, so a slow start says where it spent its time."""

from __future__ import annotations

import logging
import time

import torch

logger = logging.getLogger(__name__)


class StartupClock:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        """The time since the previous mark goes to ``phase`` (the device's queue drained first)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._last
        self._last = now

    def log(self) -> None:
        logger.info("start-up: %s", ", ".join(f"{k} {v:.2f} s" for k, v in self.seconds.items()))
