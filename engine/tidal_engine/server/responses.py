"""POST /v1/responses: OpenAI's Responses API, stateless, on top of the chat machinery.

An answer's output is a list of items: a `reasoning` item (with --reasoning-parser), a
`message` with one `output_text` part, and one `function_call` per tool call. Streaming
sends the standard `response.*` events; the final `response.completed` (or
`response.incomplete`) carries the same Response object a non-streamed request gets.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tidal_engine.engine.async_engine import EngineDeadError, EngineShuttingDownError, EngineSleepingError
from tidal_engine.outputs import RequestOutput
from tidal_engine.server.chat_output import ChatOutputPlan
from tidal_engine.server.errors import bad_request
from tidal_engine.server.protocol import ChatCompletionRequest, ChatResponseMessage, DeltaMessage
from tidal_engine.server.responses_protocol import ResponsesRequest
from tidal_engine.server.serving import (
    EngineStreamingResponse,
    OpenAIServing,
    _engine_error,
    cancel_on_disconnect,
    parse_model,
)


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": [part]}


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def output_items(message: ChatResponseMessage) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    if message.reasoning_content:
        items.append(reasoning_item(_new_id("rs"), message.reasoning_content))
    if message.content:
        items.append(message_item(_new_id("msg"), message.content))
    for call in message.tool_calls:
        items.append(function_call_item(_new_id("fc"), call.id, call.function.name, call.function.arguments))
    return items


class ResponsesServing:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create(self, data: dict[str, Any], raw: Request) -> Response:
        request = parse_model(ResponsesRequest, data)
        refusal = request.refusal()
        if refusal is not None:
            raise bad_request(*refusal)
        chat = parse_model(ChatCompletionRequest, request.chat_body())
        prepared = await self.serving.prepare_chat(chat, "max_output_tokens")
        response_id = _new_id("resp")
        created = int(time.time())
        streams = await self.serving.submit(response_id, [prepared.prompt_ids], prepared.params, None,
                                            prepared.lora_name)
        if request.stream:
            return EngineStreamingResponse(self._stream(request, streams[0], prepared.plan, response_id, created),
                                           media_type="text/event-stream")
        (output,) = await cancel_on_disconnect(raw, self.serving.final_outputs(streams))
        message, _ = prepared.plan.message(output.outputs[0].text)
        return JSONResponse(self._response(request, response_id, created, output_items(message), output))

    def _response(self, request: ResponsesRequest, response_id: str, created: int, items: list[dict[str, Any]],
                  output: RequestOutput | None) -> dict[str, Any]:
        """The Response object; `output` None: still in progress."""
        status, incomplete, usage = "in_progress", None, None
        if output is not None:
            completion = output.outputs[0]
            cut_short = completion.finish_reason == "length"
            status = "incomplete" if cut_short else "completed"
            incomplete = {"reason": "max_output_tokens"} if cut_short else None
            usage = self._usage(output, items)
        return {
            "id": response_id, "object": "response", "created_at": created, "status": status,
            "incomplete_details": incomplete, "error": None, "model": self.serving.response_model(request.model),
            "output": items, "usage": usage, **request.echo_fields(),
        }

    def _usage(self, output: RequestOutput, items: list[dict[str, Any]]) -> dict[str, Any]:
        prompt = len(output.prompt_token_ids)
        generated = len(output.outputs[0].token_ids)
        reasoning = "".join(p["text"] for i in items if i["type"] == "reasoning" for p in i["content"])
        # The reasoning text re-tokenized: the engine does not tag tokens by where they went.
        reasoning_tokens = len(self.serving.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": output.num_cached_tokens},
                "output_tokens": generated, "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, generated)},
                "total_tokens": prompt + generated}

    async def _stream(self, request: ResponsesRequest, stream: Any, plan: ChatOutputPlan, response_id: str,
                      created: int) -> AsyncIterator[str]:
        events = _EventWriter()
        yield events.send("response.created", response=self._response(request, response_id, created, [], None))
        yield events.send("response.in_progress", response=self._response(request, response_id, created, [], None))
        items = _ItemStream(events)
        streamer = plan.streamer()
        final: RequestOutput | None = None
        try:
            async for output in self.serving.engine.iterate(stream):
                final = output
                completion = output.outputs[0]
                for delta in streamer.update(completion.text, completion.finished):
                    for event in items.add(delta):
                        yield event
            for event in items.close():
                yield event
            assert final is not None
            response = self._response(request, response_id, created, items.done, final)
            kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
            yield events.send(kind, response=response)
        except (EngineDeadError, EngineSleepingError, EngineShuttingDownError) as exc:
            err = _engine_error(exc)
            yield events.send("error", code=str(err.status_code), message=err.message, param=None)


class _EventWriter:
    def __init__(self) -> None:
        self.sequence = 0

    def send(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


class _ItemStream:
    """Turns chat deltas into output items and their events, one open item at a time."""

    def __init__(self, events: _EventWriter) -> None:
        self.events = events
        self.done: list[dict[str, Any]] = []
        self.kind: str | None = None  # "reasoning" | "message" | "function_call"
        self.item: dict[str, Any] = {}
        self.text = ""

    @property
    def index(self) -> int:
        return len(self.done)

    def add(self, delta: DeltaMessage) -> list[str]:
        out: list[str] = []
        if delta.reasoning_content:
            out += self._open("reasoning", reasoning_item(_new_id("rs"), "", "in_progress"))
            out.append(self._delta("response.reasoning_text.delta", delta.reasoning_content, content_index=0))
        if delta.content:
            out += self._open("message", message_item(_new_id("msg"), "", "in_progress"))
            out.append(self._delta("response.output_text.delta", delta.content, content_index=0, logprobs=[]))
        for piece in delta.tool_calls or []:
            if piece.id is not None:
                item = function_call_item(_new_id("fc"), piece.id, piece.function.name or "", "", "in_progress")
                out += self._open("function_call", item, force=True)
            if piece.function.arguments:
                out.append(self._delta("response.function_call_arguments.delta", piece.function.arguments))
        return out

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        out: list[str] = []
        base = {"item_id": self.item["id"], "output_index": self.index}
        if self.kind == "message":
            final = message_item(self.item["id"], self.text)
            part = final["content"][0]
            out.append(self.events.send("response.output_text.done", **base, content_index=0, text=self.text,
                                        logprobs=[]))
            out.append(self.events.send("response.content_part.done", **base, content_index=0, part=part))
        elif self.kind == "reasoning":
            final = reasoning_item(self.item["id"], self.text)
            out.append(self.events.send("response.reasoning_text.done", **base, content_index=0, text=self.text))
        else:
            final = {**self.item, "arguments": self.text, "status": "completed"}
            out.append(self.events.send("response.function_call_arguments.done", **base, name=final["name"],
                                        arguments=self.text))
        out.append(self.events.send("response.output_item.done", output_index=self.index, item=final))
        self.done.append(final)
        self.kind, self.item, self.text = None, {}, ""
        return out

    def _open(self, kind: str, item: dict[str, Any], force: bool = False) -> list[str]:
        if self.kind == kind and not force:
            return []
        out = self.close()
        self.kind, self.item, self.text = kind, item, ""
        added = dict(item)
        if kind == "message":
            added["content"] = []
        elif kind == "reasoning":
            added["content"] = []
        out.append(self.events.send("response.output_item.added", output_index=self.index, item=added))
        if kind == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out.append(self.events.send("response.content_part.added", item_id=item["id"], output_index=self.index,
                                        content_index=0, part=part))
        return out

    def _delta(self, kind: str, text: str, **fields: Any) -> str:
        self.text += text
        return self.events.send(kind, item_id=self.item["id"], output_index=self.index, delta=text, **fields)
