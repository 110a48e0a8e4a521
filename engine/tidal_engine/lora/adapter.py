"""Reading and validating PEFT LoRA adapters (``adapter_config.json`` + ``adapter_model.safetensors``).

An adapter is read into host memory as plain float32 tensors, keyed by *our* module
names: PEFT trains q/k/v and gate/up as separate linears, we store them merged, so each
``(layer, module)`` entry holds one ``(A, B)`` pair per shard ("q", "k", "v", "gate",
"up", or None for an unmerged module). The scaling (alpha/r, or alpha/sqrt(r) with
rsLoRA) is folded into B here, so the forward pass only ever computes ``x A^T B^T``.

Every problem is a ``LoRAError`` with a message that names the adapter and the cause;
``status`` says how the HTTP layer answers it (400 bad input, 404 unknown name).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_WEIGHTS_FILE = "adapter_model.bin"

# PEFT target (HF module name) → (our module inside the decoder layer, shard of it or None).
TARGET_MODULES: dict[str, tuple[str, str | None]] = {
    "q_proj": ("self_attn.qkv_proj", "q"),
    "k_proj": ("self_attn.qkv_proj", "k"),
    "v_proj": ("self_attn.qkv_proj", "v"),
    "o_proj": ("self_attn.o_proj", None),
    "gate_proj": ("mlp.gate_up_proj", "gate"),
    "up_proj": ("mlp.gate_up_proj", "up"),
    "down_proj": ("mlp.down_proj", None),
}
# Our LoRA-capable modules and their shards, in output order (must match models/llama.py).
MODULE_SHARDS: dict[str, tuple[str | None, ...]] = {
    "self_attn.qkv_proj": ("q", "k", "v"),
    "self_attn.o_proj": (None,),
    "mlp.gate_up_proj": ("gate", "up"),
    "mlp.down_proj": (None,),
}
_PARENT_OF = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
              "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}

# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (PEFT strips the adapter
# name "default" when saving; tolerate it being present anyway).
_TENSOR_NAME = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?layers\.(?P<layer>\d+)\.(?P<parent>[A-Za-z_]+)\."
    r"(?P<module>[A-Za-z_]+)\.lora_(?P<ab>A|B)(?:\.[A-Za-z0-9_-]+)?\.weight$"
)


class LoRAError(ValueError):
    """A bad adapter, path, name or request; ``status`` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class BaseModelShape:
    """What an adapter must fit: the decoder's layer count and each target's (in, out)."""

    num_layers: int
    dims: dict[str, tuple[int, int]]  # PEFT target name → (in_features, out_features)

    @classmethod
    def from_arch(cls, arch: Any) -> "BaseModelShape":
        hidden, inter = arch.hidden_size, arch.intermediate_size
        q_out = arch.num_attention_heads * arch.head_dim
        kv_out = arch.num_key_value_heads * arch.head_dim
        return cls(
            num_layers=arch.num_hidden_layers,
            dims={
                "q_proj": (hidden, q_out),
                "k_proj": (hidden, kv_out),
                "v_proj": (hidden, kv_out),
                "o_proj": (q_out, hidden),
                "gate_proj": (hidden, inter),
                "up_proj": (hidden, inter),
                "down_proj": (inter, hidden),
            },
        )


@dataclass(frozen=True)
class AdapterConfig:
    """The parts of a PEFT LoraConfig that change the computation."""

    rank: int
    alpha: float
    use_rslora: bool
    target_modules: frozenset[str]
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    base_model: str | None = None

    def scaling(self, rank: int, alpha: float) -> float:
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank

    def rank_and_alpha(self, module_path: str) -> tuple[int, float]:
        """PEFT's per-module overrides: a pattern key matches a module path by its suffix."""
        rank = _match_pattern(self.rank_pattern, module_path, self.rank)
        alpha = _match_pattern(self.alpha_pattern, module_path, self.alpha)
        return int(rank), float(alpha)


def _match_pattern(patterns: dict[str, Any], module_path: str, default: Any) -> Any:
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?(?:{key})$", module_path):
            return value
    return default


@dataclass
class LoRAAdapter:
    """One adapter in host memory, ready to be copied into a device slot."""

    name: str
    path: str
    rank: int  # the largest rank of any of its modules
    config: AdapterConfig
    # (layer index, our module name) → {shard: (A [r, in], B·scale [out_shard, r])}, float32, CPU
    weights: dict[tuple[int, str], dict[str | None, tuple[torch.Tensor, torch.Tensor]]]

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size()
                   for shards in self.weights.values() for a, b in shards.values())

    @property
    def targets(self) -> list[str]:
        return sorted(self.config.target_modules)


# ---------------------------------------------------------------------- paths


