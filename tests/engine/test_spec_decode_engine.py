"""The engine with n-gram speculation on a tiny random model: greedy outputs equal those without
speculation token for token (mixed batches, chunked prefill, prefix hits, preemption, n > 1,
stop tokens, stop strings, max_tokens at every offset), and the spec-decode counters."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from tidal_engine import LLM, SamplingParams
from tidal_engine.server.metrics import ServerMetrics, metric_value

from tiny_models import make_tiny_model
from tiny_tokenizer import EOS_ID, SAMPLE_PROMPTS, save_byte_tokenizer

PROMPTS = [p * 3 for p in SAMPLE_PROMPTS]  # repeated text: the n-gram proposer finds matches
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-qwen3-spec")
    make_tiny_model("qwen3", folder, eos_token_id=EOS_ID, bos_token_id=None, max_position_embeddings=256)
    save_byte_tokenizer(folder, vocab_size=1000)
    return folder


def make_llm(folder: Path, spec: bool, **options: object) -> LLM:
    defaults: dict[str, object] = dict(dtype="float32", device="cpu", max_model_len=256, num_gpu_blocks_override=512)
    defaults.update(options)
    return LLM(str(folder), speculative_config=SPEC if spec else None, **defaults)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in make_llm(model_dir, False).generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def spec_llm(model_dir: Path) -> LLM:
    return make_llm(model_dir, True)


def test_greedy_equal_and_drafts_accepted(spec_llm: LLM, reference: list[list[int]]) -> None:
    before = spec_llm.engine.get_stats()
    assert [o.outputs[0].token_ids for o in spec_llm.generate(PROMPTS, GREEDY)] == reference
    # Again: the prompts now hit the prefix cache.
    assert [o.outputs[0].token_ids for o in spec_llm.generate(PROMPTS, GREEDY)] == reference
    stats = spec_llm.engine.get_stats()
    assert stats.prefix_cache_hits > before.prefix_cache_hits
    assert 0 < stats.spec_decode_num_accepted_tokens <= stats.spec_decode_num_draft_tokens
    assert stats.spec_decode_num_drafts > 0
    per_pos = stats.spec_decode_num_accepted_tokens_per_pos
    assert len(per_pos) == 3 and sum(per_pos) == stats.spec_decode_num_accepted_tokens
    assert per_pos[0] >= per_pos[1] >= per_pos[2]  # a later position is accepted only after the earlier
    # The generation counter counts emitted tokens, as without speculation.
    assert stats.generation_tokens_total - before.generation_tokens_total == 2 * sum(map(len, reference))


@pytest.mark.parametrize("options", [
    dict(max_num_batched_tokens=7, max_num_seqs=4),  # chunked prefill next to verify rows; clipped drafts
    dict(num_gpu_blocks_override=17, max_num_seqs=8),  # preemption (one 256-token sequence needs 16 blocks)
])
def test_greedy_equal_under_pressure(model_dir: Path, reference: list[list[int]], options: dict) -> None:
    llm = make_llm(model_dir, True, **options)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
    if options.get("num_gpu_blocks_override") == 17:
        assert llm.engine.get_stats().num_preemptions > 0


def test_max_tokens_at_every_offset_within_a_run(spec_llm: LLM, reference: list[list[int]]) -> None:
    for max_tokens in range(1, 9):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outputs = spec_llm.generate(PROMPTS[:3], params)
        assert [o.outputs[0].token_ids for o in outputs] == [r[:max_tokens] for r in reference[:3]]
        assert all(o.outputs[0].finish_reason == "length" for o in outputs)


def test_stop_token_inside_an_accepted_run(spec_llm: LLM, reference: list[list[int]]) -> None:
    for ref, prompt in zip(reference[:4], PROMPTS[:4]):
        stop = ref[len(ref) // 2]
        cut = ref.index(stop)
        out = spec_llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                                         stop_token_ids=[stop]))[0].outputs[0]
        assert out.token_ids == ref[: cut + 1] and out.finish_reason == "stop" and out.stop_reason == stop


def test_stop_strings_and_n_and_mixed_rows_match_no_speculation(model_dir: Path, spec_llm: LLM) -> None:
    plain = make_llm(model_dir, False)
    tok = plain.engine.tokenizer
    params = []
    for i, prompt in enumerate(PROMPTS):
        if i % 3 == 0:  # a stop string taken from the middle of the greedy answer
            text = plain.generate([prompt], GREEDY)[0].outputs[0].text
            params.append(SamplingParams(temperature=0.0, max_tokens=40, stop=[text[10:13]]))
        elif i % 3 == 1:  # n > 1 (greedy samples are identical)
            params.append(SamplingParams(temperature=0.0, max_tokens=30, n=2, ignore_eos=True))
        else:  # a penalty: never drafted, but verified rows share its batch
            params.append(SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, repetition_penalty=1.3))
    want = plain.generate(PROMPTS, params)
    got = spec_llm.generate(PROMPTS, params)
    for w, g in zip(want, got):
        assert [(c.token_ids, c.text, c.finish_reason) for c in g.outputs] == \
            [(c.token_ids, c.text, c.finish_reason) for c in w.outputs]
    assert tok is not None


def test_next_step_launched_ahead_and_an_abort_meanwhile(spec_llm: LLM, reference: list[list[int]]) -> None:
    # Speculating without async scheduling, step() returns step N's outputs with step N+1
    # already launched (N's tokens and stops were in before it was scheduled). A request
    # aborted while N+1 runs gets nothing more; the other keeps its exact greedy tokens.
    engine, core = spec_llm.engine, spec_llm.engine.core
    assert not core.async_scheduling
    for i in range(2):
        engine.add_request(f"ahead{i}", PROMPTS[i], GREEDY)
    got: dict[str, list[int]] = {"ahead0": [], "ahead1": []}
    aborted_at = None
    drafts_before = engine.get_stats().spec_decode_num_drafts
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id] = list(out.outputs[0].token_ids)
        if engine.has_unfinished_requests():
            assert core._in_flight is not None  # the next step runs while the caller works
        if aborted_at is None and len(got["ahead1"]) >= 5:
            aborted_at = len(got["ahead1"])
            engine.abort_request("ahead1")
            assert core._in_flight is not None and "ahead1" in {c.request.request_id for c in core._in_flight.output.chunks}
    assert got["ahead0"] == reference[0]
    assert aborted_at is not None and got["ahead1"] == reference[1][:aborted_at]
    assert engine.get_stats().spec_decode_num_drafts > drafts_before
    core.settle()
    assert core._in_flight is None and engine.get_stats().kv_cache_usage == 0


def test_sampled_rows_run_with_drafts(spec_llm: LLM) -> None:
    before = spec_llm.engine.get_stats().spec_decode_num_drafts
    params = SamplingParams(temperature=0.8, top_k=20, max_tokens=30, ignore_eos=True)
    outputs = spec_llm.generate(PROMPTS, params)
    assert all(len(o.outputs[0].token_ids) == 30 for o in outputs)
    assert spec_llm.engine.get_stats().spec_decode_num_drafts > before


def test_spec_decode_counters_in_metrics(spec_llm: LLM) -> None:
    stats = spec_llm.engine.get_stats()
    engine = SimpleNamespace(snapshot=SimpleNamespace(stats=stats, peak_running=0, sleep_level=0, updated_at=0.0),
                             add_finished_listener=lambda listener: None)
    text = ServerMetrics(engine, "m", 256).render().decode()  # type: ignore[arg-type]
    assert metric_value(text, "tidal:spec_decode_num_drafts_total", model_name="m") == stats.spec_decode_num_drafts
    assert metric_value(text, "tidal:spec_decode_num_accepted_tokens_total", model_name="m") == \
        stats.spec_decode_num_accepted_tokens
    assert metric_value(text, "tidal:spec_decode_num_accepted_tokens_per_pos_total", model_name="m", position=0) == \
        stats.spec_decode_num_accepted_tokens_per_pos[0]
