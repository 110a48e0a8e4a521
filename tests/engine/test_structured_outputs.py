"""Structured outputs (xgrammar): parameter validation, the sampler's masking, the engine on the
real SmolLM2 (JSON schema, choice, regex, mixed batches, n > 1) and the server's response_format."""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from tidal_engine import LLM, SamplingParams  # noqa: E402
from tidal_engine.models.loader import resolve_model  # noqa: E402
from tidal_engine.executor.plan import SamplingOptions  # noqa: E402
from tidal_engine.runner.sampler import Sampler  # noqa: E402
from tidal_engine.structured import (  # noqa: E402
    MAX_SCHEMA_DEPTH,
    GrammarCompilerCache,
    GrammarMatcher,
    StructuredOutputsParams,
)
from tidal_engine.structured.backend import apply_bitmask_torch  # noqa: E402

# Bounded on purpose: a tiny model can loop forever in an unbounded number or string.
CITY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "London", "Berlin"]},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["city", "population_millions"],
    "additionalProperties": False,
}
PROMPTS = [
    "The capital of France is",
    "Answer in JSON. Which city is the largest in Germany?",
    "Hello",
    "London has a population of",
]


def _nested_schema(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer", "minimum": 0, "maximum": 9}
    for _ in range(levels - 1):
        schema = {"type": "array", "items": schema, "maxItems": 1}
    return schema


# ---------------------------------------------------------------- validation (no model)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "need one of"),
        ({"regex": "a", "choice": ["x"]}, "exactly one kind"),
        ({"json": {"type": "object"}, "json_object": True}, "exactly one kind"),
        ({"choice": []}, "non-empty list"),
        ({"choice": ["a", ""]}, "non-empty string"),
        ({"choice": ["a", 3]}, "non-empty string"),
        ({"regex": "[0-9"}, "invalid regex"),
        ({"regex": ""}, "non-empty string"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"json": "[1, 2]"}, "must be an object"),
        ({"json": {"type": "no-such-type"}}, "invalid JSON schema"),
        ({"json": {"type": "object", "properties": {"a": {"$ref": "#/missing"}}}}, "invalid JSON schema"),
        ({"json": _nested_schema(MAX_SCHEMA_DEPTH + 1)}, "nested 65 levels"),
        ({"grammar": "root ::= "}, "invalid grammar"),
        ({"json_object": "yes"}, "json_object must be true"),
    ],
)
def test_invalid_params_raise_value_error(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)


def test_valid_params_and_cache_keys() -> None:
    assert StructuredOutputsParams(json=_nested_schema(MAX_SCHEMA_DEPTH)).kind == "json"
    a = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "boolean"}}})
    b = StructuredOutputsParams(json='{"properties": {"a": {"type": "boolean"}}, "type": "object"}')
    assert a.cache_key() == b.cache_key()  # same schema, key order and text form aside
    assert StructuredOutputsParams(choice=['say "hi"', "café"]).kind == "choice"
    assert StructuredOutputsParams(grammar='root ::= "yes" | "no"').kind == "grammar"
    assert StructuredOutputsParams(json_object=True).kind == "json_object"
    assert SamplingParams(structured_outputs=a).structured_outputs is a
    with pytest.raises(ValueError, match="structured_outputs must be"):
        SamplingParams(structured_outputs={"json": {}})  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return resolve_model("smollm2-135m").load_tokenizer()


@pytest.fixture(scope="module")
def grammars(tokenizer: Any) -> GrammarCompilerCache:
    return GrammarCompilerCache(tokenizer, vocab_size=len(tokenizer) + 64, stop_token_ids=[tokenizer.eos_token_id])


def test_compiler_cache_reuses_compiled_grammars(grammars: GrammarCompilerCache) -> None:
    first = grammars.compile(StructuredOutputsParams(json=CITY_SCHEMA))
    again = grammars.compile(StructuredOutputsParams(json=json.dumps(CITY_SCHEMA)))
    assert first is again
    assert grammars.compile(StructuredOutputsParams(regex="[0-9]{3}")) is not first


def test_matcher_walks_a_regex_and_ends_on_eos(grammars: GrammarCompilerCache, tokenizer: Any) -> None:
    matcher = GrammarMatcher(grammars.compile(StructuredOutputsParams(regex="[0-9]{2}")), grammars.vocab_size)
    for token in tokenizer.encode("42", add_special_tokens=False):
        assert matcher.accept_token(token)
    assert not matcher.accept_token(tokenizer.encode("x", add_special_tokens=False)[0])
    assert not matcher.is_terminated()
    assert matcher.accept_token(tokenizer.eos_token_id)
    assert matcher.is_terminated()


