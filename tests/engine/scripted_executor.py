"""A model-free worker for engine-core tests: it plays a worker by the StepPlan contract alone.

It keeps each request's token history and block table from the plan's diffs, checks every
step against them (positions, blocks that cover them, no token it doesn't know), and
"samples" a token that is a pure function of the history (``next_token``). Build it
directly, or name it as the executor backend ("scripted_executor:ScriptedExecutor") so an
engine-core process uses it.
"""

from __future__ import annotations

import time
from typing import Any

from tidal_engine.executor.base import Executor, PendingStep
from tidal_engine.executor.plan import StepPlan, StepResult

BLOCK = 16


def next_token(history: list[int]) -> int:
    """The scripted model: the next token depends on the last few and the length."""
    return (sum(history[-3:]) * 31 + 7 * len(history)) % 900 + 50  # never EOS, never < 50


def expected_tokens(prompt: list[int], n: int) -> list[int]:
    history = list(prompt)
    for _ in range(n):
        history.append(next_token(history))
    return history[len(prompt):]


class _Done(PendingStep):
    def __init__(self, result: StepResult) -> None:
        self._result = result

    def result(self) -> StepResult:
        return self._result


class ScriptedExecutor(Executor):
    step_delay_s = 0.0

    def __init__(self, config: Any = None, source: Any = None, device: Any = None, dtype: Any = None,
                 num_blocks: int | None = None) -> None:
        override = getattr(config, "num_gpu_blocks_override", None)
        self.num_kv_blocks = num_blocks or override or 256
        self.history: dict[str, list[int]] = {}
        self.blocks: dict[str, list[int]] = {}
        self.plans: list[StepPlan] = []

    def execute(self, plan: StepPlan) -> PendingStep:
        if self.step_delay_s and plan.scheduled:
            time.sleep(self.step_delay_s)  # a slow device, so requests stay in flight
        self.plans.append(plan)
        for rid in plan.finished_req_ids:
            assert rid in self.history, f"forgetting {rid}, which was never sent"
            del self.history[rid], self.blocks[rid]
        new_ids = {r.req_id for r in plan.new_requests}
        assert {s.req_id for s in plan.scheduled} >= new_ids
        for new in plan.new_requests:
            assert new.req_id not in self.history, f"{new.req_id} sent twice"
            self.history[new.req_id] = list(new.prompt_token_ids) + list(new.output_token_ids)
            self.blocks[new.req_id] = list(new.block_ids)
        req_ids: list[str] = []
        tokens: list[int] = []
        for s in plan.scheduled:
            history = self.history[s.req_id]
            if s.resumed:
                self.blocks[s.req_id] = list(s.new_block_ids)
            else:
                self.blocks[s.req_id] += s.new_block_ids
            end = s.num_computed_tokens + s.num_new_tokens
            assert end <= len(history), f"{s.req_id}: computing up to {end}, knows {len(history)} tokens"
            assert len(self.blocks[s.req_id]) * BLOCK >= end, f"{s.req_id}: blocks don't cover position {end - 1}"
            assert len(set(self.blocks[s.req_id])) == len(self.blocks[s.req_id])
            assert s.samples == (end == len(history)), f"{s.req_id}: samples={s.samples} at {end}/{len(history)}"
            if s.samples:
                token = next_token(history)
                history.append(token)
                req_ids.append(s.req_id)
                tokens.append(token)
        return _Done(StepResult(step_id=plan.step_id, req_ids=req_ids, token_ids=tokens))

    def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        if method == "wake_up":
            return [False]
        if method == "memory_usage":
            return [{}]
        return [None]

    def shutdown(self) -> None:
        pass

    def check_health(self) -> None:
        pass




class SlowScriptedExecutor(ScriptedExecutor):
    step_delay_s = 0.05
