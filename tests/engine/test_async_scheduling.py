"""Async scheduling (one step in flight) gives exactly the synchronous engine's results.

The CPU runs it without any overlap, but the bookkeeping is the same code as on CUDA:
placeholder tokens, device-side feeding of the previous step's samples, held requests,
steps computed for requests that stopped meanwhile, and the fallbacks to synchronous steps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tidal_engine import LLM, SamplingParams
from tidal_engine.core.request import Request

from tiny_models import make_tiny_model
from tiny_tokenizer import EOS_ID, SAMPLE_PROMPTS, save_byte_tokenizer

PROMPTS = SAMPLE_PROMPTS


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-qwen3-async")
    make_tiny_model("qwen3", folder, eos_token_id=EOS_ID, bos_token_id=None, max_position_embeddings=256)
    save_byte_tokenizer(folder, vocab_size=1000)
    return folder


def make_llm(folder: Path, async_scheduling: bool, **options: Any) -> LLM:
    defaults: dict[str, Any] = dict(dtype="float32", device="cpu", max_model_len=128, num_gpu_blocks_override=512)
    defaults.update(options)
    return LLM(str(folder), async_scheduling=async_scheduling, **defaults)


class ExecuteLog:
    """Wraps the executor: how many steps ran, and how many were launched before the
    previous step's tokens were back on the host (their decodes are fed on the device)."""

    def __init__(self, llm: LLM) -> None:
        self.steps = 0
        self.fed_steps = 0
        self.outstanding = 0
        executor = llm.engine.executor
        original = executor.execute

        def execute(plan: Any) -> Any:
            if not plan.scheduled:
                return original(plan)  # a bookkeeping plan (finished ids only), no forward
            self.steps += 1
            self.fed_steps += self.outstanding > 0
            self.outstanding += 1
            pending = original(plan)
            result = pending.result

            def counted_result() -> Any:
                self.outstanding -= 1
                return result()

            pending.result = counted_result  # type: ignore[method-assign]
            return pending

        executor.execute = execute  # type: ignore[method-assign]


def outputs_of(llm: LLM, prompts: list[str], params: list[SamplingParams] | SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def mixed_params() -> list[SamplingParams]:
    """Different lengths, stop tokens and stop strings, so requests end at different steps."""
    return [
        SamplingParams(temperature=0.0, max_tokens=3 + 5 * i, ignore_eos=True, stop_token_ids=[7 * i + 40] if i % 3 == 1 else None,
                       stop=["e"] if i % 3 == 2 else None)
        for i in range(len(PROMPTS))
    ]


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"max_num_batched_tokens": 7},  # chunked prefills mixed with decodes
        {"num_gpu_blocks_override": 8},  # preemption: placeholders in preempted requests
        {"enable_prefix_caching": False},
    ],
    ids=["plain", "chunked", "preempting", "no-prefix-cache"],
)
def test_async_equals_sync(model_dir: Path, options: dict[str, Any]) -> None:
    params = mixed_params()
    expected = [o.outputs[0] for o in make_llm(model_dir, False, **options).generate(PROMPTS * 2, params * 2)]
    llm = make_llm(model_dir, True, **options)
    log = ExecuteLog(llm)
    got = [o.outputs[0] for o in llm.generate(PROMPTS * 2, params * 2)]
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert [o.text for o in got] == [o.text for o in expected]
    assert [(o.finish_reason, o.stop_reason) for o in got] == [(o.finish_reason, o.stop_reason) for o in expected]
    assert log.fed_steps > 0  # it really ran ahead
    if "num_gpu_blocks_override" in options:
        assert llm.engine.get_stats().num_preemptions > 0
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.num_free_blocks == engine.executor.num_kv_blocks


