"""The uniprocess executor: one Worker in the engine core's own process.

``execute`` hands the plan to the worker, which queues the step on the device and returns
at once; the core takes the result when it wants it (async scheduling: after launching the
next step). ``collective_rpc`` calls the worker's method directly.
"""

from __future__ import annotations

from typing import Any

import torch

from tidal_engine.executor.base import Executor, PendingStep
from tidal_engine.executor.plan import StepPlan
from tidal_engine.worker.worker import Worker


def resolve_worker_args(config: Any, source: Any, device: Any, dtype: Any) -> tuple[Any, torch.device, torch.dtype]:
    """Fill in what the caller left out (source, device, dtype) from the config."""
    from tidal_engine.models.loader import resolve_dtype, resolve_model

    if source is None:
        source = resolve_model(config.model, getattr(config, "cache_dir", None))
    if device is None:
        from tidal_engine.engine.core import resolve_device

        device = resolve_device(config.device)
    elif not isinstance(device, torch.device):
        device = torch.device(device)
    if dtype is None:
        dtype = resolve_dtype(source.arch_config.torch_dtype, config.dtype, device)
    elif isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return source, device, dtype


class UniprocExecutor(Executor):
    def __init__(self, config: Any, source: Any = None, device: Any = None, dtype: Any = None, **worker_kwargs: Any) -> None:
        source, device, dtype = resolve_worker_args(config, source, device, dtype)
        self.config = config
        self.driver_worker = Worker(config, source, device, dtype, rank=0, world_size=1, **worker_kwargs)
        self.num_kv_blocks = self.driver_worker.num_kv_blocks()

    @property
    def lora_manager(self) -> Any:
        """The worker's adapter manager (None without enable_lora): in one process the core
        uses the same registry the runner's slots load from."""
        return self.driver_worker.runner.lora_manager

    def execute(self, plan: StepPlan) -> PendingStep:
        return self.driver_worker.execute(plan)

    def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return [getattr(self.driver_worker, method)(*args, **kwargs)]

    def check_health(self) -> None:
        return None  # the worker lives and dies with this process

    def shutdown(self) -> None:
        self.driver_worker.settle()
