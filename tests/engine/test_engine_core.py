"""The engine core's side of the per-step plan, against a model-free worker.

``ScriptedExecutor`` (scripted_executor.py) plays a worker by the plan's contract alone, so
the core's plans must carry exactly what a worker needs:
new requests once, appended blocks, whole tables after a preemption, finished ids. The
outputs must equal that function's sequence, with async scheduling or without, under
preemption, n > 1, stops and aborts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tidal_engine.config import EngineConfig
from tidal_engine.engine.core import EngineCore
from tidal_engine.engine.output_processor import OutputProcessor
from tidal_engine.sampling_params import SamplingParams

from scripted_executor import BLOCK, ScriptedExecutor, expected_tokens
from tiny_models import make_tiny_model
from tiny_tokenizer import EOS_ID, save_byte_tokenizer

VOCAB = 1000


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-core")
    make_tiny_model("qwen3", folder, eos_token_id=EOS_ID, bos_token_id=None, max_position_embeddings=256)
    save_byte_tokenizer(folder, vocab_size=VOCAB)
    return folder


def make_core(model_dir: Path, async_scheduling: bool, num_blocks: int = 256, **options: Any) -> EngineCore:
    config = EngineConfig(model=str(model_dir), device="cpu", dtype="float32", max_model_len=128,
                          async_scheduling=async_scheduling, block_size=BLOCK, **options)
    return EngineCore(config, executor=ScriptedExecutor(num_blocks=num_blocks))


def run(core: EngineCore, prompts: dict[str, list[int]], params: SamplingParams) -> dict[str, list[list[int]]]:
    processor = OutputProcessor(core.tokenizer)
    for rid, prompt in prompts.items():
        core.add_request(rid, prompt, params)
        processor.add_request(rid, None, prompt, params)
    finals: dict[str, list[list[int]]] = {}
    for _ in range(2000):
        if not core.has_unfinished_requests():
            break
        touched, stopped = processor.process(core.step())
        core.finish_samples(stopped)
        for state in touched:
            if state.finished:
                finals[state.request_id] = [s.token_ids for s in state.samples]
    core.settle()
    return finals


PROMPTS = {f"r{i}": [100 + 13 * i + j for j in range(5 + 7 * i)] for i in range(6)}


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_plans_carry_what_a_worker_needs(model_dir: Path, async_scheduling: bool) -> None:
    core = make_core(model_dir, async_scheduling, max_num_batched_tokens=24)  # chunked prefills
    got = run(core, PROMPTS, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert got == {rid: [expected_tokens(p, 20)] for rid, p in PROMPTS.items()}
    executor = core.executor
    assert isinstance(executor, ScriptedExecutor)
    sent = [r.req_id for plan in executor.plans for r in plan.new_requests]
    assert sorted(sent) == sorted(PROMPTS)  # each request crosses once
    forgotten = [rid for plan in executor.plans for rid in plan.finished_req_ids]
    assert sorted(forgotten) == sorted(PROMPTS) and not executor.history  # nothing leaks in the worker
    assert core.kv_cache_manager.num_free_blocks == 256


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preemption_resends_whole_block_tables(model_dir: Path, async_scheduling: bool) -> None:
    # 20 blocks for 6 requests that grow to 3-4 blocks each: preemption is certain.
    core = make_core(model_dir, async_scheduling, num_blocks=20)
    got = run(core, PROMPTS, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    assert got == {rid: [expected_tokens(p, 30)] for rid, p in PROMPTS.items()}
    assert core.scheduler.num_preemptions > 0
    executor = core.executor
    assert isinstance(executor, ScriptedExecutor)
    assert any(s.resumed for plan in executor.plans for s in plan.scheduled)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_n_samples_stop_tokens_and_stop_strings(model_dir: Path, async_scheduling: bool) -> None:
    prompt = PROMPTS["r2"]
    reference = expected_tokens(prompt, 20)
    core = make_core(model_dir, async_scheduling)
    stop_token = reference[6]
    got = run(core, {"a": prompt}, SamplingParams(n=3, temperature=0, max_tokens=20, stop_token_ids=[stop_token]))
    first = reference.index(stop_token)
    assert got == {"a": [reference[: first + 1]] * 3}
    # A stop string is found by the output processor, which ends the sample in the core.
    core = make_core(model_dir, async_scheduling)
    text = core.tokenizer.decode(reference, skip_special_tokens=True)
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop
    processor = OutputProcessor(core.tokenizer)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop])
    core.add_request("s", prompt, params)
    processor.add_request("s", None, prompt, params)
    final = None
    while core.has_unfinished_requests():
        touched, stopped = processor.process(core.step())
        core.finish_samples(stopped)
        final = next((OutputProcessor.output(s) for s in touched if s.finished), final)
    core.settle()
    assert final is not None and final.outputs[0].finish_reason == "stop" and final.outputs[0].stop_reason == stop
    assert final.outputs[0].text == text[: text.index(stop)]
    assert core.kv_cache_manager.num_free_blocks == 256


def test_aborts_reach_the_worker_as_finished_ids(model_dir: Path) -> None:
    core = make_core(model_dir, True)
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    for rid in ("keep", "drop"):
        core.add_request(rid, PROMPTS["r1"], params)
    for _ in range(4):
        core.step()
    core.abort_request("drop")
    while core.has_unfinished_requests():
        core.step()
    core.settle()
    executor = core.executor
    assert isinstance(executor, ScriptedExecutor)
    forgotten = [rid for plan in executor.plans for rid in plan.finished_req_ids]
    assert "drop" in forgotten
    assert "drop" not in executor.history
