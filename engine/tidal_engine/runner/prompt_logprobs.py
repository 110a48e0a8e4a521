"""vLLM's `prompt_logprobs` from the prefill forward itself.

The hidden state at prompt position j gives the distribution of the token at j + 1, so every
prefill chunk already holds what a prompt position's logprob needs. The worker lists, per
step, the chunk rows of the requests that asked (``PromptLogprobsJob``: flat rows and the
prompt tokens they predict); the runner runs that step eagerly and hands the job the step's
hidden states; the job turns those rows into logits, log-softmax (raw, as vLLM's), the prompt
token's logprob and rank, and the top-k, in slices so a long chunk never holds all its logits.
Chunked prefill just gives each chunk's positions in turn; the worker remembers how far each
request got, so a recomputation (after a preemption) does not repeat positions. Requests that
ask for prompt logprobs skip the prefix cache (core/kv_cache_manager.py), as in vLLM, so
every prompt position is computed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from tidal_engine.executor.plan import SampledLogprobs

# Rows turned into logits at once: bounds the step's extra memory to SLICE x vocab floats.
SLICE = 256


@dataclass
class PromptLogprobsJob:
    """The prompt positions one step computes for the requests that asked, in flat-batch rows."""

    req_ids: list[str] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)  # positions per request, in req_ids order
    ks: list[int] = field(default_factory=list)  # top-k per request
    rows: list[np.ndarray] = field(default_factory=list)  # flat rows (hidden state at j)
    targets: list[np.ndarray] = field(default_factory=list)  # prompt token at j + 1
    _values: torch.Tensor | None = None  # [positions, 2 + 2k]: logprob, rank, top logprobs, top ids

    def add(self, req_id: str, k: int, rows: np.ndarray, targets: np.ndarray) -> None:
        self.req_ids.append(req_id)
        self.counts.append(int(rows.shape[0]))
        self.ks.append(k)
        self.rows.append(rows)
        self.targets.append(targets)

    def __bool__(self) -> bool:
        return bool(self.req_ids)

    @torch.inference_mode()
    def compute(self, hidden: torch.Tensor, compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Queue the logprobs of the job's rows of ``hidden`` (nothing waits for the device)."""
        device = hidden.device
        rows = torch.from_numpy(np.concatenate(self.rows)).to(device, non_blocking=True)
        targets = torch.from_numpy(np.concatenate(self.targets)).to(device, non_blocking=True)
        k = max(self.ks)
        parts = []
        for a in range(0, int(rows.shape[0]), SLICE):
            logits = compute_logits(hidden.index_select(0, rows[a : a + SLICE]))
            parts.append(position_logprobs(logits, targets[a : a + SLICE], k))
        self._values = torch.cat(parts)

    def to_host(self) -> dict[str, list[SampledLogprobs]]:
        """Each request's positions, in order (waits for the device)."""
        assert self._values is not None, "compute() was not called"
        values = self._values.cpu().tolist()
        k_max = max(self.ks)
        out: dict[str, list[SampledLogprobs]] = {}
        pos = 0
        for req_id, count, k in zip(self.req_ids, self.counts, self.ks):
            out[req_id] = [
                SampledLogprobs(sampled_logprob=v[0], rank=int(v[1]), top_logprobs=v[2 : 2 + k],
                                top_ids=[int(t) for t in v[2 + k_max : 2 + k_max + k]])
                for v in values[pos : pos + count]
            ]
            pos += count
        return out


def position_logprobs(logits: torch.Tensor, targets: torch.Tensor, k: int) -> torch.Tensor:
    """[n, 2 + 2k] float32: each target's logprob and rank (1 = most likely; ties share the
    better rank), then the k best logprobs and their ids."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, targets.view(-1, 1))
    rank = (logprobs > chosen).sum(dim=-1, keepdim=True) + 1
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0])
    return torch.cat([chosen, rank.float(), top_values, top_ids.float()], dim=1)
