"""Model resolution and loading: config dialects, HF folders, GGUF (SmolLM2), dtypes, errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tidal_engine.models.config import ArchConfig
from tidal_engine.models.loader import (
    GGUFSource,
    HFFolderSource,
    gguf_to_hf_name,
    load_model,
    read_safetensors,
    read_safetensors_parallel,
    resolve_dtype,
    resolve_model,
    unpermute_rotary_rows,
)
from smollm2_reference import GGUF_NAME, hf_reference, smollm2_dir
from tiny_models import hf_logits, make_tiny_model, run_chunks

CPU = torch.device("cpu")

# ---------------------------------------------------------------- ArchConfig

_BASE: dict[str, Any] = dict(
    model_type="llama",
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    eos_token_id=[7, 8],
    bos_token_id=1,
)
_LLAMA3 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=1024)


def test_config_dialects_agree() -> None:
    """transformers 4 (torch_dtype, rope_theta, rope_scaling) and 5 (dtype, rope_parameters)."""
    v4 = {**_BASE, "torch_dtype": "bfloat16", "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **_LLAMA3}}
    v5 = {**_BASE, "dtype": "bfloat16", "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **_LLAMA3}}
    old = {**v4, "rope_scaling": {"type": "llama3", **_LLAMA3}}  # pre-4.45 spelling
    configs = [ArchConfig.from_hf_config(c) for c in (v4, v5, old)]
    assert configs[0] == configs[1] == configs[2]
    cfg = configs[0]
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling == {"rope_type": "llama3", **_LLAMA3}
    assert cfg.torch_dtype == torch.bfloat16
    assert cfg.head_dim == 16 and cfg.eos_token_ids == [7, 8]


def test_config_defaults_and_families() -> None:
    plain = ArchConfig.from_hf_config({**_BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    assert plain.rope_scaling is None and plain.rope_theta == 1e6 and plain.torch_dtype is None
    qwen2 = ArchConfig.from_hf_config({**_BASE, "model_type": "qwen2"})
    assert qwen2.attention_bias and not qwen2.o_proj_bias and not qwen2.qk_norm
    qwen3 = ArchConfig.from_hf_config({**_BASE, "model_type": "qwen3", "head_dim": 32})
    assert qwen3.qk_norm and qwen3.head_dim == 32 and not qwen3.attention_bias


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"model_type": "mistral", "architectures": ["MistralForCausalLM"]}, "unsupported model architecture"),
        ({"model_type": None}, "unsupported model architecture"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_config_rejects_unsupported(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ArchConfig.from_hf_config({**_BASE, **overrides})


# ---------------------------------------------------------------- HF folders


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny_llama")
    make_tiny_model("llama", folder)
    return folder


def _copy(folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folder, tmp_path / "model"))


def test_sharded_folder_loads_with_parity(tmp_path: Path) -> None:
    hf_model = make_tiny_model("qwen2_tied", tmp_path)
    hf_model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    source = resolve_model(str(tmp_path / "sharded"))
    assert isinstance(source, HFFolderSource) and len(source.weight_files) > 1
    ours = load_model(source, torch.float32, CPU)
    ids = list(range(3, 30))
    assert (run_chunks(ours, ids, 5, block_size=4) - hf_logits(hf_model, ids)).abs().max().item() <= 1e-4


def test_parallel_reads_give_every_tensor_of_every_shard(tmp_path: Path) -> None:
    hf_model = make_tiny_model("qwen2_tied", tmp_path)
    hf_model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    files = resolve_model(str(tmp_path / "sharded")).weight_files
    serial = dict(read_safetensors(files))
    parallel = dict(read_safetensors_parallel(files, CPU, workers=3, window=4))
    assert serial.keys() == parallel.keys()
    assert all(torch.equal(serial[k], parallel[k]) and serial[k].dtype == parallel[k].dtype for k in serial)


def test_nonexistent_path() -> None:
    with pytest.raises(ValueError, match="does not exist: /nonexistent/model"):
        resolve_model("/nonexistent/model")


def test_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=f"{tmp_path} has no config.json"):
        resolve_model(str(tmp_path))


def test_folder_without_weights(tiny_folder: Path, tmp_path: Path) -> None:
    folder = _copy(tiny_folder, tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        resolve_model(str(folder))


def test_truncated_safetensors(tiny_folder: Path, tmp_path: Path) -> None:
    folder = _copy(tiny_folder, tmp_path)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    with pytest.raises(ValueError, match=f"truncated safetensors file {weights}"):
        resolve_model(str(folder))


def test_corrupt_safetensors_header(tiny_folder: Path, tmp_path: Path) -> None:
    folder = _copy(tiny_folder, tmp_path)
    weights = folder / "model.safetensors"
    weights.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    with pytest.raises(ValueError, match=f"corrupt safetensors file {weights}"):
        resolve_model(str(folder))


def test_unsupported_architecture_folder(tiny_folder: Path, tmp_path: Path) -> None:
    folder = _copy(tiny_folder, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "gpt2"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported model architecture: model_type='gpt2'"):
        resolve_model(str(folder))


def test_missing_and_misshaped_tensors(tiny_folder: Path) -> None:
    source = resolve_model(str(tiny_folder))
    weights = dict(source.load_weights())
    model = load_model(source, torch.float32, CPU)

    missing = {k: v for k, v in weights.items() if k != "model.layers.1.self_attn.k_proj.weight"}
    with pytest.raises(ValueError, match="missing 1 tensor.*model.layers.1.self_attn.k_proj.weight"):
        model.load_weights(missing.items())

    misshaped = {**weights, "model.layers.0.mlp.up_proj.weight": torch.zeros(3, 64)}
    with pytest.raises(ValueError, match="model.layers.0.mlp.up_proj.weight.*shape mismatch"):
        model.load_weights(misshaped.items())

    extra = {**weights, "model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}
    with pytest.raises(ValueError, match="unexpected tensor.*q_proj.bias"):
        model.load_weights(extra.items())


def test_tied_checkpoint_may_carry_lm_head(tmp_path: Path) -> None:
    """Some tied checkpoints still save lm_head.weight; it is skipped, the embedding is the head."""
    make_tiny_model("qwen2_tied", tmp_path)
    source = resolve_model(str(tmp_path))
    weights = dict(source.load_weights())
    model = load_model(source, torch.float32, CPU)
    model.load_weights([*weights.items(), ("lm_head.weight", torch.zeros_like(weights["model.embed_tokens.weight"]))])
    assert model.lm_head.weight is model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, weights["model.embed_tokens.weight"])


# ---------------------------------------------------------------- dtypes


@pytest.mark.parametrize(
    "config_dtype, requested, device, expected",
    [
        (torch.bfloat16, "auto", "cpu", torch.float32),
        ("bfloat16", "auto", "cuda", torch.bfloat16),
        (torch.float32, "auto", "cuda", torch.float32),
        (None, "half", "cpu", torch.float16),
        (None, "fp16", "cuda", torch.float16),
        (None, "bf16", "cpu", torch.bfloat16),
        (torch.float16, "float", "cuda", torch.float32),
        (None, "fp32", "cpu", torch.float32),
        (None, "bfloat16", "cpu", torch.bfloat16),
    ],
)
def test_resolve_dtype(config_dtype: Any, requested: str, device: str, expected: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_dtype(config_dtype, requested, torch.device(device)) == expected


def test_resolve_dtype_rejects_unknown() -> None:
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype(None, "int8", CPU)


# ---------------------------------------------------------------- GGUF


def test_gguf_names() -> None:
    assert gguf_to_hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_to_hf_name("output.weight") == "lm_head.weight"
    assert gguf_to_hf_name("blk.12.ffn_gate.weight") == "model.layers.12.mlp.gate_proj.weight"
    assert gguf_to_hf_name("blk.0.attn_k.bias") == "model.layers.0.self_attn.k_proj.bias"
    assert gguf_to_hf_name("blk.0.attn_q_norm.weight") == "model.layers.0.self_attn.q_norm.weight"
    with pytest.raises(ValueError, match="no known HF counterpart"):
        gguf_to_hf_name("blk.0.ffn_gate_exps.weight")


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    num_heads, head_dim = 3, 8
    weight = torch.randn(num_heads * head_dim, 5)
    # llama.cpp's converter: each head's [two halves] rows → interleaved pairs.
    permuted = weight.reshape(num_heads, 2, head_dim // 2, 5).transpose(1, 2).reshape(weight.shape)
    assert torch.equal(unpermute_rotary_rows(permuted, num_heads), weight)


def test_corrupt_gguf(tmp_path: Path) -> None:
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"definitely not a GGUF file" * 50)
    with pytest.raises(ValueError, match=f"corrupt or truncated GGUF file {path}"):
        resolve_model(str(path))


def test_unrecognised_file(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match="unrecognised model file"):
        resolve_model(str(path))


@pytest.fixture(scope="module")
def smollm2() -> GGUFSource:
    source = resolve_model("smollm2-135m")
    assert isinstance(source, GGUFSource)
    return source


@pytest.mark.slow
def test_truncated_gguf(smollm2: GGUFSource, tmp_path: Path) -> None:
    path = tmp_path / "truncated.gguf"
    with smollm2.path.open("rb") as handle:
        path.write_bytes(handle.read(4_000_000))  # metadata intact, tensor data cut off
    with pytest.raises(ValueError, match=f"GGUF file {path}"):
        resolve_model(str(path))


@pytest.mark.slow
def test_smollm2_config(smollm2: GGUFSource) -> None:
    cfg = smollm2.arch_config
    assert smollm2.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert (cfg.architecture, cfg.hidden_size, cfg.num_hidden_layers) == ("llama", 576, 30)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert (cfg.vocab_size, cfg.rope_theta, cfg.tie_word_embeddings) == (49152, 100000.0, True)
    assert (cfg.bos_token_id, cfg.eos_token_id) == (1, 2)


@pytest.mark.slow
def test_smollm2_tokenizer_has_chat_template(smollm2: GGUFSource) -> None:
    tokenizer = smollm2.load_tokenizer()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"


@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2: GGUFSource) -> None:
    """Weights bit-identical to transformers' own GGUF load; logits within 1e-4."""
    hf_model, _ = hf_reference()  # transformers' own load of the same file
    assert smollm2.path.samefile(Path(smollm2_dir()) / GGUF_NAME)
    reference = hf_model.state_dict()
    ours = dict(smollm2.load_weights())
    assert set(ours) == set(reference) - {"lm_head.weight"}  # tied
    different = [name for name, tensor in ours.items() if not torch.equal(tensor, reference[name])]
    assert not different, f"weights differ from transformers: {different[:5]}"

    model = load_model(smollm2, torch.float32, CPU)
    ids = list(range(100, 124))
    logits = run_chunks(model, ids, [16, 5, 1, 1, 1], block_size=16)
    assert (logits - hf_logits(hf_model, ids)).abs().max().item() <= 1e-4


