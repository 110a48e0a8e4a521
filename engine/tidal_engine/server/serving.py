"""The OpenAI endpoints' logic: parse, validate, run through the engine, shape the answer.

Bodies are read by `read_json_body` (size limit, UTF-8, JSON) and validated with the
pydantic models in protocol.py, so every bad input becomes a 4xx before the engine sees it.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.types import Receive, Scope, Send

from tidal_engine.engine.async_engine import (
    EngineClient,
    EngineDeadError,
    EngineShuttingDownError,
    EngineSleepingError,
)
from tidal_engine.lora.adapter import LoRAError
from tidal_engine.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from tidal_engine.sampling_params import SamplingParams
from tidal_engine.server.errors import (
    ENGINE_UNAVAILABLE,
    NOT_FOUND,
    REQUEST_TOO_LARGE,
    APIError,
    bad_request,
    engine_sleeping_error,
    error_body,
    validation_error_to_api_error,
)
from tidal_engine.server.chat_output import ChatOutputPlan
from tidal_engine.server.protocol import (
    ChatChoice,
    ChatTool,
    NamedToolChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatStreamChoice,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    TokenLogprob,
    TopLogprob,
    UsageInfo,
    SamplingFields,
)
from tidal_engine.server import prompt_logprobs
from tidal_engine.server.reasoning import get_reasoning_parser
from tidal_engine.server.tool_parsers import get_tool_parser
from tidal_engine.server.tool_parsers.forced import RequiredChoiceParser, named_constraint, required_constraint
from tidal_engine.server.tool_parsers.strict import strict_constraint
from tidal_engine.structured import StructuredOutputsParams

ModelT = TypeVar("ModelT", bound=BaseModel)
T = TypeVar("T")


# ---------------------------------------------------------------------- body parsing


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


async def read_json_body(request: Request, limit: int) -> dict[str, Any]:
    """The body as a JSON object, enforcing the size limit on the header and on the bytes."""
    too_large = APIError(413, f"Request body exceeds the limit of {limit} bytes.", REQUEST_TOO_LARGE)
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > limit:
                raise too_large
        except ValueError:
            raise bad_request("Invalid Content-Length header.") from None
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:  # a chunked body has no Content-Length: count what arrives
            raise too_large
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        raise bad_request("The request body is empty; send a JSON object.")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"The request body is not valid UTF-8 (byte {exc.start}).") from None
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise bad_request(f"Malformed JSON in the request body: {exc}") from None
    if not isinstance(data, dict):
        raise bad_request("The request body must be a JSON object.")
    return data


def parse_model(model_cls: type[ModelT], data: dict[str, Any]) -> ModelT:
    try:
        return model_cls.model_validate(data)
    except ValidationError as exc:
        unknown = [".".join(str(p) for p in e["loc"] if "[" not in str(p))  # no pydantic union-branch names
                   for e in exc.errors() if e["type"] == "extra_forbidden"]
        if unknown:  # name them all: a client sending one unknown field often sends several
            raise bad_request(
                f"Unknown field(s): {', '.join(unknown)}. Tidal refuses fields it does not implement "
                "rather than ignoring them (docs/engine-api.md lists the supported ones).",
                unknown[0],
            ) from None
        raise validation_error_to_api_error(exc) from None


# ---------------------------------------------------------------------- disconnects


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run `work`, cancelling it if the client goes away (its generator then aborts the request)."""
    task = asyncio.ensure_future(work)

    async def wait_disconnect() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        # Nobody reads this answer; 499 is nginx's "client closed request".
        raise APIError(499, "Client disconnected.", "client_disconnected")
    return task.result()


class EngineStreamingResponse(StreamingResponse):
    """A streaming response that stops (and so aborts the request) as soon as the client leaves.

    Starlette only notices a disconnect on the next write with ASGI 2.4 servers; watching
    `receive` as well frees the KV blocks without waiting for another token.
    """

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:
                        pass  # the client went away mid-write
                    group.cancel_scope.cancel()

                async def watch() -> None:
                    await self.listen_for_disconnect(receive)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                group.start_soon(watch)
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()


