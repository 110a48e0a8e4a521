"""Bad input: every case gets the right 4xx with an OpenAI-style JSON error, and the server
keeps serving afterwards. Validation errors (pydantic included) are 400, as in vLLM."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from test_server_support import LiveServer, live_server  # noqa: E402

MSG = [{"role": "user", "content": "Hi"}]
TEN_MB = 10 * 1024 * 1024


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with live_server() as live:
        yield live


def _chunked(data: bytes, size: int = 1 << 20) -> Iterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


# (id, method, path, kwargs for httpx, expected status, expected error type, expected param or None)
CASES: list[tuple[str, str, str, dict[str, Any], int, str, str | None]] = [
    ("malformed_json", "POST", "/v1/completions", {"content": b'{"prompt": "hi",'}, 400, "invalid_request_error", None),
    ("json_not_object", "POST", "/v1/completions", {"json": ["prompt"]}, 400, "invalid_request_error", None),
    ("empty_body", "POST", "/v1/chat/completions", {"content": b""}, 400, "invalid_request_error", None),
    ("non_utf8_body", "POST", "/v1/completions", {"content": b'{"prompt": "\xff\xfe"}'}, 400,
     "invalid_request_error", None),
    ("nan_literal", "POST", "/v1/completions", {"content": b'{"prompt": "x", "temperature": NaN}'}, 400,
     "invalid_request_error", None),
    ("wrong_type_max_tokens", "POST", "/v1/completions", {"json": {"prompt": "x", "max_tokens": "ten"}}, 400,
     "invalid_request_error", "max_tokens"),
    ("wrong_type_messages", "POST", "/v1/chat/completions", {"json": {"messages": "hello"}}, 400,
     "invalid_request_error", "messages"),
    ("missing_prompt", "POST", "/v1/completions", {"json": {"max_tokens": 3}}, 400, "invalid_request_error",
     "prompt"),
    ("unknown_model", "POST", "/v1/chat/completions", {"json": {"model": "gpt-9", "messages": MSG}}, 404,
     "not_found_error", "model"),
    ("negative_max_tokens", "POST", "/v1/completions", {"json": {"prompt": "x", "max_tokens": -1}}, 400,
     "invalid_request_error", "max_tokens"),
    ("temperature_5", "POST", "/v1/chat/completions", {"json": {"messages": MSG, "temperature": 5}}, 400,
     "invalid_request_error", "temperature"),
    ("top_p_zero", "POST", "/v1/completions", {"json": {"prompt": "x", "top_p": 0}}, 400,
     "invalid_request_error", "top_p"),
    ("logprobs_100", "POST", "/v1/completions", {"json": {"prompt": "x", "logprobs": 100}}, 400,
     "invalid_request_error", "logprobs"),
    # Structured outputs are supported (see test_structured_outputs.py); unknown formats are still refused.
    ("response_format_text_xml", "POST", "/v1/chat/completions",
     {"json": {"messages": MSG, "response_format": {"type": "text_xml"}}}, 400, "invalid_request_error",
     "response_format"),
    ("response_format_bad_schema", "POST", "/v1/completions",
     {"json": {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}}},
     400, "invalid_request_error", "response_format"),
    ("top_logprobs_100", "POST", "/v1/chat/completions",
     {"json": {"messages": MSG, "logprobs": True, "top_logprobs": 100}}, 400, "invalid_request_error",
     "top_logprobs"),
    ("top_logprobs_without_logprobs", "POST", "/v1/chat/completions",
     {"json": {"messages": MSG, "top_logprobs": 2}}, 400, "invalid_request_error", None),
    ("n_10000", "POST", "/v1/chat/completions", {"json": {"messages": MSG, "n": 10000}}, 400,
     "invalid_request_error", "n"),
    ("stop_wrong_type", "POST", "/v1/completions", {"json": {"prompt": "x", "stop": 5}}, 400,
     "invalid_request_error", "stop"),
    ("min_tokens_over_max", "POST", "/v1/completions", {"json": {"prompt": "x", "max_tokens": 2, "min_tokens": 5}},
     400, "invalid_request_error", None),
    ("prompt_over_context", "POST", "/v1/completions", {"json": {"prompt": "hello " * 400}}, 400,
     "invalid_request_error", None),
    ("chat_over_context", "POST", "/v1/chat/completions",
     {"json": {"messages": [{"role": "user", "content": "hello " * 400}]}}, 400, "invalid_request_error",
     "messages"),
    ("token_ids_over_context", "POST", "/v1/completions", {"json": {"prompt": [1] * 300}}, 400,
     "invalid_request_error", "prompt"),
    ("token_id_outside_vocab", "POST", "/v1/completions", {"json": {"prompt": [10**9]}}, 400,
     "invalid_request_error", "prompt"),
    ("empty_prompt_list", "POST", "/v1/completions", {"json": {"prompt": []}}, 400, "invalid_request_error", None),
    ("invalid_role", "POST", "/v1/chat/completions", {"json": {"messages": [{"role": "wizard", "content": "x"}]}},
     400, "invalid_request_error", "messages.0.role"),
    ("empty_messages", "POST", "/v1/chat/completions", {"json": {"messages": []}}, 400, "invalid_request_error",
     "messages"),
    ("message_without_content", "POST", "/v1/chat/completions", {"json": {"messages": [{"role": "user"}]}}, 400,
     "invalid_request_error", None),
    ("image_content_part", "POST", "/v1/chat/completions",
     {"json": {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}},
     400, "invalid_request_error", None),
    # tools default to tool_choice "auto", which needs --enable-auto-tool-choice and a parser.
    ("tools_auto_without_parser", "POST", "/v1/chat/completions",
     {"json": {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}]}}, 400,
     "invalid_request_error", "tool_choice"),
    ("tool_bad_name", "POST", "/v1/chat/completions",
     {"json": {"messages": MSG, "tool_choice": "required",
               "tools": [{"type": "function", "function": {"name": "bad name!"}}]}}, 400,
     "invalid_request_error", "tools.0.function.name"),
    ("tool_unknown_key", "POST", "/v1/chat/completions",
     {"json": {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f", "params": {}}}]}}, 400,
     "invalid_request_error", "tools.0.function.params"),
    ("tool_wrong_type", "POST", "/v1/chat/completions",
     {"json": {"messages": MSG, "tools": [{"type": "retrieval", "function": {"name": "f"}}]}}, 400,
     "invalid_request_error", "tools.0.type"),
    ("tool_choice_unknown_function", "POST", "/v1/chat/completions",
     {"json": {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}],
               "tool_choice": {"type": "function", "function": {"name": "g"}}}}, 400, "invalid_request_error", None),
    ("tool_choice_required_without_tools", "POST", "/v1/chat/completions",
     {"json": {"messages": MSG, "tool_choice": "required"}}, 400, "invalid_request_error", None),
    ("tool_choice_bad_string", "POST", "/v1/chat/completions",
     {"json": {"messages": MSG, "tool_choice": "always"}}, 400, "invalid_request_error", "tool_choice"),
    ("tool_message_without_call_id", "POST", "/v1/chat/completions",
     {"json": {"messages": [{"role": "tool", "content": "42"}]}}, 400, "invalid_request_error", None),
    # Unknown fields are refused with their name, never dropped.
    ("unknown_field_chat", "POST", "/v1/chat/completions", {"json": {"messages": MSG, "temprature": 0}}, 400,
     "invalid_request_error", "temprature"),
    ("unknown_field_completion", "POST", "/v1/completions", {"json": {"prompt": "x", "service_tier": "flex"}}, 400,
     "invalid_request_error", "service_tier"),
    ("unknown_field_in_message", "POST", "/v1/chat/completions",
     {"json": {"messages": [{"role": "user", "content": "x", "mood": "happy"}]}}, 400, "invalid_request_error",
     "messages.0.mood"),
    ("max_tokens_over_context", "POST", "/v1/completions", {"json": {"prompt": "x", "max_tokens": 1000}}, 400,
     "invalid_request_error", "max_tokens"),
    ("max_completion_tokens_over_context", "POST", "/v1/chat/completions",
     {"json": {"messages": MSG, "max_completion_tokens": 256}}, 400, "invalid_request_error", "max_tokens"),
    ("stream_options_without_stream", "POST", "/v1/chat/completions",
     {"json": {"messages": MSG, "stream_options": {"include_usage": True}}}, 400, "invalid_request_error", None),
    ("truncate_over_context", "POST", "/v1/completions",
     {"json": {"prompt": "x", "truncate_prompt_tokens": 1000}}, 400, "invalid_request_error",
     "truncate_prompt_tokens"),
    # vLLM fields that need engine support Tidal lacks: refused unless "off".
    ("prompt_logprobs_100", "POST", "/v1/completions", {"json": {"prompt": "x", "prompt_logprobs": 100}}, 400,
     "invalid_request_error", "prompt_logprobs"),
    ("allowed_token_ids_outside_vocab", "POST", "/v1/completions",
     {"json": {"prompt": "x", "allowed_token_ids": [10**9]}}, 400, "invalid_request_error", "allowed_token_ids"),
    ("allowed_token_ids_empty", "POST", "/v1/completions", {"json": {"prompt": "x", "allowed_token_ids": []}}, 400,
     "invalid_request_error", "allowed_token_ids"),
    ("bad_words_empty_word", "POST", "/v1/chat/completions", {"json": {"messages": MSG, "bad_words": [""]}}, 400,
     "invalid_request_error", "bad_words.0"),
    # priority needs --scheduling-policy priority (tests/engine/test_server_request_fields.py).
    ("priority_without_policy", "POST", "/v1/chat/completions", {"json": {"messages": MSG, "priority": 1}}, 400,
     "invalid_request_error", None),
    ("priority_not_int", "POST", "/v1/completions", {"json": {"prompt": "x", "priority": "high"}}, 400,
     "invalid_request_error", "priority"),
    # Fields Tidal cannot honour, each refused by name (docs/engine-api.md's table).
    ("logit_bias_refused", "POST", "/v1/chat/completions", {"json": {"messages": MSG, "logit_bias": {"7": 5.0}}},
     400, "invalid_request_error", "logit_bias"),
    ("best_of_refused", "POST", "/v1/completions", {"json": {"prompt": "x", "n": 1, "best_of": 2}}, 400,
     "invalid_request_error", "best_of"),
    ("suffix_refused", "POST", "/v1/completions", {"json": {"prompt": "x", "suffix": "end"}}, 400,
     "invalid_request_error", "suffix"),
    ("body_10mb", "POST", "/v1/completions", {"content": b'{"prompt": "' + b"a" * TEN_MB + b'"}'}, 413,
     "request_too_large", None),
    ("body_10mb_chunked", "POST", "/v1/chat/completions", {"content": _chunked(b"x" * TEN_MB)}, 413,
     "request_too_large", None),
    ("detokenize_negative", "POST", "/detokenize", {"json": {"tokens": [-1]}}, 400, "invalid_request_error",
     "tokens.0"),
    ("tokenize_wrong_type", "POST", "/tokenize", {"json": {"prompt": 12}}, 400, "invalid_request_error", "prompt"),
    ("sleep_level_3", "POST", "/sleep?level=3", {}, 400, "invalid_request_error", "level"),
    ("sleep_level_not_int", "POST", "/sleep?level=deep", {}, 400, "invalid_request_error", "level"),
    ("sleep_bad_mode", "POST", "/sleep?level=1&mode=later", {}, 400, "invalid_request_error", "mode"),
    ("wake_bad_tag", "POST", "/wake_up?tags=everything", {}, 400, "invalid_request_error", "tags"),
    ("unknown_route", "GET", "/v1/nothing", {}, 404, "not_found_error", None),
    ("wrong_method", "GET", "/v1/completions", {}, 405, "invalid_request_error", None),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_4xx_json(server: LiveServer, case: tuple[str, str, str, dict[str, Any], int, str, Any]) -> None:
    _, method, path, kwargs, status, err_type, param = case
    with server.client() as c:
        response = c.request(method, path, **kwargs)
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == err_type
        assert error["code"] == status
        assert error["message"]
        if param is not None:
            assert error["param"] == param
        # ... and the server still serves.
        ok = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert ok.status_code == 200, ok.text


def test_prompt_too_long_names_the_token_counts(server: LiveServer) -> None:
    # A string prompt is tokenized and rejected by the engine itself: still a clean 400.
    with server.client() as c:
        message = c.post("/v1/completions", json={"prompt": "hello " * 400}).json()["error"]["message"]
    counts = [int(n) for n in re.findall(r"\d+", message)]
    assert 256 in counts and any(n >= 400 for n in counts), message
