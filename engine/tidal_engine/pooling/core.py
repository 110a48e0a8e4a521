"""The pooling engine core: embedding and score requests through the engine's scheduler.

It runs where ``EngineCore`` runs (the engine-core process, driven by ``EngineCoreProc``'s
loop, or in process for offline use) and offers the same surface to that loop. A request is
a ``core.request.Request`` with ``pooling_params``: the scheduler admits it whole under the
step's token and sequence budgets and gives it no KV blocks; the runner pools it in one
prefill-only forward; the request is finished right after, and its vector goes back as a
``PooledOutput``.

Chunking: none. Encoders (BERT) must see the whole text in one forward, and decoders pool
their last token with no KV cache to carry a prompt across steps, so the token budget is
raised to at least ``max_model_len`` and any admissible prompt fits an empty step.

One step stays in flight: ``step()`` launches step N+1 on the device, then collects step N,
so the scheduler, the host-side input packing and the replies overlap the device's work. A
launched request leaves the scheduler at once (it holds nothing there), so the step in flight
never takes the next step's sequence slots; the gauges count it as running until it is back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch

from tidal_engine.core.kv_cache_manager import KVCacheManager
from tidal_engine.core.request import Request, RequestStatus
from tidal_engine.core.scheduler import Scheduler, SchedulerConfig
from tidal_engine.engine.messages import CoreStats, PooledOutput
from tidal_engine.pooling.loader import ConvertOption, load_pooling_model
from tidal_engine.pooling.params import PoolingModelInfo, PoolingParams
from tidal_engine.pooling.runner import PooledBatch, PoolingInput, PoolingRunner
from tidal_engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

BLOCK_SIZE = 16
# Pooling requests sample nothing; one shared default spares each request SamplingParams'
# validation (the scheduler reads only its priority).
NO_SAMPLING = SamplingParams()


def default_token_budget(device: torch.device) -> int:
    """Pooling steps are prefill only: larger than generation's, to keep the matmuls big."""
    return 16384 if device.type == "cuda" else 4096


