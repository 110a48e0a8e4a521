"""A GGUF file's tokenizer is converted once, saved in the start-up cache, and read back with
the same behaviour; a damaged entry is replaced; a cache that cannot be written costs only time.
The GGUF metadata is parsed once per process."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from tidal_engine.models import loader
from tidal_engine.models.loader import load_tokenizer, model_generation_config, resolve_model, resolve_model_path
from tidal_engine.models.tokenizer_cache import cached_gguf_tokenizer, tokenizer_cache_key

GGUF = resolve_model_path("smollm2-135m")
TEXTS = ["What is the capital of France?", "naïve café — 東京 🌊", "<|im_start|>user\nhi<|im_end|>", "  spaced\n\ttabs  "]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def converted() -> Any:
    """transformers' own conversion of the GGUF metadata (seconds of CPU, once per module)."""
    return AutoTokenizer.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name)


class Conversions:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.count = 0

    def __call__(self) -> Any:
        self.count += 1
        return self.tokenizer


def assert_same_behaviour(got: Any, want: Any) -> None:
    assert len(got) == len(want)
    assert got.get_vocab() == want.get_vocab()
    assert (got.bos_token, got.eos_token, got.eos_token_id) == (want.bos_token, want.eos_token, want.eos_token_id)
    assert got.all_special_tokens == want.all_special_tokens
    assert got.chat_template == want.chat_template
    for text in TEXTS:
        ids = want(text)["input_ids"]
        assert got(text)["input_ids"] == ids, text
        assert got.decode(ids) == want.decode(ids)
    assert (got.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
            == want.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True))


def entries(cache_dir: Path) -> list[str]:
    return sorted(p.name for p in (cache_dir / "tokenizers").iterdir())


def test_converted_once_then_read_back_with_the_same_behaviour(tmp_path: Path, converted: Any) -> None:
    convert = Conversions(converted)
    first = cached_gguf_tokenizer(GGUF, convert, tmp_path)
    second = cached_gguf_tokenizer(GGUF, convert, tmp_path)
    assert first is converted and second is not converted
    assert convert.count == 1
    assert entries(tmp_path) == [tokenizer_cache_key(GGUF)]  # no staging folder left behind
    assert_same_behaviour(second, converted)


def test_load_tokenizer_fills_the_cache_dir_it_is_given(tmp_path: Path, converted: Any) -> None:
    tokenizer = load_tokenizer("smollm2-135m", cache_dir=tmp_path)
    assert entries(tmp_path) == [tokenizer_cache_key(GGUF)]
    assert_same_behaviour(tokenizer, converted)


def test_a_damaged_entry_is_converted_again_and_replaced(tmp_path: Path, converted: Any) -> None:
    entry = tmp_path / "tokenizers" / tokenizer_cache_key(GGUF)
    entry.mkdir(parents=True)
    (entry / "tokenizer_config.json").write_text("{not json")
    convert = Conversions(converted)
    assert cached_gguf_tokenizer(GGUF, convert, tmp_path) is converted
    assert_same_behaviour(cached_gguf_tokenizer(GGUF, convert, tmp_path), converted)
    assert convert.count == 1


def test_a_cache_that_cannot_be_written_still_gives_the_tokenizer(tmp_path: Path, converted: Any) -> None:
    not_a_folder = tmp_path / "cache"
    not_a_folder.write_text("a file where the cache folder should be")
    convert = Conversions(converted)
    assert cached_gguf_tokenizer(GGUF, convert, not_a_folder) is converted
    assert cached_gguf_tokenizer(GGUF, convert, not_a_folder) is converted
    assert convert.count == 2


def test_the_key_follows_the_file_and_its_changes(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(60))
    key = tokenizer_cache_key(model)
    assert key.startswith("m-") and tokenizer_cache_key(model) == key
    stat = model.stat()
    os.utime(model, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert tokenizer_cache_key(model) != key
    other = tmp_path / "other" / "m.gguf"
    other.parent.mkdir()
    other.write_bytes(model.read_bytes())
    assert tokenizer_cache_key(other) != tokenizer_cache_key(model)


def test_a_gguf_file_is_parsed_once_per_process_and_has_no_generation_config() -> None:
    assert resolve_model("smollm2-135m") is resolve_model(str(GGUF))
    assert model_generation_config("smollm2-135m") == {}


def test_a_cached_tokenizer_needs_no_parse_of_the_file(tmp_path: Path, converted: Any,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The API server only needs the tokenizer: with the cache filled it never reads the metadata."""
    cached_gguf_tokenizer(GGUF, Conversions(converted), tmp_path)

    def no_parse(model: str) -> Any:
        raise AssertionError(f"{model} was parsed")
    monkeypatch.setattr(loader, "gguf_source", no_parse)
    monkeypatch.setattr(loader, "resolve_model", no_parse)
    assert_same_behaviour(load_tokenizer("smollm2-135m", cache_dir=tmp_path), converted)


def test_a_corrupt_file_without_a_cached_tokenizer_is_a_clear_error(tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"definitely not a GGUF file" * 50)
    with pytest.raises(ValueError, match=f"corrupt or truncated GGUF file {broken}"):
        load_tokenizer(str(broken), cache_dir=tmp_path)
