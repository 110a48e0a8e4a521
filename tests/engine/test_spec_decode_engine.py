"""The engine with n-gram speculation on a tiny random model: greedy outputs equal those without
speculation token for token (mixed batches, chunked prefill, prefix hits, preemption, n > 1,
stop tokens, stop strings, max_tokens at every offset), and the spec-decode counters."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tidal_engine import LLM, SamplingParams
from tidal_engine.server.metrics import ServerMetrics, metric_value

from pair_statistics import assert_pairs_follow, top_k_distribution
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
    defaults: dict[str, object] = dict(dtype="float32", device="cpu", max_model_len=256, num_gpu_blocks_override=512,
                                       speculative_config=SPEC if spec else None)
    defaults.update(options)
    return LLM(str(folder), **defaults)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in make_llm(model_dir, False).generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def spec_llm(model_dir: Path, request: pytest.FixtureRequest) -> LLM:
    # async: async scheduling forced on, so drafts are made on the device (spec_decode/device_drafts.py)
    llm = make_llm(model_dir, True, async_scheduling=request.param)
    assert llm.engine.core.async_scheduling == request.param == (llm.engine.runner.batch.device_drafts is not None)
    return llm


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


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("options", [
    dict(max_num_batched_tokens=7, max_num_seqs=4),  # chunked prefill next to verify rows; clipped drafts
    dict(num_gpu_blocks_override=17, max_num_seqs=8),  # preemption (one 256-token sequence needs 16 blocks)
])
def test_greedy_equal_under_pressure(model_dir: Path, reference: list[list[int]], options: dict,
                                     async_scheduling: bool) -> None:
    llm = make_llm(model_dir, True, async_scheduling=async_scheduling, **options)
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
    # step() returns step N's outputs with step N+1 already launched: without async
    # scheduling N's tokens and stops were in before N+1 was scheduled, with it N+1 was
    # launched first. A request aborted while N+1 runs gets nothing more; the other keeps
    # its exact greedy tokens.
    engine, core = spec_llm.engine, spec_llm.engine.core
    for i in range(2):
        engine.add_request(f"ahead{i}", PROMPTS[i], GREEDY)
    got: dict[str, list[int]] = {"ahead0": [], "ahead1": []}
    aborted_at = None
    drafts_before = engine.get_stats().spec_decode_num_drafts
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id] = list(out.outputs[0].token_ids)
        in_flight = set() if core._in_flight is None else {c.request.request_id for c in core._in_flight.output.chunks}
        if engine.has_unfinished_requests() and not core.async_scheduling:
            assert in_flight  # the next step runs while the caller works
        # (with async scheduling a row near max_tokens whose in-flight step has drafts sits a step out)
        if aborted_at is None and len(got["ahead1"]) >= 5 and "ahead1" in in_flight:
            aborted_at = len(got["ahead1"])
            engine.abort_request("ahead1")
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


def test_async_drafts_with_worker_processes(model_dir: Path, reference: list[list[int]]) -> None:
    # Worker processes (two tensor-parallel ranks) take each step's result on a sender thread,
    # so a rank may know a step's tokens before the next plan arrives: the rows with drafts
    # made on the device take their input token, shift and drafts from the device all the same.
    llm = make_llm(model_dir, True, async_scheduling=True, distributed_executor_backend="mp", tensor_parallel_size=2)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
        assert llm.engine.get_stats().spec_decode_num_accepted_tokens > 0
    finally:
        llm.engine.shutdown()


def run_mixed(llm: LLM, requests: list[tuple[list[int], str | None]], params: SamplingParams) -> list[list[int]]:
    """Requests with and without an adapter, added together so they share steps."""
    engine = llm.engine
    for i, (prompt, lora) in enumerate(requests):
        engine.add_request(f"mixed{i}", prompt, params, lora_name=lora)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return [done[f"mixed{i}"] for i in range(len(requests))]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_lora_rows_keep_their_greedy_tokens(model_dir: Path, tmp_path: Path, async_scheduling: bool) -> None:
    # Adapter rows next to base rows: the LoRA steps run eagerly (and, with async scheduling,
    # synchronously, their drafts from the host), each row the greedy tokens of its own model.
    from test_lora_support import make_peft_adapter
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    make_peft_adapter(hf, tmp_path / "a", rank=4, alpha=8, seed=1)
    lora = dict(enable_lora=True, max_loras=1, max_lora_rank=8, lora_modules={"a": str(tmp_path / "a")})
    tok = make_llm(model_dir, False).engine.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS[:4]]
    requests = [(p, "a" if i % 2 == 0 else None) for i, p in enumerate(prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = run_mixed(make_llm(model_dir, False, **lora), requests, params)
    spec = make_llm(model_dir, True, async_scheduling=async_scheduling, **lora)
    assert run_mixed(spec, requests, params) == want
    assert want[0] != run_mixed(make_llm(model_dir, False, **lora), [(prompts[0], None)], params)[0]  # the adapter matters
    assert spec.engine.get_stats().spec_decode_num_drafts > 0


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_sampled_rows_keep_the_target_distribution(model_dir: Path, async_scheduling: bool) -> None:
    """(t1, t2) of top-k = 4 sampling, t2 from a verify step whose draft is the likeliest t2
    (a table proposer; on the device with async scheduling): the pairs follow the target's exact
    joint distribution (chi-square, p = 0.001, fixed seed), and some drafts are accepted."""
    from transformers import AutoModelForCausalLM

    prompt, samples, top_k = [5, 17, 42, 99], 600, 4
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    p1 = top_k_distribution(hf, prompt, top_k)
    second = {a: top_k_distribution(hf, prompt + [a], top_k) for a in p1.nonzero().flatten().tolist()}
    expected = {(a, b): samples * float(p1[a]) * float(pb)
                for a, p2 in second.items() for b, pb in enumerate(p2) if pb > 0}
    table = torch.zeros(p1.shape[0], dtype=torch.int64)  # last token -> its likeliest successor
    for a, p2 in second.items():
        table[a] = int(p2.argmax())
    llm = make_llm(model_dir, True, async_scheduling=async_scheduling,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 1})
    if async_scheduling:
        llm.engine.runner.batch.device_drafts.proposer = TableProposer(table)
    else:
        llm.engine.core.proposer = TableProposer(table)
    params = SamplingParams(temperature=1.0, top_k=top_k, max_tokens=3, ignore_eos=True)  # room for a draft at t2
    outputs = llm.generate([list(prompt) for _ in range(samples)], params)
    stats = llm.engine.get_stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert_pairs_follow(outputs, expected, samples)


class TableProposer:
    """One draft: ``table[last token]``, on the host (the Proposer interface) or on the device."""

    num_speculative_tokens = 1

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table

    def release(self, request_id: str) -> None:
        pass

    def propose(self, token_ids: list, max_drafts: list[int], request_ids: list[str]) -> list:
        import numpy as np

        return [np.asarray([int(self.table[int(t[-1])])] if cap > 0 else [], dtype=np.int64)
                for t, cap in zip(token_ids, max_drafts)]

    def propose_on_device(self, tokens: torch.Tensor, lens: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        last = tokens.gather(1, (lens - 1).clamp(min=0)[:, None])
        return self.table.to(tokens.device)[last]


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
