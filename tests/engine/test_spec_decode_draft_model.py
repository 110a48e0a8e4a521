"""The draft model (on the worker, its KV in the target's blocks, drafts made on the device) on
tiny random models, with async scheduling forced on and off: greedy output equals decoding
without speculation (the target as its own draft accepts every draft, which checks the draft's
KV and positions; a perturbed copy accepts some) across mixed batches, chunked prefill, prefix
hits, preemption, aborts, n > 1, stop strings and max_tokens offsets; sampled rows keep the
target's distribution (chi-square); the KV cache's block count pays for both models; bad drafts
are refused clearly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tidal_engine import LLM, SamplingParams

from pair_statistics import assert_pairs_follow, expected_pairs
from tiny_models import make_tiny_model
from tiny_tokenizer import EOS_ID, SAMPLE_PROMPTS, save_byte_tokenizer

PROMPTS = SAMPLE_PROMPTS
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The target, a perturbed copy of it (a draft that is often but not always right) and a
    model whose vocabulary differs."""
    target = tmp_path_factory.mktemp("spec-target")
    model = make_tiny_model("qwen3", target, eos_token_id=EOS_ID, bos_token_id=None, max_position_embeddings=256)
    save_byte_tokenizer(target, vocab_size=1000)
    near = tmp_path_factory.mktemp("spec-draft-near")
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.02)
    model.save_pretrained(near)
    save_byte_tokenizer(near, vocab_size=1000)
    other = tmp_path_factory.mktemp("spec-draft-other-vocab")
    make_tiny_model("qwen3", other, vocab_size=1024, eos_token_id=EOS_ID, bos_token_id=None,
                    max_position_embeddings=256)
    save_byte_tokenizer(other, vocab_size=1024)
    short = tmp_path_factory.mktemp("spec-draft-short")
    make_tiny_model("qwen3", short, eos_token_id=EOS_ID, bos_token_id=None, max_position_embeddings=128)
    save_byte_tokenizer(short, vocab_size=1000)
    return {"target": target, "near": near, "other": other, "short": short}


def make_llm(target: Path, draft: Path | None, k: int = 3, **options: object) -> LLM:
    defaults: dict[str, object] = dict(dtype="float32", device="cpu", max_model_len=256, num_gpu_blocks_override=512)
    defaults.update(options)
    spec = {"model": str(draft), "num_speculative_tokens": k} if draft else None
    return LLM(str(target), speculative_config=spec, **defaults)


@pytest.fixture(scope="module")
def plain(folders: dict[str, Path]) -> LLM:
    return make_llm(folders["target"], None)


@pytest.fixture(scope="module")
def reference(plain: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def self_draft(folders: dict[str, Path], request: pytest.FixtureRequest) -> LLM:
    """The target as its own draft; async: async scheduling forced on (the CUDA default)."""
    llm = make_llm(folders["target"], folders["target"], async_scheduling=request.param)
    assert llm.engine.core.async_scheduling == request.param
    assert llm.engine.runner.draft is not None and llm.engine.runner.batch.device_drafts is not None
    return llm


def test_target_as_its_own_draft_accepts_every_draft(self_draft: LLM, reference: list[list[int]]) -> None:
    before = self_draft.engine.get_stats()
    assert [o.outputs[0].token_ids for o in self_draft.generate(PROMPTS, GREEDY)] == reference
    # Again: the prompts now hit the prefix cache, whose blocks hold the draft's KV too.
    assert [o.outputs[0].token_ids for o in self_draft.generate(PROMPTS, GREEDY)] == reference
    stats = self_draft.engine.get_stats()
    assert stats.prefix_cache_hits > before.prefix_cache_hits
    assert stats.spec_decode_num_drafts > before.spec_decode_num_drafts
    accepted = stats.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    drafted = stats.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    assert accepted == drafted > 0  # every draft: the draft's KV and positions are the target's


def test_stop_strings_n_and_max_tokens_inside_accepted_runs(self_draft: LLM, plain: LLM,
                                                             reference: list[list[int]]) -> None:
    stop = plain.tokenizer.decode(reference[1][9:11])  # ends the second prompt's text inside a run of drafts
    cases = [SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, stop=[stop]),
             SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, n=2),
             *[SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (1, 2, 3, 5)]]
    for params in cases:
        want = [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in plain.generate(PROMPTS[:3], params)]
        got = [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in self_draft.generate(PROMPTS[:3], params)]
        assert got == want
        if params.stop:
            assert want[1][0][2] == "stop"  # the stop string did end the second prompt's sample


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_different_draft_gives_mixed_acceptance_and_the_same_tokens(
        folders: dict[str, Path], reference: list[list[int]], async_scheduling: bool) -> None:
    # A 9-token step budget: prompts are chunked and ride next to verify rows (mixed batches).
    llm = make_llm(folders["target"], folders["near"], async_scheduling=async_scheduling, max_num_batched_tokens=9,
                   max_num_seqs=3)
    short = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], short)] == [r[:12] for r in reference[:3]]
    stats = llm.engine.get_stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    # Sampled rows verify too (their distribution: test_sampled_rows_keep_the_target_distribution).
    before = stats.spec_decode_num_drafts
    sampled = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=6, ignore_eos=True)
    outputs = llm.generate(PROMPTS[:3], sampled)
    assert all(len(o.outputs[0].token_ids) == 6 for o in outputs)
    assert llm.engine.get_stats().spec_decode_num_drafts > before


