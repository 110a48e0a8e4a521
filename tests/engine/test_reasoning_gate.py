"""Structured outputs start after the reasoning (--reasoning-parser): the gate alone, and the
engine on a tiny model whose byte tokenizer spells </think> as eight tokens."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tidal_engine import LLM, SamplingParams
from tidal_engine.structured import StructuredOutputsParams
from tidal_engine.structured.reasoning_gate import ReasoningGate, reasoning_ended
from tidal_engine.structured.token_rules import TokenRules

from tiny_models import make_tiny_model
from tiny_tokenizer import EOS_ID, save_byte_tokenizer

END = list(b"</think>")


def allowed(gate: ReasoningGate, vocab: int) -> set[int]:
    bits = np.unpackbits(np.frombuffer(gate.bitmask_bytes(), dtype=np.uint8), bitorder="little")
    return {t for t in range(vocab) if bits[t]}


def test_gate_opens_after_the_end_marker() -> None:
    gate = ReasoningGate(TokenRules(300, allowed_token_ids=[65, 66]), END, 300)
    assert allowed(gate, 300) == set(range(300))  # reasoning: anything goes
    for token in list(b"so </thin") + END:
        assert gate.accept_token(token)
    assert gate.open and allowed(gate, 300) == {65, 66}
    assert reasoning_ended(list(b"a<think>b</think>c"), END, list(b"<think>"))
    assert not reasoning_ended(list(b"a</think>b<think>c"), END, list(b"<think>"))
    assert not reasoning_ended(list(b"abc"), END, list(b"<think>"))


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-gate")
    make_tiny_model("llama", path, eos_token_id=EOS_ID, max_position_embeddings=128)
    save_byte_tokenizer(path)
    return path


def test_engine_applies_the_grammar_after_the_reasoning(folder: Path) -> None:
    llm = LLM(str(folder), dtype="float32", device="cpu", num_gpu_blocks_override=64, reasoning_parser="qwen3")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(regex="[xyz]{12}"))
    closed, thinking = llm.generate([list(b"q<think>hm</think>"), list(b"q<think>")], params)
    assert set(closed.outputs[0].text) <= set("xyz") and len(closed.outputs[0].text) == 12
    assert not set(thinking.outputs[0].text) <= set("xyz")  # still reasoning: the grammar waits
    plain = LLM(str(folder), dtype="float32", device="cpu", num_gpu_blocks_override=64)
    assert set(plain.generate([list(b"q<think>")], params)[0].outputs[0].text) <= set("xyz")
