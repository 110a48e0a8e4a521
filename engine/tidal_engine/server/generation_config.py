"""--generation-config: sampling defaults from the checkpoint's generation_config.json, as vLLM
applies them (only to fields a request leaves out).

``auto`` reads the model's own file, ``vllm`` uses vLLM's neutral defaults (none of the
file), and a path reads generation_config.json from that folder (or that file).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# generation_config.json key → request field.
_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def sampling_defaults(config: dict[str, Any]) -> dict[str, Any]:
    """The request-field defaults a generation config sets."""
    return {field: config[key] for key, field in _FIELDS.items() if config.get(key) is not None}


def read_generation_config(mode: str, model: str) -> dict[str, Any]:
    if mode == "vllm":
        return {}
    if mode == "auto":
        from tidal_engine.models.loader import model_generation_config

        return model_generation_config(model)
    path = Path(mode).expanduser()
    if path.is_dir():
        path = path / "generation_config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--generation-config {mode}: cannot read {path}: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"--generation-config {mode}: {path} is not a JSON object")
    return config


def load_sampling_defaults(mode: str, model: str) -> dict[str, Any]:
    defaults = sampling_defaults(read_generation_config(mode, model))
    if defaults:
        logger.info("sampling defaults from the generation config (--generation-config %s): %s", mode, defaults)
    return defaults
