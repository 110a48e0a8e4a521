"""Token sampling for one engine step: penalties, min_tokens, greedy or filtered random sampling, logprobs.

Order of operations (per row):
  1. repetition penalty (prompt + output tokens; HF/vLLM: divide positive logits, multiply negative ones)
  2. frequency and presence penalties (output tokens only; OpenAI semantics)
  3. min_tokens: EOS (unless ignore_eos) and stop_token_ids are masked while the output is too short
     (not for rows with a grammar: the grammar alone decides where the output may end)
  4. structured outputs: rows with a grammar keep only the tokens its bitmask allows
  5. greedy rows: argmax; the others: temperature, top_k, top_p, min_p, then an exponential race.

Logprobs come from the log_softmax of the RAW logits (vLLM V1's default "raw_logprobs" mode), so they do
not depend on the penalties or on the sampling filters.

Seeded rows draw their noise from their own generator, one full-vocabulary draw per step, so a seed gives
the same tokens whatever else shares the batch. Unseeded rows share one generator (torch's default
generator unless one is given), the only state the sampler keeps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tidal_engine.outputs import Logprob, PositionLogprobs
from tidal_engine.sampling_params import SamplingParams
from tidal_engine.structured import GrammarMatcher, apply_bitmasks

__all__ = ["SamplingRow", "SamplerOutput", "SampledTokens", "Sampler", "make_generator", "needs_host_history"]


@dataclass
class SamplingRow:
    """What the sampler needs to know about one request to pick its next token."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    # Per-request generator, set when params.seed is set (see make_generator); None: shared generator.
    generator: torch.Generator | None = None
    eos_token_ids: set[int] = field(default_factory=set)
    # Structured outputs: the sample's grammar state; the sampler reads it, the engine advances it.
    grammar: GrammarMatcher | None = None


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[PositionLogprobs | None]  # None where the request asked for no logprobs
    # Raw logprob of each sampled token, for cumulative_logprob; None for rows without logprobs.
    sampled_logprob: list[float | None]


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A request's private generator; it lives with the request and advances one draw per step."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


