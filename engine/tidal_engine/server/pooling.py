"""The HTTP server of a pooling model (``tidal-engine serve --runner pooling``).

It serves /v1/embeddings, /pooling, /score and /rerank (also /v1/rerank and /v2/rerank)
beside the probes, /v1/models and /metrics; the generation endpoints answer 400. Texts are
tokenized here, in the API process, and sent to the engine-core process as token ids, one
pooling request per input (pooling/client.py); the core's scheduler batches them
(pooling/core.py).
"""

from __future__ import annotations

import base64
import dataclasses
from multiprocessing.process import BaseProcess
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from transformers import AutoTokenizer

from tidal_engine.engine.async_engine import EngineDeadError, EngineShuttingDownError, EngineSleepingError
from tidal_engine.engine.core_proc import CoreAddresses
from tidal_engine.engine.messages import CoreInfo
from tidal_engine.models.loader import resolve_model_path
from tidal_engine.pooling.client import PoolingClient
from tidal_engine.pooling.params import PoolingParams
from tidal_engine.pooling.runner import PoolingInput
from tidal_engine.server.app import ServerSettings
from tidal_engine.server.base_app import create_base_app
from tidal_engine.server.errors import (NOT_FOUND, APIError, bad_request, 
                                        validation_error_to_api_error)
from tidal_engine.server.metrics import METRICS_PREFIXES
from tidal_engine.server.pooling_metrics import PoolingMetrics
from tidal_engine.server.pooling_protocol import (MAX_INPUTS, EmbeddingData, EmbeddingRequest, EmbeddingResponse,
                                                  PoolingData, PoolingRequest, PoolingResponse, RerankDocument,
                                                  RerankRequest, RerankResponse, RerankResult, RerankUsage,
                                                  ScoreData, ScoreRequest, ScoreResponse, Usage)
from tidal_engine.server.protocol import ModelCard, ModelList
from tidal_engine.server.serving import _engine_error, read_json_body

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")