def confine_path(path: str, allowed_roots: Sequence[str]) -> Path:
    """The adapter folder, resolved (symlinks followed), checked to lie under an allowed root.

    A path with a ``..`` component is refused outright rather than normalised, so a caller
    can't reach outside a root even through a directory that happens to exist. The root
    check runs before any existence check, so nobody can probe for files outside the roots.
    """
    if not isinstance(path, str) or not path.strip():
        raise LoRAError("lora_path must be a non-empty path to an adapter folder")
    if "\x00" in path:
        raise LoRAError("lora_path must not contain NUL bytes")
    raw = Path(path)
    if ".." in raw.parts:
        raise LoRAError(f"adapter path {path!r} must not contain '..'")
    resolved = raw.resolve()  # follows symlinks, so a link inside a root can't point out of it
    if allowed_roots and not any(_is_under(resolved, root) for root in allowed_roots):
        raise LoRAError(
            f"adapter path {path!r} is outside the allowed roots ({', '.join(allowed_roots)}); "
            "see --allowed-lora-roots"
        )
    if not resolved.exists():
        raise LoRAError(f"adapter path {path!r} does not exist")
    if not resolved.is_dir():
        raise LoRAError(f"adapter path {path!r} is not a folder (expected {CONFIG_FILE} and {WEIGHTS_FILE} in it)")
    return resolved


def _is_under(path: Path, root: str) -> bool:
    return path.is_relative_to(Path(root).resolve())


def _adapter_file(folder: Path, name: str, allowed_roots: Sequence[str], display: str) -> Path:
    file = folder / name
    if not file.is_file():
        return file  # the caller reports what is missing
    resolved = file.resolve()
    # A symlinked file inside the folder must not lead out of the roots either.
    if allowed_roots and not any(_is_under(resolved, root) for root in allowed_roots):
        raise LoRAError(f"{name} in adapter path {display!r} links outside the allowed roots")
    return resolved


# ---------------------------------------------------------------------- config


def parse_adapter_config(raw: dict[str, Any], where: str) -> AdapterConfig:
    """Validate a PEFT adapter_config.json (already parsed) and keep what matters."""
    peft_type = raw.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise LoRAError(f"{where}: peft_type {peft_type!r} is not supported (only LORA)")
    rank = raw.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoRAError(f"{where}: 'r' must be a positive integer, got {rank!r}")
    alpha = raw.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        raise LoRAError(f"{where}: 'lora_alpha' must be a positive number, got {alpha!r}")
    if raw.get("use_dora"):
        raise LoRAError(f"{where}: DoRA adapters (use_dora) are not supported")
    if raw.get("fan_in_fan_out"):
        raise LoRAError(f"{where}: fan_in_fan_out adapters (GPT-2 style Conv1D) are not supported")
    if raw.get("bias", "none") not in ("none", None) or raw.get("lora_bias"):
        raise LoRAError(f"{where}: adapters that train biases (bias={raw.get('bias')!r}) are not supported")
    if raw.get("modules_to_save"):
        raise LoRAError(
            f"{where}: modules_to_save {raw['modules_to_save']} (fully trained copies of base modules) "
            "is not supported"
        )
    targets = raw.get("target_modules")
    if isinstance(targets, str):
        if targets == "all-linear":
            target_set = frozenset(TARGET_MODULES)
        else:  # a regex over full module paths: the tensors present decide (checked later)
            target_set = frozenset(t for t in TARGET_MODULES if re.search(targets, f"layers.0.{_PARENT_OF[t]}.{t}"))
    elif isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets):
        unknown = sorted({t.rsplit(".", 1)[-1] for t in targets} - set(TARGET_MODULES))
        if unknown:
            raise LoRAError(
                f"{where}: target module(s) {', '.join(unknown)} do not exist in this model; "
                f"LoRA can target {', '.join(TARGET_MODULES)}"
            )
        target_set = frozenset(t.rsplit(".", 1)[-1] for t in targets)
    else:
        raise LoRAError(f"{where}: 'target_modules' must be a list of module names or a string, got {targets!r}")
    rank_pattern = raw.get("rank_pattern") or {}
    alpha_pattern = raw.get("alpha_pattern") or {}
    if not isinstance(rank_pattern, dict) or not isinstance(alpha_pattern, dict):
        raise LoRAError(f"{where}: rank_pattern and alpha_pattern must be objects")
    return AdapterConfig(
        rank=rank,
        alpha=float(alpha),
        use_rslora=bool(raw.get("use_rslora", False)),
        target_modules=target_set,
        rank_pattern={str(k): int(v) for k, v in rank_pattern.items()},
        alpha_pattern={str(k): float(v) for k, v in alpha_pattern.items()},
        base_model=raw.get("base_model_name_or_path"),
    )


