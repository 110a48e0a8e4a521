"""Per-request sampling parameters, validated on construction (vLLM's field names)."""

from __future__ import annotations

from dataclasses import dataclass

from tidal_engine.structured.params import StructuredOutputsParams


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to the context length
    min_tokens: int = 0
    logprobs: int | None = None  # number of top logprobs besides the sampled token
    # Logprobs of the prompt's tokens (each given the ones before) plus this many top alternatives.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None  # constrain the output (JSON schema, regex, …)
    # Scheduling priority (lower runs first) under scheduling_policy "priority"; vLLM passes it
    # next to the params, Tidal carries it in them so it travels to the core with them.
    priority: int = 0
    # Only these tokens may be sampled (vLLM); None: any.
    allowed_token_ids: list[int] | None = None
    # Words that must not appear in the output (vLLM): tokenized by the engine, which bans a
    # word's last token right after the output ends with the rest of it.
    bad_words: list[str] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        self.validate()

    def validate(self) -> None:
        def fail(msg: str) -> None:
            raise ValueError(msg)

        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            fail(f"n must be an integer >= 1, got {self.n!r}")
        if not _is_number(self.temperature) or self.temperature < 0:
            fail(f"temperature must be >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            fail(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            fail(f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            fail(f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                fail(f"{name} must be in [-2, 2], got {value!r}")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            fail(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            fail(f"seed must be an integer, got {self.seed!r}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            fail(f"stop must be a string or a list of strings, got {self.stop!r}")
        if any(s == "" for s in self.stop):
            fail("stop strings must not be empty")
        if not isinstance(self.stop_token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            fail(f"stop_token_ids must be a list of non-negative integers, got {self.stop_token_ids!r}")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1
        ):
            fail(f"max_tokens must be at least 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            fail(f"min_tokens must be >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool) or not 0 <= self.logprobs <= 20
        ):
            fail(f"logprobs must be an integer in [0, 20], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int) or isinstance(self.prompt_logprobs, bool)
            or not 0 <= self.prompt_logprobs <= 20
        ):
            fail(f"prompt_logprobs must be an integer in [0, 20], got {self.prompt_logprobs!r}")
        if self.allowed_token_ids is not None and (
            not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.allowed_token_ids)
        ):
            fail(f"allowed_token_ids must be a non-empty list of token ids, got {self.allowed_token_ids!r}")
        if self.bad_words is not None and (
            not isinstance(self.bad_words, list) or not all(isinstance(w, str) and w for w in self.bad_words)
        ):
            fail(f"bad_words must be a list of non-empty strings, got {self.bad_words!r}")
        if not isinstance(self.priority, int) or isinstance(self.priority, bool):
            fail(f"priority must be an integer, got {self.priority!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            fail(f"structured_outputs must be a StructuredOutputsParams, got {type(self.structured_outputs).__name__}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-5

    def clone(self, **changes: object) -> "SamplingParams":
        values = {f: getattr(self, f) for f in self.__dataclass_fields__}
        values.update(changes)
        return SamplingParams(**values)  # type: ignore[arg-type]


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