def test_length_limited_requests_waste_no_step(model_dir: Path) -> None:
    llm = make_llm(model_dir, True)
    log = ExecuteLog(llm)
    [out] = llm.generate("hello", SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 6
    assert log.steps == 6  # the step after the last token is held back, not computed
    assert log.fed_steps == 5


def test_a_stop_costs_at_most_one_extra_step(model_dir: Path) -> None:
    [reference] = outputs_of(make_llm(model_dir, False), ["hello"], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    stop_at = 5
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=[reference[stop_at]])
    first = reference.index(reference[stop_at])  # the stop token may occur earlier
    llm = make_llm(model_dir, True)
    log = ExecuteLog(llm)
    [tokens] = outputs_of(llm, ["hello"], params)
    assert tokens == reference[: first + 1]
    assert log.steps == first + 2  # one step computed for nothing after the stop
    # The step left in flight belongs to no live request; sleeping waits for it.
    assert llm.engine.core._in_flight is not None
    llm.engine.sleep(1)
    assert llm.engine.core._in_flight is None
    llm.engine.wake_up()
    assert outputs_of(llm, ["hello"], params) == [tokens]


def test_seeded_sampling_and_n_greater_than_one(model_dir: Path) -> None:
    params = [
        SamplingParams(temperature=1.0, seed=11, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=5, n=3, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=15, ignore_eos=True, min_tokens=4),
    ]
    prompts = PROMPTS[:3]

    def run(async_scheduling: bool) -> list[list[list[int]]]:
        result = make_llm(model_dir, async_scheduling).generate(prompts, params)
        return [[c.token_ids for c in o.outputs] for o in result]

    assert run(True) == run(False)


def test_penalties_and_logprobs_keep_async_scheduling(model_dir: Path) -> None:
    # The sampler counts output tokens on the device and logprobs come back with the ids one
    # step later, so these rows run ahead too, with the synchronous engine's results.
    params = [
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.5),
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2),
    ]
    expected = make_llm(model_dir, False).generate(PROMPTS[:2], params)
    llm = make_llm(model_dir, True)
    log = ExecuteLog(llm)
    got = llm.generate(PROMPTS[:2], params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert got[1].outputs[0].logprobs == expected[1].outputs[0].logprobs
    assert got[1].outputs[0].cumulative_logprob == pytest.approx(expected[1].outputs[0].cumulative_logprob)
    assert got[0].outputs[0].cumulative_logprob is None  # no logprobs asked: none computed (vLLM V1)
    assert log.fed_steps > 0


def test_abort_while_a_step_is_in_flight(model_dir: Path) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    [expected] = outputs_of(make_llm(model_dir, False), [PROMPTS[1]], greedy)
    llm = make_llm(model_dir, True)
    engine = llm.engine
    engine.add_request("keep", PROMPTS[1], greedy)
    engine.add_request("drop", PROMPTS[2], greedy)
    finished: dict[str, list[int]] = {}
    for step in range(40):
        if step == 4:
            assert engine.core._in_flight is not None  # "drop" has a step running right now
            engine.abort_request("drop")
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0].token_ids
        if not engine.has_unfinished_requests():
            break
    assert finished == {"keep": expected}
    engine.core.settle()
    assert engine.kv_cache_manager.num_free_blocks == engine.executor.num_kv_blocks


def test_prefix_cache_never_hashes_a_placeholder(model_dir: Path) -> None:
    # Outputs that fill whole blocks while a step is in flight: the cached hashes must be
    # those of the real tokens, so a later prompt with the same text hits the same blocks.
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    hits = []
    for async_scheduling in (False, True):
        llm = make_llm(model_dir, async_scheduling)
        engine = llm.engine
        engine.add_request("first", list(range(100, 124)), greedy)
        request = engine.core._samples["first"].request
        while engine.has_unfinished_requests():
            engine.step()
        tokens = list(request.all_token_ids)
        fresh = Request("check", tokens)
        assert request.block_hashes == fresh.update_block_hashes(16)[: len(request.block_hashes)]
        [again] = llm.generate([tokens[:-1]], SamplingParams(temperature=0.0, max_tokens=1))
        hits.append(again.num_cached_tokens)
    assert hits[0] == hits[1] == (len(tokens) - 2) // 16 * 16
