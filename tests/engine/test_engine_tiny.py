"""The whole engine on a tiny random model: batching, chunking, caching, preemption, stops, aborts."""

from __future__ import annotations

from pathlib import Path

import pytest

from tidal_engine import LLM, SamplingParams

from tiny_models import make_tiny_model
from tiny_tokenizer import EOS_ID, SAMPLE_PROMPTS, save_byte_tokenizer

PROMPTS = SAMPLE_PROMPTS * 2  # 16 requests


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-qwen3")
    make_tiny_model("qwen3", folder, eos_token_id=EOS_ID, bos_token_id=None, max_position_embeddings=256)
    save_byte_tokenizer(folder, vocab_size=1000)
    return folder


def make_llm(folder: Path, **options: object) -> LLM:
    defaults: dict[str, object] = dict(dtype="float32", device="cpu", max_model_len=128, num_gpu_blocks_override=512)
    defaults.update(options)
    return LLM(str(folder), **defaults)


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def reference_outputs(tiny_model_dir: Path) -> list[list[int]]:
    """Greedy outputs with plenty of KV cache and no chunking pressure."""
    llm = make_llm(tiny_model_dir, max_num_batched_tokens=4096)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def test_preemption_keeps_greedy_outputs(tiny_model_dir: Path, reference_outputs: list[list[int]]) -> None:
    # 8 blocks of 16 = 128 tokens: the minimum for one full-length request, far less than
    # 16 concurrent requests need, so the scheduler must preempt and recompute.
    llm = make_llm(tiny_model_dir, num_gpu_blocks_override=8)
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == reference_outputs
    assert llm.engine.get_stats().num_preemptions > 0
    assert llm.engine.kv_cache_manager.num_free_blocks == 8


@pytest.mark.parametrize("budget", [1, 7, 16])
def test_chunked_prefill_budgets_keep_greedy_outputs(
    tiny_model_dir: Path, reference_outputs: list[list[int]], budget: int
) -> None:
    llm = make_llm(tiny_model_dir, max_num_batched_tokens=budget, max_num_seqs=4)
    outputs = llm.generate(PROMPTS[:8], GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == reference_outputs[:8]


def test_prefix_caching_off_gives_same_tokens(tiny_model_dir: Path, reference_outputs: list[list[int]]) -> None:
    llm = make_llm(tiny_model_dir, enable_prefix_caching=False)
    outputs = llm.generate(PROMPTS[:4], GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == reference_outputs[:4]
    assert llm.engine.get_stats().prefix_cache_queries == 0


def test_decodes_are_not_stalled_by_a_long_prompt(tiny_model_dir: Path) -> None:
    llm = make_llm(tiny_model_dir, max_num_batched_tokens=16)
    engine = llm.engine
    engine.add_request("short", "hi", SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    engine.step()  # "short" is prefilled and decoding
    engine.add_request("long", "x" * 100, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    short_tokens = []
    for _ in range(7):  # the 100-token prompt needs 7 chunks of <= 16 tokens
        for output in engine.step():
            if output.request_id == "short":
                short_tokens.append(len(output.outputs[0].token_ids))
    assert short_tokens == list(range(2, 9))  # one new token every step, never stalled
    while engine.has_unfinished_requests():
        engine.step()


def test_abort_frees_blocks_at_any_stage(tiny_model_dir: Path) -> None:
    llm = make_llm(tiny_model_dir, max_num_batched_tokens=8)
    engine = llm.engine
    total = engine.kv_cache_manager.num_free_blocks
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    engine.add_request("waiting", "a" * 40, params)
    engine.add_request("prefilling", "b" * 60, params)
    engine.step()
    engine.abort_request("prefilling")
    engine.abort_request("waiting")
    engine.add_request("decoding", "c", params)
    for _ in range(5):
        engine.step()
    engine.abort_request("decoding")
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.num_free_blocks == total
    assert engine.get_stats().kv_cache_usage == 0.0


def test_stop_string_stop_token_and_min_tokens(tiny_model_dir: Path) -> None:
    llm = make_llm(tiny_model_dir)
    [free] = llm.generate("hello world", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    text, tokens = free.outputs[0].text, free.outputs[0].token_ids
    # A stop string taken from the middle of the free-running text ends the answer right before it.
    stop = text[5:7]
    [stopped] = llm.generate("hello world", SamplingParams(temperature=0.0, max_tokens=24, stop=[stop], ignore_eos=True))
    assert stopped.outputs[0].finish_reason == "stop"
    assert stopped.outputs[0].stop_reason == stop
    assert stopped.outputs[0].text == text[: text.index(stop)]
    # A stop token id ends generation on that token.
    [by_id] = llm.generate(
        "hello world", SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[tokens[3]], ignore_eos=True)
    )
    assert by_id.outputs[0].token_ids == tokens[: tokens.index(tokens[3]) + 1]
    assert by_id.outputs[0].stop_reason == tokens[3]


def test_logprobs_and_seeded_sampling(tiny_model_dir: Path) -> None:
    llm = make_llm(tiny_model_dir)
    params = SamplingParams(temperature=1.0, seed=123, max_tokens=8, logprobs=3, ignore_eos=True)
    [alone] = llm.generate("seeded", params)
    # The same seed in a busy batch gives the same tokens.
    crowd = llm.generate(["other one", "seeded", "more traffic"], [GREEDY, params, SamplingParams(temperature=1.0, max_tokens=8)])
    assert crowd[1].outputs[0].token_ids == alone.outputs[0].token_ids
    logprobs = alone.outputs[0].logprobs
    assert logprobs is not None and len(logprobs) == 8
    for token, position in zip(alone.outputs[0].token_ids, logprobs):
        assert token in position and len(position) >= 3
        assert all(entry.logprob <= 0 for entry in position.values())
    assert alone.outputs[0].cumulative_logprob == pytest.approx(
        sum(p[t].logprob for t, p in zip(alone.outputs[0].token_ids, logprobs)), abs=1e-4
    )


def test_max_tokens_defaults_to_the_context(tiny_model_dir: Path) -> None:
    llm = make_llm(tiny_model_dir, max_model_len=40)
    [output] = llm.generate("x" * 30, SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))
    assert len(output.outputs[0].token_ids) == 10
    assert output.outputs[0].finish_reason == "length"


def test_chat_uses_the_template(tiny_model_dir: Path) -> None:
    llm = make_llm(tiny_model_dir)
    [output] = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0.0, max_tokens=3))
    assert llm.tokenizer.decode(output.prompt_token_ids) == "<user>hi\n<assistant>"


def test_corrupt_weights_are_a_clear_error(tiny_model_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    for file in tiny_model_dir.iterdir():
        data = file.read_bytes()
        (broken / file.name).write_bytes(data[: len(data) // 2] if file.suffix == ".safetensors" else data)
    with pytest.raises(ValueError, match="safetensors"):
        make_llm(broken)
