"""vLLM's `prompt_logprobs`: the logprob of every prompt token given the tokens before it, plus
the top-k alternatives at each position.

The runner computes logits only where a request samples, so each position is asked as its
own one-token request: the prefix as prompt, the prompt's next token as the only allowed
one, greedy. Logprobs are the raw model's (before any mask), so the sampled token's logprob
and rank are exactly the prompt token's. The requests share the prefix through the prefix
cache; still, the work grows with the prompt, hence the length limit.
"""

from __future__ import annotations

import uuid
from typing import Any

from tidal_engine.outputs import PositionLogprobs
from tidal_engine.sampling_params import SamplingParams

# Longer prompts are refused: one request per position.
MAX_PROMPT_LOGPROBS_TOKENS = 512


async def prompt_logprobs(serving: Any, prompt_ids: list[int], k: int, cache_salt: str | None,
                          lora_name: str | None) -> list[dict[str, dict[str, Any]] | None]:
    """One entry per prompt token: None for the first, then {token id: logprob} for the prompt
    token and the k most likely (vLLM's shape; JSON keys are the ids as strings)."""
    base = f"plp-{uuid.uuid4().hex}"
    params = [SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=k,
                             allowed_token_ids=[prompt_ids[i]]) for i in range(1, len(prompt_ids))]
    streams = []
    try:
        for i, p in enumerate(params, start=1):
            streams += await serving.submit(f"{base}-{i}", [prompt_ids[:i]], p, cache_salt, lora_name)
        outputs = await serving.final_outputs(streams)
    except BaseException:
        for stream in streams:
            serving.engine.abort(stream.request_id)
        raise
    entries: list[dict[str, dict[str, Any]] | None] = [None]
    for output in outputs:
        position: PositionLogprobs = (output.outputs[0].logprobs or [{}])[0]
        entries.append({str(token): {"logprob": lp.logprob, "rank": lp.rank,
                                     "decoded_token": lp.decoded_token if lp.decoded_token is not None
                                     else serving.tokenizer.decode([token])}
                        for token, lp in position.items()})
    return entries


def check(num_prompt_tokens: int, stream: bool) -> str | None:
    """Why a prompt_logprobs request cannot be served, or None."""
    if stream:
        return "prompt_logprobs is not supported with stream: true"
    if num_prompt_tokens > MAX_PROMPT_LOGPROBS_TOKENS:
        return (f"prompt_logprobs is limited to prompts of {MAX_PROMPT_LOGPROBS_TOKENS} tokens "
                f"(this one has {num_prompt_tokens})")
    return None

