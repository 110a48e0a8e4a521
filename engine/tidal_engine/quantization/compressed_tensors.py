"""``quant_method: compressed-tensors`` checkpoints (llm-compressor's format): the float8 schemes.

A scheme is a ``config_groups`` entry: the weights (8-bit float, per channel or per tensor)
and the input activations (per token dynamic, or a static per-tensor scale, which Tidal
reads past: it scales every token dynamically). The tensors are those of the ``fp8`` method,
``weight`` e4m3 and ``weight_scale``, so the same LinearMethod loads them.
"""

from __future__ import annotations

from typing import Any

from tidal_engine.layers.linear import LinearMethod
from tidal_engine.quantization.base import QuantizationConfig
from tidal_engine.quantization.fp8 import Fp8LinearMethod

_FLOAT_FORMATS = ("float-quantized", "naive-quantized")


class CompressedTensorsConfig(QuantizationConfig):
    name = "compressed-tensors"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "CompressedTensorsConfig":
        groups = config.get("config_groups") or {}
        if not groups:
            raise ValueError("compressed-tensors: quantization_config has no config_groups")
        for group_name, group in groups.items():
            weights = group.get("weights") or {}
            fmt = group.get("format") or config.get("format")
            if weights.get("type") != "float" or int(weights.get("num_bits", 0)) != 8:
                raise ValueError(f"compressed-tensors: {group_name} quantizes weights to {weights.get('num_bits')}-bit "
                                 f"{weights.get('type')} (format {fmt!r}); only float8 (W8A8 FP8) is supported here "
                                 "(INT4 checkpoints: use the AWQ or GPTQ format)")
            if fmt not in _FLOAT_FORMATS:
                raise ValueError(f"compressed-tensors: format {fmt!r} is not supported (supported: {_FLOAT_FORMATS})")
            strategy = weights.get("strategy", "tensor")
            if strategy not in ("tensor", "channel"):
                raise ValueError(f"compressed-tensors: weight strategy {strategy!r} is not supported "
                                 "(per-tensor and per-channel are)")
            acts = group.get("input_activations")
            if acts is not None and (acts.get("type") != "float" or int(acts.get("num_bits", 0)) != 8):
                raise ValueError(f"compressed-tensors: {group_name} quantizes activations to "
                                 f"{acts.get('num_bits')}-bit {acts.get('type')}; only float8 is supported")
            targets = set(group.get("targets") or [])
            if not targets & {"Linear", "re:.*"} and not all(t.startswith("re:") for t in targets):
                raise ValueError(f"compressed-tensors: {group_name} targets {sorted(targets)}; only Linear is supported")
        return cls(list(config.get("ignore") or []))

    def make_method(self) -> LinearMethod:
        return Fp8LinearMethod(online=False)