def test_dummy_load_format_reads_nothing_and_gives_finite_logits(tmp_path: Path) -> None:
    from tidal_engine.models.loader import load_model as load

    make_tiny_model("qwen3", tmp_path)
    source = resolve_model(str(tmp_path))
    source.load_weight_slices = lambda: pytest.fail("dummy weights must not read the checkpoint")  # type: ignore[method-assign]
    model = load(source, torch.float32, CPU, load_format="dummy")
    assert torch.equal(model.norm.weight, torch.ones_like(model.norm.weight))
    logits = run_chunks(model, [1, 2, 3, 4, 5], [5], 4)
    assert torch.isfinite(logits).all() and logits.std() > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_staged_uploads_give_the_bytes_of_the_host_arrays_gpu() -> None:
    import numpy as np

    from tidal_engine.models.staged_upload import StagedUploader

    uploader = StagedUploader(torch.device("cuda"), lanes=1, chunk_bytes=1 << 16)
    try:
        rng = np.random.default_rng(0)
        for size in (1, (1 << 16) - 1, 1 << 16, 5 * (1 << 16) + 7):  # within, at and across chunk edges
            data = rng.integers(0, 256, size, dtype=np.uint8)
            assert torch.equal(uploader.upload(data).cpu(), torch.from_numpy(data))
    finally:
        uploader.close()
