"""KV connectors: moving KV blocks between the device cache and another tier or engine.

``base.py`` is the interface; ``offload_*.py`` the host-memory offload connector (docs/kv-offload.md).
"""

from tidal_engine.kv_transfer.base import (
    BlockTransfer,
    KVConnectorScheduler,
    KVConnectorWorker,
    KVTransferPlan,
    KVTransferReport,
)

__all__ = ["BlockTransfer", "KVConnectorScheduler", "KVConnectorWorker", "KVTransferPlan", "KVTransferReport"]