class PoolingEngineCore:
    def __init__(self, runner: PoolingRunner, tokenizer: Any, model_name: str, max_num_seqs: int = 256,
                 max_num_batched_tokens: int | None = None, enable_sleep_mode: bool = False,
                 reload: Callable[[], PoolingRunner] | None = None) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.info: PoolingModelInfo = runner.info
        self.max_model_len = runner.info.max_model_len
        self.device = runner.device
        self.vocab_size = len(tokenizer)
        self.eos_token_ids: set[int] = set()
        self.lora_manager = None
        self.async_scheduling = False
        self.enable_sleep_mode = enable_sleep_mode
        self.sleep_level = 0  # 0 awake; 1 weights in host memory; 2 weights discarded
        self._reload = reload  # level 2's wake: the model again, from disk
        budget = max(max_num_batched_tokens or default_token_budget(self.device), self.max_model_len)
        config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                 max_model_len=self.max_model_len, enable_chunked_prefill=False, block_size=BLOCK_SIZE)
        # Pooling requests take no blocks; the manager is sized only to meet the scheduler's
        # one-sequence check.
        blocks = KVCacheManager(-(-self.max_model_len // BLOCK_SIZE), BLOCK_SIZE, enable_prefix_caching=False)
        self.scheduler = Scheduler(config, blocks)
        self.max_num_batched_tokens = budget
        self._in_flight: tuple[list[Request], PooledBatch | BaseException] | None = None
        self._launched: dict[str, Request] = {}  # left the scheduler, result not yet collected
        self._in_flight_started = 0.0
        self.requests_total = 0
        self.prompt_tokens_total = 0
        self.step_seconds_total = 0.0
        self.max_num_running_seen = 0

    @classmethod
    def from_model(cls, model: str, model_name: str, convert: ConvertOption = "auto", dtype: str = "auto",
                   device: str = "auto", max_model_len: int | None = None, tokenizer: str | None = None,
                   max_num_seqs: int = 256, max_num_batched_tokens: int | None = None,
                   enable_sleep_mode: bool = False) -> PoolingEngineCore:
        from tidal_engine.engine.core import resolve_device

        target = resolve_device(device)

        def load() -> tuple[PoolingRunner, Any]:
            loaded = load_pooling_model(model, convert, dtype, target, max_model_len, tokenizer)
            logger.info("pooling model %s loaded: task %s, %s pooling, %s on %s, max_model_len %d", model,
                        loaded.info.task, loaded.info.method, loaded.dtype, target, loaded.info.max_model_len)
            return PoolingRunner(loaded, target), loaded.tokenizer

        runner, tok = load()
        return cls(runner, tok, model_name, max_num_seqs, max_num_batched_tokens, enable_sleep_mode,
                   reload=lambda: load()[0])

    @classmethod
    def from_config(cls, config: Any) -> PoolingEngineCore:
        """From an ``EngineConfig`` with ``runner="pooling"`` (the engine-core process)."""
        return cls.from_model(
            config.model, config.served_model_name or config.model, convert=config.convert, dtype=config.dtype,
            device=config.device, max_model_len=config.max_model_len, tokenizer=config.tokenizer,
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            enable_sleep_mode=config.enable_sleep_mode,
        )

    @property
    def pooling_info(self) -> dict[str, Any]:
        return asdict(self.info)

    # ---------------------------------------------------------------- requests

    def add_pooling_request(self, request_id: str, token_ids: list[int], params: PoolingParams,
                            token_type_ids: list[int] | None = None, arrival_time: float | None = None) -> None:
        """Queue one input (ValueError for bad input: the caller's 4xx)."""
        if self.is_sleeping():
            raise RuntimeError("the engine is sleeping")
        if not token_ids:
            raise ValueError("a pooling input needs at least one token")
        if min(token_ids) < 0 or max(token_ids) >= self.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.vocab_size})")
        if token_type_ids is not None and len(token_type_ids) != len(token_ids):
            raise ValueError("token_type_ids must have one entry per token")
        self.scheduler.add_request(Request(request_id, token_ids, NO_SAMPLING, arrival_time=arrival_time,
                                           pooling_params=params, token_type_ids=token_type_ids))

    def add_request(self, *_: Any, **__: Any) -> None:
        raise ValueError(f"`{self.model_name}` is a pooling model ({self.info.task}); it does not generate text")

    def abort_request(self, request_id: str) -> None:
        self.scheduler.abort_request(request_id)
        self._launched.pop(request_id, None)  # in flight: its result is dropped

    def finish_samples(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.abort_request(request_id)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.scheduler.requests or request_id in self._launched

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    # ---------------------------------------------------------------- steps

    def step(self) -> list[PooledOutput]:
        """Launch the next step, then return the outputs of the one launched before it."""
        launched = None
        if not self.is_sleeping():
            plan = self.scheduler.schedule()
            if not plan.is_empty:
                requests = [chunk.request for chunk in plan.chunks]
                for request in requests:  # nothing of it stays: no blocks, no further chunk
                    self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
                    self._launched[request.request_id] = request
                self.max_num_running_seen = max(self.max_num_running_seen, len(self._launched))
                launched = (requests, self._launch(requests))
        done, self._in_flight = self._in_flight, launched
        started, self._in_flight_started = self._in_flight_started, time.perf_counter()
        if done is None:
            return []
        return self._collect(*done, started)

    def _launch(self, requests: list[Request]) -> PooledBatch | BaseException:
        batch = [PoolingInput(r.prompt_token_ids, r.token_type_ids, r.pooling_params) for r in requests]
        try:
            return self.runner.launch(batch)
        except Exception as exc:  # a failed step fails its requests, not the engine
            logger.exception("pooling step of %d request(s) failed", len(requests))
            return exc

    def _collect(self, requests: list[Request], launched: PooledBatch | BaseException, started: float) -> list[PooledOutput]:
        outcome: list[torch.Tensor] | BaseException
        try:
            outcome = launched if isinstance(launched, BaseException) else launched.result()
        except Exception as exc:
            logger.exception("pooling step of %d request(s) failed", len(requests))
            outcome = exc
        self.step_seconds_total += time.perf_counter() - started
        outputs = []
        for i, request in enumerate(requests):
            if self._launched.pop(request.request_id, None) is None:
                continue  # aborted while it ran
            self.requests_total += 1
            self.prompt_tokens_total += request.num_prompt_tokens
            if isinstance(outcome, BaseException):
                outputs.append(PooledOutput(request.request_id, error=f"{type(outcome).__name__}: {outcome}"))
            else:
                outputs.append(PooledOutput(request.request_id, outcome[i].numpy().astype("<f4").tobytes()))
        return outputs

    def encode_offline(self, items: list[PoolingInput]) -> list[torch.Tensor]:
        """Pool ``items`` in process (offline use, benchmarks): longest first, so a step's
        prompts pad little; results in input order."""
        order = sorted(range(len(items)), key=lambda i: -items[i].num_tokens)
        for i in order:
            item = items[i]
            self.add_pooling_request(f"offline-{i}", item.token_ids, item.params, item.token_type_ids)
        results: dict[str, torch.Tensor] = {}
        while self.has_unfinished_requests():
            for out in self.step():
                if out.error is not None:
                    raise RuntimeError(out.error)
                results[out.request_id] = torch.frombuffer(bytearray(out.data), dtype=torch.float32)
        return [results[f"offline-{i}"] for i in range(len(items))]

    # ---------------------------------------------------------------- stats, sleep, lifecycle

    def get_stats(self) -> CoreStats:
        return CoreStats(
            num_running=len(self._launched) + self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
            prompt_tokens_total=self.prompt_tokens_total, prompt_tokens_computed=self.prompt_tokens_total,
            max_num_running_seen=self.max_num_running_seen, sleep_level=self.sleep_level,
            pooling_requests_total=self.requests_total, pooling_step_seconds=self.step_seconds_total,
        )

    def is_sleeping(self) -> bool:
        return self.sleep_level > 0

    def sleep(self, level: int = 1) -> None:
        """Level 1 keeps the weights in host memory, level 2 drops them (wake reloads them)."""
        if not self.enable_sleep_mode:
            raise ValueError("sleep mode is not enabled; start the server with --enable-sleep-mode")
        if level not in (1, 2):
            raise ValueError(f"level must be 1 or 2, got {level}")
        if self.sleep_level >= level:
            return
        if level == 1:
            self.runner.model.to("cpu")
        else:
            self.runner.model = None  # type: ignore[assignment]  # dropped: wake reloads it
        self.sleep_level = level
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def wake_up(self, tags: list[str] | None = None) -> None:
        if self.sleep_level == 1:
            self.runner.model.to(self.runner.device)
        elif self.sleep_level == 2:
            assert self._reload is not None
            self.runner = self._reload()
        self.sleep_level = 0

    def reset_prefix_cache(self) -> bool:
        return True  # a pooling core caches nothing

    def load_lora(self, *_: Any) -> None:
        raise ValueError("pooling models take no LoRA adapters")

    def remove_lora(self, *_: Any) -> bool:
        raise ValueError("pooling models take no LoRA adapters")

    def shutdown(self) -> None:
        self._in_flight = None
        self._launched.clear()
