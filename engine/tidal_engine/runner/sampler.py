"""Token sampling with per-request state kept on the device.

A worker's model runner registers each request once (``add_request``: its ``SamplingOptions``,
prompt and any tokens sampled before), then calls ``sample(logits, req_ids)`` every step. The
sampler owns one *slot* per request (``max_num_seqs`` slots, a free list; the slot tensors grow
if more requests are ever known at once, e.g. finished ones not yet forgotten). Each slot's sampling
parameters live in two small device tensors (float and int64 columns); the state that depends on
the sampled tokens is updated ON THE DEVICE right after each draw:

  * ``num_sampled``: tokens sampled so far (min_tokens; it is also the seeded RNG's counter);
  * a ``[slots, vocab]`` int32 count of the output tokens (frequency / presence / repetition
    penalties), allocated lazily when the first request with a penalty arrives;
  * a ``[slots, vocab]`` bool prompt-presence mask (repetition penalty), written at add_request.

So the next step never needs the sampled ids on the host: penalties, min_tokens and logprobs
all keep async scheduling. ``sample()`` never waits for the device: per step it makes one small
host→device copy of int64 indices (pinned, non-blocking on CUDA), branches only on host-known
facts (which options the batch's requests set, and a host count of the calls per request),
and starts an async device→host copy of the ids (and of the logprobs) into reused pinned
buffers; ``SampledTokens.result()`` waits for that copy.

Order of operations (per row), as before:
  1. repetition penalty (prompt + output tokens; divide positive logits, multiply negative ones)
  2. frequency and presence penalties (output tokens only; OpenAI semantics)
  3. min_tokens: ``options.min_tokens_banned`` masked while fewer than min_tokens were sampled
     (not for rows with a grammar: the grammar alone decides where the output may end)
  4. structured outputs: rows with a grammar bitmask keep only the tokens it allows (bits beyond
     the bitmask's width stay allowed, as xgrammar's all-ones allocation leaves them)
  5. greedy rows (temperature < 1e-5): argmax; the others: temperature, then top_k, top_p,
     min_p, then a draw.

Filtering (exact; ``_filter_candidates``, densified by ``filtered_probs`` for tests). Random rows
are split, on the host, into three groups:
  * ``top_k``: rows with top_k set. ``top_k_candidates(x, max_k)`` gives the k best candidates sorted
    (a ``torch.topk`` over only the chunks of the vocabulary that can hold them),
    positions ≥ the row's k are masked, and top-p / min-p run on those candidates: exact, since
    top-p acts on the renormalised top-k distribution, which lives inside the candidates.
  * ``sort``: rows with top_p < 1 but no top_k. Top-p needs the order of the whole vocabulary,
    so these rows (only these) get a stable descending sort. (A sync-free threshold search would
    need ~30 masked passes over the vocabulary in torch ops, no cheaper than one segmented sort;
    a fused kernel could beat it later, ``filtered_probs`` is the oracle to check it against.)
  * ``plain``: neither: the whole vocabulary in vocabulary order, min_p as a threshold.
  Top-p keeps the smallest head of most-likely tokens whose mass reaches top_p (a token is dropped
  once the mass before it already reaches top_p; the most likely token always stays). Min-p drops
  p < min_p * p_max; it only depends on p / p_max, so it is the same before or after renormalising.

Drawing (exact): inverse-CDF on the candidate weights in float64: one uniform u per row, and the
token is the first whose cumulative weight exceeds u * total (zero-weight tokens have empty
intervals and are never picked; u * total is capped just below the total). One random number per
row makes per-request seeds cheap: seeded rows get u from a counter-based hash of
(seed, num_sampled) in plain int64 torch ops (no Python loop, CPU and GPU alike), so a seed gives
the same tokens whatever else shares the batch and in any Sampler instance; unseeded rows take u
from the shared generator (``generator``, else torch's default one for the device).

Logprobs are vLLM V1's raw logprobs (log_softmax of the logits as given, before penalties and
filters): the sampled token's logprob and rank (1 = best, ties share the better rank) and the
top ``options.logprobs`` alternatives, computed on the device for the rows that asked.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tidal_engine.executor.plan import SampledLogprobs, SamplingOptions

__all__ = ["Sampler", "SampledTokens", "filtered_probs", "GREEDY_EPS"]

GREEDY_EPS = 1e-5

# Float parameter columns.
_TEMP, _TOP_P, _MIN_P, _REP, _FREQ, _PRES = range(6)
_NUM_F = 6
# Int64 state columns.
_TOP_K, _MIN_TOKENS, _SEED_LO, _SEED_HI, _NUM_SAMPLED = range(5)
_NUM_I = 5

_MASK32 = 0xFFFFFFFF

# From this vocabulary on, the greedy fast path's argmax is the split kernel (argmax_rows) on CUDA:
# torch's runs one block a row (8 us on a 151936-token row on an H200).
_SPLIT_ARGMAX_MIN_VOCAB = 8192


@functools.cache
def _split_argmax() -> Callable[..., torch.Tensor] | None:
    # Imported on first use: the sampler also serves CPU installs without Triton.
    from tidal_engine.kernels.triton import triton_available

    if not triton_available():
        return None
    from tidal_engine.kernels.triton.argmax import argmax_rows

    return argmax_rows


def _greedy_argmax(logits: torch.Tensor, record_into: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    if logits.is_cuda and logits.shape[1] >= _SPLIT_ARGMAX_MIN_VOCAB and (argmax_rows := _split_argmax()):
        return argmax_rows(logits, scatter_into=record_into)  # the record in the same launch
    ids = logits.argmax(dim=-1)
    _record(ids, record_into)
    return ids


def _record(ids: torch.Tensor, record_into: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    if record_into is not None:
        record_into[0].index_copy_(0, record_into[1], ids.view(-1).long())


# ---------------------------------------------------------------- host-side request records


@dataclass
class _Request:
    slot: int
    options: SamplingOptions
    calls: int  # tokens sampled so far, counted on the host (len(output) + sample() calls)
    banned: list[int]  # min_tokens_banned within the vocabulary
    top_k: int  # vocab when off
    greedy: bool
    penalties: bool
    repetition: bool

    @property
    def in_min_tokens(self) -> bool:
        return self.calls < self.options.min_tokens and bool(self.banned) and not self.options.has_grammar


def _group_of(top_k: int, top_p: float, vocab: int) -> str:
    if top_k < vocab:
        return "top_k"
    if top_p < 1.0:
        return "sort"
    return "plain"


# ---------------------------------------------------------------- filtering (exact)


def _filter_candidates(
    x: torch.Tensor,
    group: str,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    max_k: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Filter one group of rows: logits ``x`` [n, V] (any float dtype, not yet divided by the
    temperature), ``temperature`` [n] float32 (> 0).

    Returns unnormalised non-negative float32 weights [n, C] over candidates and the candidates'
    token ids [n, C] (None: the candidates are the whole vocabulary in order). ``top_k`` [n] int64
    (group "top_k" only), ``top_p`` / ``min_p`` [n] float or None when no row of the group uses them.
    The temperature is applied after choosing the candidates (it keeps the order), so the top-k
    path scales only k values per row.
    """
    inv_t = temperature.reciprocal().unsqueeze(1)
    if group == "plain":
        weights = torch.softmax(x.float() * inv_t, dim=-1)
        if min_p is not None:
            threshold = weights.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
            weights = weights.masked_fill(weights < threshold, 0.0)
        return weights, None

    if group == "top_k":
        assert top_k is not None and max_k > 0
        values, ids = top_k_candidates(x, max_k)
        values = values.float() * inv_t
        positions = torch.arange(max_k, device=x.device)
        values = values.masked_fill(positions.unsqueeze(0) >= top_k.unsqueeze(1), float("-inf"))
    else:  # "sort"
        # Stable, so ties keep vocabulary order.
        values, ids = x.sort(dim=-1, descending=True, stable=True)
        values = values.float() * inv_t

    weights = torch.softmax(values, dim=-1)  # sorted descending: column 0 is the max
    if top_p is not None:
        mass_before = weights.cumsum(dim=-1) - weights
        drop = mass_before >= top_p.unsqueeze(1)
        drop[:, 0] = False
        weights = weights.masked_fill(drop, 0.0)
    if min_p is not None:
        # Ratios to the max do not change when renormalising after top-k / top-p.
        weights = weights.masked_fill(weights < weights[:, :1] * min_p.unsqueeze(1), 0.0)
    return weights, ids


