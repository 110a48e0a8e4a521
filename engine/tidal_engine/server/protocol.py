"""Request and response shapes of the OpenAI-compatible API (vLLM's field names).

Requests are parsed strictly: a string where a number belongs is a 400, not a coercion,
and a field Tidal does not know is a 400 that names it (never silently dropped). Known
fields set to a value Tidal cannot honour are refused too (see `unsupported_fields`).
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

from tidal_engine.structured import StructuredOutputsParams

# vLLM's default max_logprobs: a request for more top logprobs is a 400.
MAX_LOGPROBS = 20
# The most choices one request may ask for; guards memory against n=10000.
MAX_N = 128


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(_Request):
    """Sampling knobs shared by completions and chat (OpenAI ranges, vLLM extras)."""

    model: str | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0
    skip_special_tokens: bool = True
    # Fast tokenizers (the only kind Tidal loads) never put spaces between special tokens:
    # accepted, as vLLM's fast detokenizer accepts it.
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Keep only the last k prompt tokens (vLLM; -1: the context length).
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    # The top-k alternatives at every prompt position (vLLM); see prompt_logprobs.py.
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    allowed_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)] | None = None
    bad_words: list[Annotated[str, Field(min_length=1)]] | None = None
    priority: int = 0  # lower runs first; needs --scheduling-policy priority
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    # Accepted so OpenAI clients can send them, but only their no-op values are allowed.
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    # OpenAI's {"type": "text" | "json_object" | "json_schema"} and vLLM's own constraint field.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_stop(self) -> "SamplingFields":
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options needs stream set to true")
        return self

    def unsupported_fields(self) -> list[str]:
        """Fields set to something Tidal cannot honour (each would otherwise be silently lost)."""
        bad: list[str] = []
        if self.logit_bias:
            bad.append("logit_bias")
        if self.best_of is not None and self.best_of != self.n:
            bad.append("best_of")
        return bad

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The output constraint asked for, if any; ValueError (with ``.param``) for a bad one."""
        fmt = self.response_format
        fmt_type = fmt.get("type", "text") if fmt is not None else "text"
        if fmt_type != "text" and self.structured_outputs is not None:
            raise _param_error("give either response_format or structured_outputs, not both", "response_format")
        if self.structured_outputs is not None:
            return _from_structured_outputs(self.structured_outputs)
        if fmt is None or fmt_type == "text":
            return None
        if fmt_type == "json_object":
            return _build("response_format", json_object=True)
        if fmt_type == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict):
                raise _param_error(
                    'response_format of type "json_schema" needs a "json_schema" object with a "schema"',
                    "response_format",
                )
            schema = spec.get("schema")
            if schema is None:  # OpenAI allows leaving it out: any JSON object then
                return _build("response_format", json_object=True)
            if not isinstance(schema, dict):
                raise _param_error("response_format.json_schema.schema must be a JSON object", "response_format")
            return _build("response_format", json=schema)
        raise _param_error(
            f"response_format type {fmt_type!r} is not supported; use 'text', 'json_object' or 'json_schema'",
            "response_format",
        )


_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


def _param_error(message: str, param: str) -> ValueError:
    exc = ValueError(message)
    exc.param = param  # type: ignore[attr-defined]
    return exc


def _build(param: str, **kwargs: Any) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**kwargs)
    except ValueError as exc:
        raise _param_error(f"{param}: {exc}", param) from None


def _from_structured_outputs(spec: dict[str, Any]) -> StructuredOutputsParams:
    unknown = sorted(k for k, v in spec.items() if k not in _STRUCTURED_KEYS and v is not None)
    if unknown:
        raise _param_error(
            f"structured_outputs: unsupported field(s) {', '.join(unknown)}; use one of {', '.join(_STRUCTURED_KEYS)}",
            "structured_outputs",
        )
    kwargs = {k: spec[k] for k in _STRUCTURED_KEYS if spec.get(k) is not None}
    # Strict typing, as for every other field: the dataclass would not check these.
    checks = {"json": (dict, str), "regex": str, "grammar": str, "choice": list, "json_object": bool,
              "structural_tag": str}
    for key, value in kwargs.items():
        if not isinstance(value, checks[key]):  # type: ignore[arg-type]
            raise _param_error(f"structured_outputs.{key} has the wrong type ({type(value).__name__})",
                               "structured_outputs")
    return _build("structured_outputs", **kwargs)


