"""Drafts made on the device, for async scheduling with speculation.

With async scheduling, step N+1 is scheduled and launched before the host knows which of step
N's drafts were accepted, so N+1's drafts cannot come from the host. ``DeviceDrafts`` keeps,
per persistent-batch row, on the device:

- ``tokens[row, :lens[row]]``: the row's history (prompt, then every sampled or emitted token,
  appended by each step right after it samples, in stream order);
- ``accepted[row]``: how many drafts the row's last step accepted (0 for a plain sample): the
  host scheduled the row's next step as if none were, and the runner shifts that step's
  positions by this count on the device (ModelRunner._shift_fed_rows);
- ``drafts[row]``: the next step's k drafts, proposed from the history right after the step
  (a ``DeviceProposer``: n-gram lookup, or the benchmark's oracle).

With a draft model (spec_decode/draft_model.py) there is no ``DeviceProposer``: the drafts are
made by the draft model right before the step that verifies them, so only ``accepted`` is kept
(no history, no ``drafts``).

Nothing here reads anything back on the host.
"""

from __future__ import annotations

from typing import Protocol

import torch

from tidal_engine.spec_decode.device_ngram import propose_ngram


class DeviceProposer(Protocol):
    num_speculative_tokens: int

    def propose_on_device(self, tokens: torch.Tensor, lens: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``tokens`` [B, W] (each row's history, junk past ``lens``), ``rows`` [B] the
        persistent-batch rows; returns [B, k] draft ids. Any ids are safe: verification accepts
        only what the target itself would emit (greedy) or keeps its distribution (sampled)."""
        ...


class DeviceNgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose_on_device(self, tokens: torch.Tensor, lens: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        drafts, _ = propose_ngram(tokens, lens, self.num_speculative_tokens, self.min_n, self.max_n)
        return drafts


class DeviceDrafts:
    def __init__(self, proposer: DeviceProposer | None, num_rows: int, max_model_len: int, device: torch.device,
                 num_speculative_tokens: int | None = None) -> None:
        """``proposer`` None: drafts come from elsewhere (the draft model); only ``accepted`` is
        kept, and ``num_speculative_tokens`` gives k."""
        self.proposer = proposer
        self.k = proposer.num_speculative_tokens if proposer is not None else int(num_speculative_tokens or 0)
        self.device = device
        # Room for a whole verify step's tokens past the end (junk writes are never read).
        self.width = max_model_len + 2 * (self.k + 1) if proposer is not None else 1
        self.tokens = torch.zeros((0, self.width), dtype=torch.int64, device=device)
        self.lens = torch.zeros(0, dtype=torch.int64, device=device)
        self.accepted = torch.zeros(0, dtype=torch.int64, device=device)
        self.drafts = torch.zeros((0, self.k), dtype=torch.int64, device=device)
        self.ensure_rows(num_rows)

    def ensure_rows(self, num_rows: int) -> None:
        old = self.tokens.shape[0]
        if num_rows <= old:
            return

        def grow(t: torch.Tensor) -> torch.Tensor:
            out = torch.zeros((num_rows, *t.shape[1:]), dtype=t.dtype, device=self.device)
            out[:old].copy_(t)
            return out

        self.tokens, self.lens = grow(self.tokens), grow(self.lens)
        self.accepted, self.drafts = grow(self.accepted), grow(self.drafts)

    def add_row(self, row: int, token_ids: list[int]) -> None:
        """A request got ``row``: its known tokens become the row's history."""
        self.ensure_rows(row + 1)
        self.accepted[row] = 0
        if self.proposer is None:
            return
        n = len(token_ids)
        host = torch.tensor(token_ids, dtype=torch.int64)
        if self.device.type == "cuda":
            host = host.pin_memory()  # a pageable copy would wait for the step in flight
        self.tokens[row, :n].copy_(host, non_blocking=True)
        self.lens[row] = n
        self.drafts[row] = 0

    def record(self, rows: torch.Tensor, tokens: torch.Tensor, emitted: torch.Tensor) -> None:
        """After a step: row ``rows[i]`` emitted ``tokens[i, :emitted[i]]`` (device tensors;
        ``tokens`` [N, m]). Appends them to the histories and sets ``accepted``."""
        if rows.numel() == 0:
            return
        if self.proposer is None:
            self.accepted.index_copy_(0, rows, emitted - 1)
            return
        m = tokens.shape[1]
        start = self.lens.index_select(0, rows)
        cols = (start[:, None] + torch.arange(m, device=self.device)[None, :]).clamp(max=self.width - 1)
        self.tokens[rows[:, None].expand(-1, m), cols] = tokens  # past emitted[i]: junk, never read
        self.lens.index_copy_(0, rows, start + emitted)
        self.accepted.index_copy_(0, rows, emitted - 1)

    def propose(self, rows: torch.Tensor, width: int) -> None:
        """The next drafts of ``rows`` from their histories; ``width`` bounds every row's length."""
        if rows.numel() == 0 or self.proposer is None:
            return
        width = max(1, min(width, self.width))
        history = self.tokens[:, :width].index_select(0, rows)
        lens = self.lens.index_select(0, rows).clamp(max=width)
        self.drafts.index_copy_(0, rows, self.proposer.propose_on_device(history, lens, rows))