def test_the_kv_cache_pays_for_both_models(folders: dict[str, Path]) -> None:
    """Each block id holds the target's and the draft's KV: the budget buys fewer blocks."""
    budget = 3 << 20
    llm = make_llm(folders["target"], folders["near"], num_gpu_blocks_override=None, kv_cache_memory_bytes=budget)
    runner = llm.engine.runner
    assert runner.draft is not None
    target, draft = runner.kv_spec.bytes_per_block, runner.draft.bytes_per_block
    assert runner.num_blocks == budget // (target + draft) < budget // target
    assert llm.engine.core.kv_cache_manager.num_blocks == runner.num_blocks
    assert all(c.shape[1] == runner.num_blocks for c in runner.draft.caches + runner.kv_caches)


def test_sampled_rows_keep_the_target_distribution(folders: dict[str, Path]) -> None:
    """(t1, t2) of top-k = 4 sampling: t2 comes from a verify step (one draft, or its rejection),
    and the pairs follow the target's exact joint distribution (chi-square, p = 0.001, fixed seed)."""
    from transformers import AutoModelForCausalLM

    prompt, samples, top_k = [5, 17, 42, 99], 800, 4
    hf = AutoModelForCausalLM.from_pretrained(folders["target"], dtype=torch.float32).eval()
    expected = expected_pairs(hf, prompt, top_k, samples)
    llm = make_llm(folders["target"], folders["near"], k=2, async_scheduling=True)
    params = SamplingParams(temperature=1.0, top_k=top_k, max_tokens=3, ignore_eos=True)
    outputs = llm.generate([list(prompt) for _ in range(samples)], params)
    stats = llm.engine.get_stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert_pairs_follow(outputs, expected, samples)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_preemption_and_aborts_mid_speculation(folders: dict[str, Path], reference: list[list[int]],
                                               async_scheduling: bool) -> None:
    # 10 blocks of 16 tokens: the rows cannot all stay resident, so some are preempted mid-run.
    llm = make_llm(folders["target"], folders["target"], num_gpu_blocks_override=10, max_num_seqs=8,
                   max_model_len=128, async_scheduling=async_scheduling)
    engine = llm.engine
    engine.add_request("aborted", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"kept-{i}", prompt, GREEDY)
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        drafts_before = engine.get_stats().spec_decode_num_drafts
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        if "aborted" in engine.core._parents and engine.get_stats().spec_decode_num_drafts > drafts_before:
            engine.abort_request("aborted")  # the step just verified drafts
    assert "aborted" not in outputs
    assert [outputs[f"kept-{i}"] for i in range(len(PROMPTS))] == reference
    stats = engine.get_stats()
    assert stats.num_preemptions > 0
    # A resumed row recomputes the draft's KV with the target's: still every draft accepted.
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0


@pytest.mark.parametrize("draft, message, options", [
    ("other", "must share the target's tokenizer", {}),
    ("/nonexistent/draft", "model path does not exist", {}),
    ("short", "shorter than max_model_len", {}),
    ("near", "tensor_parallel_size 1 only", {"tensor_parallel_size": 2}),
])
def test_a_bad_draft_model_is_refused(folders: dict[str, Path], draft: str, message: str, options: dict) -> None:
    path = folders.get(draft, Path(draft))
    with pytest.raises(ValueError, match=message):
        make_llm(folders["target"], path, **options)


def test_the_draft_model_resolves_through_the_engines_cache_dir(folders: dict[str, Path], tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A GGUF draft keeps its index and tokenizer in the engine's start-up cache (--cache-dir),
    like the target."""
    from tidal_engine.spec_decode import draft_model

    resolved: list[tuple[str, object]] = []
    real_resolve = draft_model.resolve_model

    def recording_resolve(model: str, cache_dir: object = None) -> object:
        resolved.append((model, cache_dir))
        return real_resolve(model, cache_dir)

    monkeypatch.setattr(draft_model, "resolve_model", recording_resolve)
    llm = make_llm(folders["target"], folders["near"], cache_dir=str(tmp_path))
    # checked by the engine core before the workers start, then loaded by the worker
    assert resolved == [(str(folders["near"]), str(tmp_path))] * 2
    assert llm.engine.core.config.cache_dir == str(tmp_path)
