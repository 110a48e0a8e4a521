"""`strict: true` function tools under tool_choice "auto": free text, then calls held to the
function's schema by an xgrammar structural tag (server/tool_parsers/strict.py).

Two views: the grammar driven by random choices among the tokens it allows ("whatever a model
samples"), for each parser that supports strict; and the served engine with a tiny model built
to open a hermes `<tool_call>` at once and then write nonsense, so its calls are valid only
when strict holds them.
"""

from __future__ import annotations

import functools
import json
import random
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from test_server_support import TINY_MAX_MODEL_LEN, LiveServer, live_server  # noqa: E402
from tool_chat_template import TIME_TOOL, TOOL_TEMPLATE, WEATHER_TOOL  # noqa: E402

from tidal_engine.models.loader import resolve_model  # noqa: E402
from tidal_engine.server.tool_parsers import get_tool_parser  # noqa: E402
from tidal_engine.server.tool_parsers.strict import strict_constraint  # noqa: E402
from tidal_engine.structured.params import xgrammar  # noqa: E402

MSG = [{"role": "user", "content": "What is the weather in Paris?"}]
ENUMS = {"get_weather": {"city": {"Paris", "Rome", "Oslo"}, "unit": {"celsius", "fahrenheit"}},
         "get_time": {"zone": {"UTC", "CET"}}}


def strict(tool: dict[str, Any]) -> dict[str, Any]:
    return {**tool, "function": {**tool["function"], "strict": True}}


def functions(tools: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any] | None, bool]]:
    return [(t["function"]["name"], t["function"].get("parameters"), bool(t["function"].get("strict")))
            for t in tools]


def assert_valid(name: str, arguments: str) -> None:
    """Valid against the test tools' schemas: exactly the required keys, each an allowed value."""
    values = json.loads(arguments)
    assert set(values) == set(ENUMS[name]), values
    for key, allowed in ENUMS[name].items():
        assert values[key] in allowed, values


@functools.cache
def smollm2_tokenizer() -> Any:
    return resolve_model("smollm2-135m").load_tokenizer()


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return smollm2_tokenizer()


@pytest.mark.parametrize("parser_name", ["hermes", "llama3_json"])
def test_random_choices_after_the_opener_give_schema_valid_calls(tokenizer: Any, parser_name: str) -> None:
    parser = get_tool_parser(parser_name)
    constraint = strict_constraint(parser, functions([strict(WEATHER_TOOL), strict(TIME_TOOL)]), parallel=False)
    xgr = xgrammar()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer),
                                              stop_token_ids=[tokenizer.eos_token_id])
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_grammar(constraint.parsed_grammar)
    opener = "<tool_call>" if parser_name == "hermes" else '{"name": '
    for seed in range(4):
        rng = random.Random(seed)
        matcher = xgr.GrammarMatcher(compiled)
        tokens = tokenizer.encode(("Let me check. " if parser_name == "hermes" else "") + opener)
        assert all(matcher.accept_token(t) for t in tokens)  # the text before and the opener are free
        bitmask = xgr.allocate_token_bitmask(1, len(tokenizer))
        for _ in range(400):
            if matcher.is_terminated():
                break
            matcher.fill_next_token_bitmask(bitmask)
            bits = np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little")[: len(tokenizer)]
            token = int(rng.choice(np.flatnonzero(bits)))
            assert matcher.accept_token(token)
            tokens.append(token)
        assert matcher.is_terminated(), "the call never closed"
        text = tokenizer.decode(tokens[:-1])  # the last token is EOS: the first call ends the answer
        extracted = parser.extract(text)
        (call,) = extracted.calls
        assert_valid(call.name, call.arguments)


@pytest.mark.parametrize("parser_name", ["pythonic", "mistral"])
def test_parsers_whose_calls_cannot_be_constrained_refuse_strict(parser_name: str) -> None:
    with pytest.raises(ValueError, match=f"not supported with the '{parser_name}' tool-call parser"):
        strict_constraint(get_tool_parser(parser_name), functions([strict(WEATHER_TOOL)]), parallel=True)


