"""Shared helpers for the LoRA tests (no tests here): real PEFT adapters for the tiny models.

``make_peft_adapter`` wraps a copy of a tiny HF model with peft's ``get_peft_model``, gives
lora_B random values (PEFT starts it at zero, which would make every adapter a no-op) and
saves it with ``save_pretrained``, so the files are exactly what PEFT writes. It returns the
PEFT model too: its logits are the reference. ``write_adapter`` writes the same format by
hand, for error cases PEFT refuses to produce.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import make_tiny_model  # noqa: E402

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_peft_adapter(
    hf_model: Any,
    folder: Path,
    *,
    rank: int,
    alpha: float,
    targets: list[str] | None = None,
    seed: int = 1,
    use_rslora: bool = False,
    std: float = 0.1,
) -> Any:
    """Save a random PEFT LoRA adapter for ``hf_model`` into ``folder``; return the PEFT model."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets or ALL_TARGETS, lora_dropout=0.0,
                        use_rslora=use_rslora, init_lora_weights=True)
    peft_model = get_peft_model(copy.deepcopy(hf_model), config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    peft_model.save_pretrained(str(folder))
    return peft_model.eval()


def write_adapter(
    folder: Path,
    tensors: dict[str, torch.Tensor],
    *,
    rank: int,
    alpha: float = 16,
    targets: list[str] | str | None = None,
    **config: Any,
) -> Path:
    """An adapter folder in PEFT's format, written by hand."""
    folder.mkdir(parents=True, exist_ok=True)
    body = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": targets or ["q_proj"],
            "bias": "none", **config}
    (folder / "adapter_config.json").write_text(json.dumps(body))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "adapter_model.safetensors"))
    return folder


def random_lora_tensors(
    modules: dict[str, tuple[int, int]], rank: int, layers: int = 2, seed: int = 0
) -> dict[str, torch.Tensor]:
    """PEFT-named A/B tensors: ``modules`` maps e.g. "self_attn.q_proj" to (in, out)."""
    generator = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for layer in range(layers):
        for module, (fan_in, fan_out) in modules.items():
            stem = f"base_model.model.model.layers.{layer}.{module}"
            out[f"{stem}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) * 0.1
            out[f"{stem}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * 0.1
    return out


def chunk(lora_name: str | None, num_new_tokens: int) -> Any:
    """A stand-in for a scheduler chunk, as LoRAManager.begin_step reads it."""
    return SimpleNamespace(request=SimpleNamespace(lora_name=lora_name), num_new_tokens=num_new_tokens)


__all__ = ["ALL_TARGETS", "chunk", "make_peft_adapter", "make_tiny_model", "random_lora_tensors", "write_adapter"]
