"""The verify step of speculative decoding: one target forward over a mixed batch in which
some decode rows carry drafts as extra query tokens; logits at every verified position;
plain rows sample as usual, drafting rows go through the exact rejection sampler.

The forward replays a verify graph (runner/mixed_graphs.py ``VerifyGraphs``: rows of at most
k + 1 tokens, the multi-query decode attention) when every row fits one, else a mixed-step
graph (a prefill chunk in the batch), else runs eagerly (LoRA rows, no graphs, CPU).

Synchronous by design (the engine turns async scheduling off with speculation): nothing here
feeds tokens on the device, and the result is read on the host right after.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tidal_engine.runner.sampler import GREEDY_EPS, filtered_probs
from tidal_engine.spec_decode.rejection_sampler import rejection_sample

if TYPE_CHECKING:
    from tidal_engine.runner.input_buffers import StepInput, StepLayout
    from tidal_engine.runner.model_runner import ModelRunner


class VerifiedTokens:
    """A verify step's tokens: ``result()`` gives one list of 1..k+1 ids per sampling row."""

    def __init__(self, plain: Any, plain_pos: list[int], spec: tuple[torch.Tensor, torch.Tensor] | None,
                 spec_pos: list[int], num_rows: int) -> None:
        self._plain, self._plain_pos = plain, plain_pos
        self._spec, self._spec_pos = spec, spec_pos
        self._num_rows = num_rows
        self.done = False

    def result(self) -> tuple[list[list[int]], list[None]]:
        out: list[list[int]] = [[] for _ in range(self._num_rows)]
        if self._plain is not None:
            ids, _ = self._plain.result()
            for pos, t in zip(self._plain_pos, ids):
                out[pos] = [int(t)]
        if self._spec is not None:
            tokens, emitted = self._spec
            packed = torch.cat([emitted[:, None], tokens], dim=1).cpu().tolist()  # one device → host copy
            for pos, row in zip(self._spec_pos, packed):
                out[pos] = row[1 : 1 + row[0]]
        self.done = True
        return out, []


def _stage(runner: ModelRunner, step: StepInput, allow_graphs: bool) -> tuple[StepLayout, Callable[[], torch.Tensor]]:
    """Stage the step; returns its layout and the forward to launch, which gives the final
    hidden states (the real tokens first, in the layout's order)."""
    width = runner._width(step)
    verify = runner.verify_graphs if allow_graphs else None
    bucket = None
    if verify is not None:
        bucket = verify.bucket_for_step(int(step.q_lens.max()), int(step.rows.shape[0]), width)
    if bucket is not None:
        assert verify is not None
        layout, staged = runner._stage(step, width, verify.seqs_for(bucket), bucket)
        return layout, lambda: verify.replay(bucket, staged, runner._block_tables(layout, staged))
    mixed = runner._mixed_bucket(step, width) if allow_graphs else None
    if mixed is not None:
        graphs = runner.mixed_graphs
        assert graphs is not None
        layout, staged = runner._stage(step, width, graphs.seqs_for(mixed), mixed)
        return layout, lambda: graphs.replay(mixed, staged, runner._block_tables(layout, staged))
    layout, staged = runner._stage(step, width, None)
    ids, positions, meta, _ = runner._views(layout, staged)
    return layout, lambda: runner.model(ids, positions, runner.kv_caches, meta)


def execute_verify(
    runner: ModelRunner,
    step: StepInput,
    sample_req_ids: list[str],
    drafts: list[list[int]],
    grammar_bitmasks: dict[str, bytes] | None,
    allow_graphs: bool = True,
) -> VerifiedTokens | None:
    layout, forward = _stage(runner, step, allow_graphs)
    if not layout.num_samples:
        forward()
        return None
    # Logit rows: for each sampling sequence, its last num_drafts + 1 tokens.
    ends = layout.sample_rows  # flat index of each sampling sequence's last token
    nd = np.asarray([len(d) for d in drafts], dtype=np.int64)
    counts = nd + 1
    first = np.repeat(ends - nd, counts)
    offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    starts = np.cumsum(counts) - counts
    plain_pos = [i for i in range(len(drafts)) if nd[i] == 0]
    spec_pos = [i for i in range(len(drafts)) if nd[i] > 0]
    k = int(nd.max())
    r = len(spec_pos)
    draft_ids = np.zeros((r, k), dtype=np.int64)
    for j, i in enumerate(spec_pos):
        draft_ids[j, : nd[i]] = drafts[i]
    spec_index = np.concatenate([starts[i] + np.minimum(np.arange(k + 1), nd[i]) for i in spec_pos]) if spec_pos else []
    # Every index the step needs, in one host → device copy queued before the forward (a copy
    # from pageable memory after it would wait for it before the next launches are queued).
    parts = [first + offsets, starts[plain_pos], spec_index, draft_ids.reshape(-1), nd[spec_pos]]
    sizes = [len(x) for x in parts]
    uploaded = torch.as_tensor(np.concatenate(parts).astype(np.int64), device=runner.device)
    rows_t, plain_index, spec_index_t, draft_ids_t, nd_t = torch.split(uploaded, sizes)
    hidden = forward()
    logits = runner.model.compute_logits(hidden.index_select(0, rows_t))
    sampler = runner.sampler
    plain = None
    if plain_pos:
        plain_ids = [sample_req_ids[i] for i in plain_pos]
        masks = {rid: m for rid, m in (grammar_bitmasks or {}).items() if rid in plain_ids} or None
        plain = sampler.sample(logits.index_select(0, plain_index), plain_ids, masks)
    spec = None
    if spec_pos:
        vocab = logits.shape[1]
        spec_logits = logits.index_select(0, spec_index_t).view(r, k + 1, vocab)
        options = [sampler.options_of(sample_req_ids[i]) for i in spec_pos]
        greedy = [o.temperature < GREEDY_EPS for o in options]
        all_greedy = all(greedy)
        probs = spec_logits if all_greedy else spec_logits.float()
        sampled_rows = [j for j, g in enumerate(greedy) if not g]
        if sampled_rows:  # the target's filtered distribution, as the plain sampler draws from
            flat = spec_logits[sampled_rows].reshape(-1, vocab)
            rep = k + 1
            o = [options[j] for j in sampled_rows]
            dist = filtered_probs(flat, [x.temperature for x in o for _ in range(rep)],
                                  [x.top_k for x in o for _ in range(rep)], [x.top_p for x in o for _ in range(rep)],
                                  [x.min_p for x in o for _ in range(rep)])
            probs[sampled_rows] = dist.view(len(sampled_rows), rep, vocab)
        greedy_t = torch.ones(r, dtype=torch.bool, device=logits.device) if all_greedy else \
            torch.as_tensor(greedy, device=logits.device)
        spec = rejection_sample(probs, draft_ids_t.view(r, k), nd_t, greedy_t, generator=sampler.generator,
                                all_greedy=all_greedy)
        for i in spec_pos:  # the worker adds the rest once it knows how many were emitted
            sampler.count_extra(sample_req_ids[i], 1)
    return VerifiedTokens(plain, plain_pos, spec, spec_pos, len(drafts))
