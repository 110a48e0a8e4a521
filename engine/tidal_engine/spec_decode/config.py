"""vLLM's ``--speculative-config`` JSON as a typed, validated config."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model")
# A draft slot whose id the device writes while the row's last token is known on the host (a
# draft model's drafts; PLACEHOLDER_TOKEN = -1 marks slots of a row whose last token is in flight).
DEVICE_DRAFT_SLOT = -2
_KEYS = {"method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # "ngram" (prompt lookup) or "draft_model" (a small model sharing the tokenizer)
    num_speculative_tokens: int  # k: drafts proposed per step and verified in one target forward
    prompt_lookup_min: int = 1  # n-gram: shortest suffix looked up
    prompt_lookup_max: int = 1  # n-gram: longest suffix looked up (tried first)
    model: str | None = None  # draft_model: path or alias

    @classmethod
    def parse(cls, value: str | dict[str, Any]) -> SpeculativeConfig:
        """From the flag's JSON text (or an already decoded dict); ValueError on bad input."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--speculative-config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError("--speculative-config must be a JSON object")
        unknown = sorted(set(value) - _KEYS)
        if unknown:
            raise ValueError(f"--speculative-config has unknown key(s) {unknown}; known: {sorted(_KEYS)}")
        model = value.get("model")
        method = value.get("method") or ("draft_model" if model else None)
        if method not in METHODS:
            raise ValueError(f"--speculative-config method must be one of {list(METHODS)} (or give a model), "
                             f"got {method!r}")
        k = _int(value, "num_speculative_tokens", None)
        if k < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {k}")
        if method == "draft_model":
            if not isinstance(model, str) or not model:
                raise ValueError("a draft_model speculative config needs \"model\": a path or alias")
            if "prompt_lookup_min" in value or "prompt_lookup_max" in value:
                raise ValueError("prompt_lookup_min/max are for method \"ngram\"")
            return cls(method=method, num_speculative_tokens=k, model=model)
        if model is not None:
            raise ValueError("method \"ngram\" takes no model")
        # vLLM: either bound alone sets both.
        lo = _int(value, "prompt_lookup_min", value.get("prompt_lookup_max", 1))
        hi = _int(value, "prompt_lookup_max", lo)
        if lo < 1 or hi < lo:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo} and {hi}")
        return cls(method=method, num_speculative_tokens=k, prompt_lookup_min=lo, prompt_lookup_max=hi)


def drafts_on_device(spec: SpeculativeConfig | None, async_scheduling: bool | None, device_type: str) -> bool:
    """Whether drafts are made on the device. A draft model always proposes there (on the
    workers, either way of scheduling); n-gram lookup does under async scheduling (the default
    on CUDA). The engine core and the runners decide alike."""
    if spec is None:
        return False
    if spec.method == "draft_model":
        return True
    return async_scheduling if async_scheduling is not None else device_type == "cuda"


def _int(value: dict[str, Any], key: str, default: Any) -> int:
    got = value.get(key, default)
    if got is None:
        raise ValueError(f"--speculative-config needs {key}")
    if isinstance(got, bool) or not isinstance(got, int):
        raise ValueError(f"{key} must be an integer, got {got!r}")
    return got
