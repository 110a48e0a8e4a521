"""Request and response shapes of the pooling API: OpenAI's /v1/embeddings, vLLM's /pooling
and /score, and /rerank in the Jina and Cohere shapes (vLLM's field names throughout)."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

# A text, a batch of texts, one token array, or a batch of token arrays (OpenAI's four forms).
EmbeddingInput = str | list[str] | list[Annotated[int, Field(ge=0)]] | list[list[Annotated[int, Field(ge=0)]]]
MAX_INPUTS = 2048  # OpenAI's limit on one embeddings request


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    user: str | None = None
    # vLLM's extension: truncate over-long prompts to this many tokens (-1: the model's limit)
    # instead of refusing them.
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None


class EmbeddingRequest(_Request):
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    normalize: bool | None = None  # vLLM's extension; default: the model's (true)


class PoolingRequest(EmbeddingRequest):
    """/pooling: the model's raw pooled output (an embedding, or class probabilities)."""


class ScoreRequest(_Request):
    text_1: str | list[str]
    text_2: str | list[str]


class RerankDocument(BaseModel):
    model_config = ConfigDict(extra="ignore")
    text: str


class RerankRequest(_Request):
    query: str
    documents: list[str | RerankDocument]
    top_n: Annotated[int, Field(ge=1)] | None = None
    return_documents: bool = True


def _id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class Usage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingData(BaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # str: base64 of little-endian float32


class EmbeddingResponse(BaseModel):
    id: str = Field(default_factory=lambda: _id("embd"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: Usage


class PoolingData(BaseModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: list[float] | str


class PoolingResponse(BaseModel):
    id: str = Field(default_factory=lambda: _id("pool"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[PoolingData]
    usage: Usage


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str = Field(default_factory=lambda: _id("score"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreData]
    usage: Usage


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(BaseModel):
    total_tokens: int


class RerankBilledUnits(BaseModel):
    search_units: int = 1


class RerankMeta(BaseModel):
    billed_units: RerankBilledUnits = Field(default_factory=RerankBilledUnits)


class RerankResponse(BaseModel):
    """Jina's shape (model, usage, results with documents) plus Cohere's (id, meta)."""

    id: str = Field(default_factory=lambda: _id("rerank"))
    model: str
    usage: RerankUsage
    results: list[RerankResult]
    meta: RerankMeta = Field(default_factory=RerankMeta)
