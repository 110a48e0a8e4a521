"""LLM(skip_tokenizer_init=True): no tokenizer is loaded, token-id prompts give the same token
ids as with one, and what needs the vocabulary is refused clearly."""

from __future__ import annotations

from pathlib import Path

import pytest

from tidal_engine import LLM, SamplingParams
from tidal_engine.structured import StructuredOutputsParams

from tiny_models import make_tiny_model
from tiny_tokenizer import EOS_ID, save_byte_tokenizer


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-skip-tok")
    make_tiny_model("llama", path, eos_token_id=EOS_ID, max_position_embeddings=128)
    save_byte_tokenizer(path, vocab_size=512)
    return path


def make(folder: Path, **options: object) -> LLM:
    return LLM(str(folder), dtype="float32", device="cpu", num_gpu_blocks_override=64, **options)  # type: ignore[arg-type]


def test_token_id_prompts_without_a_tokenizer(folder: Path) -> None:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    prompts = [list(b"hello"), list(b"tidal engines")]
    with_tokenizer = make(folder).generate(prompts, params)
    llm = make(folder, skip_tokenizer_init=True)
    assert llm.tokenizer is None
    outputs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in with_tokenizer]
    assert all(o.outputs[0].text == "" and o.prompt is None for o in outputs)
    first = outputs[0].outputs[0]
    assert first.logprobs is not None and first.logprobs[0][first.token_ids[0]].decoded_token is None
    stopped = llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                      stop_token_ids=[with_tokenizer[0].outputs[0].token_ids[2]]))
    assert stopped[0].outputs[0].finish_reason == "stop" and len(stopped[0].outputs[0].token_ids) == 3

    with pytest.raises(ValueError, match="token ids"):
        llm.generate("hello", params)
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate(prompts[0], SamplingParams(stop=["x"]))
    with pytest.raises(ValueError, match="need the tokenizer"):
        llm.generate(prompts[0], SamplingParams(structured_outputs=StructuredOutputsParams(regex="[ab]+")))
