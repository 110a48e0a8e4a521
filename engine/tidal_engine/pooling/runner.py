"""One prefill-only forward over a batch of pooling requests; nothing is kept afterwards.

``launch`` queues the forward on the device and returns at once; ``PooledBatch.result``
waits for it and copies the pooled rows to the host. The engine core launches step N+1
before it collects step N, so the host's work overlaps the device's.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from tidal_engine.pooling.loader import LoadedPoolingModel
from tidal_engine.pooling.params import PoolingParams
from tidal_engine.pooling.pooler import finish_embeddings, finish_logits, pool


@dataclass
class PoolingInput:
    token_ids: list[int]
    token_type_ids: list[int] | None = None  # BERT sentence pairs: 0 for the first text, 1 for the second
    params: PoolingParams = PoolingParams()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class PooledBatch:
    """A launched step: the pooled rows (still on the device) and each row's parameters."""

    rows: torch.Tensor  # [N, H] float32 embeddings, or [N, labels] logits
    params: list[PoolingParams]
    task: str

    def result(self) -> list[torch.Tensor]:
        """Embeddings (task embed) or scores (task classify) on the CPU, float32, in batch order."""
        if self.task == "classify":
            return [finish_logits(row, p) for row, p in zip(self.rows.cpu(), self.params, strict=True)]
        return finish_embeddings(self.rows, self.params)


class PoolingRunner:
    def __init__(self, loaded: LoadedPoolingModel, device: torch.device) -> None:
        self.model = loaded.model
        self.info = loaded.info
        self.dtype = loaded.dtype
        self.device = device

    @torch.inference_mode()
    def launch(self, batch: list[PoolingInput]) -> PooledBatch:
        seq_lens = [item.num_tokens for item in batch]
        ids = torch.from_numpy(np.fromiter(chain.from_iterable(item.token_ids for item in batch), np.int64,
                                           sum(seq_lens)))
        positions = torch.cat([torch.arange(n) for n in seq_lens])
        token_types = None
        if any(item.token_type_ids is not None for item in batch):
            token_types = torch.tensor(
                [t for item in batch for t in (item.token_type_ids or [0] * item.num_tokens)], dtype=torch.long
            ).to(self.device, non_blocking=True)
        ids, positions = ids.to(self.device, non_blocking=True), positions.to(self.device, non_blocking=True)
        if self.info.method == "last" and getattr(self.model, "is_causal", False):
            # Decoders pool inside the model: their last layer's MLP runs on the pooled rows only.
            last_rows = torch.tensor(seq_lens).cumsum(0).sub_(1).to(self.device, non_blocking=True)
            pooled = self.model(ids, positions, token_types, seq_lens, keep_rows=last_rows)
        else:
            pooled = pool(self.model(ids, positions, token_types, seq_lens), seq_lens, self.info.method)
        params = [item.params for item in batch]
        if self.info.task == "classify":
            return PooledBatch(self.model.classify(pooled.to(self.dtype)), params, "classify")
        return PooledBatch(pooled.float(), params, "embed")

    def run(self, batch: list[PoolingInput]) -> list[torch.Tensor]:
        """Launch and wait: one synchronous step."""
        return self.launch(batch).result()
