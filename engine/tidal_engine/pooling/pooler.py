"""From the hidden states of a packed batch to one vector per request (pure functions)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tidal_engine.pooling.params import PoolingMethod, PoolingParams


def pool(hidden: torch.Tensor, seq_lens: list[int], method: PoolingMethod) -> torch.Tensor:
    """``[T, H]`` packed by ``seq_lens`` → ``[N, H]`` (first token, mean, or last token)."""
    starts = torch.tensor([0, *seq_lens], device=hidden.device).cumsum(0)
    if method == "cls":
        return hidden[starts[:-1]]
    if method == "last":
        return hidden[starts[1:] - 1]
    owner = torch.repeat_interleave(torch.arange(len(seq_lens), device=hidden.device),
                                    torch.tensor(seq_lens, device=hidden.device))
    sums = torch.zeros(len(seq_lens), hidden.shape[1], device=hidden.device, dtype=torch.float32)
    sums.index_add_(0, owner, hidden.float())
    return sums / torch.tensor(seq_lens, device=hidden.device, dtype=torch.float32)[:, None]


def finish_embedding(vector: torch.Tensor, params: PoolingParams) -> torch.Tensor:
    """Matryoshka truncation, then L2 normalisation (as sentence-transformers does)."""
    vector = vector.float()
    if params.dimensions is not None:
        vector = vector[..., : params.dimensions]
    return F.normalize(vector, dim=-1) if params.normalize else vector


def finish_embeddings(rows: torch.Tensor, params: list[PoolingParams]) -> list[torch.Tensor]:
    """``finish_embedding`` for every row of a step, on the rows' device when all rows ask the
    same (one normalisation and one copy for the batch), row by row on the host otherwise."""
    if all(p == params[0] for p in params):
        return list(finish_embedding(rows, params[0]).cpu().unbind(0))
    return [finish_embedding(row, p) for row, p in zip(rows.cpu(), params, strict=True)]


def finish_logits(logits: torch.Tensor, params: PoolingParams) -> torch.Tensor:
    """Scores: sigmoid for one label, softmax over several; raw logits without activation."""
    logits = logits.float()
    if not params.activation:
        return logits
    return torch.sigmoid(logits) if logits.shape[-1] == 1 else torch.softmax(logits, dim=-1)
