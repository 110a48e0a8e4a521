"""Weight quantization (docs/quantization.md): which format a model's linears use.

``resolve_quantization`` reads the checkpoint's ``quantization_config`` and ``--quantization``
and returns the QuantizationConfig, or None for plain weights.
"""

from __future__ import annotations

from typing import Any

from tidal_engine.quantization.base import QuantizationConfig
from tidal_engine.quantization.compressed_tensors import CompressedTensorsConfig
from tidal_engine.quantization.fp8 import Fp8Config
from tidal_engine.quantization.int4 import AWQConfig, GPTQConfig

# quant_method (config.json) / --quantization value → its config class.
QUANTIZATION_METHODS: dict[str, type[QuantizationConfig]] = {
    "fp8": Fp8Config,
    "compressed-tensors": CompressedTensorsConfig,
    "awq": AWQConfig,
    "gptq": GPTQConfig,
}
# What --quantization accepts (vLLM's names); only fp8 can quantize a plain checkpoint on load.
QUANTIZATION_CHOICES = ("none", *QUANTIZATION_METHODS)


def resolve_quantization(checkpoint: dict[str, Any] | None, requested: str | None) -> QuantizationConfig | None:
    """The checkpoint's format, checked against ``--quantization`` (None/"none": whatever the
    checkpoint has). A plain checkpoint with ``fp8`` is quantized while loading."""
    requested = None if requested in (None, "none", "None") else requested
    if requested is not None and requested not in QUANTIZATION_METHODS:
        raise ValueError(f"unknown quantization {requested!r} (supported: {', '.join(QUANTIZATION_METHODS)})")
    if not checkpoint:
        if requested is None:
            return None
        if requested != "fp8":
            raise ValueError(f"--quantization {requested} needs a {requested} checkpoint, but the model's config.json "
                             "has no quantization_config (only fp8 quantizes a plain checkpoint while loading)")
        return Fp8Config(online=True)
    method = str(checkpoint.get("quant_method", "")).lower()
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"the checkpoint's quantization_config has quant_method {method!r}, which Tidal does not "
                         f"support (supported: {', '.join(QUANTIZATION_METHODS)})")
    if requested is not None and requested != method:
        raise ValueError(f"--quantization {requested} does not match the checkpoint, whose config.json says "
                         f"quant_method {method!r}")
    return QUANTIZATION_METHODS[method].from_config(checkpoint)


__all__ = ["QUANTIZATION_CHOICES", "QUANTIZATION_METHODS", "QuantizationConfig", "resolve_quantization"]
