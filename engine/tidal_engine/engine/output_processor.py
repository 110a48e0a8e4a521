"""Deltas from the engine core → text and ``RequestOutput``s, on the caller's side.

The core sends only new token ids per sample. Here each sample gets its incremental
detokenizer and stop-string check (a match ends the sample; the caller tells the core
with ``finish_samples``), its logprobs get their token text, and ``output()`` builds the
cumulative ``RequestOutput`` vLLM callers expect. ``output()`` copies the token lists, so
call it once per consumption, not once per step: the server's streams keep only the
latest state and build the output when the client is ready for it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from tidal_engine.engine.messages import SampleDelta, sample_request_id
from tidal_engine.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestMetrics, RequestOutput
from tidal_engine.runner.detokenizer import IncrementalDetokenizer, decode_token
from tidal_engine.sampling_params import SamplingParams


@dataclass
class SampleState:
    index: int
    detokenizer: "IncrementalDetokenizer | NoDetokenizer"
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[SampleState]
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    new_tokens: int = 0  # tokens since the consumer last took an output (ITL bookkeeping)
    prompt_logprobs: list[PositionLogprobs | None] | None = None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


class NoDetokenizer:
    """skip_tokenizer_init: token ids only, no text and so no stop strings."""

    def add_token(self, token_id: int, stop_terminated: bool = False) -> None:
        return None

    def safe_text(self, finished: bool) -> str:
        return ""


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}

    def add_request(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
        arrival_time: float | None = None,
    ) -> RequestState:
        state = RequestState(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            params=params,
            samples=[
                SampleState(i, IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params)
                            if self.tokenizer is not None else NoDetokenizer(),
                            logprobs=[] if params.logprobs is not None else None)
                for i in range(params.n)
            ],
            metrics=RequestMetrics(arrival_time=arrival_time or time.time()),
        )
        self.requests[request_id] = state
        return state

    def abort_request(self, request_id: str) -> RequestState | None:
        """Forget a request; its samples still running end as "abort"."""
        state = self.requests.pop(request_id, None)
        if state is not None:
            for sample in state.samples:
                if sample.finish_reason is None:
                    sample.finish_reason = "abort"
            state.metrics.finished_time = time.time()
        return state

    def process(self, deltas: list[SampleDelta]) -> tuple[list[RequestState], list[str]]:
        """Apply one step's deltas. Returns the requests they touched (finished ones are
        forgotten here) and the sample ids whose stop string matched (end them in the core)."""
        now = time.time()
        touched: dict[str, RequestState] = {}
        stopped: list[str] = []
        for delta in deltas:
            state = self.requests.get(delta.request_id)
            if state is None:
                continue  # aborted meanwhile
            sample = state.samples[delta.index]
            if sample.finish_reason is not None:
                continue  # ended on a stop string; the core learns it a step later
            if delta.first_scheduled_time is not None:
                state.metrics.first_scheduled_time = delta.first_scheduled_time
            state.num_cached_tokens = delta.num_cached_tokens
            if delta.prompt_logprobs is not None:
                prompt = state.prompt_token_ids
                state.prompt_logprobs = [None, *(self._position(prompt[i], entry)
                                                 for i, entry in enumerate(delta.prompt_logprobs, start=1))]
            if self._apply(state, sample, delta) and delta.finish_reason is None:
                stopped.append(sample_request_id(state.request_id, sample.index, state.params.n))
            state.new_tokens += len(delta.new_token_ids)
            state.metrics.first_token_time = state.metrics.first_token_time or now
            state.metrics.last_token_time = now
            touched[state.request_id] = state
        for state in touched.values():
            if state.finished:
                state.metrics.finished_time = now
                del self.requests[state.request_id]
        return list(touched.values()), stopped

    def _apply(self, state: RequestState, sample: SampleState, delta: SampleDelta) -> bool:
        """Add the delta's tokens to the sample; True when a stop string ended it."""
        last = len(delta.new_token_ids) - 1
        for i, token_id in enumerate(delta.new_token_ids):
            sample.token_ids.append(token_id)
            if delta.new_logprobs is not None and sample.logprobs is not None:
                entry = delta.new_logprobs[i]
                sample.cumulative_logprob += entry.sampled_logprob
                sample.logprobs.append(self._position(token_id, entry))
            terminated = delta.stop_terminated and i == last
            matched = sample.detokenizer.add_token(token_id, stop_terminated=terminated)
            if matched is not None:
                # A stop string outranks "length" on the same token (as before the split).
                sample.finish_reason, sample.stop_reason = "stop", matched
                return True
        if delta.finish_reason is not None:
            sample.finish_reason, sample.stop_reason = delta.finish_reason, delta.stop_reason
        return False

    def _position(self, token_id: int, entry: Any) -> PositionLogprobs:
        # Sampled token first, then the top alternatives, as vLLM orders them.
        position: PositionLogprobs = {
            token_id: Logprob(entry.sampled_logprob, entry.rank, self._decode(token_id))
        }
        for rank, (tid, value) in enumerate(zip(entry.top_ids, entry.top_logprobs), start=1):
            if tid not in position:
                position[tid] = Logprob(value, rank, self._decode(tid))
        return position

    def _decode(self, token_id: int) -> str | None:
        return decode_token(self.tokenizer, token_id) if self.tokenizer is not None else None

    @staticmethod
    def output(state: RequestState) -> RequestOutput:
        """The request's cumulative output now (copies its token lists)."""
        finished = state.finished
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=[
                CompletionOutput(
                    index=s.index,
                    text=s.detokenizer.safe_text(finished=s.finish_reason is not None),
                    token_ids=list(s.token_ids),
                    # Only with logprobs on, as in vLLM V1.
                    cumulative_logprob=s.cumulative_logprob if s.logprobs is not None else None,
                    logprobs=list(s.logprobs) if s.logprobs is not None else None,
                    finish_reason=s.finish_reason,
                    stop_reason=s.stop_reason,
                )
                for s in state.samples
            ],
            finished=finished,
            num_cached_tokens=state.num_cached_tokens,
            metrics=state.metrics,
            prompt_logprobs=state.prompt_logprobs,
        )
