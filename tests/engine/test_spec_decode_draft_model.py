"""The draft-model proposer on tiny random models: greedy output equals decoding without
speculation (the target as its own draft accepts every draft; a perturbed copy accepts some),
sampled rows keep the target's distribution (chi-square), preemption and aborts mid-speculation leave nothing behind, bad drafts are
refused clearly."""

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
    return {"target": target, "near": near, "other": other}


def make_llm(target: Path, draft: Path | None, k: int = 3, **options: object) -> LLM:
    defaults: dict[str, object] = dict(dtype="float32", device="cpu", max_model_len=256, num_gpu_blocks_override=512)
    defaults.update(options)
    spec = {"model": str(draft), "num_speculative_tokens": k} if draft else None
    return LLM(str(target), speculative_config=spec, **defaults)


@pytest.fixture(scope="module")
def reference(folders: dict[str, Path]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in make_llm(folders["target"], None).generate(PROMPTS, GREEDY)]


def draft_pool_is_empty(llm: LLM) -> bool:
    pool = llm.engine.core.proposer.pool
    return pool.num_free_blocks == pool.caches[0].shape[1] - 1


def test_target_as_its_own_draft_accepts_every_draft(folders: dict[str, Path], reference: list[list[int]]) -> None:
    llm = make_llm(folders["target"], folders["target"])
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
    stats = llm.engine.get_stats()
    assert stats.spec_decode_num_drafts > 0
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0
    assert draft_pool_is_empty(llm)  # finished requests gave their draft blocks back


def test_stop_strings_n_and_max_tokens_inside_accepted_runs(folders: dict[str, Path],
                                                             reference: list[list[int]]) -> None:
    plain, spec = make_llm(folders["target"], None), make_llm(folders["target"], folders["target"])
    stop = plain.tokenizer.decode(reference[1][9:11])  # ends the second prompt's text inside a run of drafts
    cases = [SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, n=2),
             SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, stop=[stop])]
    for params in cases:
        want = [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in plain.generate(PROMPTS[:3], params)]
        got = [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in spec.generate(PROMPTS[:3], params)]
        assert got == want
    assert want[1][0][2] == "stop"  # the stop string did end the second prompt's sample
    assert spec.engine.get_stats().spec_decode_num_accepted_tokens > 0


def test_a_different_draft_gives_mixed_acceptance_and_the_same_tokens(
        folders: dict[str, Path], reference: list[list[int]]) -> None:
    llm = make_llm(folders["target"], folders["near"])
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:4], GREEDY)] == reference[:4]
    stats = llm.engine.get_stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    # Sampled rows verify too (their distribution: test_sampled_rows_keep_the_target_distribution).
    before = stats.spec_decode_num_drafts
    sampled = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, ignore_eos=True)
    outputs = llm.generate(PROMPTS[:4], sampled)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outputs)
    assert llm.engine.get_stats().spec_decode_num_drafts > before


def test_sampled_rows_keep_the_target_distribution(folders: dict[str, Path]) -> None:
    """(t1, t2) of top-k = 4 sampling: t2 comes from a verify step (one draft, or its rejection),
    and the pairs follow the target's exact joint distribution (chi-square, p = 0.001, fixed seed)."""
    from transformers import AutoModelForCausalLM

    prompt, samples, top_k = [5, 17, 42, 99], 800, 4
    hf = AutoModelForCausalLM.from_pretrained(folders["target"], dtype=torch.float32).eval()
    expected = expected_pairs(hf, prompt, top_k, samples)
    llm = make_llm(folders["target"], folders["near"], k=2)
    params = SamplingParams(temperature=1.0, top_k=top_k, max_tokens=3, ignore_eos=True)
    outputs = llm.generate([list(prompt) for _ in range(samples)], params)
    stats = llm.engine.get_stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert_pairs_follow(outputs, expected, samples)


def test_preemption_and_aborts_mid_speculation(folders: dict[str, Path], reference: list[list[int]]) -> None:
    # 10 blocks of 16 tokens: the rows cannot all stay resident, so some are preempted mid-run.
    llm = make_llm(folders["target"], folders["near"], num_gpu_blocks_override=10, max_num_seqs=8,
                   max_model_len=128)
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
            engine.abort_request("aborted")  # the step just verified drafts; the draft model holds its KV
    assert "aborted" not in outputs
    assert [outputs[f"kept-{i}"] for i in range(len(PROMPTS))] == reference
    assert engine.get_stats().num_preemptions > 0
    assert draft_pool_is_empty(llm)


@pytest.mark.parametrize("draft, message", [
    ("other", "must share the target's tokenizer"),
    ("/nonexistent/draft", "model path does not exist"),
])
def test_a_bad_draft_model_is_refused(folders: dict[str, Path], draft: str, message: str) -> None:
    path = folders.get(draft, Path(draft))
    with pytest.raises(ValueError, match=message):
        make_llm(folders["target"], path)


def test_the_draft_pool_rolls_back_by_prefix_and_evicts_idle_states() -> None:
    import numpy as np

    from tidal_engine.spec_decode.draft_kv import DraftKVPool

    pool = DraftKVPool(num_layers=1, num_blocks=5, block_size=4, num_kv_heads=1, head_dim=2,
                       dtype=torch.float32, device=torch.device("cpu"))
    state = pool.state("a")
    state.tokens = [1, 2, 3, 7, 8]  # 7 and 8 were drafts; the target emitted 4 after 3
    assert state.rollback_to(np.array([1, 2, 3, 4, 5])) == 3 and state.tokens == [1, 2, 3]
    assert state.rollback_to(np.array([1, 2, 3])) == 2  # the last token is always fed again
    assert pool.reserve("a", 9, keep={"a"}) and len(state.blocks) == 3 and pool.num_free_blocks == 1
    pool.state("b")
    assert not pool.reserve("b", 8, keep={"a", "b"})  # "a" is in the batch: not evicted
    assert pool.reserve("b", 8, keep={"b"}) and pool.num_free_blocks == 2  # "a" was idle: evicted
    pool.release("b")
    assert pool.num_free_blocks == 4


def test_the_draft_model_resolves_through_the_engines_cache_dir(folders: dict[str, Path], tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A GGUF draft keeps its index and tokenizer in the engine's start-up cache (--cache-dir),
    like the target."""
    from tidal_engine.spec_decode import draft_model_proposer

    resolved: list[tuple[str, object]] = []
    real_resolve = draft_model_proposer.resolve_model

    def recording_resolve(model: str, cache_dir: object = None) -> object:
        resolved.append((model, cache_dir))
        return real_resolve(model, cache_dir)

    monkeypatch.setattr(draft_model_proposer, "resolve_model", recording_resolve)
    llm = make_llm(folders["target"], folders["near"], cache_dir=str(tmp_path))
    assert resolved == [(str(folders["near"]), str(tmp_path))]
    assert llm.engine.core.config.cache_dir == str(tmp_path)
