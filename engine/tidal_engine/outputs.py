"""What the engine hands back for each request (vLLM's shapes, so callers port easily)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely
    decoded_token: str | None = None


# One position's logprobs: the sampled token plus the top-k alternatives.
PositionLogprobs = dict[int, Logprob]


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str  # cumulative; while unfinished, a possible partial stop string is held back
    token_ids: list[int]  # cumulative
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or string that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    extra: dict[str, object] = field(default_factory=dict)
    # vLLM's prompt_logprobs: None for the first prompt token, then each token's position
    # logprobs (it and the top alternatives); None when not asked (or not yet computed).
    prompt_logprobs: list[PositionLogprobs | None] | None = None
