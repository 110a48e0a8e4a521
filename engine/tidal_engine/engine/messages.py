"""What crosses between the API servers and the engine core (msgspec, msgpack on the wire).

Requests go in once, already tokenized. Outputs come back as *deltas*: per sample, only
the tokens sampled since the last output (plus their logprobs when asked), a finish
reason when it ends. Text, stop strings and the cumulative views live in the API server.
"""

from __future__ import annotations

from typing import Any

import msgspec

from tidal_engine.executor.plan import SampledLogprobs
from tidal_engine.sampling_params import SamplingParams
from tidal_engine.structured.params import StructuredOutputsParams


class EngineCoreRequest(msgspec.Struct, tag="add"):
    request_id: str
    prompt_token_ids: list[int]
    params: dict[str, Any]  # SamplingParams' fields (structured outputs as their own dict)
    arrival_time: float
    cache_salt: str | None = None
    lora_name: str | None = None
    client_index: int = 0  # which API server gets the outputs
    # A pooling request (embeddings, scores): PoolingParams' fields; ``params`` is then unused.
    pooling_params: dict[str, Any] | None = None
    token_type_ids: list[int] | None = None  # BERT sentence pairs


class AbortRequests(msgspec.Struct, tag="abort"):
    # A parent id ends every sample; "<id>#<index>" ends one sample (its stop string matched).
    request_ids: list[str]
    finish_reason: str = "abort"


class UtilityCall(msgspec.Struct, tag="call"):
    call_id: int
    method: str
    args: list[Any] = []
    client_index: int = 0


EngineCoreInput = EngineCoreRequest | AbortRequests | UtilityCall


def sample_request_id(request_id: str, index: int, n: int) -> str:
    """The id of one sample in the core (and in AbortRequests): the request id itself when n == 1."""
    return request_id if n == 1 else f"{request_id}#{index}"


class SampleDelta(msgspec.Struct, array_like=True):
    """One sample's progress in one step."""

    request_id: str  # the parent (user) request
    index: int  # the sample (0..n-1)
    new_token_ids: list[int]
    new_logprobs: list[SampledLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    # The last token ended the sample as EOS or a stop token id: its text is not shown.
    stop_terminated: bool = False
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None
    # prompt_logprobs: positions 1.. of the prompt (the first has none), with the first token.
    prompt_logprobs: list[SampledLogprobs] | None = None


class PooledOutput(msgspec.Struct, array_like=True):
    """A pooling request's result: its float32 vector (little-endian bytes), or why it failed."""

    request_id: str
    data: bytes = b""
    error: str | None = None


class CoreStats(msgspec.Struct):
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    max_num_running_seen: int = 0
    max_loras: int = 0
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    sleep_level: int = 0
    # Registered LoRA adapters: (name, path, rank, unloading), the API servers' /v1/models.
    lora_adapters: list[tuple[str, str, int, bool]] = []
    # Speculative decoding (vLLM's spec_decode counters): rows that verified drafts, drafts, accepted.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = []
    prompt_tokens_computed: int = 0  # prompt tokens computed (not served from any cache tier)
    # KV offload (kv_transfer/): the host tier's prefix hits (tokens the device tier missed),
    # what moved between the tiers and how long the copies took; the host pool's fill.
    kv_offload_enabled: bool = False
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    kv_offload_bytes_loaded: int = 0
    kv_offload_bytes_saved: int = 0
    kv_offload_load_seconds: float = 0.0
    kv_offload_save_seconds: float = 0.0
    kv_offload_failed_loads: int = 0
    kv_offload_host_usage: float = 0.0
    # Pooling cores: inputs pooled so far and the seconds their steps took.
    pooling_requests_total: int = 0
    pooling_step_seconds: float = 0.0


class UtilityResult(msgspec.Struct, array_like=True):
    call_id: int
    ok: bool
    value: Any = None
    error_type: str | None = None  # "ValueError", "LoRAError", "RuntimeError", ...
    error_message: str | None = None
    error_status: int | None = None  # LoRAError's HTTP status


class EngineCoreOutputs(msgspec.Struct):
    deltas: list[SampleDelta] = []
    utility_results: list[UtilityResult] = []
    stats: CoreStats | None = None
    # Adds the core took, and those it refused (bad input found there): id → (type, message, status).
    accepted: list[str] = []
    rejected: dict[str, tuple[str, str, int]] = {}
    # Requests the core ended on its own (sleep with mode=abort): end their streams as "abort".
    aborted: list[str] = []
    # The core is going away (its loop died): the message to show every waiting request.
    fatal: str | None = None
    pooled: list[PooledOutput] = []  # pooling requests that ended in this step


class CoreInfo(msgspec.Struct):
    """What an API server learns from the core at start-up."""

    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    enable_lora: bool
    async_scheduling: bool
    device: str
    pooling: dict[str, Any] | None = None  # a pooling core's PoolingModelInfo fields; None: it generates


def params_to_dict(params: SamplingParams) -> dict[str, Any]:
    """SamplingParams as plain data (structured outputs by their public fields)."""
    values = {name: getattr(params, name) for name in params.__dataclass_fields__}
    structured = params.structured_outputs
    if structured is not None:
        values["structured_outputs"] = {
            name: getattr(structured, name) for name in structured.__dataclass_fields__ if not name.startswith("_")
        }
    return values


def params_from_dict(values: dict[str, Any]) -> SamplingParams:
    values = dict(values)
    structured = values.get("structured_outputs")
    if structured is not None:
        values["structured_outputs"] = StructuredOutputsParams(**structured)
    return SamplingParams(**values)


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def input_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(EngineCoreInput)


def output_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(EngineCoreOutputs)
