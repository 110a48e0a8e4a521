"""Incremental detokenization and stop-string handling for one request.

Decoding uses two offsets into the token ids, as HF's TextStreamer and vLLM do:
  - prefix_offset: start of a short window of already-shown tokens that gives the decoder context
    (byte-level and SentencePiece decoders render a token differently depending on what precedes it);
  - read_offset: end of the already-shown tokens.
Each step decodes only window[prefix_offset:read_offset] and window[prefix_offset:], and the new text is
the difference. While the decode ends with U+FFFD, a multi-byte character is still split across tokens:
the tokens are held back until it completes, so no broken UTF-8 is ever shown.
"""

from __future__ import annotations

from typing import Any

from tidal_engine.sampling_params import SamplingParams

__all__ = ["IncrementalDetokenizer", "decode_token"]

# Prompt tokens used as decoding context for the first output token (vLLM uses 5 too).
_PROMPT_CONTEXT_TOKENS = 5
# Drop ids before prefix_offset once this many pile up, so the window stays short.
_TRIM_THRESHOLD = 256
_REPLACEMENT_CHAR = "\ufffd"


def _decode(tokenizer: Any, token_ids: list[int], skip_special_tokens: bool) -> str:
    # No clean-up of tokenization spaces: it is not prefix-stable, and vLLM does not apply it either.
    backend = _fast_backend(tokenizer)
    if backend is not None:  # the same call the wrapper ends in, minus its per-call overhead
        return backend.decode(token_ids, skip_special_tokens=skip_special_tokens)
    return tokenizer.decode(
        token_ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )


_BACKENDS: dict[type, bool] = {}


def _fast_backend(tokenizer: Any) -> Any | None:
    """The `tokenizers` backend of an HF fast tokenizer whose decode is the stock one (then,
    without clean-up, ``decode`` is exactly ``backend.decode``); None for anything else.
    Detokenizing calls decode twice per token: the wrapper's checks were ~60% of that."""
    cls = type(tokenizer)
    stock = _BACKENDS.get(cls)
    if stock is None:
        try:
            from transformers.tokenization_utils_tokenizers import TokenizersBackend
        except ImportError:  # older transformers: keep the public API
            TokenizersBackend = None  # noqa: N806
        stock = (
            TokenizersBackend is not None
            and isinstance(tokenizer, TokenizersBackend)
            and cls._decode is TokenizersBackend._decode
            and cls.decode is TokenizersBackend.decode
        )
        _BACKENDS[cls] = stock
    return getattr(tokenizer, "_tokenizer", None) if stock else None


def decode_token(tokenizer: Any, token_id: int) -> str:
    """The text of one token on its own (Logprob.decoded_token); special tokens are shown."""
    return _decode(tokenizer, [token_id], skip_special_tokens=False)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.skip_special_tokens: bool = params.skip_special_tokens
        self.stop_strings: list[str] = list(params.stop or [])
        self.num_output_tokens: int = 0
        self.output_text: str = ""
        # The stop string that ended the request, or None.
        self.stop_reason: str | None = None
        # Window of ids: a few prompt tokens for context, then the output tokens not yet trimmed.
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset: int = 0
        self._read_offset: int = len(self._ids)
        self._prefix_text: str | None = None  # decode of _ids[prefix:read], cached while offsets stay

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    def add_token(self, token_id: int, stop_terminated: bool = False) -> str | None:
        """Append one sampled token; returns the matched stop string if the text now hits one.

        stop_terminated: the token ends the request as EOS or one of stop_token_ids. As in vLLM, its
        text is then left out unless include_stop_str_in_output.
        """
        if self.stop_reason is not None:
            return None  # the request already ended on a stop string; later tokens are not shown
        self.num_output_tokens += 1
        if stop_terminated and not self.params.include_stop_str_in_output:
            return None
        self._ids.append(token_id)
        delta = self._take_delta()
        if not delta:
            return None
        self.output_text += delta
        # Like vLLM, the first min_tokens tokens cannot end the request.
        if self.stop_strings and self.num_output_tokens > self.params.min_tokens:
            return self._check_stop(len(delta))
        return None

    def safe_text(self, finished: bool) -> str:
        """Text that may be shown to a streaming client now (always a prefix of the final text)."""
        if self.stop_reason is not None:
            return self.output_text
        if finished:
            # Nothing more will come: show even an incomplete trailing character, as decode() would.
            return self.output_text + self._pending_text()
        held = self._partial_stop_len(self.output_text)
        return self.output_text[: len(self.output_text) - held] if held else self.output_text

    def _take_delta(self) -> str:
        if self._prefix_text is None:
            self._prefix_text = _decode(
                self.tokenizer, self._ids[self._prefix_offset : self._read_offset], self.skip_special_tokens
            )
        new_text = _decode(self.tokenizer, self._ids[self._prefix_offset :], self.skip_special_tokens)
        if len(new_text) <= len(self._prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            # Nothing visible yet (e.g. a skipped special token) or a character still incomplete.
            return ""
        delta = new_text[len(self._prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = None
        if self._prefix_offset >= _TRIM_THRESHOLD:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return delta

    def _pending_text(self) -> str:
        """Text of held-back tokens (ends with an incomplete character), without advancing."""
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = _decode(
            self.tokenizer, self._ids[self._prefix_offset : self._read_offset], self.skip_special_tokens
        )
        new_text = _decode(self.tokenizer, self._ids[self._prefix_offset :], self.skip_special_tokens)
        return new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""

    def _check_stop(self, new_chars: int) -> str | None:
        text = self.output_text
        found: tuple[int, str] | None = None
        for stop in self.stop_strings:
            # Only the new text can complete a match; start far enough back to catch one that
            # straddles the previous token boundary.
            start = max(0, len(text) - new_chars - len(stop) + 1)
            pos = text.find(stop, start)
            # Earliest match wins; at equal positions, the first stop string listed.
            if pos != -1 and (found is None or pos < found[0]):
                found = (pos, stop)
        if found is None:
            return None
        pos, stop = found
        end = pos + len(stop) if self.params.include_stop_str_in_output else pos
        self.output_text = text[:end]
        self.stop_reason = stop
        return stop

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest tail of text that is a proper prefix of some stop string."""
        held = 0
        for stop in self.stop_strings:
            for n in range(min(len(stop) - 1, len(text)), held, -1):
                if text.endswith(stop[:n]):
                    held = n
                    break
        return held
