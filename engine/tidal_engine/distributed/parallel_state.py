"""The process-wide parallel layout: this rank's place in the tensor × pipeline grid.

Global rank ``r = pp_rank * tp_size + tp_rank``: the ranks of one pipeline stage are
consecutive (their all-reduces stay on neighbouring GPUs), and rank 0 (the driver, the
one that returns sampled tokens) is tensor rank 0 of the first stage.

One layout per process, set once by the worker before it builds the model (as vLLM's
``parallel_state`` does): layers read it when they create their shards. A process that
never calls ``init_parallel`` (the uniprocess executor, unit tests) sees a 1 × 1 layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ParallelLayout:
    tp_size: int = 1
    pp_size: int = 1
    tp_rank: int = 0
    pp_rank: int = 0

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.pp_size < 1:
            raise ValueError(f"parallel sizes must be >= 1, got tp={self.tp_size} pp={self.pp_size}")
        if not (0 <= self.tp_rank < self.tp_size and 0 <= self.pp_rank < self.pp_size):
            raise ValueError(f"rank (tp {self.tp_rank}, pp {self.pp_rank}) outside tp={self.tp_size} pp={self.pp_size}")

    @classmethod
    def of_rank(cls, rank: int, tp_size: int, pp_size: int) -> "ParallelLayout":
        if not 0 <= rank < tp_size * pp_size:
            raise ValueError(f"rank {rank} outside a world of {tp_size * pp_size}")
        return cls(tp_size, pp_size, rank % tp_size, rank // tp_size)

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def stage_rank(self, pp_rank: int) -> int:
        """The global rank of this tensor rank in pipeline stage ``pp_rank``."""
        return pp_rank * self.tp_size + self.tp_rank


@dataclass
class _State:
    layout: ParallelLayout
    tp_group: Any = None  # torch.distributed ProcessGroup of this stage's tensor ranks


_STATE = _State(ParallelLayout())


def get_parallel() -> ParallelLayout:
    return _STATE.layout


def tp_group() -> Any:
    return _STATE.tp_group


def init_parallel(tp_size: int, pp_size: int, rank: int, backend: str, init_method: str) -> ParallelLayout:
    """Join the torch.distributed world (gloo on CPU, nccl on CUDA) and build the groups.

    Every rank must call this with the same sizes: ``new_group`` is collective."""
    import torch.distributed as dist

    layout = ParallelLayout.of_rank(rank, tp_size, pp_size)
    if layout.world_size == 1:
        _STATE.layout = layout
        return layout
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=layout.world_size)
    mine = None
    for stage in range(pp_size):
        ranks = list(range(stage * tp_size, (stage + 1) * tp_size))
        group = dist.new_group(ranks) if tp_size > 1 else None
        if stage == layout.pp_rank:
            mine = group
    _STATE.layout = layout
    _STATE.tp_group = mine
    return layout


def set_layout_for_tests(layout: ParallelLayout, tp_group: Any = None) -> None:
    """Pretend to be one rank (layer unit tests build one shard without a process group)."""
    _STATE.layout = layout
    _STATE.tp_group = tp_group


def destroy_parallel() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    _STATE.layout = ParallelLayout()
    _STATE.tp_group = None


def device_for_rank(device: torch.device, rank: int) -> torch.device:
    """CUDA ranks take one GPU each (rank r → cuda:r); CPU ranks share the CPU."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", rank)
