"""One prefill-only forward over a batch of pooling requests; nothing is kept afterwards."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tidal_engine.pooling.loader import LoadedPoolingModel
from tidal_engine.pooling.params import PoolingParams
from tidal_engine.pooling.pooler import finish_embedding, finish_logits, pool


@dataclass
class PoolingInput:
    token_ids: list[int]
    token_type_ids: list[int] | None = None  # BERT sentence pairs: 0 for the first text, 1 for the second
    params: PoolingParams = PoolingParams()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class PoolingRunner:
    def __init__(self, loaded: LoadedPoolingModel, device: torch.device) -> None:
        self.model = loaded.model
        self.info = loaded.info
        self.dtype = loaded.dtype
        self.device = device

    @torch.inference_mode()
    def run(self, batch: list[PoolingInput]) -> list[torch.Tensor]:
        """Embeddings (task embed) or scores (task classify) on the CPU, float32, in batch order."""
        seq_lens = [item.num_tokens for item in batch]
        ids = torch.tensor([t for item in batch for t in item.token_ids], dtype=torch.long)
        positions = torch.cat([torch.arange(n) for n in seq_lens])
        token_types = None
        if any(item.token_type_ids is not None for item in batch):
            token_types = torch.tensor(
                [t for item in batch for t in (item.token_type_ids or [0] * item.num_tokens)], dtype=torch.long
            ).to(self.device, non_blocking=True)
        hidden = self.model(ids.to(self.device, non_blocking=True), positions.to(self.device, non_blocking=True),
                            token_types, seq_lens)
        pooled = pool(hidden, seq_lens, self.info.method)
        if self.info.task == "classify":
            logits = self.model.classify(pooled.to(self.dtype)).cpu()
            return [finish_logits(row, item.params) for row, item in zip(logits, batch, strict=True)]
        vectors = pooled.float().cpu()
        return [finish_embedding(row, item.params) for row, item in zip(vectors, batch, strict=True)]
