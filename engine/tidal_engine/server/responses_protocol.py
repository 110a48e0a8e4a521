"""Request shapes of the Responses API (POST /v1/responses), stateless, and their translation
into a chat request: the Responses API runs on the chat machinery (template, tools, parsers).

Parsed as strictly as chat: an unknown field is a 400 naming it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from tidal_engine.server.protocol import FUNCTION_NAME


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class InputText(_Request):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class MessageItem(_Request):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(_Request):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Request):
    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


class ReasoningItem(_Request):
    """A reasoning item of an earlier answer, sent back with the rest of its output: dropped,
    as chat templates drop earlier turns' reasoning."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] = Field(default_factory=list)
    content: list[Any] | None = None
    encrypted_content: str | None = None
    status: str | None = None


def _item_type(value: Any) -> str:
    # A message may leave out "type" (EasyInputMessage).
    return value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "message")


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")] | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]


class FunctionTool(_Request):
    type: Literal["function"]
    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(_Request):
    type: Literal["function"]
    name: str


class TextFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Request):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None


class ResponsesRequest(_Request):
    model: str | None = None
    input: str | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    stream: bool = False
    store: bool | None = None  # only false: nothing is stored
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled"] | None = None

    def refusal(self) -> tuple[str, str] | None:
        """(message, param) for what a stateless server cannot do."""
        if self.previous_response_id is not None:
            return ("previous_response_id is not supported: Tidal stores no responses. Send the earlier "
                    "turns in `input` instead (the output items of a response can be sent back as they are).",
                    "previous_response_id")
        if self.store:
            return "store: true is not supported: Tidal stores no responses; send store: false.", "store"
        return None

    def chat_body(self) -> dict[str, Any]:
        """The equivalent chat completion request body."""
        body: dict[str, Any] = {"messages": self.messages(), "max_completion_tokens": self.max_output_tokens,
                                "temperature": self.temperature, "top_p": self.top_p,
                                "parallel_tool_calls": self.parallel_tool_calls}
        if self.model is not None:
            body["model"] = self.model
        if self.user is not None:
            body["user"] = self.user
        if self.tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                             for t in self.tools]
        if isinstance(self.tool_choice, NamedFunctionChoice):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_object":
            body["response_format"] = {"type": "json_object"}
        elif fmt is not None and fmt.type == "json_schema":
            spec: dict[str, Any] = {"name": fmt.name or "output"}
            if fmt.schema_ is not None:
                spec["schema"] = fmt.schema_
            body["response_format"] = {"type": "json_schema", "json_schema": spec}
        return {k: v for k, v in body.items() if v is not None}

    def messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return messages + [{"role": "user", "content": self.input}]
        for item in self.input:
            if isinstance(item, MessageItem):
                messages.append({"role": item.role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant":  # calls join the assistant turn
                    last.setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        return messages

    def echo_fields(self) -> dict[str, Any]:
        """The request settings a Response object repeats."""
        tools = [t.model_dump(exclude_none=True) for t in self.tools or []]
        choice: Any = self.tool_choice.model_dump() if isinstance(self.tool_choice, BaseModel) else self.tool_choice
        fmt = self.text.format.model_dump(by_alias=True, exclude_none=True) if self.text and self.text.format else \
            {"type": "text"}
        return {
            "instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
            "temperature": self.temperature if self.temperature is not None else 1.0,
            "top_p": self.top_p if self.top_p is not None else 1.0, "tools": tools,
            "tool_choice": choice or ("auto" if tools else "none"), "parallel_tool_calls": self.parallel_tool_calls,
            "text": {"format": fmt}, "metadata": self.metadata or {}, "user": self.user,
            "store": False, "previous_response_id": None, "truncation": "disabled",
        }