def test_sampler_masks_only_grammar_rows(grammars: GrammarCompilerCache, tokenizer: Any) -> None:
    """The padded model vocabulary is covered; rows without a grammar are left alone; logprobs stay raw."""
    vocab = grammars.vocab_size
    torch.manual_seed(0)
    logits = torch.randn(3, vocab)
    logits[:, vocab - 1] = 100.0  # a padded id the model prefers: never allowed by a grammar
    choice = StructuredOutputsParams(choice=["yes", "no"])
    matchers = {
        "greedy": GrammarMatcher(grammars.compile(choice), vocab),
        "seeded": GrammarMatcher(grammars.compile(choice), vocab),
    }
    sampler = Sampler(vocab, 4, torch.device("cpu"))
    sampler.add_request("free", SamplingOptions(temperature=0, logprobs=0), [1])
    sampler.add_request("greedy", SamplingOptions(temperature=0, logprobs=0, has_grammar=True), [1])
    sampler.add_request("seeded", SamplingOptions(temperature=1.0, seed=3, has_grammar=True), [1])
    original = logits.clone()
    bitmasks = {name: matcher.bitmask_bytes() for name, matcher in matchers.items()}
    token_ids, logprobs = sampler.sample(logits, ["free", "greedy", "seeded"], bitmasks).result()
    assert torch.equal(logits, original)
    assert token_ids[0] == vocab - 1
    for token in token_ids[1:]:  # any token that starts a choice ("y", "ye", "yes", ...)
        piece = tokenizer.decode([token])
        assert piece and ("yes".startswith(piece) or "no".startswith(piece)), piece
    raw = torch.log_softmax(original[1], dim=-1)[token_ids[1]].item()
    assert logprobs[1] is not None and logprobs[1].sampled_logprob == pytest.approx(raw, abs=1e-5)
    assert logprobs[2] is None


def test_torch_bitmask_path_matches_xgrammar(grammars: GrammarCompilerCache) -> None:
    """The accelerator path (plain torch unpacking) masks exactly as xgrammar's CPU kernel."""
    import xgrammar as xgr

    vocab = grammars.vocab_size
    matcher = GrammarMatcher(grammars.compile(StructuredOutputsParams(json=CITY_SCHEMA)), vocab)
    bitmask = xgr.allocate_token_bitmask(2, vocab)
    matcher.fill_bitmask(bitmask, 1)
    expected = torch.randn(2, vocab)
    ours = expected.clone()
    xgr.apply_token_bitmask_inplace(expected, bitmask, indices=[1])
    apply_bitmask_torch(ours, bitmask, [1])
    assert torch.equal(expected, ours)


# ---------------------------------------------------------------- the engine on SmolLM2


@pytest.fixture(scope="module")
def llm() -> LLM:
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    return LLM("smollm2-135m", dtype="float32", max_model_len=1024, kv_cache_memory_bytes=64 << 20)


def _structured(**kwargs: Any) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 1234}], ids=["greedy", "seeded"])
def test_json_schema_outputs_validate(llm: LLM, sampling: dict[str, Any]) -> None:
    params = SamplingParams(max_tokens=64, structured_outputs=_structured(json=CITY_SCHEMA), **sampling)
    outputs = llm.generate(PROMPTS, params)
    for output in outputs:
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), CITY_SCHEMA)


@pytest.mark.slow
def test_choice_and_regex(llm: LLM) -> None:
    choices = ["yes", "no", "maybe not"]
    for output in llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=16,
                                                            structured_outputs=_structured(choice=choices))):
        assert output.outputs[0].text in choices
        assert output.outputs[0].finish_reason == "stop"
    regex = r"[0-9]{3}-[0-9]{4}"
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=32, structured_outputs=_structured(regex=regex))
    for output in llm.generate(PROMPTS[:2], params):
        assert re.fullmatch(regex, output.outputs[0].text), output.outputs[0].text
        assert output.outputs[0].finish_reason == "stop"