class _HostCopies:
    """A few pinned host buffers, used in turn, for the sampled ids' device→host copies: a
    step's ids may still be in flight while the next step samples (async scheduling)."""

    RING = 4

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self._events: list[torch.cuda.Event] = []  # one per buffer: its copy is done
        self._turn = 0

    def start(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
        n = ids.shape[0]
        if not self._buffers or self._buffers[0].shape[0] < n:
            torch.cuda.synchronize(ids.device)  # old buffers may still be copied into
            size = max(n, 2 * (self._buffers[0].shape[0] if self._buffers else 256))
            self._buffers = [torch.empty(size, dtype=torch.long, pin_memory=True) for _ in range(self.RING)]
            self._events = [torch.cuda.Event() for _ in range(self.RING)]
        self._turn = (self._turn + 1) % self.RING
        host = self._buffers[self._turn][:n]
        host.copy_(ids, non_blocking=True)
        event = self._events[self._turn]
        event.record()
        return host, event


class SampledTokens:
    """One step's sampled ids: on the device now (the next step may read them there), on the
    host once ``result()`` has waited for their copy, and for nothing queued after it."""

    def __init__(
        self,
        device_ids: torch.Tensor,
        raw_logprobs: torch.Tensor | None,
        rows: list[SamplingRow],
        host_copies: _HostCopies | None,
    ) -> None:
        self.device_ids = device_ids
        self._raw_logprobs = raw_logprobs
        self._rows = rows
        self._host: torch.Tensor | None = None
        self._event: torch.cuda.Event | None = None
        if device_ids.is_cuda and host_copies is not None:
            self._host, self._event = host_copies.start(device_ids)
        self._result: SamplerOutput | None = None

    def result(self) -> SamplerOutput:
        if self._result is None:
            if self._event is not None and self._host is not None:
                self._event.synchronize()
                token_list = self._host.tolist()
            else:
                token_list = self.device_ids.tolist()
            logprobs: list[PositionLogprobs | None] = [None] * len(token_list)
            sampled: list[float | None] = [None] * len(token_list)
            if self._raw_logprobs is not None:
                sampled_lp = self._raw_logprobs.gather(1, self.device_ids.unsqueeze(1)).squeeze(1)
                logprobs = _collect_logprobs(self._raw_logprobs, self.device_ids, sampled_lp, self._rows)
                values = sampled_lp.tolist()
                sampled = [values[i] if r.params.logprobs is not None else None for i, r in enumerate(self._rows)]
            self._result = SamplerOutput(token_ids=token_list, logprobs=logprobs, sampled_logprob=sampled)
            self._raw_logprobs = None  # free the [rows, vocab] tensor
        return self._result


class Sampler:
    def __init__(self, generator: torch.Generator | None = None) -> None:
        # None: torch's default generator for the logits' device (seeded by torch.manual_seed).
        self.generator = generator
        self._host_copies = _HostCopies()

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """Sample and wait for the result on the host."""
        return self.sample(logits, rows).result()

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SampledTokens:
        """Queue the sampling on the logits' device and start copying the ids to the host;
        nothing here waits for the device (``SampledTokens.result()`` does)."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [len(rows), vocab], got {tuple(logits.shape)} for {len(rows)} rows")
        num_rows = logits.shape[0]
        device = logits.device
        if num_rows == 0:
            return SampledTokens(torch.empty(0, dtype=torch.long, device=device), None, rows, None)
        # Plain greedy rows need nothing but the argmax: no float copy, no log-softmax.
        grammars = [(i, r.grammar) for i, r in enumerate(rows) if r.grammar is not None]
        needs_processing = any(_needs_penalties(r.params) for r in rows) or any(_in_min_tokens(r) for r in rows) or grammars
        wants_logprobs = any(r.params.logprobs is not None for r in rows)
        if not needs_processing and not wants_logprobs and all(r.params.is_greedy for r in rows):
            return SampledTokens(logits.argmax(dim=-1), None, rows, self._host_copies)
        raw = logits.float()

        # Copy only when something will modify the logits: the caller's tensor stays untouched.
        processed = raw
        if needs_processing:
            processed = raw.clone()
            _apply_penalties(processed, rows)
            _apply_min_tokens(processed, rows)
            if grammars:
                apply_bitmasks(processed, grammars)  # type: ignore[arg-type]

        greedy = [i for i, r in enumerate(rows) if r.params.is_greedy]
        stochastic = [i for i, r in enumerate(rows) if not r.params.is_greedy]
        if not stochastic:
            token_ids = processed.argmax(dim=-1)
        else:
            token_ids = torch.empty(num_rows, dtype=torch.long, device=device)
            if greedy:
                g_idx = torch.tensor(greedy, dtype=torch.long, device=device)
                token_ids[g_idx] = processed[g_idx].argmax(dim=-1)
            r_idx = torch.tensor(stochastic, dtype=torch.long, device=device)
            token_ids[r_idx] = self._sample(processed[r_idx], [rows[i] for i in stochastic])
        # Logprobs (and cumulative_logprob) only for the rows that asked, as vLLM V1 does.
        raw_logprobs = torch.log_softmax(raw, dim=-1) if wants_logprobs else None
        return SampledTokens(token_ids, raw_logprobs, rows, self._host_copies)

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Random sampling for non-greedy rows; logits [M, V] may be modified in place (a private copy)."""
        num_rows, vocab = logits.shape
        device = logits.device
        temperature = torch.tensor([r.params.temperature for r in rows], dtype=logits.dtype, device=device)
        logits = logits / temperature.unsqueeze(1)

        top_k_list = [r.params.top_k if 0 < r.params.top_k < vocab else vocab for r in rows]
        top_p_list = [r.params.top_p for r in rows]
        use_top_k = any(k < vocab for k in top_k_list)
        use_top_p = any(p < 1.0 for p in top_p_list)
        if use_top_k or use_top_p:
            # One stable descending sort serves both filters; stable so ties keep vocabulary order
            # (top_k=1 then picks the same token as argmax).
            sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
            if use_top_k:
                top_k = torch.tensor(top_k_list, dtype=torch.long, device=device)
                positions = torch.arange(vocab, device=device)
                sorted_logits.masked_fill_(positions.unsqueeze(0) >= top_k.unsqueeze(1), float("-inf"))
            if use_top_p:
                top_p = torch.tensor(top_p_list, dtype=logits.dtype, device=device)
                probs_sorted = sorted_logits.softmax(dim=-1)
                mass_before = probs_sorted.cumsum(dim=-1) - probs_sorted
                # Keep the smallest head whose mass reaches top_p: drop a token once the mass of the
                # tokens before it already does. The most likely token always stays.
                drop = mass_before >= top_p.unsqueeze(1)
                drop[:, 0] = False
                sorted_logits.masked_fill_(drop, float("-inf"))
            logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)

        probs = logits.softmax(dim=-1)
        min_p_list = [r.params.min_p for r in rows]
        if any(p > 0.0 for p in min_p_list):
            min_p = torch.tensor(min_p_list, dtype=probs.dtype, device=device)
            threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
            # No renormalisation needed: the exponential race is scale invariant per row.
            probs = probs.masked_fill(probs < threshold, 0.0)

        noise = self._noise(probs, rows)
        # Exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) picks i with probability p_i.
        return (probs / noise).argmax(dim=-1)

    def _noise(self, probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        noise = torch.empty_like(probs)
        shared = [j for j, r in enumerate(rows) if r.generator is None]
        if len(shared) == len(rows):
            noise.exponential_(generator=self.generator)
        elif shared:
            s_idx = torch.tensor(shared, dtype=torch.long, device=probs.device)
            noise[s_idx] = torch.empty(
                (len(shared), probs.shape[1]), dtype=probs.dtype, device=probs.device
            ).exponential_(generator=self.generator)
        for j, row in enumerate(rows):
            if row.generator is not None:
                noise[j].exponential_(generator=row.generator)
        # exponential_ may return exactly 0 on some backends; a zero would turn into inf and win.
        return noise.clamp_min_(torch.finfo(noise.dtype).tiny)


def needs_host_history(row: SamplingRow) -> bool:
    """The row's next draw reads its previous tokens on the host (penalties, a grammar) or
    its result needs a host round trip (logprobs): no sampling a step ahead for it."""
    return row.grammar is not None or row.params.logprobs is not None or _needs_penalties(row.params)


def _needs_penalties(params: SamplingParams) -> bool:
    return (
        params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0
    )


def _in_min_tokens(row: SamplingRow) -> bool:
    return len(row.output_token_ids) < row.params.min_tokens


def _token_counts(
    token_lists: list[list[int]], vocab: int, device: torch.device
) -> torch.Tensor:
    """[len(token_lists), vocab] float counts of each token id, built with one scatter_add."""
    longest = max((len(t) for t in token_lists), default=0)
    # Pad with an extra column `vocab` that is dropped afterwards; out-of-range ids land there too.
    padded = [[t if 0 <= t < vocab else vocab for t in ids] + [vocab] * (longest - len(ids)) for ids in token_lists]
    counts = torch.zeros((len(token_lists), vocab + 1), dtype=torch.float32, device=device)
    if longest:
        index = torch.tensor(padded, dtype=torch.long, device=device)
        counts.scatter_add_(1, index, torch.ones_like(index, dtype=torch.float32))
    return counts[:, :vocab]


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    vocab = logits.shape[1]
    device = logits.device
    rep = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    if rep:
        idx = torch.tensor(rep, dtype=torch.long, device=device)
        seen = _token_counts([rows[i].prompt_token_ids + rows[i].output_token_ids for i in rep], vocab, device) > 0
        penalty = torch.tensor(
            [rows[i].params.repetition_penalty for i in rep], dtype=logits.dtype, device=device
        ).unsqueeze(1)
        sub = logits[idx]
        penalised = torch.where(sub > 0, sub / penalty, sub * penalty)
        logits[idx] = torch.where(seen, penalised, sub)

    freq_pres = [
        i for i, r in enumerate(rows) if r.params.frequency_penalty != 0.0 or r.params.presence_penalty != 0.0
    ]
    if freq_pres:
        idx = torch.tensor(freq_pres, dtype=torch.long, device=device)
        counts = _token_counts([rows[i].output_token_ids for i in freq_pres], vocab, device)
        freq = torch.tensor([rows[i].params.frequency_penalty for i in freq_pres], dtype=logits.dtype, device=device)
        pres = torch.tensor([rows[i].params.presence_penalty for i in freq_pres], dtype=logits.dtype, device=device)
        logits[idx] = logits[idx] - freq.unsqueeze(1) * counts - pres.unsqueeze(1) * (counts > 0).to(logits.dtype)


def _apply_min_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    vocab = logits.shape[1]
    row_ids: list[int] = []
    col_ids: list[int] = []
    for i, row in enumerate(rows):
        # A grammar at its end allows only EOS; masking it too would leave no token at all.
        if not _in_min_tokens(row) or row.grammar is not None:
            continue
        banned = set(row.params.stop_token_ids or [])
        # With ignore_eos, EOS does not end the request, so it need not be held back (as in vLLM).
        if not row.params.ignore_eos:
            banned |= row.eos_token_ids
        for token in banned:
            if 0 <= token < vocab:
                row_ids.append(i)
                col_ids.append(token)
    if row_ids:
        logits[row_ids, col_ids] = float("-inf")


def _collect_logprobs(
    raw_logprobs: torch.Tensor,
    token_ids: torch.Tensor,
    sampled_lp: torch.Tensor,
    rows: list[SamplingRow],
) -> list[PositionLogprobs | None]:
    wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    result: list[PositionLogprobs | None] = [None] * len(rows)
    if not wanted:
        return result
    device = raw_logprobs.device
    idx = torch.tensor(wanted, dtype=torch.long, device=device)
    sub = raw_logprobs[idx]
    # Rank 1 = most likely; ties share the better rank.
    ranks = ((sub > sampled_lp[idx].unsqueeze(1)).sum(dim=-1) + 1).tolist()
    k = max(rows[i].params.logprobs or 0 for i in wanted)
    top_values: list[list[float]] = [[] for _ in wanted]
    top_ids: list[list[int]] = [[] for _ in wanted]
    if k > 0:
        values, ids = sub.topk(min(k, sub.shape[1]), dim=-1)
        top_values, top_ids = values.tolist(), ids.tolist()
    sampled_ids = token_ids[idx].tolist()
    sampled_values = sampled_lp[idx].tolist()
    for j, i in enumerate(wanted):
        # Sampled token first, then the top alternatives, as vLLM orders them.
        position: PositionLogprobs = {sampled_ids[j]: Logprob(logprob=sampled_values[j], rank=ranks[j])}
        n_top = rows[i].params.logprobs or 0
        for r, (token, value) in enumerate(zip(top_ids[j][:n_top], top_values[j][:n_top]), start=1):
            if token not in position:
                position[token] = Logprob(logprob=value, rank=r)
        result[i] = position
    return result