def sse(payload: BaseModel | dict[str, Any], with_usage: bool = True) -> str:
    """One server-sent event. Chunks carry `usage` only when the client asked for it
    (stream_options.include_usage), as OpenAI's do."""
    if isinstance(payload, BaseModel):
        exclude = set() if with_usage else {"usage"}
        if getattr(payload, "prompt_logprobs", ...) is None:
            exclude.add("prompt_logprobs")  # a chat chunk's: only on the one that carries them
        return f"data: {payload.model_dump_json(exclude_none=False, exclude=exclude or None)}\n\n"
    return f"data: {json.dumps(payload)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


async def _merge(iterators: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Interleave several async iterators, tagging each item with its iterator's index."""
    if len(iterators) == 1:
        async for item in iterators[0]:
            yield 0, item
        return
    queue: asyncio.Queue[tuple[int, T] | tuple[int, BaseException] | None] = asyncio.Queue()

    async def pump(i: int, it: AsyncIterator[T]) -> None:
        try:
            async for item in it:
                await queue.put((i, item))
        except BaseException as exc:  # noqa: BLE001 - re-raised by the consumer
            await queue.put((i, exc))
        finally:
            await queue.put(None)

    tasks = [asyncio.ensure_future(pump(i, it)) for i, it in enumerate(iterators)]
    remaining = len(tasks)
    try:
        while remaining:
            entry = await queue.get()
            if entry is None:
                remaining -= 1
                continue
            i, item = entry
            if isinstance(item, BaseException):
                raise item
            yield i, item  # type: ignore[misc]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# ---------------------------------------------------------------------- the service


@dataclass
class PreparedChat:
    plan: ChatOutputPlan
    params: SamplingParams
    prompt_ids: list[int]
    lora_name: str | None


@dataclass
class ServingSettings:
    served_model_names: list[str]
    model_source: str
    max_request_body_bytes: int = 8 * 1024 * 1024
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    chat_template: str | None = None  # overrides the tokenizer's (--chat-template)
    # Sampling defaults for fields a request leaves out (--generation-config, see generation_config.py).
    default_sampling: dict[str, Any] = field(default_factory=dict)


class OpenAIServing:
    def __init__(self, engine: EngineClient, settings: ServingSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.model_name = settings.served_model_names[0]
        self.vocab_size = len(self.tokenizer)
        self.tool_parser = get_tool_parser(settings.tool_call_parser) if settings.tool_call_parser else None
        self.reasoning_parser = get_reasoning_parser(settings.reasoning_parser) if settings.reasoning_parser else None

    # -------------------------------------------------------------- shared checks

    def check_model(self, model: str | None) -> str | None:
        """404 unless `model` is a served name or a loaded LoRA adapter; returns the adapter's
        name (None for the base model)."""
        if model is None or model in self.settings.served_model_names:
            return None
        if any(info.name == model for info in self.engine.list_lora_adapters()):
            return model
        raise APIError(404, f"The model `{model}` does not exist.", NOT_FOUND, "model")

    def response_model(self, model: str | None) -> str:
        """The `model` answers carry: the adapter's name for adapter requests (vLLM's choice)."""
        if model is None or model in self.settings.served_model_names:
            return self.model_name
        return model

    def check_supported(self, request: SamplingFields) -> None:
        unsupported = request.unsupported_fields()
        if unsupported:
            raise bad_request(f"Not supported by Tidal yet: {', '.join(unsupported)}.", unsupported[0].split()[0])

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        # An id past the vocabulary would crash the embedding lookup inside the engine loop.
        for token_id in token_ids:
            if token_id >= self.vocab_size:
                raise bad_request(f"Token id {token_id} is outside the vocabulary (size {self.vocab_size}).", param)

    def check_prompt_length(self, num_tokens: int, param: str) -> None:
        if num_tokens >= self.max_model_len:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens, "
                f"but the prompt has {num_tokens} tokens (at most {self.max_model_len - 1} leave room "
                "for one generated token). Please shorten the prompt.",
                param,
            )

    def check_max_tokens(self, num_prompt_tokens: int, max_tokens: int | None, param: str) -> None:
        """vLLM's 400 for a prompt plus max_tokens past the context (never silently clamped)."""
        if max_tokens is not None and num_prompt_tokens + max_tokens > self.max_model_len:
            raise bad_request(
                f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum "
                f"context length is {self.max_model_len} tokens and your request has {num_prompt_tokens} input "
                f"tokens ({max_tokens} > {self.max_model_len} - {num_prompt_tokens}).",
                param,
            )

    def truncate(self, token_ids: list[int], keep: int | None) -> list[int]:
        """truncate_prompt_tokens: the last `keep` tokens (-1: as many as the context holds)."""
        if keep is None:
            return token_ids
        if keep == -1:
            keep = self.max_model_len
        if keep > self.max_model_len:
            raise bad_request(f"truncate_prompt_tokens ({keep}) must not exceed the context length "
                              f"({self.max_model_len}).", "truncate_prompt_tokens")
        return token_ids[-keep:] if keep else []

    def default_max_tokens(self, requested: int | None) -> int | None:
        # generation_config.json's max_new_tokens applies to requests that set no limit (vLLM).
        return requested if requested is not None else self.settings.default_sampling.get("max_tokens")

    def sampling_params(self, request: SamplingFields, max_tokens: int | None, logprobs: int | None,
                        prompt_lps: int | None = None) -> SamplingParams:
        try:
            structured = request.structured_outputs_params()
        except ValueError as exc:
            raise bad_request(str(exc), getattr(exc, "param", None)) from None
        return self.build_sampling_params(request, max_tokens, logprobs, structured, prompt_lps)

    def build_sampling_params(self, request: SamplingFields, max_tokens: int | None, logprobs: int | None,
                              structured: Any, prompt_lps: int | None = None) -> SamplingParams:
        defaults = self.settings.default_sampling
        if request.allowed_token_ids is not None:
            self.check_token_ids(request.allowed_token_ids, "allowed_token_ids")

        def pick(name: str, fallback: float) -> Any:
            value = getattr(request, name)
            return value if value is not None else defaults.get(name, fallback)

        try:
            return SamplingParams(
                n=request.n,
                temperature=pick("temperature", 1.0),
                top_p=pick("top_p", 1.0),
                top_k=pick("top_k", 0),
                min_p=pick("min_p", 0.0),
                presence_penalty=request.presence_penalty or 0.0,
                frequency_penalty=request.frequency_penalty or 0.0,
                repetition_penalty=pick("repetition_penalty", 1.0),
                seed=request.seed,
                stop=request.stop,
                stop_token_ids=list(request.stop_token_ids or []),
                ignore_eos=request.ignore_eos,
                max_tokens=max_tokens,
                min_tokens=request.min_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_lps,
                skip_special_tokens=request.skip_special_tokens,
                include_stop_str_in_output=request.include_stop_str_in_output,
                structured_outputs=structured,
                priority=request.priority,
                allowed_token_ids=list(request.allowed_token_ids) if request.allowed_token_ids is not None else None,
                bad_words=list(request.bad_words) if request.bad_words else None,
            )
        except ValueError as exc:
            raise bad_request(str(exc)) from None

    async def submit(
        self, base_id: str, prompts: list[str | list[int]], params: SamplingParams, cache_salt: str | None,
        lora_name: str | None = None,
    ) -> list[Any]:
        """Add one engine request per prompt; all or none (earlier ones are aborted on failure)."""
        streams: list[Any] = []
        try:
            for i, prompt in enumerate(prompts):
                request_id = base_id if len(prompts) == 1 else f"{base_id}-{i}"
                lora = {"lora_name": lora_name} if lora_name is not None else {}
                streams.append(await self.engine.add_request(request_id, prompt, params, cache_salt=cache_salt, **lora))
        except BaseException as exc:
            for stream in streams:
                self.engine.abort(stream.request_id)
            raise _engine_error(exc) from exc
        return streams

    async def final_outputs(self, streams: list[Any]) -> list[RequestOutput]:
        async def last(stream: Any) -> RequestOutput:
            result: RequestOutput | None = None
            async for output in self.engine.iterate(stream):
                result = output
            assert result is not None
            return result

        try:
            return list(await asyncio.gather(*(last(s) for s in streams)))
        except (EngineDeadError, EngineSleepingError, EngineShuttingDownError) as exc:
            raise _engine_error(exc) from exc

    def decode_token(self, token_id: int, logprob: Any) -> str:
        text = getattr(logprob, "decoded_token", None)
        if text is None:
            text = self.tokenizer.decode([token_id])
        return text

    def _top(self, position: PositionLogprobs, k: int) -> list[tuple[int, Any]]:
        ranked = sorted(position.items(), key=lambda kv: (kv[1].rank or 10**9, -kv[1].logprob))
        return ranked[:k]

    # -------------------------------------------------------------- models

    def list_models(self) -> ModelList:
        cards = [
            ModelCard(id=name, root=self.settings.model_source, max_model_len=self.max_model_len)
            for name in self.settings.served_model_names
        ]
        # LoRA adapters name their base model in `parent`, as vLLM's list does.
        cards += [
            ModelCard(id=info.name, root=info.path, parent=self.model_name, max_model_len=self.max_model_len)
            for info in self.engine.list_lora_adapters()
        ]
        return ModelList(data=cards)

    # -------------------------------------------------------------- completions

    async def create_completion(self, data: dict[str, Any], raw: Request) -> Response:
        request = parse_model(CompletionRequest, data)
        lora_name = self.check_model(request.model)
        self.check_supported(request)
        texts = self._completion_prompts(request.prompt)
        prompts: list[str | list[int]] = []
        for prompt in texts:
            ids = prompt if isinstance(prompt, list) else await self.encode(prompt, add_special_tokens=True)
            ids = self.truncate(ids, request.truncate_prompt_tokens)
            self.check_prompt_length(len(ids), "prompt")
            self.check_max_tokens(len(ids), request.max_tokens, "max_tokens")
            prompts.append(ids)
        echo_logprobs = request.echo and request.logprobs is not None  # the prompt's logprobs come first
        params = self.sampling_params(request, self.default_max_tokens(request.max_tokens), request.logprobs,
                                      prompt_logprobs.engine_prompt_logprobs(
                                          request.prompt_logprobs, request.logprobs if echo_logprobs else None))
        base_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        streams = await self.submit(base_id, prompts, params, request.cache_salt, lora_name)
        if request.stream:
            return EngineStreamingResponse(
                self._completion_stream(request, streams, texts, base_id, created), media_type="text/event-stream"
            )
        outputs = await cancel_on_disconnect(raw, self.final_outputs(streams))
        prompt_lps = [self.prompt_logprobs_json(o, request.prompt_logprobs) for o in outputs]
        echo_lps = [self.prompt_logprobs_json(o, request.logprobs if echo_logprobs else None) for o in outputs]
        choices: list[CompletionChoice] = []
        for prompt_idx, output in enumerate(outputs):
            prompt_text = self._prompt_text(output, texts[prompt_idx]) if request.echo else ""
            for completion in output.outputs:
                logprobs = self._completion_logprobs(completion, 0, len(completion.token_ids), request.logprobs,
                                                     len(prompt_text))
                if echo_logprobs and logprobs is not None:
                    logprobs = self._echo_logprobs(prompts[prompt_idx], echo_lps[prompt_idx], logprobs,  # type: ignore[arg-type]
                                                   request.logprobs or 0)
                choices.append(
                    CompletionChoice(
                        index=prompt_idx * request.n + completion.index,
                        text=prompt_text + completion.text,
                        logprobs=logprobs,
                        finish_reason=completion.finish_reason,
                        stop_reason=completion.stop_reason,
                        prompt_logprobs=prompt_lps[prompt_idx],
                    )
                )
        return JSONResponse(
            CompletionResponse(
                id=base_id, created=created, model=self.response_model(request.model), choices=choices,
                usage=_usage(outputs),
            ).model_dump()
        )

    def prompt_logprobs_json(self, output: RequestOutput, k: int | None) -> list[Any] | None:
        """The output's prompt logprobs in vLLM's JSON shape with top-k alternatives; None when
        not asked (k None) or not yet computed."""
        if k is None:
            return None
        return prompt_logprobs.to_json(output.prompt_logprobs, k, self.decode_token)

    def _echo_logprobs(self, prompt_ids: list[int], entries: list[Any], generated: CompletionLogprobs,
                       k: int) -> CompletionLogprobs:
        """vLLM's echo with logprobs: the prompt's tokens first (the first has no logprob)."""
        result = CompletionLogprobs()
        offset = 0
        for token_id, entry in zip(prompt_ids, entries):
            token = self.tokenizer.decode([token_id])
            result.tokens.append(token)
            result.text_offset.append(offset)
            offset += len(token)
            if entry is None:
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
                continue
            result.token_logprobs.append(entry[str(token_id)]["logprob"])
            ranked = sorted(entry.values(), key=lambda e: e["rank"] or 10**9)
            result.top_logprobs.append({e["decoded_token"]: e["logprob"] for e in ranked if (e["rank"] or k + 1) <= k})
        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            getattr(result, name).extend(getattr(generated, name))
        return result

    def _completion_prompts(self, prompt: Any) -> list[str | list[int]]:
        if isinstance(prompt, str):
            prompts: list[str | list[int]] = [prompt]
        elif prompt and isinstance(prompt[0], int):
            prompts = [list(prompt)]
        else:
            prompts = list(prompt)
        for p in prompts:
            if isinstance(p, list):
                self.check_token_ids(p, "prompt")
        return prompts

    def _prompt_text(self, output: RequestOutput, prompt: str | list[int]) -> str:
        if isinstance(prompt, str):
            return prompt
        return self.tokenizer.decode(output.prompt_token_ids or prompt)

    def _completion_logprobs(
        self, completion: CompletionOutput, start: int, end: int, k: int | None, text_offset: int
    ) -> CompletionLogprobs | None:
        if k is None or completion.logprobs is None:
            return None
        result = CompletionLogprobs()
        end = min(end, len(completion.logprobs), len(completion.token_ids))
        offset = text_offset
        for pos in range(start, end):
            token_id = completion.token_ids[pos]
            position = completion.logprobs[pos]
            sampled = position.get(token_id)
            token = self.decode_token(token_id, sampled)
            result.tokens.append(token)
            result.token_logprobs.append(None if sampled is None else sampled.logprob)
            result.top_logprobs.append(
                {self.decode_token(tid, lp): lp.logprob for tid, lp in self._top(position, k)} if k else {}
            )
            result.text_offset.append(offset)
            offset += len(token)
        return result

    async def _completion_stream(
        self, request: CompletionRequest, streams: list[Any], texts: list[str | list[int]], base_id: str,
        created: int,
    ) -> AsyncIterator[str]:
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        continuous = bool(request.stream_options and request.stream_options.continuous_usage_stats)
        sent_text: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        echoed: set[int] = set()
        echo_len: dict[int, int] = {}  # the echoed prompt's length: where the answer's text offsets start
        done: set[int] = set()
        finals: dict[int, RequestOutput] = {}
        try:
            async for prompt_idx, output in _merge([self.engine.iterate(s) for s in streams]):
                if output.finished:
                    finals[prompt_idx] = output
                for completion in output.outputs:
                    index = prompt_idx * request.n + completion.index
                    if index in done:
                        continue  # with n > 1, finished choices keep appearing in later outputs
                    delta = completion.text[sent_text.get(index, 0):]
                    if not delta and not completion.finished and index in echoed:
                        continue
                    if completion.finished:
                        done.add(index)
                    prefix = ""
                    first = index not in echoed  # the choice's first chunk: the prompt's part rides on it
                    echoed.add(index)
                    if request.echo and first:
                        prefix = self._prompt_text(output, texts[prompt_idx])
                        echo_len[index] = len(prefix)
                    start = sent_tokens.get(index, 0)
                    logprobs = self._completion_logprobs(
                        completion, start, len(completion.token_ids), request.logprobs,
                        sent_text.get(index, 0) + echo_len.get(index, 0)
                    )
                    if request.echo and first and logprobs is not None:
                        logprobs = self._echo_logprobs(output.prompt_token_ids,
                                                       self.prompt_logprobs_json(output, request.logprobs) or [],
                                                       logprobs, request.logprobs or 0)
                    sent_text[index] = len(completion.text)
                    sent_tokens[index] = len(completion.token_ids)
                    chunk = CompletionChunk(
                        id=base_id,
                        created=created,
                        model=self.response_model(request.model),
                        choices=[
                            CompletionChoice(
                                index=index,
                                text=prefix + delta,
                                logprobs=logprobs,
                                finish_reason=completion.finish_reason,
                                stop_reason=completion.stop_reason,
                                prompt_logprobs=self.prompt_logprobs_json(output, request.prompt_logprobs)
                                if first else None,
                            )
                        ],
                        usage=_usage([output]) if continuous else None,
                    )
                    yield sse(chunk, with_usage=include_usage or continuous)
            if include_usage:
                usage = _usage([finals[i] for i in sorted(finals)])
                yield sse(CompletionChunk(id=base_id, created=created, model=self.response_model(request.model),
                                          choices=[], usage=usage))
        except (EngineDeadError, EngineSleepingError, EngineShuttingDownError) as exc:
            err = _engine_error(exc)
            yield sse(error_body(err.status_code, err.message, err.err_type))
        yield SSE_DONE

    # -------------------------------------------------------------- chat

    async def render_chat(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        continue_final_message: bool,
        template_kwargs: dict[str, Any] | None,
        tools: list[ChatTool] | None = None,
        chat_template: str | None = None,
    ) -> str:
        template = chat_template or self.settings.chat_template
        if template is None and getattr(self.tokenizer, "chat_template", None) is None:
            raise bad_request("This model has no chat template; use /v1/completions instead.")
        conversation = [m.for_template() for m in messages]
        tool_specs = [t.model_dump(exclude_none=True) for t in tools] if tools else None

        def render() -> str:
            return self.tokenizer.apply_chat_template(
                conversation,
                tools=tool_specs,
                chat_template=template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **(template_kwargs or {}),
            )

        try:
            text = await asyncio.to_thread(render)
        except Exception as exc:  # jinja raises for conversations the template forbids
            raise bad_request(f"The chat template rejected the messages: {exc}", "messages") from None
        if not isinstance(text, str):
            raise bad_request("The chat template did not render to text.", "messages")
        return text

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens=add_special_tokens)

    def chat_output_plan(self, request: ChatCompletionRequest) -> tuple[ChatOutputPlan, StructuredOutputsParams | None]:
        """How to read the answer (reasoning, tool calls), and the constraint tool_choice adds."""
        choice = request.effective_tool_choice
        plan = ChatOutputPlan(reasoning=self.reasoning_parser)
        tools = request.tools or []
        if choice == "none" or not tools:
            return plan, None
        if choice == "auto":
            if not (self.settings.enable_auto_tool_choice and self.tool_parser is not None):
                raise bad_request('"auto" tool choice needs the server started with --enable-auto-tool-choice '
                                  "and --tool-call-parser.", "tool_choice")
            plan.tool_parser = self.tool_parser
            plan.max_calls = None if request.parallel_tool_calls else 1
            if not any(t.function.strict for t in tools):
                return plan, None
        if request.response_format is not None or request.structured_outputs is not None:
            raise bad_request("tool_choice required or named, or a strict function, already constrains the "
                              "output; drop response_format/structured_outputs.", "tool_choice")
        try:
            if choice == "auto":  # strict functions: their calls are held to their schemas
                assert self.tool_parser is not None
                functions = [(t.function.name, t.function.parameters, bool(t.function.strict)) for t in tools]
                return plan, strict_constraint(self.tool_parser, functions, request.parallel_tool_calls)
            if choice == "required":
                plan.tool_parser = RequiredChoiceParser()
                functions = [(t.function.name, t.function.parameters) for t in tools]
                return plan, required_constraint(functions, request.parallel_tool_calls)
            assert isinstance(choice, NamedToolChoice)
            (tool,) = [t for t in tools if t.function.name == choice.function.name]
            plan.named_function = tool.function.name
            return plan, named_constraint(tool.function.parameters)
        except ValueError as exc:  # a schema xgrammar cannot use
            raise bad_request(f"tools: {exc}", "tools") from None

    async def prepare_chat(self, request: ChatCompletionRequest, max_tokens_param: str = "max_tokens") -> PreparedChat:
        """Everything a chat request needs before it reaches the engine (every check a 400)."""
        lora_name = self.check_model(request.model)
        self.check_supported(request)
        plan, tool_constraint = self.chat_output_plan(request)
        text = await self.render_chat(
            request.messages, request.add_generation_prompt, request.continue_final_message,
            request.chat_template_kwargs, request.tools, request.chat_template,
        )
        # The template already placed BOS and the like; don't let the tokenizer add them twice.
        prompt_ids = self.truncate(await self.encode(text, add_special_tokens=False), request.truncate_prompt_tokens)
        self.check_prompt_length(len(prompt_ids), "messages")
        self.check_max_tokens(len(prompt_ids), request.effective_max_tokens, max_tokens_param)
        top = request.top_logprobs or 0
        max_tokens = self.default_max_tokens(request.effective_max_tokens)
        logprobs = top if request.logprobs else None
        if tool_constraint is not None:
            params = self.build_sampling_params(request, max_tokens, logprobs, tool_constraint, request.prompt_logprobs)
        else:
            params = self.sampling_params(request, max_tokens, logprobs, request.prompt_logprobs)
        return PreparedChat(plan, params, prompt_ids, lora_name)

    async def create_chat_completion(self, data: dict[str, Any], raw: Request) -> Response:
        request = parse_model(ChatCompletionRequest, data)
        prepared = await self.prepare_chat(request)
        plan, params, prompt_ids, lora_name = prepared.plan, prepared.params, prepared.prompt_ids, prepared.lora_name
        top = request.top_logprobs or 0
        echo = self._chat_echo(request)
        base_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        streams = await self.submit(base_id, [prompt_ids], params, request.cache_salt, lora_name)
        if request.stream:
            return EngineStreamingResponse(
                self._chat_stream(request, streams[0], plan, echo, base_id, created), media_type="text/event-stream"
            )
        (output,) = await cancel_on_disconnect(raw, self.final_outputs(streams))
        prompt_lps = self.prompt_logprobs_json(output, request.prompt_logprobs)
        choices = []
        for c in output.outputs:
            message, called = plan.message(c.text)
            if echo:
                message.content = echo + (message.content or "")
            choices.append(ChatChoice(
                index=c.index,
                message=message,
                logprobs=self._chat_logprobs(c, 0, len(c.token_ids), top) if request.logprobs else None,
                finish_reason=plan.finish_reason(c.finish_reason, called),
                stop_reason=c.stop_reason,
            ))
        return JSONResponse(
            ChatCompletionResponse(
                id=base_id, created=created, model=self.response_model(request.model), choices=choices,
                usage=_usage([output]), prompt_logprobs=prompt_lps,
            ).model_dump()
        )

    @staticmethod
    def _chat_echo(request: ChatCompletionRequest) -> str:
        """vLLM's chat `echo`: the answer starts with the final message when it is the assistant's."""
        last = request.messages[-1]
        return (last.text() or "") if request.echo and last.role == "assistant" else ""

    def _chat_logprobs(self, completion: CompletionOutput, start: int, end: int, k: int) -> ChatLogprobs:
        content: list[TokenLogprob] = []
        if completion.logprobs is not None:
            end = min(end, len(completion.logprobs), len(completion.token_ids))
            for pos in range(start, end):
                token_id = completion.token_ids[pos]
                position = completion.logprobs[pos]
                sampled = position.get(token_id)
                token = self.decode_token(token_id, sampled)
                tops = [
                    TopLogprob(token=(t := self.decode_token(tid, lp)), logprob=lp.logprob, bytes=list(t.encode()))
                    for tid, lp in self._top(position, k)
                ]
                content.append(
                    TokenLogprob(
                        token=token,
                        logprob=-9999.0 if sampled is None else sampled.logprob,
                        bytes=list(token.encode()),
                        top_logprobs=tops,
                    )
                )
        return ChatLogprobs(content=content)

    async def _chat_stream(
        self, request: ChatCompletionRequest, stream: Any, plan: ChatOutputPlan, echo: str, base_id: str,
        created: int,
    ) -> AsyncIterator[str]:
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        continuous = bool(request.stream_options and request.stream_options.continuous_usage_stats)
        with_usage = include_usage or continuous
        top = request.top_logprobs or 0

        def chunk(choice: ChatStreamChoice, usage: UsageInfo | None = None, prompt_lps: Any = None) -> str:
            return sse(ChatCompletionChunk(id=base_id, created=created, model=self.response_model(request.model),
                                           choices=[choice], usage=usage, prompt_logprobs=prompt_lps),
                       with_usage=with_usage)

        # The first chunk of every choice carries the role, as OpenAI's does (and vLLM's echo).
        for i in range(request.n):
            yield chunk(ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=echo)))
        streamers = {i: plan.streamer() for i in range(request.n)}
        sent_tokens: dict[int, int] = {}
        done: set[int] = set()
        final: RequestOutput | None = None
        try:
            async for output in self.engine.iterate(stream):
                final = output
                for completion in output.outputs:
                    index = completion.index
                    if index in done:
                        continue  # with n > 1, finished choices keep appearing in later outputs
                    if len(completion.token_ids) == sent_tokens.get(index, 0) and not completion.finished:
                        continue
                    if completion.finished:
                        done.add(index)
                    streamer = streamers[index]
                    deltas = streamer.update(completion.text, completion.finished)
                    start = sent_tokens.get(index, 0)
                    logprobs = (
                        self._chat_logprobs(completion, start, len(completion.token_ids), top)
                        if request.logprobs else None
                    )
                    sent_tokens[index] = len(completion.token_ids)
                    usage = _usage([output]) if continuous else None
                    prompt_lps = None
                    if index == 0 and start == 0:  # the first token's chunk carries the prompt's logprobs
                        prompt_lps = self.prompt_logprobs_json(output, request.prompt_logprobs)
                    if not deltas and (logprobs is not None or completion.finished or prompt_lps is not None):
                        deltas = [DeltaMessage(content="")]  # logprobs and the finish need a chunk to ride on
                    for n, delta in enumerate(deltas):
                        last = n == len(deltas) - 1
                        yield chunk(
                            ChatStreamChoice(
                                index=index,
                                delta=delta,
                                logprobs=logprobs if last else None,
                                finish_reason=(plan.finish_reason(completion.finish_reason, streamer.called)
                                               if last and completion.finished else None),
                                stop_reason=completion.stop_reason if last and completion.finished else None,
                            ),
                            usage,
                            prompt_lps if n == 0 else None,
                        )
            if include_usage and final is not None:
                yield sse(ChatCompletionChunk(id=base_id, created=created, model=self.response_model(request.model),
                                              choices=[], usage=_usage([final])))
        except (EngineDeadError, EngineSleepingError, EngineShuttingDownError) as exc:
            err = _engine_error(exc)
            yield sse(error_body(err.status_code, err.message, err.err_type))
        yield SSE_DONE

    # -------------------------------------------------------------- tokenizer endpoints

    async def tokenize(self, data: dict[str, Any]) -> TokenizeResponse:
        if "messages" in data:
            chat = parse_model(TokenizeChatRequest, data)
            self.check_model(chat.model)
            text = await self.render_chat(
                chat.messages, chat.add_generation_prompt, chat.continue_final_message, chat.chat_template_kwargs,
                chat.tools, chat.chat_template,
            )
            tokens = await self.encode(text, add_special_tokens=chat.add_special_tokens)
            want_strs = chat.return_token_strs
        else:
            plain = parse_model(TokenizeCompletionRequest, data)
            self.check_model(plain.model)
            tokens = await self.encode(plain.prompt, add_special_tokens=plain.add_special_tokens)
            want_strs = plain.return_token_strs
        token_strs = self.tokenizer.convert_ids_to_tokens(tokens) if want_strs else None
        return TokenizeResponse(count=len(tokens), max_model_len=self.max_model_len, tokens=tokens,
                                token_strs=token_strs)

    async def detokenize(self, data: dict[str, Any]) -> DetokenizeResponse:
        request = parse_model(DetokenizeRequest, data)
        self.check_model(request.model)
        self.check_token_ids(request.tokens, "tokens")
        text = await asyncio.to_thread(self.tokenizer.decode, request.tokens)
        return DetokenizeResponse(prompt=text)


def _usage(outputs: list[RequestOutput]) -> UsageInfo:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    return UsageInfo(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details={"cached_tokens": cached},
    )


def _engine_error(exc: BaseException) -> APIError:
    """Map what the engine raises to the HTTP answer."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineSleepingError):
        return engine_sleeping_error()
    if isinstance(exc, EngineShuttingDownError):
        return APIError(503, "The server is shutting down.", ENGINE_UNAVAILABLE)
    if isinstance(exc, EngineDeadError):
        return APIError(503, "The engine has stopped; this server cannot serve requests.", ENGINE_UNAVAILABLE)
    if isinstance(exc, LoRAError) and exc.status == 404:
        # The adapter was unloaded between the model check and the engine taking the request.
        return APIError(404, str(exc), NOT_FOUND, "model")
    if isinstance(exc, ValueError):
        return bad_request(str(exc))  # the engine's own input checks (e.g. prompt too long)
    raise exc

