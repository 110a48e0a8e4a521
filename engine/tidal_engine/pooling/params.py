"""What a pooling request asks of the model, and what a pooling model does."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

PoolingTask = Literal["embed", "classify"]
PoolingMethod = Literal["cls", "mean", "last"]


@dataclass(frozen=True)
class PoolingParams:
    """Per request. ``dimensions``: keep the first N (Matryoshka), then renormalise.
    ``normalize`` (embed): L2-normalise. ``activation`` (classify): sigmoid for one label,
    softmax for several; off gives raw logits."""

    dimensions: int | None = None
    normalize: bool = True
    activation: bool = True


@dataclass(frozen=True)
class PoolingModelInfo:
    """Fixed at load time: the task, how tokens pool into one vector, the context length."""

    task: PoolingTask
    method: PoolingMethod
    max_model_len: int
    hidden_size: int
    num_labels: int  # classify only; 0 for embed
    labels: tuple[str, ...]  # id → label name (classify)
