"""Speculative decoding on a GPU (marked ``gpu``; run with ``TRITON_INTERPRET=0 pytest
tests/engine/test_spec_decode_gpu.py -m gpu`` on a CUDA machine): verify steps replay the
verify CUDA graphs (multi-query decode attention) or the mixed-step graphs, and the greedy
tokens equal those of the same engine without drafts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tiny_tokenizer import SAMPLE_PROMPTS

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(INTERPRETING, reason="GPU tests run compiled: set TRITON_INTERPRET=0"),
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_models import make_tiny_model
    from tiny_tokenizer import EOS_ID, save_byte_tokenizer

    folder = tmp_path_factory.mktemp("tiny-qwen3-spec-gpu")
    make_tiny_model("qwen3", folder, eos_token_id=EOS_ID, bos_token_id=None, max_position_embeddings=512)
    save_byte_tokenizer(folder, vocab_size=1000)
    return folder


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("max_num_batched_tokens", [None, 96], ids=["decode-rows", "with-prefill-chunks"])
def test_verify_graphs_keep_the_greedy_tokens(tiny_dir: Path, max_num_batched_tokens: int | None,
                                              async_scheduling: bool) -> None:
    # fp32, so the verify graphs' GEMM shapes (k + 1 rows a sequence) can't flip a token; a
    # repetitive prompt set so n-gram drafts are found and accepted. 96 tokens a step: chunked
    # prefills run next to verify rows (the mixed-step graphs). async: drafts made on the
    # device, each step shifted there by its previous step's accepted count.
    from tidal_engine import LLM, SamplingParams

    llm = LLM(str(tiny_dir), device="cuda", dtype="float32", max_model_len=512, num_gpu_blocks_override=256,
              max_num_batched_tokens=max_num_batched_tokens, cuda_graph_sizes=[1, 2, 4, 8],
              async_scheduling=async_scheduling,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    assert (llm.engine.runner.batch.device_drafts is not None) == async_scheduling
    prompts = [p * 4 for p in SAMPLE_PROMPTS]
    params = [SamplingParams(temperature=0.0, max_tokens=24 + 4 * i, ignore_eos=True) for i in range(len(prompts))]
    core = llm.engine.core
    runner = llm.engine.runner
    assert runner.verify_graphs is not None and sorted(runner.verify_graphs.graphs) == [4, 8, 16, 32]
    proposer, core.proposer = core.proposer, None
    base = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    core.proposer = proposer
    assert runner.verify_graphs.num_replays == 0
    spec = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    stats = llm.engine.get_stats()
    assert spec == base
    assert runner.verify_graphs.num_replays > 0
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens


def test_verify_steps_through_the_few_row_gemv_in_bf16(tiny_dir: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # bf16, with the start-up choice forced onto the Triton kernels (the fastest kernel, never
    # cuBLAS), so every k + 1-row linear of a verify step (and of 2..8-row decode batches) runs
    # the few-row GEMV inside the captured graphs. bf16 sums in another order may flip a near-tie,
    # so the speculative tokens must equal the plain ones for all prompts but at most one.
    from tidal_engine import LLM, SamplingParams
    from tidal_engine.kernels import gemv_choice
    from tidal_engine.layers.linear import LinearBase

    def fastest_kernel(timings: dict) -> object:
        return min((c for c in timings if c is not None), key=timings.__getitem__, default=None)

    monkeypatch.setattr(gemv_choice, "pick_fastest", fastest_kernel)
    llm = LLM(str(tiny_dir), device="cuda", dtype="bfloat16", max_model_len=512, num_gpu_blocks_override=256,
              cuda_graph_sizes=[1, 2, 4, 8], cache_dir=str(tmp_path),  # no stored choices
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    runner = llm.engine.runner
    linears = [m for m in runner.model.modules() if isinstance(m, LinearBase)]
    assert linears and all(m.gemv_rows_configs is not None and m.gemv_rows_configs[4] is not None for m in linears)
    prompts = [p * 4 for p in SAMPLE_PROMPTS]
    params = [SamplingParams(temperature=0.0, max_tokens=24 + 4 * i, ignore_eos=True) for i in range(len(prompts))]
    core = llm.engine.core
    proposer, core.proposer = core.proposer, None
    base = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    core.proposer = proposer
    single = [llm.generate([p], q)[0].outputs[0].token_ids for p, q in zip(prompts, params)]  # 4-row verify steps
    spec = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    stats = llm.engine.get_stats()
    assert runner.verify_graphs is not None and runner.verify_graphs.num_replays > 0
    assert stats.spec_decode_num_accepted_tokens > 0
    assert sum(a == b for a, b in zip(single, base)) >= len(prompts) - 1, (single, base)
    assert sum(a == b for a, b in zip(spec, base)) >= len(prompts) - 1, (spec, base)


@pytest.mark.parametrize("async_scheduling, max_num_batched_tokens", [(True, 96), (False, None)],
                         ids=["async-with-prefill-chunks", "sync-decode-rows"])
def test_the_target_as_its_own_draft_model(tiny_dir: Path, async_scheduling: bool,
                                           max_num_batched_tokens: int | None) -> None:
    # The draft model on the worker, its KV in the target's blocks, its drafts made on the device
    # right before each verify step (async: at positions shifted there by the previous step's
    # accepted count). The target as its own draft must give the plain greedy tokens and have
    # (nearly) every draft accepted: the draft's one-token forwards run eagerly, the target's
    # verify through the graphs, so only a near-tie in fp32 could tell them apart.
    from tidal_engine import LLM, SamplingParams

    llm = LLM(str(tiny_dir), device="cuda", dtype="float32", max_model_len=512, num_gpu_blocks_override=256,
              max_num_batched_tokens=max_num_batched_tokens, cuda_graph_sizes=[1, 2, 4, 8],
              async_scheduling=async_scheduling,
              speculative_config={"model": str(tiny_dir), "num_speculative_tokens": 3})
    core, runner = llm.engine.core, llm.engine.runner
    assert core.async_scheduling == async_scheduling and runner.draft is not None
    assert all(c.shape[1] == 256 for c in runner.draft.caches)
    params = [SamplingParams(temperature=0.0, max_tokens=24 + 4 * i, ignore_eos=True) for i in range(len(SAMPLE_PROMPTS))]
    proposer, core.proposer = core.proposer, None
    base = [o.outputs[0].token_ids for o in llm.generate(SAMPLE_PROMPTS, params)]
    core.proposer = proposer
    spec = [o.outputs[0].token_ids for o in llm.generate(SAMPLE_PROMPTS, params)]
    stats = llm.engine.get_stats()
    assert spec == base
    assert runner.verify_graphs is not None and runner.verify_graphs.num_replays > 0
    drafted, accepted = stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens
    assert drafted > 0 and accepted >= 0.95 * drafted, (accepted, drafted)
