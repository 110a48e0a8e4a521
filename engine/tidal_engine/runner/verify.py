"""The verify step of speculative decoding: one target forward over a mixed batch in which
some decode rows carry drafts as extra query tokens; logits at every verified position;
plain rows sample as usual, drafting rows go through the exact rejection sampler.

The forward replays a verify graph (runner/mixed_graphs.py ``VerifyGraphs``: rows of at most
k + 1 tokens, the multi-query decode attention) when every row fits one, else a mixed-step
graph (a prefill chunk in the batch), else runs eagerly (LoRA rows, no graphs, CPU).

With a draft model, it writes the drafts of the rows with device draft slots into the staged
inputs right before the target forward, and its KV for the step's tokens right after
(spec_decode/draft_model.py). With drafts made on the host (a synchronous engine), nothing here feeds tokens on the device
and the result is read on the host right after. With drafts made on the device (async
scheduling, ``_verify_on_device``) the drafts are read from the step's inputs, accepted on the
device, the tokens appended to the device histories and the next drafts proposed, all before
the host reads anything; the result's copy is started at once and waited for a step later.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tidal_engine.core.request import PLACEHOLDER_TOKEN
from tidal_engine.runner.sampler import GREEDY_EPS, filtered_probs
from tidal_engine.spec_decode.rejection_sampler import accept_greedy, rejection_sample

if TYPE_CHECKING:
    from tidal_engine.runner.input_buffers import StepInput, StepLayout
    from tidal_engine.runner.model_runner import ModelRunner


class VerifiedTokens:
    """A verify step's tokens: ``result()`` gives one list of 1..k+1 ids per sampling row.

    ``spec``: the rejection sampler's ``(tokens, num_emitted)`` on the device, or ``greedy``:
    the argmax of every logit row on the device plus, per drafting row, its first logit row
    and its drafts; those rows are verified on the host (``accept_greedy``) after one copy."""

    def __init__(self, plain: Any, plain_pos: list[int], spec: tuple[torch.Tensor, torch.Tensor] | None,
                 spec_pos: list[int], num_rows: int,
                 greedy: tuple[torch.Tensor, list[int], list[list[int]]] | None = None) -> None:
        self._plain, self._plain_pos = plain, plain_pos
        self._spec, self._spec_pos = spec, spec_pos
        self._greedy = greedy
        self._num_rows = num_rows
        self._packed: torch.Tensor | None = None  # the spec rows' (emitted, tokens), copied early
        self._event: torch.cuda.Event | None = None
        self.done = False

    def start_copy(self) -> None:
        """Start the spec rows' device → host copy now (async scheduling: ``result()`` comes
        after the next step is queued, and must not wait for it)."""
        if self._spec is None:
            return
        tokens, emitted = self._spec
        packed = torch.cat([emitted[:, None], tokens], dim=1)
        if packed.device.type == "cuda":
            self._packed = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            self._packed.copy_(packed, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._packed = packed

    def result(self) -> tuple[list[list[int]], list[None]]:
        out: list[list[int]] = [[] for _ in range(self._num_rows)]
        if self._plain is not None:
            ids, _ = self._plain.result()
            for pos, t in zip(self._plain_pos, ids):
                out[pos] = [int(t)]
        if self._greedy is not None:
            argmax, firsts, drafts = self._greedy
            flat = argmax.tolist()  # one device → host copy
            for pos, first, d in zip(self._spec_pos, firsts, drafts):
                out[pos] = accept_greedy(flat[first : first + len(d) + 1], d)
        elif self._packed is not None:
            if self._event is not None:
                self._event.synchronize()
            packed = self._packed.tolist()
            for pos, row in zip(self._spec_pos, packed):
                out[pos] = row[1 : 1 + row[0]]
        elif self._spec is not None:
            tokens, emitted = self._spec
            packed = torch.cat([emitted[:, None], tokens], dim=1).cpu().tolist()  # one device → host copy
            for pos, row in zip(self._spec_pos, packed):
                out[pos] = row[1 : 1 + row[0]]
        self.done = True
        return out, []


def _stage(runner: ModelRunner, step: StepInput,
           allow_graphs: bool) -> tuple[StepLayout, torch.Tensor, Callable[[], torch.Tensor]]:
    """Stage the step; returns its layout, the staged buffer and the forward to launch, which
    gives the final hidden states (the real tokens first, in the layout's order)."""
    width = runner._width(step)
    verify = runner.verify_graphs if allow_graphs else None
    bucket = None
    if verify is not None:
        bucket = verify.bucket_for_step(int(step.q_lens.max()), int(step.rows.shape[0]), width)
    if bucket is not None:
        assert verify is not None
        layout, staged = runner._stage(step, width, verify.seqs_for(bucket), bucket)
        return layout, staged, lambda: verify.replay(bucket, staged, runner._block_tables(layout, staged))
    mixed = runner._mixed_bucket(step, width) if allow_graphs else None
    if mixed is not None:
        graphs = runner.mixed_graphs
        assert graphs is not None
        layout, staged = runner._stage(step, width, graphs.seqs_for(mixed), mixed)
        return layout, staged, lambda: graphs.replay(mixed, staged, runner._block_tables(layout, staged))
    layout, staged = runner._stage(step, width, None)
    ids, positions, meta, _ = runner._views(layout, staged)
    return layout, staged, lambda: runner.model(ids, positions, runner.kv_caches, meta)


class _VerifyIndex:
    """A verify step's index arrays, built on the host (numpy, no per-row Python loop).

    ``logit_rows``: the flat rows whose logits are computed (each sampling sequence's last
    ``drafts + 1`` tokens, in order); ``plain_index`` / ``spec_index``: rows of those logits for
    the rows without drafts / the ``k + 1`` positions of each drafting row (a row with fewer
    than ``k`` drafts repeats its last); ``draft_ids`` ``[r, k]`` (zeros past a row's drafts)."""

    def __init__(self, sample_rows: np.ndarray, drafts: list[list[int]]) -> None:
        nd = np.fromiter((len(d) for d in drafts), dtype=np.int64, count=len(drafts))
        counts = nd + 1
        starts = np.cumsum(counts) - counts
        self.logit_rows = np.repeat(sample_rows - nd, counts) + np.arange(int(counts.sum())) - np.repeat(starts, counts)
        spec = nd > 0
        self.plain_pos = np.flatnonzero(~spec)
        self.spec_pos = np.flatnonzero(spec)
        self.num_drafts = nd[self.spec_pos]
        self.k = k = int(nd.max())
        self.plain_index = starts[self.plain_pos]
        self.spec_index = (starts[self.spec_pos, None] + np.minimum(np.arange(k + 1), self.num_drafts[:, None])).reshape(-1)
        self.draft_ids = np.zeros((len(self.spec_pos), k), dtype=np.int64)
        if len(self.spec_pos):
            flat = np.fromiter(itertools.chain.from_iterable(drafts[i] for i in self.spec_pos), dtype=np.int64,
                               count=int(self.num_drafts.sum()))
            self.draft_ids[np.arange(k) < self.num_drafts[:, None]] = flat  # row-major: each row's drafts in order

    def upload(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(logit_rows, plain_index, spec_index, draft_ids [r, k], num_drafts) on ``device`` in one
        copy; on CUDA from pinned memory without waiting (the forward is already queued)."""
        parts = [self.logit_rows, self.plain_index, self.spec_index, self.draft_ids.reshape(-1), self.num_drafts]
        host = torch.from_numpy(np.concatenate(parts))
        if device.type == "cuda":
            flat = host.pin_memory().to(device, non_blocking=True)  # the caching host allocator keeps it until copied
        else:
            flat = host.to(device)
        rows, plain, spec, draft_ids, nd = torch.split(flat, [len(x) for x in parts])
        return rows, plain, spec, draft_ids.view(len(self.spec_pos), self.k), nd


def execute_verify(
    runner: ModelRunner,
    step: StepInput,
    sample_req_ids: list[str],
    drafts: list[list[int]],
    grammar_bitmasks: dict[str, bytes] | None,
    allow_graphs: bool = True,
) -> VerifiedTokens | None:
    if runner.batch.device_drafts is not None:
        # Rows whose last token is in flight (placeholder drafts in the plan) take their input
        # token from the device too, however much of their history this worker has recorded.
        in_flight = np.fromiter((bool(d) and d[0] == PLACEHOLDER_TOKEN for d in drafts), dtype=bool,
                                count=len(drafts))
        if in_flight.any():
            step.fed = step.fed.copy()
            step.fed[np.flatnonzero(step.samples)[in_flight]] = True
    layout, staged, forward = _stage(runner, step, allow_graphs)
    if runner.draft is not None:
        _draft_model_proposes(runner, step, layout, staged, drafts)
    hidden = forward()  # queued first: the verification's indices are built while it runs
    runner.draft_forward(layout, staged)
    if not layout.num_samples:
        return None
    index = _VerifyIndex(layout.sample_rows, drafts)
    if runner.batch.device_drafts is not None:
        return _verify_on_device(runner, layout, staged, hidden, index, sample_req_ids, grammar_bitmasks)
    sampler = runner.sampler
    plain_pos, spec_pos = index.plain_pos.tolist(), index.spec_pos.tolist()
    options = [sampler.options_of(sample_req_ids[i]) for i in spec_pos]
    greedy = [o.temperature < GREEDY_EPS for o in options]
    all_greedy = all(greedy)
    # Only plain rows and sampled drafting rows read index tensors on the device; greedy
    # drafting rows are verified on the host from their argmaxes. Contiguous logit rows (every
    # row drafted as many tokens as it computes, e.g. a decode batch with k drafts each) are a
    # slice of the hidden states: then such a step uploads nothing.
    rows = index.logit_rows
    n = len(rows)
    if plain_pos or not all_greedy or not (np.diff(rows) == 1).all():
        rows_t, plain_index, spec_index_t, draft_ids_t, nd_t = index.upload(runner.device)
        logits = runner.model.compute_logits(hidden.index_select(0, rows_t))
    else:
        logits = runner.model.compute_logits(hidden[int(rows[0]) : int(rows[0]) + n])
    plain = None
    if plain_pos:
        plain_ids = [sample_req_ids[i] for i in plain_pos]
        masks = {rid: m for rid, m in (grammar_bitmasks or {}).items() if rid in plain_ids} or None
        plain = sampler.sample(logits.index_select(0, plain_index), plain_ids, masks)
    spec = None
    greedy_host = None
    if spec_pos:
        k, r = index.k, len(spec_pos)
        vocab = logits.shape[1]
        if all_greedy:  # one argmax per logit row, read on the host with the drafts there
            firsts = (index.spec_index[:: k + 1]).tolist()
            greedy_host = (logits.argmax(dim=1), firsts, [drafts[i] for i in spec_pos])
        else:
            probs = logits.index_select(0, spec_index_t).view(r, k + 1, vocab)
            sampled_rows = [j for j, g in enumerate(greedy) if not g]
            spec = _accept(probs, torch.as_tensor(sampled_rows, device=logits.device),
                           [options[j] for j in sampled_rows], draft_ids_t, nd_t,
                           torch.as_tensor(greedy, device=logits.device), sampler.generator)
        for i in spec_pos:  # the worker adds the rest once it knows how many were emitted
            sampler.count_extra(sample_req_ids[i], 1)
    return VerifiedTokens(plain, plain_pos, spec, spec_pos, len(drafts), greedy_host)


def _draft_model_proposes(runner: ModelRunner, step: StepInput, layout: StepLayout, staged: torch.Tensor,
                          drafts: list[list[int]]) -> None:
    """The draft model writes the drafts of every row with device draft slots into the staged
    input ids, after the row's first token (fed and shifted on the device already when its
    previous step was in flight); before the target forward that verifies them."""
    draft = runner.draft
    assert draft is not None
    device_rows = [i for i, d in enumerate(drafts) if d and d[0] < 0]
    if not device_rows:
        return
    index = np.asarray(device_rows, dtype=np.int64)
    nd = np.fromiter((len(drafts[i]) for i in device_rows), dtype=np.int64, count=len(device_rows))
    first = layout.sample_rows[index] - nd
    rows = step.rows[step.samples][index]
    host = torch.from_numpy(np.concatenate([first, rows, nd]))
    dev = runner.device
    flat = host.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else host.to(dev)
    first_t, rows_t, nd_t = torch.split(flat, [len(first), len(rows), len(nd)])
    off = layout.offsets()
    (a, b), (pa, pb) = off["input_ids"], off["positions"]
    tables = runner.batch.block_table_dev[:, : layout.width].index_select(0, rows_t)
    draft.propose_into(staged[a:b], staged[pa:pb], first_t, tables, nd_t, int(nd.max()))


def _accept(probs: torch.Tensor, sampled_index: torch.Tensor, sampled_options: list, draft_ids: torch.Tensor,
            num_drafts: torch.Tensor, greedy: torch.Tensor,
            generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling of the drafting rows ``probs`` [r, k + 1, V] (their logits): the
    sampled rows (``sampled_index``) first get the target's filtered distribution, as the plain
    sampler draws from; greedy rows keep their logits (only their argmax is read)."""
    _, rep, vocab = probs.shape
    o = sampled_options
    dist = filtered_probs(probs.index_select(0, sampled_index).reshape(-1, vocab),
                          [x.temperature for x in o for _ in range(rep)], [x.top_k for x in o for _ in range(rep)],
                          [x.top_p for x in o for _ in range(rep)], [x.min_p for x in o for _ in range(rep)])
    probs.index_copy_(0, sampled_index, dist.view(len(o), rep, vocab))
    return rejection_sample(probs, draft_ids, num_drafts, greedy, generator=generator)


def _verify_on_device(runner: ModelRunner, layout: StepLayout, staged: torch.Tensor, hidden: torch.Tensor,
                      index: _VerifyIndex, sample_req_ids: list[str],
                      grammar_bitmasks: dict[str, bytes] | None) -> VerifiedTokens:
    """Drafts made on the device (async scheduling): the drafts are read from the step's input
    ids (the host never saw a fed row's drafts), accepted on the device, and every sampling
    row's tokens go into the device histories, with the next drafts proposed from them, before
    anything is read back; the host copy of the result is started here and waited for later."""
    device = runner.device
    sampler = runner.sampler
    drafts_state = runner.batch.device_drafts
    assert drafts_state is not None
    plain_pos, spec_pos = index.plain_pos.tolist(), index.spec_pos.tolist()
    k, r = index.k, len(spec_pos)
    options = [sampler.options_of(sample_req_ids[i]) for i in spec_pos]
    greedy = np.asarray([o.temperature < GREEDY_EPS for o in options], dtype=bool)
    sampled_rows = np.flatnonzero(~greedy)
    # Each drafting row's draft positions in the flat batch (a row with fewer than k repeats its last).
    first_draft = layout.sample_rows[index.spec_pos] - index.num_drafts + 1
    draft_rows = first_draft[:, None] + np.minimum(np.arange(k), np.maximum(index.num_drafts - 1, 0)[:, None])
    extra = [draft_rows.reshape(-1), index.plain_pos, index.spec_pos, greedy.astype(np.int64), sampled_rows]
    rows_t, plain_index, spec_index_t, _, nd_t = index.upload(device)
    flat = torch.from_numpy(np.concatenate(extra).astype(np.int64))  # one copy, never a pageable one
    flat = flat.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else flat.to(device)
    draft_rows_t, plain_pos_t, spec_pos_t, greedy_t, sampled_rows_t = torch.split(flat, [len(x) for x in extra])
    a, b = layout.offsets()["input_ids"]
    draft_ids = staged[a:b].index_select(0, draft_rows_t).view(r, k)
    logits = runner.model.compute_logits(hidden.index_select(0, rows_t))
    sa, sb = layout.offsets()["sampled_rows"]
    sampling_rows = staged[sa:sb]  # persistent-batch rows, in sample order
    plain = None
    if plain_pos:
        plain_ids = [sample_req_ids[i] for i in plain_pos]
        masks = {rid: m for rid, m in (grammar_bitmasks or {}).items() if rid in plain_ids} or None
        plain = sampler.sample(logits.index_select(0, plain_index), plain_ids, masks)
        ids = plain.device_ids.view(-1).long()
        plain_rows = sampling_rows.index_select(0, plain_pos_t)
        runner.batch.last_sampled_dev.index_copy_(0, plain_rows, ids)
        drafts_state.record(plain_rows, ids[:, None], torch.ones_like(ids))
    spec = None
    if spec_pos:
        vocab = logits.shape[1]
        if greedy.all():  # the argmax chain: accept while the draft is the argmax
            best = logits.argmax(dim=1).index_select(0, spec_index_t).view(r, k + 1)
            match = (best[:, :k] == draft_ids) & (torch.arange(k, device=device)[None, :] < nd_t[:, None])
            emitted = match.long().cumprod(dim=1).sum(dim=1) + 1
            tokens = best
        else:
            probs = logits.index_select(0, spec_index_t).view(r, k + 1, vocab)
            tokens, emitted = _accept(probs, sampled_rows_t, [options[j] for j in sampled_rows.tolist()], draft_ids,
                                      nd_t, greedy_t.bool(), sampler.generator)
        spec_rows = sampling_rows.index_select(0, spec_pos_t)
        last = tokens.gather(1, (emitted - 1)[:, None]).view(-1)
        runner.batch.last_sampled_dev.index_copy_(0, spec_rows, last)
        drafts_state.record(spec_rows, tokens, emitted)
        spec = (tokens, emitted)
        for i in spec_pos:  # the worker adds the rest once it knows how many were emitted
            sampler.count_extra(sample_req_ids[i], 1)
    drafts_state.propose(sampling_rows, runner._history_width)
    result = VerifiedTokens(plain, plain_pos, spec, spec_pos, len(sample_req_ids))
    result.start_copy()
    return result
