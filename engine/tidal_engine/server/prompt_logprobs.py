"""vLLM's `prompt_logprobs` in responses: the logprob of every prompt token given the tokens
before it, plus the top-k alternatives at each position.

The engine computes them in the prefill forward (runner/prompt_logprobs.py) and hands them
back with the first generated token (``RequestOutput.prompt_logprobs``); here they take
vLLM's JSON shape.
"""

from __future__ import annotations

from typing import Any, Callable

from tidal_engine.outputs import PositionLogprobs

# One prompt position as JSON: {token id (text): {"logprob", "rank", "decoded_token"}}.
PositionJSON = dict[str, dict[str, Any]]


def engine_prompt_logprobs(prompt_logprobs: int | None, echo_logprobs: int | None) -> int | None:
    """The top-k the engine computes: enough for `prompt_logprobs` and for completions' `echo`
    with `logprobs` (whose prompt part is these logprobs too)."""
    asked = [k for k in (prompt_logprobs, echo_logprobs) if k is not None]
    return max(asked) if asked else None


def to_json(positions: list[PositionLogprobs | None] | None, k: int,
            decode: Callable[[int, Any], str]) -> list[PositionJSON | None] | None:
    """One entry per prompt token: None for the first, then the prompt token's entry and the k
    most likely alternatives (vLLM's shape; JSON keys are the ids as strings)."""
    if positions is None:
        return None
    entries: list[PositionJSON | None] = []
    for position in positions:
        if position is None:
            entries.append(None)
            continue
        # The prompt token comes first, then the alternatives by rank (the engine's order).
        items = list(position.items())
        kept = items[:1] + [(t, lp) for t, lp in items[1:] if (lp.rank or k + 1) <= k]
        entries.append({str(token): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": decode(token, lp)}
                        for token, lp in kept})
    return entries
