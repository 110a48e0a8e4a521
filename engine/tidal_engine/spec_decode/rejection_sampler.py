"""Exact rejection sampling of draft tokens (Leviathan et al. 2023; Chen et al. 2023).

Per row, drafts d_0..d_{m-1} (m <= k) were proposed from distributions q_j, and the target's
one forward gave p_0..p_m (p_j: the target's distribution after accepting d_0..d_{j-1}).
Draft j is accepted with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection the
row emits a token drawn from the residual norm(max(p_j - q_j, 0)) and stops; when all m are
accepted it emits a bonus token drawn from p_m. The emitted tokens then have exactly the
target's distribution. Greedy rows accept d_j iff it is argmax p_j and emit argmax p_a at the
first mismatch (or the bonus): the same tokens as decoding without speculation.

A deterministic proposer (n-gram) has one-hot q: ``draft_probs=None``. Then the acceptance
probability is p_j(d_j) and the residual is p_j with d_j removed.
"""

from __future__ import annotations

import torch


def rejection_sample(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_drafts: torch.Tensor,
    greedy: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    all_greedy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify a batch of drafts.

    ``target_probs`` [R, k+1, V] (the filtered, normalised target distributions; greedy rows
    may pass raw logits, only their argmax is read), ``draft_token_ids`` [R, k] int64 (entries
    past ``num_drafts`` are ignored), ``num_drafts`` [R] int64 in [0, k], ``greedy`` [R] bool,
    ``draft_probs`` [R, k, V] or None (one-hot drafts). ``all_greedy`` (the caller knows every
    row is greedy, so ``greedy`` is all True): only argmaxes, no random draws.

    Returns ``tokens`` [R, k+1] int64 (the emitted tokens, -1 after each row's last) and
    ``num_emitted`` [R] int64 (accepted drafts + 1).
    """
    rows, positions, vocab = target_probs.shape
    k = positions - 1
    if draft_token_ids.shape != (rows, k) or num_drafts.shape != (rows,) or greedy.shape != (rows,):
        raise ValueError("draft_token_ids must be [R, k], num_drafts and greedy [R], with target_probs [R, k+1, V]")
    device = target_probs.device
    drafts = draft_token_ids.clamp(0, vocab - 1)
    is_draft = torch.arange(k, device=device)[None, :] < num_drafts[:, None]  # [R, k]
    if all_greedy:
        return _greedy_verify(target_probs, drafts, is_draft)
    p = target_probs.float()
    p_draft = p[:, :k].gather(2, drafts.unsqueeze(2)).squeeze(2)  # p_j(d_j)
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.float().gather(2, drafts.unsqueeze(2)).squeeze(2)
    u = torch.rand((rows, k), dtype=torch.float32, device=device, generator=generator)
    accept_sampled = u * q_draft < p_draft  # u < p/q without dividing by a zero q
    argmax = p.argmax(dim=2)  # [R, k+1]
    accept_greedy = argmax[:, :k] == drafts
    accept = torch.where(greedy[:, None], accept_greedy, accept_sampled) & is_draft
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # leading run of acceptances

    # The last token: the residual at the first rejection, else the bonus from p_m.
    row_ids = torch.arange(rows, device=device)
    at = num_accepted  # position of the emitted final token
    p_at = p[row_ids, at]  # [R, V]
    rejected = num_accepted < num_drafts
    if draft_probs is None:
        q_at = torch.zeros_like(p_at)
        q_at[row_ids, drafts.gather(1, at.clamp_max(k - 1).unsqueeze(1)).squeeze(1)] = 1.0 if k else 0.0
    else:
        q_at = torch.cat([draft_probs.float(), torch.zeros_like(p[:, :1])], dim=1)[row_ids, at]
    residual = (p_at - q_at).clamp_min(0.0)
    mass = residual.sum(dim=1, keepdim=True)
    # A zero residual (p == q) cannot follow a rejection except by rounding: fall back to p.
    residual = torch.where(mass > 0, residual, p_at)
    final_dist = torch.where(rejected[:, None], residual, p_at)
    final_dist = torch.where(greedy[:, None], torch.ones_like(final_dist), final_dist)  # greedy: unused
    final_sampled = torch.multinomial(final_dist, 1, generator=generator).squeeze(1)
    final = torch.where(greedy, argmax[row_ids, at], final_sampled)

    tokens = torch.full((rows, k + 1), -1, dtype=torch.long, device=device)
    keep = torch.arange(k, device=device)[None, :] < num_accepted[:, None]
    tokens[:, :k] = torch.where(keep, drafts, tokens[:, :k])
    tokens[row_ids, at] = final
    return tokens, num_accepted + 1


def _greedy_verify(target: torch.Tensor, drafts: torch.Tensor, is_draft: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row greedy: accept the leading drafts that are the argmax, then emit the argmax."""
    return _accept_argmax(target.argmax(dim=2), drafts, is_draft)


def accept_greedy(targets: list[int], drafts: list[int]) -> list[int]:
    """One greedy row on the host: ``targets`` are the target's argmaxes at the row's
    ``len(drafts) + 1`` verified positions. Accept the leading drafts equal to the argmax, then
    emit the argmax at the first mismatch (or the bonus): the tokens ``rejection_sample(...,
    all_greedy=True)`` gives, without its small kernels (a step's drafts are on the host already)."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
        accepted += 1
    return drafts[:accepted] + [targets[accepted]]


def _accept_argmax(argmax: torch.Tensor, drafts: torch.Tensor, is_draft: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, positions = argmax.shape
    k = positions - 1
    num_accepted = ((argmax[:, :k] == drafts) & is_draft).long().cumprod(dim=1).sum(dim=1)
    keep = torch.arange(k, device=argmax.device)[None, :] < num_accepted[:, None]
    tokens = torch.full((rows, k + 1), -1, dtype=torch.long, device=argmax.device)
    tokens[:, :k] = torch.where(keep, drafts, tokens[:, :k])
    row_ids = torch.arange(rows, device=argmax.device)
    tokens[row_ids, num_accepted] = argmax[row_ids, num_accepted]
    return tokens, num_accepted + 1
