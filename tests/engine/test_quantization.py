"""Weight quantization (tidal_engine/quantization): checkpoints written by Tidal's quantizer in
each on-disk format load into logits that match the dequantized reference model.

Tolerances: INT4 is weight-only, so the quantized model and the float32 model of its
dequantized weights compute the same sums (1e-4). FP8 also quantizes every linear's input per
token; the reference applies the same fake quantization to the inputs of the dequantized
model's linears (1e-2 on logits of magnitude ~10: an activation that sits on an FP8 rounding
boundary may round the other way when the sums run in another order).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tidal_engine.layers.linear import LinearBase
from tidal_engine.models.loader import load_model, resolve_model
from tidal_engine.quantization import resolve_quantization
from tidal_engine.quantization.fp8 import quantize_tokens
from tidal_engine.quantization.int4 import AWQ_ORDER, unpack_words
from tidal_engine.quantization.quantizer import write_quantized_checkpoint

from tiny_models import SeqStep, allocate_kv_caches, forward_batch, make_tiny_model

# Hidden 128 and intermediate 256: every linear splits into groups of 128 inputs.
SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
CASES = [
    ("fp8", dict()),
    ("fp8", dict(per_channel=True)),
    ("compressed-tensors", dict()),
    ("compressed-tensors", dict(per_channel=True)),
    ("awq", dict(group_size=128)),
    ("awq", dict(group_size=64, symmetric=True)),
    ("gptq", dict(group_size=128, symmetric=True)),
    ("gptq", dict(group_size=64, symmetric=False)),
]


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("plain")
    make_tiny_model("qwen3", folder, **SHAPE)
    return folder


def fake_quantize_inputs(model: torch.nn.Module) -> None:
    """The W8A8 reference: each decoder linear sees its input quantized per token."""
    def hook(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        x = args[0]
        q, scale = quantize_tokens(x.reshape(-1, x.shape[-1]))
        return ((q.float() * scale).reshape(x.shape).to(x.dtype),)

    for name, module in model.named_modules():
        if isinstance(module, LinearBase) and name != "lm_head":
            module.register_forward_pre_hook(hook)


def logits_of(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    caches = allocate_kv_caches(model, num_blocks=8, block_size=16)
    return forward_batch(model, caches, [SeqStep(tokens, 0, list(range(len(tokens) // 16 + 1)))], 16)[0]


def greedy(model: torch.nn.Module, prompt: list[int], steps: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(steps):
        tokens.append(int(logits_of(model, tokens)[-1].argmax()))
    return tokens[len(prompt):]


@pytest.mark.parametrize("method, options", CASES, ids=[f"{m}-{'-'.join(f'{k}={v}' for k, v in o.items())}"
                                                          for m, o in CASES])
def test_quantized_checkpoint_matches_dequantized_reference(
    plain_dir: Path, tmp_path: Path, method: str, options: dict
) -> None:
    write_quantized_checkpoint(plain_dir, tmp_path / "q", method, reference=tmp_path / "ref", **options)
    model = load_model(resolve_model(str(tmp_path / "q")), torch.float32, "cpu")
    reference = load_model(resolve_model(str(tmp_path / "ref")), torch.float32, "cpu")
    fp8 = method in ("fp8", "compressed-tensors")
    if fp8:
        fake_quantize_inputs(reference)
    # The decoder linears are quantized; the head and the embedding are not.
    assert model.layers[0].mlp.down_proj.method.__class__.__name__ != "UnquantizedLinearMethod"
    assert model.lm_head.weight.dtype == torch.float32
    prompt = [int(t) for t in torch.randint(0, 1000, (20,), generator=torch.Generator().manual_seed(1))]
    got, want = logits_of(model, prompt), logits_of(reference, prompt)
    assert torch.allclose(got, want, atol=1e-2 if fp8 else 1e-4, rtol=0), (got - want).abs().max()
    assert greedy(model, prompt, 32) == greedy(reference, prompt, 32)


def test_online_fp8_quantizes_a_plain_checkpoint(plain_dir: Path, tmp_path: Path) -> None:
    # Quantizing while loading gives exactly the per-channel FP8 checkpoint of the same weights.
    write_quantized_checkpoint(plain_dir, tmp_path / "q", "fp8", per_channel=True)
    online = load_model(resolve_model(str(plain_dir)), torch.float32, "cpu", quantization="fp8")
    offline = load_model(resolve_model(str(tmp_path / "q")), torch.float32, "cpu", quantization="fp8")
    qkv = online.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn and qkv.weight_scale.shape == (qkv.out_features,)
    prompt = list(range(3, 40))
    assert torch.equal(logits_of(online, prompt), logits_of(offline, prompt))


def test_awq_words_hold_outputs_in_awq_order() -> None:
    # Word 0x76543210 → nibble i is i; AWQ puts nibble i at output column AWQ_ORDER[i].
    word = torch.tensor([[0x76543210]], dtype=torch.int32)
    assert unpack_words(word).tolist() == [[0, 1, 2, 3, 4, 5, 6, 7]]
    unpacked = unpack_words(word, AWQ_ORDER).tolist()[0]
    assert [unpacked[AWQ_ORDER[i]] for i in range(8)] == list(range(8))


@pytest.mark.parametrize("checkpoint, requested, message", [
    ({"quant_method": "awq", "bits": 4, "group_size": 128}, "gptq", "--quantization gptq does not match"),
    (None, "awq", "needs a awq checkpoint"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True}, None, "desc_act=true"),
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, None, "8-bit weights are not supported"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, None, "block-wise"),
    ({"quant_method": "bitsandbytes"}, None, "quant_method 'bitsandbytes'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "channel"}}}}, None,
     "int4 strategy 'channel' is not supported"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 64}}}},
     None, "only 'pack-quantized'"),
])
def test_unsupported_or_mismatched_quantization_is_a_clear_error(checkpoint: dict | None, requested: str | None,
                                                                 message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        resolve_quantization(checkpoint, requested)


@pytest.mark.slow
def test_gptq_tensor_parallel_2_gives_the_single_rank_tokens(tmp_path: Path) -> None:
    # Two gloo ranks: packed qweight/qzeros, per-group scales and g_idx sharded by output rows
    # (q/k/v, gate/up) and by input groups (o_proj, down_proj); the engine answers the same.
    from tidal_engine import LLM, SamplingParams
    from tiny_tokenizer import EOS_ID, save_byte_tokenizer

    plain = tmp_path / "plain"
    make_tiny_model("qwen3", plain, eos_token_id=EOS_ID, bos_token_id=None, **SHAPE)
    save_byte_tokenizer(plain, vocab_size=1000)
    write_quantized_checkpoint(plain, tmp_path / "q", "gptq", group_size=32)
    options = dict(device="cpu", dtype="float32", max_model_len=64, block_size=4, num_gpu_blocks_override=32,
                   max_num_seqs=2)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [[5, 17, 99, 3, 25], [1, 2, 3]]
    single = [o.outputs[0].token_ids for o in LLM(str(tmp_path / "q"), **options).generate(prompts, params)]
    tp2 = LLM(str(tmp_path / "q"), tensor_parallel_size=2, quantization="gptq", **options)
    try:
        assert [o.outputs[0].token_ids for o in tp2.generate(prompts, params)] == single
    finally:
        tp2.engine.shutdown()


@pytest.mark.parametrize("method", ["fp8", "awq", "gptq"])
def test_dummy_load_format_fills_quantized_layers_through_the_quantizer(plain_dir: Path, tmp_path: Path,
                                                                        method: str) -> None:
    # Benchmarks of big shapes use --load-format dummy: random weights, quantized, nothing read.
    write_quantized_checkpoint(plain_dir, tmp_path / "q", method)
    model = load_model(resolve_model(str(tmp_path / "q")), torch.float32, "cpu", load_format="dummy")
    logits = logits_of(model, list(range(3, 20)))
    assert torch.isfinite(logits).all() and logits.std() > 0


@pytest.mark.parametrize("method, options", [("fp8", dict()), ("gptq", dict(group_size=64, symmetric=True))])
def test_sleep_level_2_reloads_and_reprocesses_quantized_weights(plain_dir: Path, tmp_path: Path, method: str,
                                                                 options: dict) -> None:
    # Level 2 drops the weights; the wake reads the checkpoint again into checkpoint-layout
    # copies and processes them again (online FP8 quantizes, INT4 repacks) into the same parameters.
    from tidal_engine import LLM, SamplingParams

    folder, quantization = plain_dir, "fp8"  # fp8: online, from the plain checkpoint
    if method != "fp8":
        folder, quantization = tmp_path / "q", None
        write_quantized_checkpoint(plain_dir, folder, method, **options)
    llm = LLM(str(folder), device="cpu", dtype="float32", max_model_len=64, num_gpu_blocks_override=32,
              enable_sleep_mode=True, quantization=quantization, skip_tokenizer_init=True)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 17, 99, 3, 25], [1, 2, 3]]
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    params_before = {n: p for n, p in llm.engine.runner.model.named_parameters()}
    llm.engine.sleep(2)
    assert not llm.engine.runner.weights_resident()
    llm.engine.wake_up()
    after_params = dict(llm.engine.runner.model.named_parameters())
    assert after_params.keys() == params_before.keys()
    assert all(after_params[n] is p for n, p in params_before.items())  # the same parameters, refilled
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == before
