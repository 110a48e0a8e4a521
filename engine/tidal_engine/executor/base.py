"""The executor: how the engine core reaches its workers.

The core hands a ``StepPlan`` to ``execute`` and gets a ``PendingStep`` back at once;
``PendingStep.result()`` waits for the sampled tokens. With async scheduling the core
executes step N+1 before it asks for N's result, so the executor must accept a new plan
while the previous one is still running, and apply plans in order.

``collective_rpc`` runs a named Worker method on every worker (sleep, wake, LoRA, memory)
and returns each worker's answer, the driver's first.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from tidal_engine.executor.plan import StepPlan, StepResult


class PendingStep(ABC):
    @abstractmethod
    def result(self) -> StepResult: ...


class Executor(ABC):
    num_kv_blocks: int  # per worker; the core's block manager sizes itself by it

    @abstractmethod
    def execute(self, plan: StepPlan) -> PendingStep: ...

    @abstractmethod
    def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> list[Any]: ...

    @abstractmethod
    def shutdown(self) -> None: ...

    def add_lora(self, adapter: Any) -> None:  # noqa: B027 - optional
        """The core registered ``adapter``: give it to workers that keep their own registry
        (the multiprocess executor). The uniprocess worker shares the core's."""

    def remove_lora(self, name: str) -> None:  # noqa: B027 - optional
        """The core dropped adapter ``name``: drop it in workers with their own registry."""

    @abstractmethod
    def check_health(self) -> None:
        """Raise if a worker died."""
