"""``quant_method: compressed-tensors`` checkpoints (llm-compressor's format): the float8
schemes and the INT4 weight-only ``pack-quantized`` scheme.

A scheme is a ``config_groups`` entry: the weights and the input activations.

- float8 (weights per channel or per tensor; activations per token dynamic, or a static
  per-tensor scale, which Tidal reads past: it scales every token dynamically). The tensors are
  those of the ``fp8`` method, ``weight`` e4m3 and ``weight_scale``, so the same LinearMethod
  loads them.
- INT4, ``format: pack-quantized``, strategy ``group`` (symmetric or not), no activation
  quantization: ``weight_packed`` int32 ``[out, in/8]`` (input ``8j + i`` in nibble i of word
  j, stored as ``q + 8``), ``weight_scale`` ``[out, in/g]``, ``weight_zero_point`` int32
  ``[out/8, in/g]`` when asymmetric (packed along the outputs, also ``+ 8``), and
  ``weight_shape``. That is already the row layout int4.py multiplies with.
"""

from __future__ import annotations

from typing import Any

import torch

from tidal_engine.layers.linear import LinearBase, LinearMethod
from tidal_engine.quantization.base import QuantizationConfig
from tidal_engine.quantization.fp8 import Fp8LinearMethod
from tidal_engine.quantization.int4 import PACK, Int4LinearMethod, _param, pack_rows, unpack_words

_FLOAT_FORMATS = ("float-quantized", "naive-quantized")
_INT4_FORMAT = "pack-quantized"


class PackQuantizedInt4Method(Int4LinearMethod):
    """compressed-tensors' INT4 ``pack-quantized`` tensors, turned into int4.py's row layout."""

    def __init__(self, group_size: int, symmetric: bool) -> None:
        super().__init__("compressed-tensors", group_size, has_zeros=not symmetric)
        self.ignored_params = ("weight_shape",)

    def create_weights(self, layer: LinearBase, in_features: int, out_features: int, dtype: torch.dtype | None) -> None:
        g = self.group_size
        if in_features % g or out_features % PACK or in_features % PACK:
            raise ValueError(f"compressed-tensors int4: a layer of {in_features} inputs × {out_features} outputs "
                             f"(on this rank) does not split into groups of {g} and words of {PACK}")
        scale_dtype = torch.get_default_dtype() if dtype is None else dtype
        layer.register_parameter("weight_packed", _param(
            torch.empty(out_features, in_features // PACK, dtype=torch.int32), 0, 1, input_pack=PACK))
        layer.register_parameter("weight_scale", _param(
            torch.empty(out_features, in_features // g, dtype=scale_dtype), 0, 1, input_pack=g))
        if self.has_zeros:
            layer.register_parameter("weight_zero_point", _param(
                torch.empty(out_features // PACK, in_features // g, dtype=torch.int32), 0, 1,
                output_pack=PACK, input_pack=g))

    def fill_dummy(self, layer: LinearBase, std: float, generator: torch.Generator) -> None:
        from tidal_engine.quantization.quantizer import quantize_int4

        w = torch.randn(layer.out_features, layer.in_features, generator=generator, device=generator.device) * std
        q, scale, zero = quantize_int4(w, self.group_size, symmetric=not self.has_zeros)
        layer.weight_packed.data.copy_(pack_rows(q))
        layer.weight_scale.data.copy_(scale)
        if self.has_zeros:
            layer.weight_zero_point.data.copy_(pack_rows(zero.t().contiguous()).t())
        if layer.bias is not None:
            layer.bias.data.normal_(0.0, std, generator=generator)

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        scales = layer.weight_scale.data
        if self.has_zeros:
            zeros = unpack_words(layer.weight_zero_point.data.t().contiguous()).t()  # [N, K/g], 0..15
            del layer.weight_zero_point
        else:
            zeros = torch.full_like(scales, 8)
        qweight = layer.weight_packed.data
        del layer.weight_packed, layer.weight_scale
        layer.qweight = _param(qweight, 0, 1)
        layer.scales = _param(scales, 0, 1)
        layer.zeros = _param(zeros.to(scales.dtype).contiguous(), 0, 1)
        layer.group_size = self.group_size


class CompressedTensorsConfig(QuantizationConfig):
    name = "compressed-tensors"

    def __init__(self, ignored: list[str], int4: tuple[int, bool] | None = None) -> None:
        super().__init__(ignored)
        self.int4 = int4  # (group size, symmetric) of an INT4 scheme; None: float8

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "CompressedTensorsConfig":
        groups = config.get("config_groups") or {}
        if not groups:
            raise ValueError("compressed-tensors: quantization_config has no config_groups")
        schemes = set()
        for group_name, group in groups.items():
            weights = group.get("weights") or {}
            fmt = group.get("format") or config.get("format")
            targets = set(group.get("targets") or [])
            if not targets & {"Linear", "re:.*"} and not all(t.startswith("re:") for t in targets):
                raise ValueError(f"compressed-tensors: {group_name} targets {sorted(targets)}; only Linear is supported")
            if weights.get("type") == "int" and int(weights.get("num_bits", 0)) == 4:
                schemes.add(("int4", *_int4_scheme(group_name, group, fmt)))
                continue
            if weights.get("type") != "float" or int(weights.get("num_bits", 0)) != 8:
                raise ValueError(f"compressed-tensors: {group_name} quantizes weights to {weights.get('num_bits')}-bit "
                                 f"{weights.get('type')} (format {fmt!r}); supported: float8 (W8A8 FP8) and "
                                 f"4-bit int ({_INT4_FORMAT})")
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
            schemes.add(("fp8",))
        if len(schemes) > 1:
            raise ValueError(f"compressed-tensors: config_groups mix schemes {sorted(schemes)}; one is supported")
        (scheme,) = schemes
        int4 = (int(scheme[1]), bool(scheme[2])) if scheme[0] == "int4" else None
        return cls(list(config.get("ignore") or []), int4)

    def make_method(self) -> LinearMethod:
        if self.int4 is not None:
            return PackQuantizedInt4Method(*self.int4)
        return Fp8LinearMethod(online=False)


def _int4_scheme(group_name: str, group: dict[str, Any], fmt: str | None) -> tuple[int, bool]:
    """(group size, symmetric) of a weight-only INT4 scheme, or a clear error."""
    weights = group["weights"]
    if fmt != _INT4_FORMAT:
        raise ValueError(f"compressed-tensors: {group_name} has 4-bit int weights in format {fmt!r}; "
                         f"only {_INT4_FORMAT!r} is supported")
    if weights.get("strategy") != "group" or not weights.get("group_size"):
        raise ValueError(f"compressed-tensors: {group_name} int4 strategy {weights.get('strategy')!r} is not "
                         "supported (only 'group' with a group_size)")
    if weights.get("actorder") not in (None, False, "static"):
        raise ValueError(f"compressed-tensors: {group_name} uses actorder {weights.get('actorder')!r}; "
                         "not supported")
    if group.get("input_activations"):
        raise ValueError(f"compressed-tensors: {group_name} quantizes activations with int4 weights; "
                         "only weight-only int4 (W4A16) is supported")
    group_size = int(weights["group_size"])
    if group_size % PACK:
        raise ValueError(f"compressed-tensors: group_size {group_size} is not a multiple of {PACK}")
    return group_size, bool(weights.get("symmetric", True))
