"""Which connector the engine's flags ask for, built on each side. A new connector (e.g.
prefill/decode disaggregation) is one more branch in both functions."""

from __future__ import annotations

from typing import Any

import torch

from tidal_engine.kv_transfer.base import BlockHolder, KVConnectorScheduler, KVConnectorWorker


def create_worker_connector(config: Any, kv_caches: list[torch.Tensor], device: torch.device) -> KVConnectorWorker | None:
    size = getattr(config, "kv_offloading_size", None)
    if not size:
        return None
    from tidal_engine.kv_transfer.offload_worker import OffloadConnectorWorker

    return OffloadConnectorWorker(size, kv_caches, device)


def create_scheduler_connector(config: Any, holder: BlockHolder, info: dict[str, Any]) -> KVConnectorScheduler | None:
    """``info``: what the driver worker's connector reported (``KVConnectorWorker.info``)."""
    if not getattr(config, "kv_offloading_size", None):
        return None
    from tidal_engine.kv_transfer.offload_scheduler import OffloadConnectorScheduler

    return OffloadConnectorScheduler(holder, config.block_size, int(info["num_host_blocks"]),
                                     getattr(config, "kv_offloading_save", "write-through"))
