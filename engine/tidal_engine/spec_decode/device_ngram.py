"""Prompt lookup (n-gram) on the device: the drafts of a batch from its token history with no
host round trip, for async scheduling with speculation (the drafts of step N+1 are made right
after step N's verification, in stream order, before the host knows N's tokens).

Same rule as the host ``NgramProposer``: the row's last n tokens (n from ``max_n`` down to
``min_n``) are looked up earlier in the row; the latest occurrence of the longest n that matches
gives the drafts, the tokens that followed it (at most k, never past the row's end). Fixed
shapes and no data-dependent control flow, so the ops can sit in a CUDA graph.
"""

from __future__ import annotations

import torch


def propose_ngram(tokens: torch.Tensor, lens: torch.Tensor, k: int, min_n: int, max_n: int,
                  caps: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``tokens`` [B, L] int64 (each row's history, anything past ``lens``), ``lens`` [B] int64.
    Returns ``drafts`` [B, k] (0 past a row's drafts) and ``num_drafts`` [B] (0: no match),
    at most ``caps[b]`` drafts for row b when given."""
    batch, width = tokens.shape
    device = tokens.device
    start = torch.full((batch,), -1, dtype=torch.int64, device=device)  # first draft's index
    cols = torch.arange(width, device=device)
    for n in range(max_n, min_n - 1, -1):
        if width - n < 1:
            continue
        windows = width - n  # candidate starts 0 .. width-n-1 (followed by >= 1 token)
        suffix_at = (lens[:, None] - n + torch.arange(n, device=device)[None, :]).clamp(min=0)
        suffix = tokens.gather(1, suffix_at)  # [B, n]
        match = tokens.unfold(1, n, 1)[:, :windows, :].eq(suffix[:, None, :]).all(dim=2)  # [B, windows]
        # A start whose n-gram ends before the row's last token; only rows with no longer match.
        match &= cols[None, :windows] < (lens - n)[:, None]
        match &= (start < 0)[:, None] & (lens > n)[:, None]
        latest = torch.where(match, cols[None, :windows], -1).amax(dim=1)  # -1: none
        start = torch.where(latest >= 0, latest + n, start)
    found = start >= 0
    room = (lens - start).clamp(min=0, max=k)
    if caps is not None:
        room = torch.minimum(room, caps.clamp(min=0))
    num_drafts = torch.where(found, room, 0)
    at = (start.clamp(min=0)[:, None] + torch.arange(k, device=device)[None, :]).clamp(max=width - 1)
    drafts = tokens.gather(1, at)
    drafts = torch.where(torch.arange(k, device=device)[None, :] < num_drafts[:, None], drafts, 0)
    return drafts, num_drafts