# Chunk width of the top-k prefilter: the vocabulary (151,936 for Qwen) splits into whole chunks.
TOPK_CHUNK = 128


def top_k_candidates(x: torch.Tensor, k: int, chunk: int = TOPK_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest values of each row of ``x`` [n, V], sorted descending, and their ids.

    Exact, and much cheaper than one long top-k per row when ``k * chunk`` is small against V:
    the row is cut into chunks of ``chunk`` logits, and only the ``k`` chunks with the largest
    maxima are searched. Any value of the top k lies in one of them: if its chunk were not
    among them, ``k`` other chunks would each hold a value at least as large. (Equal values
    may come back under other ids than ``torch.topk`` picks; the values are the same.)
    """
    n, vocab = x.shape
    if vocab % chunk or 4 * k * chunk > vocab:
        return x.topk(k, dim=-1, sorted=True)
    chunks = x.view(n, vocab // chunk, chunk)
    _, best = chunks.amax(dim=-1).topk(k, dim=-1, sorted=False)  # [n, k] chunk indices
    cand = chunks.gather(1, best.unsqueeze(2).expand(n, k, chunk)).view(n, k * chunk)
    values, pos = cand.topk(k, dim=-1, sorted=True)
    ids = best.gather(1, pos.div(chunk, rounding_mode="floor")) * chunk + pos.remainder(chunk)
    return values, ids


def _draw(weights: torch.Tensor, ids: torch.Tensor | None, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF: the first candidate whose cumulative weight exceeds ``u * total`` (float64)."""
    cdf = weights.to(torch.float64).cumsum(dim=-1)
    total = cdf[:, -1:]
    target = torch.minimum(u.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    pos = (cdf <= target).sum(dim=-1, keepdim=True)
    pos = pos.clamp_max_(weights.shape[1] - 1)  # only reachable if a row has no weight at all
    if ids is None:
        return pos.squeeze(1)
    return ids.gather(1, pos).squeeze(1)


def filtered_probs(
    logits: torch.Tensor,
    temperature: Sequence[float],
    top_k: Sequence[int],
    top_p: Sequence[float],
    min_p: Sequence[float],
) -> torch.Tensor:
    """The normalised probabilities [n, V] that ``sample()`` draws random rows from (tests only:
    the same grouping and ``_filter_candidates``, densified)."""
    n, vocab = logits.shape
    x = logits.float()
    eff_k = [k if 0 < k < vocab else vocab for k in top_k]
    out = torch.zeros((n, vocab), dtype=torch.float32, device=logits.device)
    groups: dict[str, list[int]] = {}
    for i in range(n):
        groups.setdefault(_group_of(eff_k[i], top_p[i], vocab), []).append(i)
    for group, rows in groups.items():
        idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
        k_t = torch.tensor([eff_k[i] for i in rows], dtype=torch.long, device=logits.device)
        p_t = torch.tensor([top_p[i] for i in rows], dtype=torch.float32, device=logits.device)
        m_t = torch.tensor([min_p[i] for i in rows], dtype=torch.float32, device=logits.device)
        t_t = torch.tensor([temperature[i] for i in rows], dtype=torch.float32, device=logits.device)
        weights, ids = _filter_candidates(
            x[idx], group, t_t, k_t if group == "top_k" else None,
            p_t if any(top_p[i] < 1.0 for i in rows) else None,
            m_t if any(min_p[i] > 0.0 for i in rows) else None,
            max(eff_k[i] for i in rows) if group == "top_k" else 0,
        )
        weights = weights / weights.sum(dim=-1, keepdim=True)
        if ids is None:
            out[idx] = weights
        else:
            out[idx] = torch.zeros_like(out[idx]).scatter_(1, ids, weights)
    return out


# ---------------------------------------------------------------- counter-based RNG


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 x in [0, 2**32), without int64 overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (xorshift-multiply), a bijection on [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _hash_uniform(seed_lo: torch.Tensor, seed_hi: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """A float64 uniform in [0, 1) (53 bits) from (seed, counter); all int64 in [0, 2**32)."""
    a = _mix32((counter & _MASK32) ^ 0x9E3779B9)
    a = _mix32(a ^ seed_lo)
    a = _mix32(a ^ seed_hi)
    b = _mix32(a ^ 0x85EBCA6B)
    bits = (a << 21) | (b >> 11)  # 53 bits
    return bits.to(torch.float64) * (1.0 / (1 << 53))


# ---------------------------------------------------------------- host copies


class _HostBuffers:
    """Pinned host buffers used in turn for the async device→host copies of a step's results.

    A buffer is reused only once the step that used it has been read (``result()``); if that
    step is still pending, a fresh buffer is made instead, so nothing pending is overwritten."""

    RING = 4

    def __init__(self) -> None:
        self._ids: list[torch.Tensor | None] = [None] * self.RING
        self._lps: list[torch.Tensor | None] = [None] * self.RING
        self._owners: list[SampledTokens | None] = [None] * self.RING
        self._turn = 0

    def take(self, owner: SampledTokens, n_ids: int, lp_shape: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        self._turn = (self._turn + 1) % self.RING
        t = self._turn
        previous = self._owners[t]
        fresh = previous is not None and not previous.done
        ids = self._ids[t]
        if fresh or ids is None or ids.shape[0] < n_ids:
            ids = torch.empty(max(n_ids, 256), dtype=torch.long, pin_memory=True)
            self._ids[t] = ids
        lps = None
        if lp_shape is not None:
            lps = self._lps[t]
            need = lp_shape[0] * lp_shape[1]
            if fresh or lps is None or lps.numel() < need:
                lps = torch.empty(max(need, 1024), dtype=torch.float32, pin_memory=True)
                self._lps[t] = lps
            lps = lps[:need].view(lp_shape)
        self._owners[t] = owner
        return ids[:n_ids], lps


# ---------------------------------------------------------------- results


class SampledTokens:
    """One step's sampled ids: ``device_ids`` on the device at once (the next step may read
    them there); ``result()`` waits for their copy to the host (and the logprobs')."""

    def __init__(self, device_ids: torch.Tensor) -> None:
        self.device_ids = device_ids
        self.done = False
        self._ids_src: torch.Tensor = device_ids  # host tensor after an async copy
        self._lp_src: torch.Tensor | None = None  # [n_rows_with_logprobs, 2 + 2 * width]
        self._lp_rows: list[int] = []  # batch positions of the rows that asked
        self._lp_counts: list[int] = []  # how many alternatives each asked
        self._lp_width = 0
        self._event: torch.cuda.Event | None = None
        self._result: tuple[list[int], list[SampledLogprobs] | list[None]] | None = None

    def result(self) -> tuple[list[int], list[SampledLogprobs] | list[None]]:
        """(ids, logprobs): logprobs parallel to ids (None for rows that asked none), or an
        empty list when no row asked."""
        if self._result is None:
            if self._event is not None:
                self._event.synchronize()
            ids: list[int] = self._ids_src.tolist()
            logprobs: list = []
            if self._lp_src is not None:
                logprobs = [None] * len(ids)
                values = self._lp_src.tolist()
                w = self._lp_width
                for row, count, v in zip(self._lp_rows, self._lp_counts, values):
                    logprobs[row] = SampledLogprobs(
                        sampled_logprob=v[0],
                        rank=int(v[1]),
                        top_ids=[int(t) for t in v[2 + w : 2 + w + count]],
                        top_logprobs=v[2 : 2 + count],
                    )
            self._result = (ids, logprobs)
            self.done = True
            self._lp_src = None
        return self._result


# ---------------------------------------------------------------- the sampler


class Sampler:
    def __init__(
        self,
        vocab_size: int,
        max_num_seqs: int,
        device: torch.device | str,
        generator: torch.Generator | None = None,
    ) -> None:
        self.vocab_size = vocab_size
        self.max_num_seqs = max_num_seqs
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        # None: torch's default generator for the device (seeded by torch.manual_seed).
        self.generator = generator
        self.num_slots = max(1, max_num_seqs)  # grows if more requests than this are ever known at once
        self._requests: dict[str, _Request] = {}
        self._free = list(range(self.num_slots - 1, -1, -1))  # pop() gives the lowest slot
        self._fparams = torch.zeros((self.num_slots, _NUM_F), dtype=torch.float32, device=self.device)
        self._iparams = torch.zeros((self.num_slots, _NUM_I), dtype=torch.long, device=self.device)
        self._counts: torch.Tensor | None = None  # [slots, vocab] int32 output-token counts
        self._prompt_mask: torch.Tensor | None = None  # [slots, vocab] bool prompt presence
        self._pinned = self.device.type == "cuda"
        self._host_buffers = _HostBuffers() if self._pinned else None

    # ------------------------------------------------------------ requests

    def _to_device(self, values: list | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A host list on the device without waiting for the device (pinned, non-blocking)."""
        if isinstance(values, torch.Tensor):
            host = values.pin_memory() if self._pinned else values
        else:
            host = torch.tensor(values, dtype=dtype, pin_memory=self._pinned)
        if self._pinned:
            return host.to(self.device, non_blocking=True)
        return host.to(self.device)

    def add_request(
        self,
        req_id: str,
        options: SamplingOptions,
        prompt_token_ids: Sequence[int],
        output_token_ids: Sequence[int] = (),
    ) -> None:
        if req_id in self._requests:
            self.remove_request(req_id)
        if not self._free:
            # The worker may briefly know more requests than max_num_seqs (finished ones are
            # forgotten a step later): grow, keeping every slot's state (rare; no host sync).
            self._grow(max(self.num_slots + 1, self.num_slots * 5 // 4))
        vocab = self.vocab_size
        slot = self._free.pop()
        top_k = options.top_k if 0 < options.top_k < vocab else vocab
        repetition = options.repetition_penalty != 1.0
        penalties = repetition or options.frequency_penalty != 0.0 or options.presence_penalty != 0.0
        record = _Request(
            slot=slot,
            options=options,
            calls=len(output_token_ids),
            banned=sorted({t for t in options.min_tokens_banned if 0 <= t < vocab}),
            top_k=top_k,
            greedy=options.temperature < GREEDY_EPS,
            penalties=penalties,
            repetition=repetition,
        )
        seed = options.seed if options.seed is not None else 0
        fvals = [options.temperature, options.top_p, options.min_p, options.repetition_penalty,
                 options.frequency_penalty, options.presence_penalty]
        ivals = [top_k, options.min_tokens, seed & _MASK32, (seed >> 32) & _MASK32, len(output_token_ids)]
        self._fparams[slot].copy_(self._to_device(fvals, torch.float32))
        self._iparams[slot].copy_(self._to_device(ivals, torch.long))
        if penalties:
            if self._counts is None:
                self._counts = torch.zeros((self.num_slots, vocab), dtype=torch.int32, device=self.device)
            row = self._counts[slot]
            row.zero_()
            outputs = [t for t in output_token_ids if 0 <= t < vocab]
            if outputs:
                index = self._to_device(outputs, torch.long)
                row.index_add_(0, index, torch.ones_like(index, dtype=torch.int32))
            if repetition:
                if self._prompt_mask is None:
                    self._prompt_mask = torch.zeros((self.num_slots, vocab), dtype=torch.bool, device=self.device)
                mask = self._prompt_mask[slot]
                mask.zero_()
                prompt = [t for t in prompt_token_ids if 0 <= t < vocab]
                if prompt:
                    mask.index_fill_(0, self._to_device(prompt, torch.long), True)
        self._requests[req_id] = record

    def _grow(self, num_slots: int) -> None:
        old = self.num_slots

        def grown(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            return torch.cat([t, t.new_zeros((num_slots - old, *t.shape[1:]))])

        self._fparams = grown(self._fparams)  # type: ignore[assignment]
        self._iparams = grown(self._iparams)  # type: ignore[assignment]
        self._counts = grown(self._counts)
        self._prompt_mask = grown(self._prompt_mask)
        self._free[:0] = list(range(num_slots - 1, old - 1, -1))
        self.num_slots = num_slots

    def allocate_penalty_state(self) -> None:
        """Allocate the [slots, vocab] output counts and prompt mask now (else lazily, with the
        first request that has a penalty): lets a runner include them in its memory profile."""
        if self._counts is None:
            self._counts = torch.zeros((self.num_slots, self.vocab_size), dtype=torch.int32, device=self.device)
        if self._prompt_mask is None:
            self._prompt_mask = torch.zeros((self.num_slots, self.vocab_size), dtype=torch.bool, device=self.device)

    def count_extra(self, req_id: str, extra: int) -> None:
        """A verify step emitted ``extra`` tokens beyond the one ``sample`` counts (speculative
        decoding): advance the host and device counters (min_tokens, the seeded RNG)."""
        record = self._requests.get(req_id)
        if record is None or extra <= 0:
            return
        record.calls += extra
        self._iparams[record.slot, _NUM_SAMPLED] += extra

    def options_of(self, req_id: str) -> SamplingOptions:
        return self._requests[req_id].options

    def remove_request(self, req_id: str) -> None:
        record = self._requests.pop(req_id, None)
        if record is not None:
            self._free.append(record.slot)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._requests

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    # ------------------------------------------------------------ sampling

    def sample(
        self,
        logits: torch.Tensor,
        req_ids: list[str],
        grammar_bitmasks: dict[str, bytes] | None = None,
        record_into: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> SampledTokens:
        """Queue the sampling of one token per row on the logits' device, update the rows'
        device state, and start copying the ids to the host; nothing here waits for the device.
        ``record_into = (dest, index)``: also ``dest[index[i]] = id of row i`` on the device (the
        persistent batch's last sampled ids; the greedy argmax kernel writes them itself)."""
        if logits.dim() != 2 or logits.shape[0] != len(req_ids):
            raise ValueError(f"logits must be [len(req_ids), vocab], got {tuple(logits.shape)} for {len(req_ids)} rows")
        if logits.shape[1] != self.vocab_size:
            raise ValueError(f"logits have {logits.shape[1]} columns, the sampler's vocabulary is {self.vocab_size}")
        try:
            records = [self._requests[r] for r in req_ids]
        except KeyError as exc:
            raise ValueError(f"unknown request {exc.args[0]!r}: add_request first") from None
        n = len(records)
        device = logits.device
        if n == 0:
            return self._finish(SampledTokens(torch.empty(0, dtype=torch.long, device=device)), None)

        bitmasks = grammar_bitmasks or {}
        grammar_rows = [i for i, r in enumerate(req_ids) if r in bitmasks]
        penalty_rows = [i for i, rec in enumerate(records) if rec.penalties]
        min_tok_rows = [i for i, rec in enumerate(records) if rec.in_min_tokens]
        lp_rows = [i for i, rec in enumerate(records) if rec.options.logprobs is not None]
        random_rows = [i for i, rec in enumerate(records) if not rec.greedy]
        for rec in records:
            rec.calls += 1

        # Fast path: plain greedy rows need nothing but the argmax.
        if not (grammar_rows or penalty_rows or min_tok_rows or lp_rows or random_rows):
            return self._finish(SampledTokens(_greedy_argmax(logits, record_into)), None)

        # One host→device copy of every index this step needs.
        groups: dict[str, list[int]] = {}
        for i in random_rows:
            groups.setdefault(_group_of(records[i].top_k, records[i].options.top_p, self.vocab_size), []).append(i)
        mt_pairs = [(i, t) for i in min_tok_rows for t in records[i].banned]
        seeded = [1 if records[i].options.seed is not None else 0 for i in random_rows]
        pieces: dict[str, list[int]] = {
            "slots": [rec.slot for rec in records],
            "penalty": penalty_rows,
            "mt_row": [p[0] for p in mt_pairs],
            "mt_tok": [p[1] for p in mt_pairs],
            "grammar": grammar_rows,
            "random": random_rows,
            "seeded": seeded,
            "lp": lp_rows,
        }
        pos_in_random = {row: j for j, row in enumerate(random_rows)}
        for name, rows in groups.items():
            pieces["gr_" + name] = [pos_in_random[i] for i in rows]
        flat: list[int] = []
        spans: dict[str, tuple[int, int]] = {}
        for name, values in pieces.items():
            spans[name] = (len(flat), len(values))
            flat.extend(values)
        packed = self._to_device(flat, torch.long)

        def part(name: str) -> torch.Tensor:
            start, length = spans[name]
            return packed.narrow(0, start, length)

        slots = part("slots")
        fparams = self._fparams.index_select(0, slots)
        iparams = self._iparams.index_select(0, slots)

        # A float32 copy only when something modifies the logits: the caller's tensor stays
        # untouched, and the top-k / sort paths read bf16 logits directly otherwise.
        processing = bool(penalty_rows or mt_pairs or grammar_rows)
        x = logits.to(torch.float32, copy=True) if processing else logits

        if penalty_rows:
            self._apply_penalties(x, slots, fparams, part("penalty"), len(penalty_rows) == n,
                                  any(records[i].repetition for i in penalty_rows))
        if mt_pairs:
            rows_t, toks_t = part("mt_row"), part("mt_tok")
            active = iparams[rows_t, _NUM_SAMPLED] < iparams[rows_t, _MIN_TOKENS]
            current = x[rows_t, toks_t]
            x[rows_t, toks_t] = torch.where(active, torch.full_like(current, float("-inf")), current)
        if grammar_rows:
            self._apply_bitmasks(x, [bitmasks[req_ids[i]] for i in grammar_rows], part("grammar"), len(grammar_rows) == n)

        # Greedy rows (and any others: overwritten below) take the argmax.
        if len(random_rows) < n:
            tokens = x.argmax(dim=-1)
        else:
            tokens = torch.empty(n, dtype=torch.long, device=device)
        if random_rows:
            all_random = len(random_rows) == n
            r_idx = part("random")
            xr = x if all_random else x.index_select(0, r_idx)
            fr = fparams if all_random else fparams.index_select(0, r_idx)
            ir = iparams if all_random else iparams.index_select(0, r_idx)
            u = self._uniforms(ir, part("seeded"), seeded)
            r_tokens = torch.empty(len(random_rows), dtype=torch.long, device=device)
            for name, rows in groups.items():
                whole = len(rows) == len(random_rows)
                g = part("gr_" + name)
                xg = xr if whole else xr.index_select(0, g)
                fg = fr if whole else fr.index_select(0, g)
                ig = ir if whole else ir.index_select(0, g)
                recs = [records[i] for i in rows]
                weights, ids = _filter_candidates(
                    xg,
                    name,
                    fg[:, _TEMP],
                    ig[:, _TOP_K] if name == "top_k" else None,
                    fg[:, _TOP_P] if any(rec.options.top_p < 1.0 for rec in recs) else None,
                    fg[:, _MIN_P] if any(rec.options.min_p > 0.0 for rec in recs) else None,
                    max(rec.top_k for rec in recs) if name == "top_k" else 0,
                )
                drawn = _draw(weights, ids, u if whole else u.index_select(0, g))
                if whole:
                    r_tokens = drawn
                else:
                    r_tokens.index_copy_(0, g, drawn)
            if all_random:
                tokens = r_tokens
            else:
                tokens.index_copy_(0, r_idx, r_tokens)

        # Record the draw in the slots' state, on the device.
        self._iparams[:, _NUM_SAMPLED].index_add_(0, slots, torch.ones_like(slots))
        if penalty_rows and self._counts is not None:
            p_idx = part("penalty")
            p_slots = slots if len(penalty_rows) == n else slots.index_select(0, p_idx)
            p_tokens = tokens if len(penalty_rows) == n else tokens.index_select(0, p_idx)
            self._counts.index_put_((p_slots, p_tokens), torch.ones_like(p_tokens, dtype=torch.int32), accumulate=True)

        out = SampledTokens(tokens)
        lp = None
        if lp_rows:
            wanted = [min(records[i].options.logprobs or 0, self.vocab_size) for i in lp_rows]
            lp = self._logprobs(logits, tokens, part("lp"), len(lp_rows) == n, max(wanted))
            out._lp_rows = lp_rows
            out._lp_counts = wanted
            out._lp_width = max(wanted)
        _record(tokens, record_into)
        return self._finish(out, lp)

    def _finish(self, out: SampledTokens, lp: torch.Tensor | None) -> SampledTokens:
        """Start the async device→host copies (CUDA) or keep the tensors as they are (CPU)."""
        if out.device_ids.is_cuda and self._host_buffers is not None and out.device_ids.numel():
            host_ids, host_lp = self._host_buffers.take(out, out.device_ids.shape[0], tuple(lp.shape) if lp is not None else None)
            host_ids.copy_(out.device_ids, non_blocking=True)
            if lp is not None and host_lp is not None:
                host_lp.copy_(lp, non_blocking=True)
            out._ids_src = host_ids
            out._lp_src = host_lp
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(out.device_ids.device))
            out._event = event
        else:
            out._lp_src = lp
        return out

    def _uniforms(self, ir: torch.Tensor, seeded_t: torch.Tensor, seeded: list[int]) -> torch.Tensor:
        """One float64 uniform in [0, 1) per random row: hashed for seeded rows, else shared."""
        m = ir.shape[0]
        hashed = None
        if any(seeded):
            hashed = _hash_uniform(ir[:, _SEED_LO], ir[:, _SEED_HI], ir[:, _NUM_SAMPLED])
            if all(seeded):
                return hashed
        shared = torch.rand(m, dtype=torch.float64, device=ir.device, generator=self.generator)
        if hashed is None:
            return shared
        return torch.where(seeded_t.bool(), hashed, shared)

    def _apply_penalties(
        self,
        x: torch.Tensor,
        slots: torch.Tensor,
        fparams: torch.Tensor,
        p_idx: torch.Tensor,
        whole: bool,
        repetition: bool,
    ) -> None:
        assert self._counts is not None
        p_slots = slots if whole else slots.index_select(0, p_idx)
        f = fparams if whole else fparams.index_select(0, p_idx)
        sub = x if whole else x.index_select(0, p_idx)
        counts = self._counts.index_select(0, p_slots)
        present = counts > 0
        if repetition:
            assert self._prompt_mask is not None
            seen = present | self._prompt_mask.index_select(0, p_slots)
            r = f[:, _REP].unsqueeze(1)
            sub = torch.where(seen, torch.where(sub > 0, sub / r, sub * r), sub)
        sub = sub - f[:, _FREQ].unsqueeze(1) * counts.to(sub.dtype) - f[:, _PRES].unsqueeze(1) * present.to(sub.dtype)
        if whole:
            x.copy_(sub)
        else:
            x.index_copy_(0, p_idx, sub)

    def _apply_bitmasks(self, x: torch.Tensor, masks: list[bytes], g_idx: torch.Tensor, whole: bool) -> None:
        vocab = x.shape[1]
        widths = [len(m) // 4 for m in masks]
        width = max(widths)
        if len(set(widths)) > 1:  # pad narrower rows with all-allowed words
            masks = [m + b"\xff" * (4 * (width - w)) for m, w in zip(masks, widths)]
        host = torch.frombuffer(bytearray(b"".join(masks)), dtype=torch.int32).view(len(masks), width)
        words = self._to_device(host, torch.int32)
        shifts = torch.arange(32, dtype=torch.int32, device=x.device)
        allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)
        if allowed.shape[1] >= vocab:
            allowed = allowed[:, :vocab]
        else:  # tokens beyond the bitmask stay allowed
            pad = torch.ones((allowed.shape[0], vocab - allowed.shape[1]), dtype=torch.bool, device=x.device)
            allowed = torch.cat([allowed, pad], dim=1)
        if whole:
            x.masked_fill_(~allowed, float("-inf"))
        else:
            x.index_copy_(0, g_idx, x.index_select(0, g_idx).masked_fill(~allowed, float("-inf")))

    def _logprobs(
        self,
        logits: torch.Tensor,
        tokens: torch.Tensor,
        lp_idx: torch.Tensor,
        whole: bool,
        width: int,
    ) -> torch.Tensor:
        """[rows, 2 + 2 * width] float32: sampled logprob, rank, top logprobs, top ids (exact in
        float32 below 2**24)."""
        raw = logits if whole else logits.index_select(0, lp_idx)
        raw = torch.log_softmax(raw.float(), dim=-1)
        sampled_tokens = tokens if whole else tokens.index_select(0, lp_idx)
        sampled = raw.gather(1, sampled_tokens.unsqueeze(1))
        rank = (raw > sampled).sum(dim=-1, keepdim=True) + 1
        parts = [sampled, rank.to(torch.float32)]
        if width > 0:
            top_values, top_ids = raw.topk(width, dim=-1)
            parts += [top_values, top_ids.to(torch.float32)]
        return torch.cat(parts, dim=1)

