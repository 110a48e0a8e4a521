"""INT4 weights, AWQ and GPTQ: 4-bit integers in groups of input columns, each group with a
scale and a zero point, ``w = (q - zero) * scale``; activations stay in the run dtype.

On disk (the formats AutoAWQ and AutoGPTQ/GPTQModel write):

| tensor | AWQ (``version: gemm``) | GPTQ (``checkpoint_format: gptq``) |
|---|---|---|
| ``qweight`` int32 | ``[in, out/8]``, 8 outputs a word in the order 0 2 4 6 1 3 5 7 | ``[in/8, out]``, 8 inputs a word, in order |
| ``qzeros`` int32 | ``[in/g, out/8]``, the qweight order | ``[in/g, out/8]``, in order, stored minus 1 (``gptq_v2``: not) |
| ``scales`` fp16 | ``[in/g, out]`` | ``[in/g, out]`` |
| ``g_idx`` int32 | – | ``[in]``, the group of each input (``k // g`` unless desc_act) |

After loading, both are repacked into one layout that the kernels read row by row:
``qweight`` ``[out, in/8]`` (8 inputs a word, in order), ``scales`` and ``zeros`` ``[out, in/g]``
in the run dtype. On CUDA in 16 bits the matmul is Triton (kernels/triton/quant_int4.py): a
dequantize-in-register GEMM, and for a few rows (decode) a GEMV that reads the words
directly (its kernel and tile shape chosen per weight shape by measurement, kernels/gemv_choice.py);
as a gated MLP's gate_up, a by-groups GEMV also applies SiLU-and-mul in its epilogue
(``folds_activation``). Elsewhere (CPU, fp32) it is the torch reference: dequantize, then multiply.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tidal_engine.layers.linear import LinearBase, LinearMethod
from tidal_engine.quantization.base import QuantizationConfig, SmallBatchKernel

PACK = 8  # 4-bit values per int32
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # word nibble i holds output column AWQ_ORDER[i]
_SHIFTS = torch.arange(PACK, dtype=torch.int32) * 4


def unpack_words(words: torch.Tensor, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 ``[..., W]`` → int32 ``[..., W*8]`` of 0..15: nibble i of word j lands at ``8j + order[i]``."""
    nibbles = (words.unsqueeze(-1) >> _SHIFTS.to(words.device)) & 0xF  # [..., W, 8], nibble i at position i
    if order is not None:
        nibbles = nibbles[..., torch.argsort(torch.tensor(order, device=words.device))]
    return nibbles.reshape(*words.shape[:-1], words.shape[-1] * PACK)


