"""The offline API: ``LLM(model=...).generate(prompts, params)``, vLLM's shape."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tidal_engine.config import EngineConfig
from tidal_engine.engine.llm_engine import LLMEngine
from tidal_engine.outputs import RequestOutput
from tidal_engine.sampling_params import SamplingParams

Prompt = str | list[int]
Message = dict[str, Any]


class LLM:
    def __init__(self, model: str, **engine_options: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options))
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Submit every prompt at once (so they batch), run to completion, return in order.
        ``lora_name``: a loaded adapter (``llm.engine.add_lora``/``--lora-modules``) for every prompt.
        ``priority``: one per prompt, lower first (needs ``scheduling_policy="priority"``), as vLLM's."""
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError("give one SamplingParams, or one per prompt")
        if priority is not None:
            if len(priority) != len(prompt_list):
                raise ValueError("give one priority per prompt")
            params_list = [p.clone(priority=level) for p, level in zip(params_list, priority)]
        ids = [f"offline-{next(self._ids)}" for _ in prompt_list]
        try:
            for request_id, prompt, params in zip(ids, prompt_list, params_list):
                self.engine.add_request(request_id, prompt, params, cache_salt=cache_salt, lora_name=lora_name)
        except ValueError:  # LoRAError included
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        return self._run(ids)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[Prompt] = [
            self.engine.tokenizer.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=add_generation_prompt
            )
            for conversation in conversations  # type: ignore[union-attr]
        ]
        # The template already holds the special tokens; encode without adding a second BOS.
        token_prompts: list[Prompt] = [
            self.engine.tokenizer.encode(p, add_special_tokens=False) for p in prompts  # type: ignore[arg-type]
        ]
        return self.generate(token_prompts, sampling_params)

    def _run(self, ids: list[str]) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        while len(finished) < len(ids):
            for output in self.engine.step(final_only=True):  # partial outputs are never shown
                if output.finished:
                    finished[output.request_id] = output
            if not self.engine.has_unfinished_requests() and len(finished) < len(ids):
                raise RuntimeError("the engine stopped before every request finished")
        return [finished[i] for i in ids]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt of token ids
    return list(prompts)  # type: ignore[arg-type]