# ---- served: a tiny model that opens a call at once, then writes nonsense ----------------------

OPENER = "<tool_call>"


def opener_model_dir() -> str:
    """A tiny Llama whose next token depends on the last one only (attention and MLP outputs
    zeroed; logits from the token's own embedding) and whose greedy walk after a newline spells
    `<tool_call>`; what follows is whatever its random weights pick."""
    from tiny_models import make_tiny_model

    tokenizer = smollm2_tokenizer()
    folder = Path(tempfile.mkdtemp(prefix="tidal-opener-tiny-"))
    model = make_tiny_model("llama", folder, vocab_size=len(tokenizer), max_position_embeddings=TINY_MAX_MODEL_LEN)
    chain = tokenizer.encode("\n" + OPENER)  # "\n" ends the generation prompt
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        embed = model.model.embed_tokens.weight
        embed.normal_(0.0, 1.0)
        head = model.lm_head.weight
        head.normal_(0.0, 0.05)
        for current, following in zip(chain, chain[1:]):
            head[following] = 20.0 * embed[current] / embed[current].norm()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with live_server(engine={"model": opener_model_dir()}, enable_auto_tool_choice=True, tool_call_parser="hermes",
                     chat_template=TOOL_TEMPLATE) as live:
        yield live


def ask(client: httpx.Client, tools: list[dict[str, Any]], **body: Any) -> httpx.Response:
    return client.post("/v1/chat/completions", json={"messages": MSG, "tools": tools, "max_tokens": 60,
                                                     "temperature": 0, "parallel_tool_calls": False, **body})


def streamed_calls(response: httpx.Response) -> list[tuple[str, str]]:
    assert response.status_code == 200, response.text
    calls: list[list[str]] = []
    for line in response.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for piece in json.loads(line[len("data: "):])["choices"][0]["delta"].get("tool_calls", []):
                if "id" in piece:
                    calls.append([piece["function"]["name"], ""])
                calls[piece["index"]][1] += piece["function"]["arguments"]
    return [(name, arguments) for name, arguments in calls]


def test_strict_functions_hold_the_calls_to_their_schemas(server: LiveServer) -> None:
    with server.client() as client:
        loose = ask(client, [WEATHER_TOOL, TIME_TOOL]).json()["choices"][0]
        # Without strict, the model's nonsense after the opener is no call at all.
        assert loose["message"]["tool_calls"] == [] and loose["message"]["content"].startswith(OPENER)
        tools = [strict(WEATHER_TOOL), strict(TIME_TOOL)]
        response = ask(client, tools)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        (call,) = choice["message"]["tool_calls"]
        assert_valid(call["function"]["name"], call["function"]["arguments"])
        streamed = streamed_calls(ask(client, tools, stream=True))
        assert streamed == [(call["function"]["name"], call["function"]["arguments"])]
        # Only the strict function's arguments are held to its schema; the other's are any object.
        mixed = ask(client, [WEATHER_TOOL, strict(TIME_TOOL)]).json()["choices"][0]
        (loose_call,) = mixed["message"]["tool_calls"]
        if loose_call["function"]["name"] == "get_time":
            assert_valid("get_time", loose_call["function"]["arguments"])
        else:
            assert isinstance(json.loads(loose_call["function"]["arguments"]), dict)


def test_strict_with_response_format_is_refused(server: LiveServer) -> None:
    with server.client() as client:
        response = ask(client, [strict(WEATHER_TOOL)], response_format={"type": "json_object"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "tool_choice"


def test_responses_api_strict_function_tools(server: LiveServer) -> None:
    tools = [{"type": "function", **WEATHER_TOOL["function"], "strict": True},
             {"type": "function", **TIME_TOOL["function"], "strict": True}]
    with server.client() as client:
        response = client.post("/v1/responses", json={"input": MSG[0]["content"], "tools": tools, "temperature": 0,
                                                      "max_output_tokens": 60, "parallel_tool_calls": False})
    assert response.status_code == 200, response.text
    (call,) = [item for item in response.json()["output"] if item["type"] == "function_call"]
    assert_valid(call["name"], call["arguments"])
