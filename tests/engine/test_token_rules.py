"""allowed_token_ids and bad_words (vLLM's fields): the bitmask rules alone, then through the
engine on a tiny random model, where they must change what greedy decoding picks."""

from __future__ import annotations


import numpy as np
import pytest

from tidal_engine import LLM, SamplingParams
from tidal_engine.structured import StructuredOutputsParams
from tidal_engine.structured.token_rules import CombinedMatcher, TokenRules, bad_word_token_ids

from tiny_models import make_tiny_model
from tiny_tokenizer import EOS_ID, save_byte_tokenizer


def allowed(rules: TokenRules | CombinedMatcher, vocab: int) -> set[int]:
    bits = np.unpackbits(np.frombuffer(rules.bitmask_bytes(), dtype=np.uint8), bitorder="little")
    return {t for t in range(vocab) if bits[t]}


def test_rules_bitmask() -> None:
    assert allowed(TokenRules(70, allowed_token_ids=[1, 33, 69]), 70) == {1, 33, 69}
    rules = TokenRules(70, bad_words=[[5], [7, 8, 9]], min_tokens=1, min_tokens_banned=[0])
    assert allowed(rules, 70) == set(range(70)) - {5, 0}  # min_tokens holds back token 0 first
    for token in (7, 8):
        assert rules.accept_token(token)
    assert allowed(rules, 70) == set(range(70)) - {5, 9}  # "7 8" so far: 9 would finish the bad word
    assert rules.accept_token(1) and allowed(rules, 70) == set(range(70)) - {5}
    assert len(rules.bitmask_bytes()) == 4 * 3  # xgrammar's layout: ceil(70 / 32) int32 words


def test_combined_with_a_grammar_allows_the_intersection() -> None:
    grammar = TokenRules(70, allowed_token_ids=[1, 2, 3])  # stands in for a grammar's matcher
    both = CombinedMatcher(grammar, TokenRules(70, allowed_token_ids=[2, 3, 4]))
    assert allowed(both, 70) == {2, 3}


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    folder = tmp_path_factory.mktemp("tiny-rules")
    make_tiny_model("llama", folder, eos_token_id=EOS_ID, max_position_embeddings=128)
    save_byte_tokenizer(folder)  # byte tokens: "ab" is [97, 98]
    return LLM(str(folder), dtype="float32", device="cpu", num_gpu_blocks_override=64)


GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def test_allowed_token_ids_through_the_engine(llm: LLM) -> None:
    free = llm.generate(["hello"], GREEDY)[0].outputs[0].token_ids
    choices = sorted(set(range(97, 100)) - set(free[:1]))  # exclude what greedy picks first
    out = llm.generate(["hello"], GREEDY.clone(allowed_token_ids=choices))[0].outputs[0]
    assert out.token_ids and set(out.token_ids) <= set(choices)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate(["hello"], GREEDY.clone(allowed_token_ids=[10**6]))


LETTERS = GREEDY.clone(allowed_token_ids=list(range(97, 123)))  # keeps the random model's text readable


def test_bad_words_through_the_engine(llm: LLM) -> None:
    free = llm.generate(["hello"], LETTERS)[0].outputs[0]
    word = free.text[2:4]  # two letters the model writes greedily
    out = llm.generate(["hello"], LETTERS.clone(bad_words=[word]))[0].outputs[0]
    assert word not in out.text and out.token_ids[:3] == free.token_ids[:3]  # only the word's end changed
    single = llm.generate(["hello"], LETTERS.clone(bad_words=[free.text[0]]))[0].outputs[0]
    assert free.text[0] not in single.text
    assert bad_word_token_ids(llm.tokenizer, ["ab"]) == [[97, 98], [32, 97, 98]]


def test_rules_with_structured_outputs_and_n(llm: LLM) -> None:
    params = GREEDY.clone(structured_outputs=StructuredOutputsParams(regex="[a-d]{6}"), allowed_token_ids=[97, 98, 256],
                          n=2, temperature=1.0, seed=3)
    for sample in llm.generate(["x"], params)[0].outputs:
        assert len(sample.text) == 6 and set(sample.text) <= {"a", "b"}
