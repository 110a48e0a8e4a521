"""A GGUF file's index (models/gguf_index.py): a source built from it has the same config and
bit-identical weights as one built by parsing, and constructs no GGUFReader; a damaged index
is rewritten, a changed file gets a new key, an unwritable cache still loads, and broken files
fail as before."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import quantize

from tidal_engine.models.gguf_index import GGUFIndex, gguf_index_file, gguf_index_key, read_gguf_index
from tidal_engine.models.loader import GGUFSource, resolve_model_path

SMOLLM2 = resolve_model_path("smollm2-135m")
Q = gguf.GGMLQuantizationType


def no_reader(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("GGUFReader was constructed")
    monkeypatch.setattr(gguf, "GGUFReader", refuse)


def write_tiny_llama(path: Path, endianess: gguf.GGUFEndian = gguf.GGUFEndian.LITTLE) -> None:
    """A one-layer llama GGUF file with plain and quantized tensors, in milliseconds."""
    rng = np.random.default_rng(0)
    hidden, vocab = 64, 8
    writer = gguf.GGUFWriter(str(path), "llama", endianess=endianess)
    for key, value in {"block_count": 1, "context_length": 128, "embedding_length": hidden,
                       "feed_forward_length": 96, "attention.head_count": 2, "attention.head_count_kv": 1}.items():
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_token_list([f"t{i}" for i in range(vocab)])  # no llama.vocab_size: the length counts
    writer.add_uint32("tokenizer.ggml.eos_token_id", 2)

    def weights(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)
    quantized = endianess == gguf.GGUFEndian.LITTLE  # gguf quantizes in the host's byte order only
    writer.add_tensor("token_embd.weight", quantize(weights(vocab, hidden), Q.Q8_0) if quantized
                      else weights(vocab, hidden), raw_dtype=Q.Q8_0 if quantized else None)
    writer.add_tensor("blk.0.attn_norm.weight", weights(hidden))
    writer.add_tensor("blk.0.attn_q.weight", weights(hidden, hidden).astype(np.float16))
    writer.add_tensor("blk.0.attn_k.weight", quantize(weights(32, hidden), Q.Q4_1) if quantized
                      else weights(32, hidden), raw_dtype=Q.Q4_1 if quantized else None)
    writer.add_tensor("output_norm.weight", weights(hidden))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path)
    return path


def assert_same_weights(got: GGUFSource, want: GGUFSource) -> None:
    got_weights, want_weights = list(got.load_weights()), list(want.load_weights())
    assert [name for name, _ in got_weights] == [name for name, _ in want_weights]
    for (name, a), (_, b) in zip(got_weights, want_weights, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), name


def assert_same_data(got: GGUFSource, want: GGUFSource) -> None:
    """The views handed to dequantize: same tensors, dtype (byte order included), shape, values."""
    for (info, a), (want_info, b) in zip(got._tensor_data(), want._tensor_data(), strict=True):
        assert info == want_info
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), info.name


@pytest.fixture(scope="module")
def smollm2_parsed(tmp_path_factory: pytest.TempPathFactory) -> tuple[GGUFSource, Path]:
    """SmolLM2 parsed once (seconds of CPU), its index written to a fresh cache."""
    cache = tmp_path_factory.mktemp("cache")
    source = GGUFSource(SMOLLM2, cache)
    assert source.reader is not None
    return source, cache


@pytest.mark.slow
def test_smollm2_from_its_index_matches_the_parse(smollm2_parsed: tuple[GGUFSource, Path],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    parsed, cache = smollm2_parsed
    assert gguf_index_file(SMOLLM2, cache).is_file()
    no_reader(monkeypatch)
    indexed = GGUFSource(SMOLLM2, cache)
    assert indexed.reader is None
    assert indexed.arch_config == parsed.arch_config
    assert indexed.arch_config.vocab_size == 49152
    assert indexed.index.array_lengths["tokenizer.ggml.merges"] == 48900  # lengths only, no strings
    # Every tensor's data as handed to dequantize (the code after it is shared; dequantizing
    # all of SmolLM2 twice costs seconds): the tiny files below compare dequantized weights.
    assert_same_data(indexed, parsed)
    name, embed = next(indexed.load_weights())
    assert name == "model.embed_tokens.weight" and torch.equal(embed, next(parsed.load_weights())[1])


def test_a_tiny_file_from_its_index_matches_the_parse(tiny: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    parsed = GGUFSource(tiny, tmp_path)
    assert parsed.arch_config.vocab_size == 8 and parsed.arch_config.eos_token_id == 2
    no_reader(monkeypatch)
    indexed = GGUFSource(tiny, tmp_path)
    assert indexed.reader is None and indexed.arch_config == parsed.arch_config
    assert_same_data(indexed, parsed)
    assert_same_weights(indexed, parsed)


def test_a_big_endian_file_keeps_its_byte_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "big.gguf"
    write_tiny_llama(path, gguf.GGUFEndian.BIG)
    parsed = GGUFSource(path, tmp_path)
    assert parsed.reader.byte_order == "S" and parsed.index.byte_order == "S"
    no_reader(monkeypatch)
    indexed = GGUFSource(path, tmp_path)
    assert indexed.arch_config == parsed.arch_config
    assert_same_data(indexed, parsed)


def damage_garbage(data: dict[str, Any]) -> str:
    return "{not json"


def damage_offset(data: dict[str, Any]) -> str:
    data["tensors"][-1][3] += 1 << 30  # past the end of the file
    return json.dumps(data)


def damage_byte_count(data: dict[str, Any]) -> str:
    data["tensors"][0][4] -= 1  # does not match the tensor's shape and type
    return json.dumps(data)


def damage_architecture(data: dict[str, Any]) -> str:
    data["fields"]["general.architecture"] = "gpt2"  # the config built from it fails
    return json.dumps(data)


def damage_missing_tensors(data: dict[str, Any]) -> str:
    del data["tensors"]
    return json.dumps(data)


@pytest.mark.parametrize("damage", [damage_garbage, damage_offset, damage_byte_count, damage_architecture,
                                    damage_missing_tensors])
def test_a_damaged_index_is_ignored_and_rewritten(tiny: Path, tmp_path: Path, damage: Any) -> None:
    want = GGUFSource(tiny, tmp_path)
    entry = gguf_index_file(tiny, tmp_path)
    intact = json.loads(entry.read_text())
    entry.write_text(damage(json.loads(entry.read_text())))
    again = GGUFSource(tiny, tmp_path)
    assert again.reader is not None  # parsed again
    assert again.arch_config == want.arch_config
    assert json.loads(entry.read_text()) == intact
    assert read_gguf_index(tiny, tmp_path) == want.index


def test_a_changed_file_gets_a_new_key(tiny: Path, tmp_path: Path) -> None:
    GGUFSource(tiny, tmp_path)
    key = gguf_index_key(tiny)
    assert key.startswith("tiny-") and gguf_index_key(tiny) == key
    stat = tiny.stat()
    os.utime(tiny, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert gguf_index_key(tiny) != key
    assert read_gguf_index(tiny, tmp_path) is None
    assert GGUFSource(tiny, tmp_path).reader is not None  # parsed, not read from the old index
    assert sorted(p.name for p in (tmp_path / "gguf").iterdir()) == sorted([f"{key}.json", f"{gguf_index_key(tiny)}.json"])


def test_an_unwritable_cache_still_loads(tiny: Path, tmp_path: Path) -> None:
    not_a_folder = tmp_path / "cache"
    not_a_folder.write_text("a file where the cache folder should be")
    first, second = GGUFSource(tiny, not_a_folder), GGUFSource(tiny, not_a_folder)
    assert first.reader is not None and second.reader is not None  # each parses: nothing was cached
    assert first.arch_config == second.arch_config
    assert_same_weights(second, first)


def test_broken_files_fail_as_before_and_leave_no_index(tiny: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"definitely not a GGUF file" * 50)
    with pytest.raises(ValueError, match=f"corrupt or truncated GGUF file {corrupt}"):
        GGUFSource(corrupt, cache)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(tiny.read_bytes()[:-64])
    with pytest.raises(ValueError, match=f"truncated GGUF file {truncated}"):
        GGUFSource(truncated, cache)
    assert not (cache / "gguf").exists()


def test_the_index_holds_no_array_contents(tiny: Path, tmp_path: Path) -> None:
    GGUFSource(tiny, tmp_path)
    index = read_gguf_index(tiny, tmp_path)
    assert isinstance(index, GGUFIndex)
    assert index.array_lengths == {"tokenizer.ggml.tokens": 8}
    assert "tokenizer.ggml.tokens" not in index.fields
    assert [t.name for t in index.tensors][:2] == ["token_embd.weight", "blk.0.attn_norm.weight"]
    assert index.tensors[0].ggml_type == Q.Q8_0 and index.tensors[0].shape == (64, 8)  # GGUF order
