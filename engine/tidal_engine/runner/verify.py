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


def _forward(runner: ModelRunner, step: StepInput, allow_graphs: bool) -> tuple[StepLayout, torch.Tensor]:
    """The step's final hidden states (the real tokens first, in the layout's order)."""
    width = runner._width(step)
    verify = runner.verify_graphs if allow_graphs else None
    bucket = None
    if verify is not None:
        bucket = verify.bucket_for_step(int(step.q_lens.max()), int(step.rows.shape[0]), width)
    if bucket is not None:
        assert verify is not None
        layout, staged = runner._stage(step, width, verify.seqs_for(bucket), bucket)
        return layout, verify.replay(bucket, staged, runner._block_tables(layout, staged))
    mixed = runner._mixed_bucket(step, width) if allow_graphs else None
    if mixed is not None:
        assert runner.mixed_graphs is not None
        layout, staged = runner._stage(step, width, runner.mixed_graphs.seqs_for(mixed), mixed)
        return layout, runner.mixed_graphs.replay(mixed, staged, runner._block_tables(layout, staged))
    layout, staged = runner._stage(step, width, None)
    ids, positions, meta, _ = runner._views(layout, staged)
    return layout, runner.model(ids, positions, runner.kv_caches, meta)


def execute_verify(
    runner: ModelRunner,
    step: StepInput,
    sample_req_ids: list[str],
    drafts: list[list[int]],
    grammar_bitmasks: dict[str, bytes] | None,
    allow_graphs: bool = True,
) -> VerifiedTokens | None:
    layout, hidden = _forward(runner, step, allow_graphs)
    if not layout.num_samples:
        return None
    # Logit rows: for each sampling sequence, its last num_drafts + 1 tokens.
    ends = layout.sample_rows  # flat index of each sampling sequence's last token
    nd = np.asarray([len(d) for d in drafts], dtype=np.int64)
    counts = nd + 1
    first = np.repeat(ends - nd, counts)
    offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    rows_t = torch.as_tensor(first + offsets, device=hidden.device)
    logits = runner.model.compute_logits(hidden.index_select(0, rows_t))
    starts = np.cumsum(counts) - counts
    plain_pos = [i for i in range(len(drafts)) if nd[i] == 0]
    spec_pos = [i for i in range(len(drafts)) if nd[i] > 0]
    sampler = runner.sampler
    plain = None
    if plain_pos:
        index = torch.as_tensor(starts[plain_pos], device=logits.device)
        plain_ids = [sample_req_ids[i] for i in plain_pos]
        masks = {r: m for r, m in (grammar_bitmasks or {}).items() if r in plain_ids} or None
        plain = sampler.sample(logits.index_select(0, index), plain_ids, masks)
    spec = None
    if spec_pos:
        k = int(nd.max())
        vocab = logits.shape[1]
        r = len(spec_pos)
        index = np.concatenate([starts[i] + np.minimum(np.arange(k + 1), nd[i]) for i in spec_pos])
        spec_logits = logits.index_select(0, torch.as_tensor(index, device=logits.device)).view(r, k + 1, vocab)
        options = [sampler.options_of(sample_req_ids[i]) for i in spec_pos]
        greedy = [o.temperature < GREEDY_EPS for o in options]
        probs = spec_logits if all(greedy) else spec_logits.float()
        sampled_rows = [j for j, g in enumerate(greedy) if not g]
        if sampled_rows:  # the target's filtered distribution, as the plain sampler draws from
            flat = spec_logits[sampled_rows].reshape(-1, vocab)
            rep = k + 1
            o = [options[j] for j in sampled_rows]
            dist = filtered_probs(flat, [x.temperature for x in o for _ in range(rep)],
                                  [x.top_k for x in o for _ in range(rep)], [x.top_p for x in o for _ in range(rep)],
                                  [x.min_p for x in o for _ in range(rep)])
            probs[sampled_rows] = dist.view(len(sampled_rows), rep, vocab)
        draft_ids = torch.zeros((r, k), dtype=torch.long)
        for j, i in enumerate(spec_pos):
            draft_ids[j, : nd[i]] = torch.as_tensor(drafts[i])
        spec = rejection_sample(probs, draft_ids.to(logits.device), torch.as_tensor(nd[spec_pos], device=logits.device),
                                torch.as_tensor(greedy, device=logits.device), generator=sampler.generator,
                                all_greedy=all(greedy))
        for i in spec_pos:  # the worker adds the rest once it knows how many were emitted
            sampler.count_extra(sample_req_ids[i], 1)
    return VerifiedTokens(plain, plain_pos, spec, spec_pos, len(drafts))
