"""ArchConfig: the hyperparameters the engine needs, normalised from any config dialect.

HF config.json files come in two dialects: transformers 4 writes ``torch_dtype``,
``rope_theta`` and ``rope_scaling``; transformers 5 writes ``dtype`` and
``rope_parameters`` (which holds ``rope_theta`` and the rope type). GGUF files carry
the same facts as metadata; the loader builds an ArchConfig from those directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# HF model_type (and GGUF general.architecture) → our architecture name.
SUPPORTED_ARCHITECTURES: dict[str, str] = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    """'bfloat16', 'torch.bfloat16', 'bf16', a torch.dtype or None → torch.dtype or None."""
    if name is None or isinstance(name, torch.dtype):
        return name
    key = str(name).lower().removeprefix("torch.")
    if key not in _DTYPE_NAMES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPE_NAMES)}")
    return _DTYPE_NAMES[key]


@dataclass
class ArchConfig:
    architecture: str  # llama | qwen2 | qwen3
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # rope_type + its parameters; None for plain rope
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v (Qwen2: always)
    o_proj_bias: bool  # Llama's attention_bias also covers o_proj; Qwen2's does not
    mlp_bias: bool
    qk_norm: bool  # Qwen3: per-head RMSNorm on q and k before rotary
    torch_dtype: torch.dtype | None  # the checkpoint's own dtype, None if unknown
    bos_token_id: int | None
    eos_token_id: int | list[int] | None
    quantization_config: dict[str, Any] | None = None  # config.json's, as written (tidal_engine/quantization)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES.values():
            raise ValueError(f"unsupported architecture {self.architecture!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type")
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ValueError(f"unsupported rope type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return list(self.eos_token_id) if isinstance(self.eos_token_id, list) else [self.eos_token_id]

    def to_hf_config(self) -> dict[str, Any]:
        """A transformers-4 config.json that ``from_hf_config`` reads back as this config (how a
        GGUF model is written out as an HF folder, e.g. by the quantizer)."""
        model_type = {arch: mt for mt, arch in SUPPORTED_ARCHITECTURES.items()}[self.architecture]
        dtype = str(self.torch_dtype).removeprefix("torch.") if self.torch_dtype is not None else None
        return {
            "model_type": model_type, "hidden_act": "silu", "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta, "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings, "attention_bias": self.attention_bias,
            "mlp_bias": self.mlp_bias, "torch_dtype": dtype,
            "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
        }

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> ArchConfig:
        """Build from a config.json dict (transformers 4 or 5 field names)."""
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_ARCHITECTURES:
            declared = config.get("architectures") or []
            raise ValueError(
                f"unsupported model architecture: model_type={model_type!r} architectures={declared}; "
                f"supported model types: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        architecture = SUPPORTED_ARCHITECTURES[model_type]
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {config['hidden_act']!r}; only silu is implemented")
        if config.get("use_sliding_window"):
            raise ValueError("sliding-window attention (use_sliding_window=true) is not supported")

        num_heads = int(config["num_attention_heads"])
        hidden_size = int(config["hidden_size"])
        rope_theta, rope_scaling = _read_rope(config)
        attention_bias = bool(config.get("attention_bias", False))
        eos = config.get("eos_token_id")
        return cls(
            architecture=architecture,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(config["intermediate_size"]),
            num_hidden_layers=int(config["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(config.get("head_dim") or hidden_size // num_heads),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            # Qwen2 hard-codes q/k/v bias and no o_proj bias, whatever the config says.
            attention_bias=True if architecture == "qwen2" else attention_bias,
            o_proj_bias=False if architecture == "qwen2" else attention_bias,
            mlp_bias=bool(config.get("mlp_bias", False)) if architecture == "llama" else False,
            qk_norm=architecture == "qwen3",
            torch_dtype=parse_dtype(config.get("dtype") or config.get("torch_dtype")),
            bos_token_id=config.get("bos_token_id"),
            eos_token_id=list(eos) if isinstance(eos, (list, tuple)) else eos,
            quantization_config=config.get("quantization_config"),
        )


def _read_rope(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling or None) from either dialect."""
    params = dict(config.get("rope_parameters") or {})
    scaling = dict(config.get("rope_scaling") or {})
    # transformers 5 keeps theta inside rope_parameters; 4 keeps it at the top level.
    rope_theta = float(params.pop("rope_theta", None) or config.get("rope_theta") or 10000.0)
    merged = {**scaling, **params}
    # Old configs spell the type "type"; "default" means plain, unscaled rope.
    rope_type = merged.pop("rope_type", None) or merged.pop("type", None) or "default"
    merged.pop("type", None)
    if rope_type == "default":
        return rope_theta, None
    return rope_theta, {"rope_type": rope_type, **merged}
