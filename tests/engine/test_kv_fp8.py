"""The fp8 KV cache (``--kv-cache-dtype fp8``) on the torch reference path: the rounding, the
logits against an fp32 cache, the greedy tokens, the block budget, checkpoint scales, and the
engine features that touch the cache (prefix caching, chunking, preemption, sleep).

Tolerances come from e4m3's 3 mantissa bits: a stored value is within 2**-4 of its input,
relatively (half an ulp), or 2**-10 absolutely below the normal range. Over the tiny model
that gives logits within ~0.05 (mean) of the fp32 cache's, logits whose spread is ~1.2. Such
a model's greedy choice is often a near-tie (top-2 margins of a few hundredths), and fp8 may
then flip it; the test asserts that every flip is such a near-tie, not that none happens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tidal_engine import LLM, SamplingParams
from tidal_engine.config import EngineConfig
from tidal_engine.layers.kv_cache_dtype import FP8_KV_DTYPE, from_cache, kv_scale_kind, to_cache
from tidal_engine.models.llama import LlamaForCausalLM
from tidal_engine.models.loader import load_model, resolve_model

from tiny_models import SeqStep, forward_batch, make_tiny_model, scattered_block_table
from tiny_tokenizer import EOS_ID, SAMPLE_PROMPTS, save_byte_tokenizer

BLOCK = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-qwen3-kvfp8")
    make_tiny_model("qwen3", folder, eos_token_id=EOS_ID, bos_token_id=None, max_position_embeddings=256)
    save_byte_tokenizer(folder, vocab_size=1000)
    return folder


def make_llm(folder: Path, **options: object) -> LLM:
    defaults: dict[str, object] = dict(dtype="float32", device="cpu", max_model_len=128, num_gpu_blocks_override=64)
    defaults.update(options)
    return LLM(str(folder), **defaults)


def token_ids(llm: LLM, prompts: list[str], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def teacher_forced_logits(model: LlamaForCausalLM, tokens: list[int], cache_dtype: torch.dtype, prefill: int) -> torch.Tensor:
    """Logits of every position after the first ``prefill - 1``: one prefill chunk, then one
    decode step per token, each reading the earlier tokens back from the paged cache."""
    cfg = model.config
    table = scattered_block_table(-(-len(tokens) // BLOCK))
    shape = (2, max(table) + 2, BLOCK, cfg.num_key_value_heads, cfg.head_dim)
    caches = [torch.zeros(shape, dtype=cache_dtype) for _ in range(cfg.num_hidden_layers)]
    outs = [forward_batch(model, caches, [SeqStep(tokens[:prefill], 0, table)], BLOCK)[0][-1:]]
    for pos in range(prefill, len(tokens)):
        outs.append(forward_batch(model, caches, [SeqStep(tokens[pos : pos + 1], pos, table)], BLOCK)[0])
    return torch.cat(outs)


def prefill_logits(model: LlamaForCausalLM, tokens: list[int], cache_dtype: torch.dtype) -> torch.Tensor:
    """Logits of every position from one prefill; the keys and values are read back from the
    paged cache (the reference backend stores, then attends over the cache)."""
    cfg = model.config
    table = scattered_block_table(-(-len(tokens) // BLOCK))
    shape = (2, max(table) + 2, BLOCK, cfg.num_key_value_heads, cfg.head_dim)
    caches = [torch.zeros(shape, dtype=cache_dtype) for _ in range(cfg.num_hidden_layers)]
    return forward_batch(model, caches, [SeqStep(tokens, 0, table)], BLOCK)[0]


def test_rounding_is_within_half_an_e4m3_ulp() -> None:
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 3
    for scale in (1.0, 0.05, 7.0):
        back = from_cache(to_cache(x, scale, FP8_KV_DTYPE), scale)
        assert torch.all((back - x).abs() <= 2**-4 * x.abs() + 2**-10 * scale)
    assert from_cache(to_cache(torch.tensor([1e6, -1e6]), 1.0, FP8_KV_DTYPE), 1.0).tolist() == [448.0, -448.0]
    assert torch.equal(to_cache(x, 0.5, torch.float32), x)  # other caches: only the cast, no scale


def test_logits_near_fp32_cache_and_flips_only_near_ties(tiny_dir: Path) -> None:
    model = load_model(resolve_model(str(tiny_dir)), torch.float32, torch.device("cpu"))
    tokens = torch.randint(0, 1000, (48,), generator=torch.Generator().manual_seed(1)).tolist()
    exact = teacher_forced_logits(model, tokens, torch.float32, prefill=16)
    fp8 = teacher_forced_logits(model, tokens, FP8_KV_DTYPE, prefill=16)
    diff = (fp8 - exact).abs()
    assert diff.mean() < 0.1 and diff.max() < 0.75, (diff.mean(), diff.max())  # measured 0.05 / 0.4
    top2 = exact.topk(2, dim=-1).values
    margin = top2[:, 0] - top2[:, 1]
    flipped = fp8.argmax(-1) != exact.argmax(-1)
    assert flipped.float().mean() <= 0.15  # measured 1 in 13
    # A flip needs the fp8 error to close the gap: the reference's top two were within 2x it.
    assert torch.all(margin[flipped] <= 2 * diff.max(dim=-1).values[flipped])


def test_fp8_greedy_is_stable_across_engine_paths(tiny_dir: Path) -> None:
    # The same fp8 values whichever way the cache is filled and reused: prefix hits, chunks of
    # 7 tokens, preemption and recompute all give the tokens of a roomy, unchunked run.
    prompts = SAMPLE_PROMPTS[:4] * 2
    reference = token_ids(make_llm(tiny_dir, kv_cache_dtype="fp8", max_num_batched_tokens=4096), prompts)
    assert token_ids(make_llm(tiny_dir, kv_cache_dtype="fp8", enable_prefix_caching=False), prompts) == reference
    chunked = make_llm(tiny_dir, kv_cache_dtype="fp8", max_num_batched_tokens=7, max_num_seqs=4)
    assert token_ids(chunked, prompts) == reference
    tight = make_llm(tiny_dir, kv_cache_dtype="fp8", num_gpu_blocks_override=8)
    assert token_ids(tight, prompts) == reference
    assert tight.engine.get_stats().num_preemptions > 0
    long_prompt = [" ".join(SAMPLE_PROMPTS)[:80]]  # several blocks, so the second run hits the prefix cache
    cached = make_llm(tiny_dir, kv_cache_dtype="fp8")
    first = token_ids(cached, long_prompt)
    again = cached.generate(long_prompt, GREEDY)[0]
    assert again.num_cached_tokens >= BLOCK and again.outputs[0].token_ids == first[0]


def test_fp8_cache_survives_sleep(tiny_dir: Path) -> None:
    llm = make_llm(tiny_dir, kv_cache_dtype="fp8", enable_sleep_mode=True)
    before = token_ids(llm, SAMPLE_PROMPTS[:2])
    for level in (1, 2):
        llm.engine.sleep(level)
        llm.engine.wake_up()
        assert all(c.dtype == FP8_KV_DTYPE for c in llm.engine.runner.kv_caches)
        assert token_ids(llm, SAMPLE_PROMPTS[:2]) == before


def test_fp8_blocks_round_trip_through_the_host_offload_pool(tiny_dir: Path) -> None:
    # The offload connector copies blocks as bytes: an fp8 block is a quarter of an fp32 one,
    # and a prefix evicted from the device comes back from host memory unchanged.
    block_bytes = 2 * 2 * BLOCK * 2 * 32  # K and V x layers x block x KV heads x head_dim, 1 byte each
    prompts = [[50 + (7 * i * seed) % 900 for i in range(100)] for seed in (1, 2, 3, 4)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    roomy = make_llm(tiny_dir, kv_cache_dtype="fp8")
    reference = [o.outputs[0].token_ids for o in roomy.generate(prompts, params)]
    llm = make_llm(tiny_dir, kv_cache_dtype="fp8", num_gpu_blocks_override=10,
                   kv_offloading_size=64 * block_bytes / 2**30)
    for p, want in zip(prompts, reference):  # each evicts the one before from the 10 device blocks
        assert llm.generate([p], params)[0].outputs[0].token_ids == want
    before = llm.engine.get_stats()
    assert llm.generate([prompts[0]], params)[0].outputs[0].token_ids == reference[0]
    after = llm.engine.get_stats()
    assert after.kv_offload_bytes_loaded - before.kv_offload_bytes_loaded == 6 * block_bytes


@pytest.mark.parametrize(("model_dtype", "ratio"), [("bfloat16", 2), ("float32", 4)])
def test_the_byte_budget_holds_more_fp8_blocks(tiny_dir: Path, model_dtype: str, ratio: int) -> None:
    budget = 1 << 20
    runners = {kv: make_llm(tiny_dir, dtype=model_dtype, kv_cache_dtype=kv, num_gpu_blocks_override=None,
                            kv_cache_memory_bytes=budget).engine.runner for kv in ("auto", "fp8_e4m3")}
    auto, fp8 = runners["auto"], runners["fp8_e4m3"]
    assert fp8.num_blocks == ratio * auto.num_blocks
    assert fp8.kv_spec.bytes_per_block * ratio == auto.kv_spec.bytes_per_block
    assert fp8.memory_usage()["kv_cache_bytes"] == auto.memory_usage()["kv_cache_bytes"] <= budget
    assert fp8.kv_caches[0].dtype == FP8_KV_DTYPE


def test_kv_cache_dtype_is_validated() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype must be auto, fp8 or fp8_e4m3, got 'fp8_e5m2'"):
        EngineConfig(model="m", kv_cache_dtype="fp8_e5m2")


# ---------------------------------------------------------------------------------------
# Scales from the checkpoint


def add_tensors(folder: Path, extra: dict[str, torch.Tensor]) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    tensors.update(extra)
    save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.fixture()
def scaled_dir(tmp_path: Path) -> Path:
    make_tiny_model("qwen3", tmp_path, eos_token_id=EOS_ID, bos_token_id=None, max_position_embeddings=256)
    save_byte_tokenizer(tmp_path, vocab_size=1000)
    add_tensors(tmp_path, {
        "model.layers.0.self_attn.k_scale": torch.tensor(0.05),  # llm-compressor / compressed-tensors
        "model.layers.0.self_attn.v_scale": torch.tensor([0.02]),
        "model.layers.1.self_attn.kv_scale": torch.tensor(0.125, dtype=torch.bfloat16),  # the old single scale
        "model.layers.1.self_attn.q_scale": torch.tensor(3.0),  # FP8 attention math: ignored
    })
    return tmp_path


def test_scales_come_from_the_checkpoint_and_round_trip(scaled_dir: Path, tiny_dir: Path) -> None:
    model = load_model(resolve_model(str(scaled_dir)), torch.float32, torch.device("cpu"))
    attns = [layer.self_attn.attn for layer in model.layers]
    assert (attns[0].k_scale, attns[0].v_scale) == pytest.approx((0.05, 0.02))
    assert (attns[1].k_scale, attns[1].v_scale) == (0.125, 0.125)
    plain = load_model(resolve_model(str(tiny_dir)), torch.float32, torch.device("cpu"))
    assert all((layer.self_attn.attn.k_scale, layer.self_attn.attn.v_scale) == (1.0, 1.0) for layer in plain.layers)
    # Scales this small put the stored values 10-50x up (and clamp some at 448): dividing on
    # write without multiplying on read, or the reverse, would wreck the logits.
    tokens = torch.randint(0, 1000, (24,), generator=torch.Generator().manual_seed(2)).tolist()
    exact = teacher_forced_logits(model, tokens, torch.float32, prefill=12)
    fp8 = teacher_forced_logits(model, tokens, FP8_KV_DTYPE, prefill=12)
    assert (fp8 - exact).abs().mean() < 0.15
    # An "auto" cache ignores the scales: the same logits as the unscaled checkpoint.
    assert torch.equal(exact, teacher_forced_logits(plain, tokens, torch.float32, prefill=12))


@pytest.mark.parametrize(("extra", "message"), [
    ({"model.layers.0.self_attn.k_scale": torch.tensor(0.0)}, "must be a positive finite number"),
    ({"model.layers.0.self_attn.v_scale": torch.tensor([1.0, 2.0])}, "one element"),
    ({"model.layers.7.self_attn.k_scale": torch.tensor(1.0)}, "unexpected tensor in checkpoint: model.layers.7"),
])
def test_bad_scales_are_refused(tmp_path: Path, extra: dict[str, torch.Tensor], message: str) -> None:
    make_tiny_model("qwen3", tmp_path, max_position_embeddings=256)
    add_tensors(tmp_path, extra)
    with pytest.raises(ValueError, match=message):
        load_model(resolve_model(str(tmp_path)), torch.float32, torch.device("cpu"))


@pytest.mark.parametrize(("suffix", "kind"), [
    ("self_attn.k_scale", "k"), ("self_attn.v_scale", "v"), ("self_attn.kv_scale", "kv"),
    ("self_attn.attn.k_scale", "k"), ("self_attn.k_proj.k_scale", "k"), ("self_attn.v_proj.v_scale", "v"),
    ("self_attn.k_proj.output_scale", "k"), ("self_attn.v_proj.output_scale", "v"), ("self_attn.q_scale", "ignore"),
    ("self_attn.k_proj.weight", None), ("self_attn.k_proj.weight_scale", None),
])
def test_checkpoint_scale_names(suffix: str, kind: str | None) -> None:
    assert kv_scale_kind(suffix) == kind


@pytest.mark.slow
def test_tensor_parallel_ranks_keep_their_heads_in_fp8(tmp_path: Path) -> None:
    # TP=2 over SmolLM2's uneven head layout (3 KV heads: 2 + 1 per rank): each rank's fp8
    # cache holds its own KV heads and sizes its blocks by them; tokens and logprobs as TP=1.
    from test_tensor_parallel import SMOLLM2_HEADS, _assert_same

    make_tiny_model("llama", tmp_path, eos_token_id=EOS_ID, bos_token_id=None, **SMOLLM2_HEADS)
    save_byte_tokenizer(tmp_path, vocab_size=320)
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=4, ignore_eos=True)
    options: dict[str, object] = dict(kv_cache_dtype="fp8", block_size=4, max_num_seqs=4)
    reference = make_llm(tmp_path, **options).generate(SAMPLE_PROMPTS[:4], params)
    tp2 = make_llm(tmp_path, tensor_parallel_size=2, **options)
    try:
        _assert_same(reference, tp2.generate(SAMPLE_PROMPTS[:4], params))
    finally:
        tp2.engine.shutdown()


def test_the_command_line_flag_reaches_the_cache(tiny_dir: Path, capsys: pytest.CaptureFixture[str],
                                                 caplog: pytest.LogCaptureFixture) -> None:
    # What the operator's quantization.kvCache: fp8 becomes: --kv-cache-dtype fp8 on the engine.
    from test_cli import run_main

    caplog.set_level("INFO", logger="tidal_engine.engine.core")
    code = run_main(["generate", "--model", str(tiny_dir), "--prompt", "hello", "--max-tokens", "4", "--device", "cpu",
                     "--kv-cache-memory-bytes", "1M", "--kv-cache-dtype", "fp8"])
    assert code == 0 and capsys.readouterr().out.strip()
    # 10**6 bytes over 4 KiB fp8 blocks (2 layers x K and V x 16 slots x 2 heads x 32): 244 (fp32: 61).
    assert "kv_cache_dtype=fp8" in caplog.text and "kv_blocks=244" in caplog.text