@pytest.mark.slow
def test_mixed_batch_leaves_free_requests_unchanged(llm: LLM) -> None:
    free = SamplingParams(temperature=0, max_tokens=12)
    alone = [o.outputs[0].text for o in llm.generate(PROMPTS[:2], free)]
    structured = SamplingParams(temperature=0, max_tokens=64, structured_outputs=_structured(json=CITY_SCHEMA))
    mixed = llm.generate([PROMPTS[0], PROMPTS[2], PROMPTS[1], PROMPTS[3]], [free, structured, free, structured])
    assert [mixed[0].outputs[0].text, mixed[2].outputs[0].text] == alone
    for output in (mixed[1], mixed[3]):
        jsonschema.validate(json.loads(output.outputs[0].text), CITY_SCHEMA)


@pytest.mark.slow
def test_n_samples_each_follow_the_schema(llm: LLM) -> None:
    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=64, structured_outputs=_structured(json=CITY_SCHEMA))
    (output,) = llm.generate([PROMPTS[1]], params)
    assert len(output.outputs) == 2
    for completion in output.outputs:
        assert completion.finish_reason == "stop"
        jsonschema.validate(json.loads(completion.text), CITY_SCHEMA)


@pytest.mark.slow
def test_grammar_end_wins_over_min_tokens(llm: LLM) -> None:
    """min_tokens must not mask the only token a finished grammar allows (EOS)."""
    params = SamplingParams(temperature=0, max_tokens=16, min_tokens=8, structured_outputs=_structured(choice=["no"]))
    (output,) = llm.generate([PROMPTS[0]], params)
    assert output.outputs[0].text == "no"
    assert output.outputs[0].finish_reason == "stop"


# ---------------------------------------------------------------- the server (tiny random model)


@pytest.fixture(scope="module")
def server() -> Iterator[Any]:
    from test_server_support import live_server

    with live_server() as live:
        yield live


MSG = [{"role": "user", "content": "Name a city as JSON."}]


def test_openai_client_response_format_json_schema(server: Any) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    response = client.chat.completions.create(
        model="tiny", messages=MSG, max_tokens=64, temperature=0,  # type: ignore[arg-type]
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA, "strict": True}},
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content or ""), CITY_SCHEMA)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_structured_outputs_field_and_json_object(server: Any, path: str) -> None:
    base = {"prompt": "Pick:"} if path == "/v1/completions" else {"messages": MSG}
    with server.client() as http:
        body = {**base, "max_tokens": 16, "temperature": 0, "structured_outputs": {"choice": ["red", "green"]}}
        answer = http.post(path, json=body)
        assert answer.status_code == 200, answer.text
        choice = answer.json()["choices"][0]
        assert (choice.get("text") or choice.get("message", {}).get("content")) in ("red", "green")
        regex = {**base, "max_tokens": 16, "temperature": 0, "structured_outputs": {"regex": "[a-c]{4}"}}
        choice = http.post(path, json=regex).json()["choices"][0]
        assert re.fullmatch("[a-c]{4}", choice.get("text") or choice.get("message", {}).get("content"))
        # JSON mode on a random model is unbounded, so only check that it is accepted.
        answer = http.post(path, json={**base, "max_tokens": 4, "response_format": {"type": "json_object"}})
        assert answer.status_code == 200, answer.text


def _schema_format(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


@pytest.mark.parametrize(
    "extra, param, message",
    [
        ({"response_format": _schema_format({"type": "no-such-type"})}, "response_format", "invalid JSON schema"),
        ({"response_format": _schema_format(_nested_schema(65))}, "response_format", "nested 65 levels"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
        ({"response_format": {"type": "text_xml"}}, "response_format", "not supported"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs", "non-empty list"),
        ({"structured_outputs": {"regex": "[0-9"}}, "structured_outputs", "invalid regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one kind"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs", "invalid structural tag"),
        ({"structured_outputs": {"json": 5}}, "structured_outputs", "wrong type"),
        ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "response_format",
         "not both"),
    ],
)
def test_bad_constraints_are_400(server: Any, extra: dict[str, Any], param: str, message: str) -> None:
    with server.client() as http:
        for path, base in (("/v1/chat/completions", {"messages": MSG}), ("/v1/completions", {"prompt": "x"})):
            answer = http.post(path, json={**base, "max_tokens": 4, **extra})
            assert answer.status_code == 400, answer.text
            error = answer.json()["error"]
            assert error["type"] == "invalid_request_error" and error["param"] == param
            assert message in error["message"]
        assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_engine_and_server_import_without_xgrammar() -> None:
    # xgrammar loads on the first structured request only (GPU images may lack it).
    import subprocess
    import sys

    code = "import sys; sys.modules['xgrammar'] = None; import tidal_engine.engine.llm_engine, tidal_engine.server.app"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