def pack_rows(values: torch.Tensor) -> torch.Tensor:
    """0..15 ``[..., K]`` → int32 ``[..., K/8]``, element ``8j + i`` in nibble i of word j."""
    v = values.to(torch.int32).reshape(*values.shape[:-1], values.shape[-1] // PACK, PACK)
    return (v << _SHIFTS.to(values.device)).sum(dim=-1, dtype=torch.int32)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
               dtype: torch.dtype) -> torch.Tensor:
    """The repacked layout → ``[out, in]`` weights in ``dtype`` (the reference path)."""
    q = unpack_words(qweight).to(dtype)  # [N, K]
    n, k = q.shape
    q = q.view(n, k // group_size, group_size)
    return ((q - zeros.to(dtype)[:, :, None]) * scales.to(dtype)[:, :, None]).view(n, k)


def _param(data: torch.Tensor, output_dim: int | None, input_dim: int | None, output_pack: int = 1,
           input_pack: int = 1) -> nn.Parameter:
    p = nn.Parameter(data, requires_grad=False)
    p.output_dim, p.input_dim = output_dim, input_dim  # type: ignore[attr-defined]
    p.output_pack, p.input_pack = output_pack, input_pack  # type: ignore[attr-defined]
    return p


class Int4LinearMethod(LinearMethod, SmallBatchKernel):
    """Loads AWQ or GPTQ tensors (``fmt``), repacks them, multiplies."""

    def __init__(self, fmt: str, group_size: int, zero_offset: int = 0, has_zeros: bool = True) -> None:
        self.fmt = fmt  # "awq" | "gptq"
        self.group_size = group_size
        self.zero_offset = zero_offset  # GPTQ v1 stores zero - 1
        self.has_zeros = has_zeros  # AWQ with zero_point false: symmetric, zero 8
        self.ignored_params = () if has_zeros else ("qzeros",)

    def create_weights(self, layer: LinearBase, in_features: int, out_features: int, dtype: torch.dtype | None) -> None:
        g = self.group_size
        if in_features % g or out_features % PACK:
            raise ValueError(f"{self.fmt}: a layer of {in_features} inputs × {out_features} outputs (on this rank) "
                             f"does not split into groups of {g} inputs and words of {PACK} outputs")
        groups = in_features // g
        scale_dtype = torch.get_default_dtype() if dtype is None else dtype
        if self.fmt == "awq":
            layer.register_parameter("qweight", _param(torch.empty(in_features, out_features // PACK, dtype=torch.int32),
                                                       1, 0, output_pack=PACK))
        else:
            layer.register_parameter("qweight", _param(torch.empty(in_features // PACK, out_features, dtype=torch.int32),
                                                       1, 0, input_pack=PACK))
            layer.register_parameter("g_idx", _param(torch.empty(in_features, dtype=torch.int32), None, 0))
        if self.has_zeros:
            layer.register_parameter("qzeros", _param(torch.empty(groups, out_features // PACK, dtype=torch.int32),
                                                      1, 0, output_pack=PACK, input_pack=g))
        layer.register_parameter("scales", _param(torch.empty(groups, out_features, dtype=scale_dtype), 1, 0,
                                                  input_pack=g))

    def fill_dummy(self, layer: LinearBase, std: float, generator: torch.Generator) -> None:
        """--load-format dummy: random N(0, std) weights through Tidal's quantizer."""
        from tidal_engine.quantization.quantizer import quantize_tensor

        w = torch.randn(layer.out_features, layer.in_features, generator=generator, device=generator.device) * std
        parts, _ = quantize_tensor(self.fmt, w, self.group_size, symmetric=not self.has_zeros)
        for name, t in parts.items():
            if name in layer._parameters:
                layer._parameters[name].data.copy_(t)
        if "g_idx" in layer._parameters:  # the checkpoint's group numbers of this rank's input run
            first = layer.input_range[0]
            layer.g_idx.data.copy_((torch.arange(layer.in_features, device=w.device) + first) // self.group_size)
        if layer.bias is not None:
            layer.bias.data.normal_(0.0, std, generator=generator)

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        g = self.group_size
        order = AWQ_ORDER if self.fmt == "awq" else None
        if self.fmt == "awq":
            q = unpack_words(layer.qweight.data, AWQ_ORDER)  # [K, N]
        else:
            q = unpack_words(layer.qweight.data.t().contiguous()).t()  # [K/8, N] → [K, N]
            in_features = q.shape[0]
            # g_idx holds the checkpoint's group numbers: a row-parallel rank's run starts past 0.
            first = layer.input_range[0]
            expected = (torch.arange(in_features, device=q.device, dtype=torch.int32) + first) // g
            if not torch.equal(layer.g_idx.data.to(torch.int32), expected):
                raise ValueError("gptq: g_idx reorders the input columns (act-order / desc_act); not supported")
            del layer.g_idx
        if self.has_zeros:
            zeros = (unpack_words(layer.qzeros.data, order) + self.zero_offset).t()  # [N, K/g]
            del layer.qzeros
        else:
            zeros = torch.full((q.shape[1], q.shape[0] // g), 8, device=q.device)
        scales = layer.scales.data.t().contiguous()  # [N, K/g]
        del layer.qweight, layer.scales
        layer.qweight = _param(pack_rows(q.t().contiguous()), 0, 1)  # [N, K/8]
        layer.scales = _param(scales, 0, 1)
        layer.zeros = _param(zeros.to(scales.dtype).contiguous(), 0, 1)
        layer.group_size = g

    @property
    def gemv_candidates(self) -> tuple:  # type: ignore[override]
        from tidal_engine.kernels.triton.quant_int4 import INT4_GEMV_CONFIGS

        return INT4_GEMV_CONFIGS

    def gemv_kind(self, layer: LinearBase) -> str:
        return f"int4g{self.group_size}"

    def gemv_weights(self, layer: LinearBase) -> tuple[torch.Tensor, ...]:
        return layer.qweight, layer.scales, layer.zeros

    def run_gemv(self, layer: LinearBase, x: torch.Tensor, weights: tuple[torch.Tensor, ...],
                 bias: torch.Tensor | None, config: Any) -> torch.Tensor:
        from tidal_engine.kernels.triton.quant_int4 import int4_gemv

        return int4_gemv(x, *weights, self.group_size, bias, config)

    def run_general(self, layer: LinearBase, x: torch.Tensor, weights: tuple[torch.Tensor, ...],
                    bias: torch.Tensor | None) -> torch.Tensor:
        if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and self.group_size % 16 == 0:
            from tidal_engine.kernels.triton.quant_int4 import int4_gemm  # (tl.dot needs K tiles of 16)

            return int4_gemm(x, *weights, self.group_size, bias)
        w = dequantize(*weights, self.group_size, x.dtype)
        return F.linear(x, w, bias)

    def warm_up(self, layer: LinearBase, dtype: torch.dtype) -> None:
        """One input per GEMM tile class and one per chosen GEMV, so none compiles while a decode
        graph is captured, and a split-K GEMV's workspace is made (zeroed) outside any capture."""
        if dtype not in (torch.bfloat16, torch.float16) or not layer.qweight.is_cuda:
            return
        from tidal_engine.kernels.triton.quant_int4 import GEMM_TILE_ROWS
        from tidal_engine.quantization.base import GEMV_MAX_ROWS

        weights = self.gemv_weights(layer)
        if self.group_size % 16 == 0:
            for rows in GEMM_TILE_ROWS:
                x = torch.zeros(rows, layer.in_features, dtype=dtype, device=layer.qweight.device)
                self.run_general(layer, x, weights, layer.bias)
        for rows, config in ((1, getattr(layer, "gemv_config", None)),
                             (GEMV_MAX_ROWS, getattr(layer, "gemv_config_few", None))):
            if config is not None:
                x = torch.zeros(rows, layer.in_features, dtype=dtype, device=layer.qweight.device)
                self.run_gemv(layer, x, weights, layer.bias, config)

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        shape = x.shape
        y = self.apply_2d(layer, x.reshape(-1, shape[-1]), bias)
        return y.reshape(*shape[:-1], y.shape[-1])

    # The by-groups GEMVs (packed halves and fp32) activate gate/up pairs in their epilogue; the
    # others and the general path do not.
    times_output_activation = True

    def folds_activation(self, layer: LinearBase, x: torch.Tensor, activation: str) -> bool:
        from tidal_engine.kernels.triton.quant_int4 import int4_tile_folds_silu_and_mul

        config = self.small_batch_config(layer, x.numel() // x.shape[-1])
        return activation == "silu_and_mul" and int4_tile_folds_silu_and_mul(config, layer.out_features)

    def apply_activated(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None,
                        activation: str) -> torch.Tensor:
        from tidal_engine.kernels.triton.quant_int4 import int4_gemv

        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        y = int4_gemv(x2, *self.gemv_weights(layer), self.group_size, bias, self.small_batch_config(layer, x2.shape[0]),
                      silu_and_mul=True)
        return y.reshape(*shape[:-1], y.shape[-1])

    def run_gemv_activated(self, layer: LinearBase, x: torch.Tensor, weights: tuple[torch.Tensor, ...],
                           bias: torch.Tensor | None, config: Any, activation: str) -> torch.Tensor:
        from tidal_engine.kernels.triton.activation import silu_and_mul
        from tidal_engine.kernels.triton.quant_int4 import int4_gemv, int4_tile_folds_silu_and_mul

        if activation != "silu_and_mul":
            raise ValueError(f"int4: no {activation} after the GEMV")
        if int4_tile_folds_silu_and_mul(config, weights[0].shape[0]):
            return int4_gemv(x, *weights, self.group_size, bias, config, silu_and_mul=True)
        return silu_and_mul(self.run_gemv(layer, x, weights, bias, config))


def _check_bits(name: str, config: dict[str, Any]) -> int:
    bits = int(config.get("bits", config.get("w_bit", 4)))
    if bits != 4:
        raise ValueError(f"{name}: {bits}-bit weights are not supported (only 4-bit)")
    group = int(config.get("group_size", config.get("q_group_size", 128)))
    if group <= 0 or group % PACK:
        raise ValueError(f"{name}: group_size {group} is not supported (a positive multiple of {PACK}; -1 is not)")
    return group


class AWQConfig(QuantizationConfig):
    name = "awq"

    def __init__(self, group_size: int, zero_point: bool, ignored: list[str] | None = None) -> None:
        super().__init__(ignored or [])
        self.group_size, self.zero_point = group_size, zero_point

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "AWQConfig":
        group = _check_bits("awq", config)
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"awq: version {version!r} is not supported (only the 'gemm' layout)")
        return cls(group, bool(config.get("zero_point", True)), list(config.get("modules_to_not_convert") or []))

    def make_method(self) -> LinearMethod:
        return Int4LinearMethod("awq", self.group_size, has_zeros=self.zero_point)


class GPTQConfig(QuantizationConfig):
    name = "gptq"

    def __init__(self, group_size: int, zero_offset: int, ignored: list[str] | None = None) -> None:
        super().__init__(ignored or [])
        self.group_size, self.zero_offset = group_size, zero_offset

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "GPTQConfig":
        group = _check_bits("gptq", config)
        if config.get("desc_act"):
            raise ValueError("gptq: desc_act=true (act-order) checkpoints are not supported; "
                             "quantize with desc_act=false")
        fmt = config.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"gptq: checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
        return cls(group, 1 if fmt == "gptq" else 0, list(config.get("modules_to_not_convert") or []))

    def make_method(self) -> LinearMethod:
        return Int4LinearMethod("gptq", self.group_size, zero_offset=self.zero_offset)

