"""FP8 W8A8: e4m3 weights with one scale per output channel, activations quantized per token
at run time.

Sources: a 16/32-bit checkpoint quantized while loading (``--quantization fp8``), or an FP8
checkpoint (``quant_method: fp8``, or ``compressed-tensors`` float8, see compressed_tensors.py).
Per-tensor checkpoint scales become per-channel ones on load (q, k and v of a merged layer keep
their own scales that way). A checkpoint's static ``input_scale`` is read past: activations are
always scaled per token, which is at least as accurate.

The matmul is ``torch._scaled_mm`` on GPUs with FP8 tensor cores (compute capability 8.9+),
with the activations quantized by one Triton kernel (kernels/triton/quant_fp8.py); inputs of
a few rows (decode) may instead go to the FP8-weight Triton GEMV, which widens the weights in
registers and leaves the activations in 16 bits (chosen per shape by measurement,
kernels/gemv_choice.py); as a gated MLP's gate_up it also applies SiLU-and-mul to its gate/up
pairs in its epilogue (``folds_activation``). Everywhere else a reference in the run dtype computes the W8A8
numbers: quantize the activations, dequantize both, multiply.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tidal_engine.layers.linear import LinearBase, LinearMethod, as_tensor
from tidal_engine.quantization.base import QuantizationConfig, SmallBatchKernel

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
_MIN_SCALE = 1e-12  # an all-zero row or token still gets a finite scale


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[R, C]`` → (e4m3 ``[R, C]``, float32 scale ``[R]``) with ``w ≈ q * scale[:, None]``."""
    scale = (w.abs().amax(dim=-1).float() / FP8_MAX).clamp(min=_MIN_SCALE)
    q = (w.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token activation quantization: ``[T, K]`` → (e4m3, float32 ``[T, 1]``)."""
    q, scale = quantize_rows(x)
    return q, scale[:, None]


def scaled_mm_supported(x: torch.Tensor) -> bool:
    return x.is_cuda and torch.cuda.get_device_capability(x.device) >= (8, 9)


class Fp8LinearMethod(LinearMethod, SmallBatchKernel):
    """``weight`` e4m3 ``[out, in]`` and ``weight_scale`` float32 ``[out]``; with ``online`` the
    checkpoint's 16/32-bit ``weight`` is loaded first and quantized after loading."""

    ignored_params = ("input_scale",)

    def __init__(self, online: bool) -> None:
        self.online = online

    def create_weights(self, layer: LinearBase, in_features: int, out_features: int, dtype: torch.dtype | None) -> None:
        weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype if self.online else FP8),
                              requires_grad=False)
        weight.output_dim, weight.input_dim = 0, 1  # type: ignore[attr-defined]
        layer.register_parameter("weight", weight)
        if self.online:
            return
        scale = nn.Parameter(torch.empty(out_features, dtype=torch.float32), requires_grad=False)
        scale.output_dim, scale.input_dim = 0, None  # type: ignore[attr-defined]

        def load_scale(param: torch.Tensor, loaded: Any, shard: str | None = None) -> None:
            # Per-tensor ([] or [1]) → the value on every row of the shard; per-channel ([out] or [out, 1]) as is.
            t = as_tensor(loaded).float()
            full = layer.full_output_sizes[shard]
            t = t.reshape(-1)
            if t.numel() == 1:
                t = t.expand(full)
            layer.weight_loader(param, t, shard)

        scale.weight_loader = load_scale  # type: ignore[attr-defined]
        layer.register_parameter("weight_scale", scale)

    def fill_dummy(self, layer: LinearBase, std: float, generator: torch.Generator) -> None:
        """--load-format dummy: random N(0, std) weights (quantized per channel unless online,
        where process_weights_after_loading quantizes them)."""
        w = torch.randn(layer.out_features, layer.in_features, generator=generator, device=generator.device) * std
        if self.online:
            layer.weight.data.copy_(w)
        else:
            q, scale = quantize_rows(w)
            layer.weight.data.copy_(q)
            layer.weight_scale.data.copy_(scale)
        if layer.bias is not None:
            layer.bias.data.normal_(0.0, std, generator=generator)

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        if not self.online:
            return
        q, scale = quantize_rows(layer.weight.data)
        layer.weight = nn.Parameter(q, requires_grad=False)
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)

    @property
    def gemv_candidates(self) -> tuple:  # type: ignore[override]
        from tidal_engine.kernels.triton.quant_fp8 import FP8_GEMV_CONFIGS

        return FP8_GEMV_CONFIGS

    def gemv_kind(self, layer: LinearBase) -> str:
        return "fp8"

    def gemv_weights(self, layer: LinearBase) -> tuple[torch.Tensor, ...]:
        return layer.weight, layer.weight_scale

    def run_gemv(self, layer: LinearBase, x: torch.Tensor, weights: tuple[torch.Tensor, ...],
                 bias: torch.Tensor | None, config: Any) -> torch.Tensor:
        from tidal_engine.kernels.triton.quant_fp8 import fp8_gemv

        return fp8_gemv(x, weights[0], weights[1], bias, config)

    def run_general(self, layer: LinearBase, x: torch.Tensor, weights: tuple[torch.Tensor, ...],
                    bias: torch.Tensor | None) -> torch.Tensor:
        weight, scale = weights
        if scaled_mm_supported(x) and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0:
            return scaled_mm(x, weight, scale, bias)
        return reference_fp8_linear(x, weight, scale, bias)

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        shape = x.shape
        y = self.apply_2d(layer, x.reshape(-1, shape[-1]), bias)
        return y.reshape(*shape[:-1], y.shape[-1])

    # The small-batch GEMV activates gate/up pairs in its epilogue; the general path does not.
    def folds_activation(self, layer: LinearBase, x: torch.Tensor, activation: str) -> bool:
        from tidal_engine.kernels.triton.gemv import tile_folds_silu_and_mul

        config = self.small_batch_config(layer, x.numel() // x.shape[-1])
        return activation == "silu_and_mul" and tile_folds_silu_and_mul(config, layer.out_features)

    def apply_activated(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None,
                        activation: str) -> torch.Tensor:
        from tidal_engine.kernels.triton.quant_fp8 import fp8_gemv

        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        y = fp8_gemv(x2, layer.weight, layer.weight_scale, bias, self.small_batch_config(layer, x2.shape[0]),
                     silu_and_mul=True)
        return y.reshape(*shape[:-1], y.shape[-1])


def scaled_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The Hopper path: per-token × per-channel scaled FP8 GEMM (cuBLASLt), bf16 out; the
    activations are quantized by one Triton kernel."""
    from tidal_engine.kernels.triton.quant_fp8 import quantize_rows_fp8

    xq, x_scale = quantize_rows_fp8(x)
    y = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=scale.view(1, -1), out_dtype=torch.bfloat16)
    y = y.to(x.dtype)
    return y + bias if bias is not None else y


def reference_fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The same W8A8 numbers in plain torch: quantize the activations, dequantize, multiply."""
    xq, x_scale = quantize_tokens(x)
    x_dq = (xq.float() * x_scale).to(x.dtype)
    w_dq = (weight.float() * scale[:, None]).to(x.dtype)
    return F.linear(x_dq, w_dq, bias)


class Fp8Config(QuantizationConfig):
    """``quant_method: fp8`` checkpoints (per-tensor or per-channel ``weight_scale``), or a
    16/32-bit checkpoint quantized on load (``online``)."""

    name = "fp8"

    def __init__(self, online: bool, ignored: list[str] | None = None) -> None:
        super().__init__(ignored or [])
        self.online = online

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Fp8Config":
        if config.get("weight_block_size"):
            raise ValueError(f"fp8: block-wise weight scales (weight_block_size={config['weight_block_size']}) are "
                             "not supported; per-tensor and per-channel are")
        scheme = config.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise ValueError(f"fp8: unknown activation_scheme {scheme!r}")
        fmt = config.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"fp8: only e4m3 weights are supported, the checkpoint has {fmt!r}")
        return cls(online=False, ignored=list(config.get("ignored_layers") or config.get("modules_to_not_convert") or []))

    def make_method(self) -> LinearMethod:
        return Fp8LinearMethod(self.online)
