"""Multi-LoRA serving: PEFT adapters read from disk, kept in a host cache, swapped into device
slots, and applied per segment of a mixed batch. See docs/lora.md."""

from tidal_engine.lora.adapter import BaseModelShape, LoRAAdapter, LoRAError, confine_path, read_adapter
from tidal_engine.lora.layers import LoRABatch, LoRAModelSlots
from tidal_engine.lora.manager import AdapterInfo, LoRAManager, LoRASettings

__all__ = [
    "AdapterInfo",
    "BaseModelShape",
    "LoRAAdapter",
    "LoRABatch",
    "LoRAError",
    "LoRAManager",
    "LoRAModelSlots",
    "LoRASettings",
    "confine_path",
    "read_adapter",
]