PromptInput = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingFields):
    prompt: PromptInput
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _check_prompt(self) -> "CompletionRequest":
        prompt = self.prompt
        if isinstance(prompt, str):
            return self
        if len(prompt) == 0:
            raise ValueError("prompt must not be empty")
        if isinstance(prompt[0], list) and any(len(p) == 0 for p in prompt):  # type: ignore[arg-type]
            raise ValueError("token-id prompts must not be empty")
        if isinstance(prompt[0], int) and any(t < 0 for t in prompt):  # type: ignore[operator]
            raise ValueError("token ids must be non-negative")
        if isinstance(prompt[0], list) and any(t < 0 for p in prompt for t in p):  # type: ignore[union-attr]
            raise ValueError("token ids must be non-negative")
        return self

    def unsupported_fields(self) -> list[str]:
        bad = super().unsupported_fields()
        if self.suffix:
            bad.append("suffix")
        return bad


class TextPart(_Request):
    type: Literal["text"]
    text: str


class FunctionCall(_Request):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None
    # What Tidal's own answers carry, so a client can send an assistant turn back unchanged.
    reasoning_content: str | None = None
    refusal: None = None

    @model_validator(mode="after")
    def _check_content(self) -> "ChatMessage":
        # Only an assistant turn that calls tools may come without content.
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    def text(self) -> str | None:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content

    def for_template(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls is not None:
            # Templates index arguments as a mapping (Llama 3, Qwen): hand them parsed JSON.
            message["tool_calls"] = [
                {"id": c.id, "type": c.type, "function": {"name": c.function.name,
                                                          "arguments": _json_or_text(c.function.arguments)}}
                for c in self.tool_calls
            ]
        return message


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


# Function names as OpenAI allows them.
FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"


class FunctionDefinition(_Request):
    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None


class ChatTool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False  # vLLM: start the answer with the final assistant message's text
    chat_template: Annotated[str, Field(min_length=1)] | None = None  # a Jinja template for this request
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, else "none" (OpenAI's default)
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _check_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and self.top_logprobs > 0 and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        return self

    @model_validator(mode="after")
    def _check_tools(self) -> "ChatCompletionRequest":
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: every function needs a distinct name")
        choice = self.tool_choice
        if choice in ("required",) and not names:
            raise ValueError('tool_choice "required" needs at least one entry in tools')
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names function {choice.function.name!r}, which is not in tools")
        return self

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeCompletionRequest(_Request):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Request):
    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False
    chat_template: Annotated[str, Field(min_length=1)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


class LoadLoRAAdapterRequest(_Request):
    """vLLM's POST /v1/load_lora_adapter body."""

    lora_name: Annotated[str, Field(min_length=1, max_length=256)]
    lora_path: Annotated[str, Field(min_length=1, max_length=4096)]


class UnloadLoRAAdapterRequest(_Request):
    """vLLM's POST /v1/unload_lora_adapter body (lora_int_id is accepted and ignored)."""

    lora_name: Annotated[str, Field(min_length=1, max_length=256)]
    lora_int_id: int | None = None


# ---------------------------------------------------------------------- responses
# Plain models: the server builds them, so no strictness is needed.


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "tidal"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # vLLM's: one entry per prompt token (None first), {token id: {logprob, rank, decoded_token}}.
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ResponseFunctionCall(BaseModel):
    name: str
    arguments: str


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ResponseToolCall] = Field(default_factory=list)
    reasoning_content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None  # vLLM's, as in completions


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaToolCall(BaseModel):
    """One piece of a streamed tool call: the first names it (id, name), the rest add arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        # OpenAI's deltas carry only what changed.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    # vLLM's prompt_logprobs, on the chunk with the first token only (left out of the others).
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str
