"""Tidal's own quantizer: float weights → the tensors of each on-disk format, and whole
checkpoints written with them (for tests, benchmarks and ``--load-format dummy``).

Round-to-nearest, no calibration: enough to produce real-format checkpoints whose
dequantized weights are known exactly, not to compete with AWQ's or GPTQ's search.
The packing here is written independently of the unpacking in int4.py (bit by bit, the way
AutoAWQ and AutoGPTQ write it), so a test of one against the other checks the layout.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tidal_engine.quantization.fp8 import FP8, quantize_rows
from tidal_engine.quantization.int4 import AWQ_ORDER, PACK

if TYPE_CHECKING:
    from tidal_engine.models.loader import ModelSource

LINEAR_WEIGHT = re.compile(r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")
METHODS = ("fp8", "compressed-tensors", "awq", "gptq")


def quantize_int4(w: torch.Tensor, group_size: int, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[N, K]`` → (q 0..15 ``[N, K]``, scales ``[N, K/g]``, zeros 0..15 ``[N, K/g]``), ``w ≈ (q - zero) * scale``."""
    n, k = w.shape
    groups = w.float().reshape(n, k // group_size, group_size)
    if symmetric:
        scale = (groups.abs().amax(-1) * 2 / 15).clamp(min=1e-8)
        zero = torch.full_like(scale, 8.0)
    else:
        lo, hi = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
        scale = ((hi - lo) / 15).clamp(min=1e-8)
        zero = (-lo / scale).round().clamp(0, 15)
    scale = scale.half().float()  # the checkpoints store fp16 scales: quantize with what they keep
    q = (groups / scale[..., None]).round() + zero[..., None]
    return q.clamp(0, 15).to(torch.int32).reshape(n, k), scale, zero.to(torch.int32)


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int) -> torch.Tensor:
    n, k = q.shape
    groups = q.float().reshape(n, k // group_size, group_size)
    return ((groups - zero[..., None].float()) * scale[..., None].float()).reshape(n, k)


def _words(nibbles: torch.Tensor) -> torch.Tensor:
    """int ``[..., 8]`` of 0..15 → int32 words ``[...]``, ``nibbles[..., i]`` in bits 4i..4i+3."""
    shifted = (nibbles.to(torch.int32) & 0xF) << (4 * torch.arange(PACK, dtype=torch.int32, device=nibbles.device))
    # The nibbles' bits do not overlap, so the sum is their OR; nibble 7's top bit wraps into
    # the sign bit: the same 32 bits as the unsigned word.
    return shifted.sum(dim=-1, dtype=torch.int32)


def _groups_of_8(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` with dimension ``dim`` (size 8W) split into ``[W, 8]``, the 8 moved last."""
    shape = list(t.shape)
    split = t.reshape(*shape[:dim], shape[dim] // PACK, PACK, *shape[dim + 1:])
    return split.movedim(dim + 1, -1)


def awq_tensors(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                symmetric: bool = False) -> dict[str, torch.Tensor]:
    """AutoAWQ's GEMM layout (inputs × outputs, 8 outputs a word, nibble i holding output
    ``8j + AWQ_ORDER[i]``). Symmetric (``zero_point: false``) checkpoints have no qzeros: the zero is 8."""
    order = list(AWQ_ORDER)
    tensors = {
        "qweight": _words(_groups_of_8(q.t(), 1)[..., order]),  # [K, N/8]
        "qzeros": _words(_groups_of_8(zero.t(), 1)[..., order]),  # [K/g, N/8]
        "scales": scale.t().contiguous().to(torch.float16),
    }
    if symmetric:
        del tensors["qzeros"]
    return tensors


def gptq_tensors(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """AutoGPTQ's layout (``checkpoint_format: gptq``: 8 inputs a word, in order; zeros stored minus one)."""
    k = q.shape[1]
    return {
        "qweight": _words(_groups_of_8(q.t(), 0)),  # [K/8, N]
        "qzeros": _words(_groups_of_8((zero - 1).t(), 1)),  # [K/g, N/8]
        "scales": scale.t().contiguous().to(torch.float16),
        "g_idx": torch.arange(k, dtype=torch.int32) // group_size,
    }


def quantize_tensor(method: str, w: torch.Tensor, group_size: int = 128, symmetric: bool = False,
                    per_channel: bool = False) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One linear's weight → (its checkpoint tensors, suffix → tensor, and the float32 weight
    those tensors stand for: the reference)."""
    if method in ("fp8", "compressed-tensors"):
        if per_channel:
            q, scale = quantize_rows(w)
        else:
            scale = (w.abs().amax().float() / torch.finfo(FP8).max).clamp(min=1e-12)
            q = (w.float() / scale).to(FP8)
            scale = scale.reshape(1) if method == "compressed-tensors" else scale.reshape(())
        stored = scale[:, None] if method == "compressed-tensors" and per_channel else scale
        deq = q.float() * (scale[:, None] if per_channel else scale)
        return {"weight": q, "weight_scale": stored.float()}, deq
    q, scale, zero = quantize_int4(w, group_size, symmetric)
    deq = dequantize_int4(q, scale, zero, group_size)
    if method == "awq":
        return awq_tensors(q, scale, zero, symmetric), deq
    return gptq_tensors(q, scale, zero, group_size), deq


def quantization_config(method: str, group_size: int = 128, symmetric: bool = False,
                        per_channel: bool = False) -> dict[str, Any]:
    """The ``quantization_config`` a checkpoint of ``method`` carries in config.json."""
    if method == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3"}
    if method == "compressed-tensors":
        return {
            "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                            "strategy": "channel" if per_channel else "tensor"},
                "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True,
                                      "strategy": "token"},
            }},
        }
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": not symmetric,
                "version": "gemm"}
    return {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": False, "sym": symmetric,
            "checkpoint_format": "gptq"}


def quantize_weights(weights: Iterable[tuple[str, torch.Tensor]], method: str, group_size: int = 128,
                     symmetric: bool = False, per_channel: bool = False
                     ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """HF-named weights → (the checkpoint's tensors in ``method``'s layout, the float32 weights
    they stand for). Only the decoder linears are quantized; everything else is kept."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r} (one of {METHODS})")
    quantized: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, t in weights:
        if LINEAR_WEIGHT.match(name):
            parts, deq = quantize_tensor(method, t, group_size, symmetric, per_channel)
            stem = name.removesuffix(".weight")
            quantized.update({f"{stem}.{suffix}": v.contiguous() for suffix, v in parts.items()})
            dequantized[name] = deq
        else:
            quantized[name] = t.contiguous()
            dequantized[name] = t.float()
    return quantized, dequantized


def write_quantized_checkpoint(src: Path, dst: Path, method: str, group_size: int = 128, symmetric: bool = False,
                               per_channel: bool = False, reference: Path | None = None) -> None:
    """Quantize the decoder linears of the HF folder ``src`` into ``dst`` (config.json with its
    quantization_config, tokenizer files copied). ``reference``: also write the float32 checkpoint
    of the dequantized weights there, the model the quantized one must reproduce."""
    from safetensors.torch import load_file, save_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    quantized, dequantized = quantize_weights(tensors.items(), method, group_size, symmetric, per_channel)
    config = json.loads((src / "config.json").read_text())
    for folder, weights, quant in ((dst, quantized, quantization_config(method, group_size, symmetric, per_channel)),
                                   (reference, dequantized, None)):
        if folder is None:
            continue
        folder.mkdir(parents=True, exist_ok=True)
        for extra in src.iterdir():
            if extra.is_file() and extra.suffix != ".safetensors" and extra.name not in (
                    "config.json", "model.safetensors.index.json"):
                shutil.copy(extra, folder / extra.name)
        save_file(weights, str(folder / "model.safetensors"))
        folder_config = {k: v for k, v in config.items() if k != "quantization_config"}
        if quant is not None:
            folder_config["quantization_config"] = quant
        (folder / "config.json").write_text(json.dumps(folder_config, indent=2))


def write_quantized_model(source: ModelSource, dst: Path, method: str, group_size: int = 128,
                          symmetric: bool = False, per_channel: bool = False) -> None:
    """Any model the engine reads (an HF folder, a GGUF file) → an HF folder in ``method``'s
    on-disk layout: config.json (from the source's hyperparameters) with its
    quantization_config, model.safetensors and the tokenizer."""
    from safetensors.torch import save_file

    quantized, _ = quantize_weights(source.load_weights(), method, group_size, symmetric, per_channel)
    dst.mkdir(parents=True, exist_ok=True)
    save_file(quantized, str(dst / "model.safetensors"))
    config = source.arch_config.to_hf_config()
    config["quantization_config"] = quantization_config(method, group_size, symmetric, per_channel)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    source.load_tokenizer().save_pretrained(str(dst))
