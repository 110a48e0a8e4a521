"""The offline engine: tokenize, run the engine core in this process, build outputs.

``LLM`` and ``tidal-engine generate`` use it: no API server, no second process, so a
script pays no IPC. ``step()`` runs one core step and turns its deltas into cumulative
``RequestOutput``s (output_processor.py). The served path uses the same core in its own
process (core_proc.py) and the same output processor in each API server (async_llm.py).
"""

from __future__ import annotations

from typing import Any

from tidal_engine.config import EngineConfig
from tidal_engine.engine.core import EngineCore
from tidal_engine.engine.messages import CoreStats
from tidal_engine.engine.output_processor import OutputProcessor
from tidal_engine.lora import AdapterInfo, LoRAAdapter
from tidal_engine.outputs import RequestOutput
from tidal_engine.sampling_params import SamplingParams

EngineStats = CoreStats  # the name callers used before the split


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.core = EngineCore(config)
        self.tokenizer = self.core.tokenizer
        self.model_name = self.core.model_name
        self.max_model_len = self.core.max_model_len
        self.outputs = OutputProcessor(self.tokenizer)

    # Views of the core, for tests and tools.
    @property
    def scheduler(self) -> Any:
        return self.core.scheduler

    @property
    def kv_cache_manager(self) -> Any:
        return self.core.kv_cache_manager

    @property
    def executor(self) -> Any:
        return self.core.executor

    @property
    def runner(self) -> Any:
        """The model runner of the in-process worker (uniprocess executor only)."""
        return self.core.executor.driver_worker.runner  # type: ignore[attr-defined]

    @property
    def async_scheduling(self) -> bool:
        return self.core.async_scheduling

    @property
    def lora_manager(self) -> Any:
        return self.core.lora_manager

    # ---- requests --------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        lora_name: str | None = None,
    ) -> None:
        params = params or SamplingParams()
        if self.tokenizer is None:
            check_without_tokenizer(prompt, params)
        prompt_text, token_ids = tokenize(self.tokenizer, prompt)
        self.core.add_request(request_id, token_ids, params, cache_salt=cache_salt,
                              arrival_time=arrival_time, lora_name=lora_name)
        self.outputs.add_request(request_id, prompt_text, token_ids, params, arrival_time)

    def abort_request(self, request_id: str) -> None:
        self.core.abort_request(request_id)
        self.outputs.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """One core step; an output for each request it advanced (with ``final_only``, for
        each request it finished: offline callers skip building the rest)."""
        touched, stopped = self.outputs.process(self.core.step())
        if stopped:
            self.core.finish_samples(stopped)
        return [OutputProcessor.output(s) for s in touched if not final_only or s.finished]

    # ---- state and admin -------------------------------------------------------------
    def get_stats(self) -> CoreStats:
        return self.core.get_stats()

    def read_lora(self, lora_name: str, lora_path: str, *, at_startup: bool = False) -> LoRAAdapter:
        return self.core.read_lora(lora_name, lora_path, at_startup=at_startup)

    def add_lora(self, adapter: LoRAAdapter) -> None:
        self.core.add_lora(adapter)

    def remove_lora(self, lora_name: str) -> bool:
        return self.core.remove_lora(lora_name)

    def list_loras(self) -> list[AdapterInfo]:
        return self.core.list_loras()

    def reset_prefix_cache(self) -> bool:
        return self.core.reset_prefix_cache()

    def is_sleeping(self) -> bool:
        return self.core.is_sleeping()

    @property
    def sleep_level(self) -> int:
        return self.core.sleep_level

    def sleep(self, level: int = 1) -> None:
        self.core.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.core.wake_up(tags)

    def memory_usage(self) -> dict[str, int]:
        return self.core.memory_usage()

    def shutdown(self) -> None:
        self.core.shutdown()


def check_without_tokenizer(prompt: str | list[int], params: SamplingParams) -> None:
    """skip_tokenizer_init: only what works on token ids."""
    if isinstance(prompt, str):
        raise ValueError("the engine runs with skip_tokenizer_init: give prompts as token ids")
    if params.stop:
        raise ValueError("stop strings need the tokenizer (skip_tokenizer_init); use stop_token_ids")


def tokenize(tokenizer: Any, prompt: str | list[int]) -> tuple[str | None, list[int]]:
    """A prompt as (text or None, token ids); token-id prompts are taken as they are."""
    if isinstance(prompt, str):
        return prompt, tokenizer.encode(prompt, add_special_tokens=True)
    # set(map(type, ...)): one C-level pass, which matters for prompts of thousands of ids.
    if isinstance(prompt, list) and set(map(type, prompt)) <= {int}:
        return None, list(prompt)
    raise ValueError("prompt must be a string or a list of token ids")