# ---------------------------------------------------------------------- weights


def read_adapter(
    name: str,
    path: str,
    shape: BaseModelShape,
    *,
    max_rank: int,
    allowed_roots: Sequence[str] = (),
) -> LoRAAdapter:
    """Read, validate and convert one PEFT adapter folder. Raises LoRAError."""
    if not name or not isinstance(name, str):
        raise LoRAError("lora_name must be a non-empty string")
    folder = confine_path(path, allowed_roots)
    where = f"adapter {name!r}"
    config_file = _adapter_file(folder, CONFIG_FILE, allowed_roots, path)
    if not config_file.is_file():
        raise LoRAError(f"{where}: {path} has no {CONFIG_FILE} (not a PEFT adapter folder)")
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoRAError(f"{where}: cannot read {CONFIG_FILE}: {exc}") from None
    if not isinstance(raw, dict):
        raise LoRAError(f"{where}: {CONFIG_FILE} is not a JSON object")
    config = parse_adapter_config(raw, where)
    weights_file = _adapter_file(folder, WEIGHTS_FILE, allowed_roots, path)
    if not weights_file.is_file():
        hint = f" ({PICKLE_WEIGHTS_FILE} is a pickle and is not loaded: convert it to safetensors)" \
            if (folder / PICKLE_WEIGHTS_FILE).exists() else ""
        raise LoRAError(f"{where}: {path} has no {WEIGHTS_FILE}{hint}")
    tensors = _load_safetensors(weights_file, where)
    weights, rank = convert_peft_tensors(tensors.items(), config, shape, where)
    if rank > max_rank:
        raise LoRAError(f"{where}: rank {rank} exceeds the maximum LoRA rank {max_rank} (--max-lora-rank)")
    return LoRAAdapter(name=name, path=str(folder), rank=rank, config=config, weights=weights)


def _load_safetensors(file: Path, where: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(file), device="cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        raise LoRAError(f"{where}: cannot read {WEIGHTS_FILE}: {exc}") from None


def convert_peft_tensors(
    tensors: Iterable[tuple[str, torch.Tensor]],
    config: AdapterConfig,
    shape: BaseModelShape,
    where: str,
) -> tuple[dict[tuple[int, str], dict[str | None, tuple[torch.Tensor, torch.Tensor]]], int]:
    """PEFT-named tensors → our per-(layer, module, shard) (A, B·scale) pairs, and the max rank."""
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for tensor_name, tensor in tensors:
        match = _TENSOR_NAME.match(tensor_name)
        if match is None:
            raise LoRAError(
                f"{where}: tensor {tensor_name!r} does not belong to a supported target "
                f"(LoRA can target {', '.join(TARGET_MODULES)} of the decoder layers)"
            )
        module, layer = match["module"], int(match["layer"])
        if module not in TARGET_MODULES or _PARENT_OF[module] != match["parent"]:
            raise LoRAError(
                f"{where}: target module {match['parent']}.{module} does not exist in this model; "
                f"LoRA can target {', '.join(TARGET_MODULES)}"
            )
        if layer >= shape.num_layers:
            raise LoRAError(f"{where}: tensor {tensor_name!r} is for layer {layer}, "
                            f"but the base model has {shape.num_layers} layers")
        pairs.setdefault((layer, module), {})[match["ab"]] = tensor
    if not pairs:
        raise LoRAError(f"{where}: {WEIGHTS_FILE} holds no LoRA tensors")

    out: dict[tuple[int, str], dict[str | None, tuple[torch.Tensor, torch.Tensor]]] = {}
    max_rank = 0
    for (layer, module), ab in sorted(pairs.items()):
        label = f"layers.{layer}.{_PARENT_OF[module]}.{module}"
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise LoRAError(f"{where}: {label} has no {missing} weight")
        a, b = ab["A"].float(), ab["B"].float()
        in_features, out_features = shape.dims[module]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise LoRAError(f"{where}: {label}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                            "are not a rank-r pair")
        if a.shape[1] != in_features or b.shape[0] != out_features:
            raise LoRAError(
                f"{where}: {label}: the adapter maps {a.shape[1]} → {b.shape[0]} features, the base model's "
                f"{module} maps {in_features} → {out_features} (an adapter for a different base model?)"
            )
        rank = a.shape[0]
        _, alpha = config.rank_and_alpha(label)
        if not torch.isfinite(a).all() or not torch.isfinite(b).all():
            raise LoRAError(f"{where}: {label} holds NaN or infinite values")
        our_module, shard = TARGET_MODULES[module]
        out.setdefault((layer, our_module), {})[shard] = (a.contiguous(), (b * config.scaling(rank, alpha)).contiguous())
        max_rank = max(max_rank, rank)
    return out, max_rank

