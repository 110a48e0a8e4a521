"""One structured (JSON) log line per finished request. Prompts only with --log-prompts."""

from __future__ import annotations

import json
import logging

from tidal_engine.engine.async_engine import FinishedRequest

logger = logging.getLogger("tidal_engine.requests")


class RequestLogger:
    def __init__(self, *, log_prompts: bool = False) -> None:
        self.log_prompts = log_prompts

    def __call__(self, record: FinishedRequest) -> None:
        line: dict[str, object] = {
            "event": "request_finished",
            "request_id": record.request_id,
            "prompt_tokens": record.prompt_tokens,
            "generation_tokens": record.generation_tokens,
            "cached_tokens": record.cached_tokens,
            "finish_reasons": record.finish_reasons,
            "queue_time_s": _round(record.queue_time_s),
            "ttft_s": _round(record.ttft_s),
            "e2e_s": _round(record.e2e_s),
        }
        if self.log_prompts:
            line["prompt"] = record.prompt
        logger.info(json.dumps(line, ensure_ascii=False))


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)