def encode_floats(vector: torch.Tensor, encoding_format: str) -> list[float] | str:
    """OpenAI's two encodings: a JSON list, or base64 of little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(vector.to(torch.float32).numpy().astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


class PoolingServing:
    def __init__(self, engine: PoolingClient, served_model_names: list[str], model_source: str) -> None:
        self.engine = engine
        self.names = served_model_names
        self.model_source = model_source
        self.tokenizer = engine.tokenizer
        self.info = engine.pooling_info

    # -------------------------------------------------------------- checks

    def _parse(self, model: type[BaseModel], data: dict[str, Any]) -> Any:
        try:
            request = model.model_validate(data)
        except ValidationError as exc:
            raise validation_error_to_api_error(exc) from None
        if request.model is not None and request.model not in self.names:
            raise APIError(404, f"The model `{request.model}` does not exist.", NOT_FOUND, "model")
        return request

    def _need_task(self, task: str, endpoint: str) -> None:
        if self.info.task != task:
            hint = {"embed": "serve an embedding model, or start this one with --convert embed",
                    "classify": "serve a cross-encoder (a *ForSequenceClassification model)"}[task]
            raise bad_request(f"{endpoint} is not supported by `{self.names[0]}`, a {self.info.task} model: {hint}.")

    def _limit(self, truncate: int | None) -> int | None:
        """Tokens to truncate to (None: refuse over-long prompts)."""
        if truncate is None:
            return None
        limit = self.info.max_model_len if truncate == -1 else truncate
        if limit > self.info.max_model_len:
            raise bad_request(f"truncate_prompt_tokens ({truncate}) exceeds the model's maximum context length "
                              f"({self.info.max_model_len}).", "truncate_prompt_tokens")
        return limit

    def _check_length(self, count: int, param: str) -> None:
        if count > self.info.max_model_len:
            raise bad_request(f"This model's maximum context length is {self.info.max_model_len} tokens; the input "
                              f"has {count}. Shorten it or set truncate_prompt_tokens.", param)

    async def _encode(self, inputs: list[PoolingInput]) -> list[torch.Tensor]:
        try:
            return await self.engine.encode(inputs)
        except (EngineDeadError, EngineSleepingError, EngineShuttingDownError, ValueError) as exc:
            raise _engine_error(exc) from None

    # -------------------------------------------------------------- tokenizing

    def _texts_to_inputs(self, texts: Sequence[str], limit: int | None, params: PoolingParams) -> list[PoolingInput]:
        encoded = self.tokenizer(list(texts), truncation=limit is not None, max_length=limit)
        inputs = []
        for ids in encoded["input_ids"]:
            self._check_length(len(ids), "input")
            inputs.append(PoolingInput(list(ids), params=params))
        return inputs

    def _embedding_inputs(self, request: EmbeddingRequest, params: PoolingParams) -> list[PoolingInput]:
        raw = request.input
        if isinstance(raw, str):
            raw = [raw]
        if not raw:
            raise bad_request("`input` must not be empty.", "input")
        if len(raw) > MAX_INPUTS:
            raise bad_request(f"`input` may hold at most {MAX_INPUTS} items.", "input")
        limit = self._limit(request.truncate_prompt_tokens)
        if isinstance(raw[0], int):
            raw = [raw]  # one token array
        if isinstance(raw[0], str):
            if any(not text for text in raw):
                raise bad_request("`input` must not contain empty strings.", "input")
            return self._texts_to_inputs(raw, limit, params)
        inputs = []
        vocab = len(self.tokenizer)
        for ids in raw:
            if not ids:
                raise bad_request("`input` must not contain empty token arrays.", "input")
            if max(ids) >= vocab:
                raise bad_request(f"token id {max(ids)} is outside the vocabulary (size {vocab}).", "input")
            ids = list(ids[:limit]) if limit is not None else list(ids)
            self._check_length(len(ids), "input")
            inputs.append(PoolingInput(ids, params=params))
        return inputs

    def _pair_inputs(self, queries: list[str], docs: list[str], limit: int | None) -> list[PoolingInput]:
        """Cross-encoder inputs: each (query, document) tokenized as one pair."""
        encoded = self.tokenizer(queries, docs, truncation="only_second" if limit is not None else False,
                                 max_length=limit)
        types = encoded.get("token_type_ids")
        inputs = []
        for i, ids in enumerate(encoded["input_ids"]):
            self._check_length(len(ids), "documents")
            inputs.append(PoolingInput(list(ids), list(types[i]) if types is not None else None))
        return inputs

    async def _scores(self, queries: list[str], docs: list[str], limit: int | None) -> tuple[list[float], int]:
        """One score per (query, document) pair, and the prompt tokens spent: a cross-encoder's
        relevance, or the cosine similarity of two embeddings."""
        if any(not text for text in [*queries, *docs]):
            raise bad_request("texts to score must not be empty.")
        if self.info.task == "classify":
            if self.info.num_labels != 1:
                raise bad_request(f"scoring needs a one-label cross-encoder; `{self.names[0]}` has "
                                  f"{self.info.num_labels} labels (use /pooling for class probabilities).")
            inputs = self._pair_inputs(queries, docs, limit)
            outputs = await self._encode(inputs)
            return [float(out[0]) for out in outputs], sum(i.num_tokens for i in inputs)
        unique = list(dict.fromkeys([*queries, *docs]))
        inputs = self._texts_to_inputs(unique, limit, PoolingParams())
        vectors = dict(zip(unique, await self._encode(inputs), strict=True))
        scores = [float(F.cosine_similarity(vectors[q], vectors[d], dim=0)) for q, d in zip(queries, docs, strict=True)]
        return scores, sum(i.num_tokens for i in inputs)

    # -------------------------------------------------------------- endpoints

    def list_models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=name, root=self.model_source, max_model_len=self.info.max_model_len)
                               for name in self.names])

    async def embeddings(self, data: dict[str, Any]) -> EmbeddingResponse:
        request: EmbeddingRequest = self._parse(EmbeddingRequest, data)
        self._need_task("embed", "/v1/embeddings")
        if request.dimensions is not None and request.dimensions > self.info.hidden_size:
            raise bad_request(f"`dimensions` ({request.dimensions}) exceeds the model's {self.info.hidden_size}.",
                              "dimensions")
        params = PoolingParams(dimensions=request.dimensions,
                               normalize=True if request.normalize is None else request.normalize)
        inputs = self._embedding_inputs(request, params)
        vectors = await self._encode(inputs)
        tokens = sum(i.num_tokens for i in inputs)
        return EmbeddingResponse(
            model=request.model or self.names[0],
            data=[EmbeddingData(index=i, embedding=encode_floats(v, request.encoding_format))
                  for i, v in enumerate(vectors)],
            usage=Usage(prompt_tokens=tokens, total_tokens=tokens),
        )

    async def pooling(self, data: dict[str, Any]) -> PoolingResponse:
        request: PoolingRequest = self._parse(PoolingRequest, data)
        params = PoolingParams(dimensions=request.dimensions,
                               normalize=True if request.normalize is None else request.normalize)
        inputs = self._embedding_inputs(request, params)
        outputs = await self._encode(inputs)
        tokens = sum(i.num_tokens for i in inputs)
        return PoolingResponse(
            model=request.model or self.names[0],
            data=[PoolingData(index=i, data=encode_floats(v, request.encoding_format)) for i, v in enumerate(outputs)],
            usage=Usage(prompt_tokens=tokens, total_tokens=tokens),
        )

    async def score(self, data: dict[str, Any]) -> ScoreResponse:
        request: ScoreRequest = self._parse(ScoreRequest, data)
        first = [request.text_1] if isinstance(request.text_1, str) else list(request.text_1)
        second = [request.text_2] if isinstance(request.text_2, str) else list(request.text_2)
        if not first or not second:
            raise bad_request("text_1 and text_2 must not be empty.")
        if len(first) == 1:
            first = first * len(second)  # one query against every document
        if len(first) != len(second):
            raise bad_request(f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, or as "
                              "many as text_2.", "text_2")
        scores, tokens = await self._scores(first, second, self._limit(request.truncate_prompt_tokens))
        return ScoreResponse(model=request.model or self.names[0],
                             data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
                             usage=Usage(prompt_tokens=tokens, total_tokens=tokens))

    async def rerank(self, data: dict[str, Any]) -> RerankResponse:
        request: RerankRequest = self._parse(RerankRequest, data)
        docs = [d if isinstance(d, str) else d.text for d in request.documents]
        if not docs:
            raise bad_request("`documents` must not be empty.", "documents")
        scores, tokens = await self._scores([request.query] * len(docs), docs,
                                            self._limit(request.truncate_prompt_tokens))
        order = sorted(range(len(docs)), key=lambda i: -scores[i])[: request.top_n or len(docs)]
        results = [RerankResult(index=i, relevance_score=scores[i],
                                document=RerankDocument(text=docs[i]) if request.return_documents else None)
                   for i in order]
        return RerankResponse(model=request.model or self.names[0], usage=RerankUsage(total_tokens=tokens),
                              results=results)


def build_pooling_app(engine: PoolingClient, settings: ServerSettings) -> FastAPI:
    names = settings.served_model_names or [engine.model_name]
    serving = PoolingServing(engine, names, settings.model_source or names[0])
    metrics = PoolingMetrics(engine, names[0], METRICS_PREFIXES[settings.metrics_prefix])
    limit = settings.max_request_body_bytes

    app = create_base_app("Tidal engine (pooling)", engine, settings,
                          stopped_message="The pooling engine has stopped.", render_metrics=metrics.render,
                          metrics_content_type=metrics.content_type,
                          list_models=lambda: serving.list_models().model_dump())

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> JSONResponse:
        return JSONResponse((await serving.embeddings(await read_json_body(request, limit))).model_dump())

    @app.post("/pooling")
    async def pooling(request: Request) -> JSONResponse:
        return JSONResponse((await serving.pooling(await read_json_body(request, limit))).model_dump())

    @app.post("/score")
    @app.post("/v1/score")
    async def score(request: Request) -> JSONResponse:
        return JSONResponse((await serving.score(await read_json_body(request, limit))).model_dump())

    @app.post("/rerank")
    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    async def rerank(request: Request) -> JSONResponse:
        return JSONResponse((await serving.rerank(await read_json_body(request, limit))).model_dump(exclude_none=True))

    @app.post("/sleep")
    async def sleep(level: int = 1, mode: str = "wait") -> JSONResponse:
        if mode not in ("wait", "abort"):
            raise bad_request(f"mode must be wait or abort, got {mode!r}", "mode")
        if level not in (1, 2):
            raise bad_request(f"level must be 1 or 2, got {level}", "level")
        try:
            await engine.sleep(level, mode)
        except ValueError as exc:
            raise bad_request(str(exc)) from None
        except (EngineDeadError, EngineShuttingDownError) as exc:
            raise _engine_error(exc) from None
        return JSONResponse({"is_sleeping": await engine.is_sleeping(), "level": engine.snapshot.sleep_level})

    @app.post("/wake_up")
    async def wake_up() -> JSONResponse:
        try:
            await engine.wake_up()
        except ValueError as exc:
            raise bad_request(str(exc)) from None
        except (EngineDeadError, EngineShuttingDownError) as exc:
            raise _engine_error(exc) from None
        return JSONResponse({"is_sleeping": await engine.is_sleeping()})

    @app.get("/is_sleeping")
    async def is_sleeping() -> JSONResponse:
        return JSONResponse({"is_sleeping": await engine.is_sleeping()})

    async def not_generative(_: Request) -> Response:
        raise bad_request(f"`{names[0]}` is a pooling model ({engine.pooling_info.task}); it does not generate text. "
                          "Use /v1/embeddings, /pooling, /score or /rerank.")

    for path in GENERATION_PATHS:
        app.add_api_route(path, not_generative, methods=["POST"])
    return app


def serve_pooling(config: Any, settings: ServerSettings) -> int:
    """Serve a pooling model: its engine core in a child process, this process the API server."""
    from tidal_engine.server.launcher import serve

    if config.enable_lora:
        raise ValueError("--enable-lora needs --runner generate: pooling models take no adapters")
    return serve(dataclasses.replace(config, runner="pooling"), settings)


def load_pooling_tokenizer(config: Any) -> Any:
    """The pooling model's tokenizer (``--tokenizer``, else the model folder's)."""
    return AutoTokenizer.from_pretrained(config.tokenizer or str(resolve_model_path(config.model)))


def run_pooling_api_server(settings: ServerSettings, info: CoreInfo, addresses: CoreAddresses, index: int,
                           tokenizer: Any, core_process: BaseProcess | None = None, *, enable_sleep_mode: bool = False,
                           reuse_port: bool = False) -> int:
    """The API server of a pooling core (launcher.run_api_server hands over here)."""
    from tidal_engine.server.app import run_server

    names = settings.served_model_names or [info.model_name]
    client = PoolingClient(tokenizer, info, addresses, index, enable_sleep_mode=enable_sleep_mode,
                           core_process=core_process)
    return run_server(client, settings, app=build_pooling_app(client, settings), reuse_port=reuse_port,  # type: ignore[arg-type]
                      hint=pooling_curl_hint(settings, names[0], client.pooling_info.task))


def pooling_curl_hint(settings: ServerSettings, model_name: str, task: str) -> str:
    """The start-up copy-paste line: an embedding, or a rerank for a cross-encoder (no key in it)."""
    host = "localhost" if settings.host in ("0.0.0.0", "::", "") else settings.host
    auth = ' -H "Authorization: Bearer $TIDAL_API_KEY"' if settings.api_key else ""
    if task == "embed":
        path, body = "/v1/embeddings", f'{{"model": "{model_name}", "input": ["Hello!"]}}'
    else:
        path, body = "/rerank", f'{{"model": "{model_name}", "query": "Hello?", "documents": ["Hi!", "Bye."]}}'
    return f"curl -s http://{host}:{settings.port}{path} -H 'Content-Type: application/json'{auth} -d '{body}'"
