"""The engine core: scheduler, KV cache manager and executor, one ``step()`` at a time.

It takes tokenized requests and gives back *deltas*: for each sample that advanced, the
token ids sampled since the last step, plus a finish reason when the sample ended on a
stop token, EOS, its grammar, ``max_tokens`` or the context. Text (detokenizing, stop
strings) is the caller's: the API server's output processor, or ``LLMEngine`` offline.
A stop string found there comes back as ``finish_samples``.

``step()`` = schedule → a ``StepPlan`` for the workers → execute → sampled ids → stops.
Async scheduling (on by default on CUDA) keeps one step in flight: ``step()`` advances
the in-flight step N with placeholder tokens, schedules and launches N+1 (the workers feed
N's sampled ids to N+1 on the device), and only then waits for N's ids and does N's host
work while the device runs N+1. A sample that stops at N has one step computed for
nothing; one whose N token is its last (max_tokens, the context) is held out of N+1.
Steps with a grammar row (the next bitmask needs the token) or a LoRA row are synchronous.
With n-gram speculation async scheduling stays on: a verify row in flight is advanced with one
placeholder as if it accepted no draft (``num_lookahead_tokens`` holds its drafts, which its
next KV allocation covers), its next step gets draft slots that the device fills, and the
device shifts that step by the count accepted (spec_decode/device_drafts.py); the accepted
tokens join the request when the step's result arrives (``_fill_placeholder``). A draft model
works the same way (it runs on the workers and fills every row's draft slots on the device).
A speculating engine without async scheduling launches ahead instead:
``step()`` completes N (tokens, stops), then proposes, schedules and launches N+1 before it
returns N's deltas, so the caller's output work (text, stop strings, messages to the API
servers) overlaps N+1 on the device.

Pipeline parallelism (PP = p) keeps up to p batches in flight instead (vLLM's batch queue):
each ``step()`` schedules new batches from the requests that are in none of the in-flight
batches until p are in flight, then waits for the oldest and returns its deltas. Batches
have distinct requests, so no batch needs another's tokens, and stage s runs batch i while
stage s-1 runs batch i+1. The stages before the last get the sampled ids with each
request's next chunk (``ScheduledRequest.new_token_ids``); no placeholders are used.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import threading
import time
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tidal_engine.config import EngineConfig
from tidal_engine.core.kv_cache_manager import KVCacheManager
from tidal_engine.core.request import PLACEHOLDER_TOKEN, Request, RequestStatus
from tidal_engine.core.scheduler import (
    ScheduledChunk,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    default_max_num_batched_tokens,
)
from tidal_engine.engine.collector import collector_paused, freeze_heap, unfreeze_heap
from tidal_engine.engine.messages import CoreStats, SampleDelta, sample_request_id
from tidal_engine.engine.tokenizer_load import TokenizerLoad
from tidal_engine.executor.base import Executor, PendingStep
from tidal_engine.executor.plan import NewRequest, SampledLogprobs, SamplingOptions, ScheduledRequest, StepPlan
from tidal_engine.kv_transfer.factory import create_scheduler_connector
from tidal_engine.lora import AdapterInfo, LoRAAdapter, LoRAError, LoRAManager
from tidal_engine.models.loader import load_tokenizer, resolve_dtype, resolve_model
from tidal_engine.sampling_params import SamplingParams
from tidal_engine.spec_decode.config import DEVICE_DRAFT_SLOT, SpeculativeConfig, drafts_on_device
from tidal_engine.spec_decode.proposer import Proposer, build_proposer
from tidal_engine.spec_decode.token_history import TokenHistory
from tidal_engine.structured import GrammarCompilerCache, GrammarMatcher
from tidal_engine.structured.reasoning_gate import ReasoningGate, reasoning_ended
from tidal_engine.structured.token_rules import CombinedMatcher, TokenRules, bad_word_token_ids

logger = logging.getLogger(__name__)



@dataclass
class _Sample:
    """Core-side state of one sample (a scheduler request) beyond what the scheduler keeps."""

    request: Request
    parent_id: str
    index: int
    options: SamplingOptions
    grammar: GrammarMatcher | None = None
    finished: bool = False
    # prompt_logprobs gathered from the prefill chunks, sent with the first token.
    prompt_logprobs: list[SampledLogprobs] = field(default_factory=list)
    # Speculative decoding: the tokens as an array the proposer reads (built on first use).
    history: TokenHistory | None = None


@dataclass
class _Parent:
    """A user request: ``n`` samples that share one prompt."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    arrival_time: float
    lora_name: str | None = None
    lora_key: str | None = None  # the adapter's load generation, for the KV cache keys
    compiled_grammar: object | None = None  # xgrammar CompiledGrammar shared by the samples
    bad_words: list[list[int]] = field(default_factory=list)  # params.bad_words as token ids
    reasoning_open: bool = False  # the grammar waits for the end of the reasoning
    samples: list[_Sample | None] = field(default_factory=list)
    pending_fanout: bool = False  # samples 1..n-1 wait until sample 0 has filled the prefix cache
    first_scheduled_time: float | None = None

    @property
    def finished(self) -> bool:
        return not self.pending_fanout and all(s is not None and s.finished for s in self.samples)


@dataclass
class _Step:
    """A launched step: what was scheduled, and its pending sampled tokens."""

    output: SchedulerOutput
    sampling_chunks: list[ScheduledChunk]
    pending: PendingStep
    synchronous: bool  # a grammar or LoRA row: the next step waits for this one's tokens
    advanced: bool = False  # the scheduler has moved on with placeholder tokens


def sampling_options(params: SamplingParams, eos_token_ids: set[int]) -> SamplingOptions:
    banned = set(params.stop_token_ids or [])
    if not params.ignore_eos:
        banned |= eos_token_ids  # with ignore_eos, EOS doesn't end the request: no need to hold it back
    return SamplingOptions(
        temperature=float(params.temperature),
        top_k=int(params.top_k),
        top_p=float(params.top_p),
        min_p=float(params.min_p),
        seed=params.seed,
        presence_penalty=float(params.presence_penalty),
        frequency_penalty=float(params.frequency_penalty),
        repetition_penalty=float(params.repetition_penalty),
        min_tokens=int(params.min_tokens),
        min_tokens_banned=tuple(sorted(banned)),
        logprobs=params.logprobs,
        prompt_logprobs=params.prompt_logprobs,
        # Token rules ride on the grammar path (their bitmask also holds the min_tokens ban).
        has_grammar=params.structured_outputs is not None or has_token_rules(params),
    )


def spec_eligible(sample: _Sample) -> bool:
    """The verifier samples exactly what the plain sampler would for this sample: no grammar or
    token rules, penalties, logprobs, min_tokens or per-request seed (those stay one token a step)."""
    o = sample.options
    return (not o.has_grammar and o.logprobs is None and o.seed is None and o.min_tokens == 0
            and o.repetition_penalty == 1.0 and o.frequency_penalty == 0.0 and o.presence_penalty == 0.0)


def has_token_rules(params: SamplingParams) -> bool:
    return params.allowed_token_ids is not None or bool(params.bad_words)


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor | None = None) -> None:
        with collector_paused():  # nothing built here is garbage (engine/collector.py)
            self._build(config, executor)
        self._heap_frozen = self.device.type == "cuda"  # a full collection would stall the GPU
        if self._heap_frozen:
            freeze_heap()

    def _build(self, config: EngineConfig, executor: Executor | None) -> None:
        started = time.perf_counter()
        self.device = resolve_device(config.device)
        self.source = resolve_model(config.model, config.cache_dir)
        arch = self.source.arch_config
        self.vocab_size = arch.vocab_size
        self.dtype = resolve_dtype(arch.torch_dtype, config.dtype, self.device)
        self.startup_seconds = {"device_and_config": time.perf_counter() - started}
        # Grammars need the tokenizer; text is the caller's. It loads on a thread while the
        # workers start (engine/tokenizer_load.py) and is taken once they are up.
        started = time.perf_counter()
        tokenizer_load = None if config.skip_tokenizer_init else TokenizerLoad(
            lambda: load_tokenizer(config.model, config.tokenizer, config.cache_dir))
        self.tokenizer: Any = None
        self.startup_seconds["tokenizer_start"] = time.perf_counter() - started
        self.model_name = config.served_model_name or config.model
        self.max_model_len = config.max_model_len or arch.max_position_embeddings
        if self.max_model_len > arch.max_position_embeddings:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) exceeds the model's context length "
                f"({arch.max_position_embeddings})"
            )
        torch.manual_seed(config.seed)
        if config.max_num_batched_tokens is None:  # resolved here, so the workers profile the real step size
            config = dataclasses.replace(config, max_num_batched_tokens=default_max_num_batched_tokens(
                self.device.type == "cuda", config.enable_chunked_prefill, self.max_model_len))
        self.config = config
        # Before the workers start, so a bad draft model fails fast (the workers load it).
        self.speculative = SpeculativeConfig.parse(config.speculative_config) if config.speculative_config else None
        if self.speculative is not None and config.pipeline_parallel_size > 1:
            raise ValueError("speculative decoding does not run with pipeline parallelism")
        if self.speculative is not None and self.speculative.method == "draft_model" \
                and config.tensor_parallel_size > 1:
            raise ValueError("a draft model runs with tensor_parallel_size 1 only (it is not sharded yet); "
                             "use n-gram speculation with tensor parallelism")
        self.proposer: Proposer | None = None
        if self.speculative is not None:
            self.tokenizer = self._take_tokenizer(tokenizer_load)  # the draft's vocabulary is checked against it
            self.proposer = build_proposer(
                self.speculative, target_vocab_size=self.vocab_size, target_tokenizer=self.tokenizer,
                max_model_len=self.max_model_len, cache_dir=config.cache_dir)
        started = time.perf_counter()
        self.executor = executor or build_executor(config, self.source, self.device, self.dtype)
        self.startup_seconds["executor"] = time.perf_counter() - started  # the workers' start-up
        try:
            if self.speculative is None:  # else taken before the workers
                self.tokenizer = self._take_tokenizer(tokenizer_load)
        except BaseException:
            self.executor.shutdown()
            raise
        started = time.perf_counter()
        self.eos_token_ids = eos_ids(arch.eos_token_id, self.tokenizer)
        self.kv_cache_manager = KVCacheManager(
            num_blocks=self.executor.num_kv_blocks,
            block_size=config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
        )
        connector_info = self.executor.collective_rpc("kv_connector_info")[0] if config.kv_offloading_size else {}
        self.kv_connector = create_scheduler_connector(config, self.kv_cache_manager, connector_info)
        self.scheduler = Scheduler(SchedulerConfig.from_engine_config(config, self.max_model_len), self.kv_cache_manager,
                                   self.kv_connector)
        self._parents: dict[str, _Parent] = {}
        self._samples: dict[str, _Sample] = {}  # scheduler request id → sample
        # What the workers know: request id → block ids sent so far; forgotten ids to send.
        self._blocks_sent: dict[str, int] = {}
        self._resumed: set[str] = set()
        self._forget: list[str] = []
        self._step_ids = 0
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self._max_running_seen = 0
        self._sleep_level = 0
        self._grammars: GrammarCompilerCache | None = None  # built on the first structured request
        self._state_lock = threading.Lock()  # sleep/wake/reset from other threads (offline users)
        self.async_scheduling = config.async_scheduling if config.async_scheduling is not None else self.device.type == "cuda"
        # Async scheduling with speculation needs drafts made on the device (a draft model
        # always, n-gram under async scheduling; the runners decide alike): a row whose last
        # token is still in flight gets draft slots that the device fills. n-gram lookup on the
        # host reads every token there: synchronous.
        self.device_drafts = drafts_on_device(self.speculative, config.async_scheduling, self.device.type) \
            and config.pipeline_parallel_size == 1
        if self.proposer is not None and not self.device_drafts:
            self.async_scheduling = False
        # vLLM's spec-decode counters: drafts (rows that verified), draft tokens, accepted tokens, per position.
        self.spec_num_drafts = 0
        self.spec_num_draft_tokens = 0
        self.spec_num_accepted_tokens = 0
        self.spec_accepted_per_pos: list[int] = [0] * (self.speculative.num_speculative_tokens if self.speculative else 0)
        self._in_flight: _Step | None = None
        # Pipeline parallelism: up to pipeline_parallel_size batches of distinct requests in
        # flight, oldest first; each request's output ids the stages before the last have got.
        self.pipeline_depth = config.pipeline_parallel_size
        self._batches: deque[_Step] = deque()
        self._outputs_sent: dict[str, int] = {}
        self.max_batches_in_flight = 0  # the most batches ever in flight at once (benchmarks, tests)
        if self.pipeline_depth > 1:
            if config.async_scheduling:
                logger.info("pipeline parallelism keeps %d batches in flight instead of async scheduling",
                            self.pipeline_depth)
            self.async_scheduling = False  # placeholders would reach the stages that get ids from plans
        self.lora_manager: LoRAManager | None = getattr(self.executor, "lora_manager", None)
        if config.enable_lora and self.lora_manager is None:
            self.executor.shutdown()
            raise ValueError(f"the {config.distributed_executor_backend} executor does not serve LoRA adapters")
        for lora_name, lora_path in (config.lora_modules or {}).items():
            self.add_lora(self.read_lora(lora_name, lora_path, at_startup=True))
        self.startup_seconds["core_setup"] = time.perf_counter() - started
        logger.info(
            "engine core ready: model=%s device=%s dtype=%s kv_blocks=%d block_size=%d kv_cache_dtype=%s "
            "max_model_len=%d async_scheduling=%s",
            self.model_name, self.device, self.dtype, self.executor.num_kv_blocks, config.block_size, config.kv_cache_dtype,
            self.max_model_len, self.async_scheduling,
        )

    def _take_tokenizer(self, load: TokenizerLoad | None) -> Any:
        """The tokenizer once loaded; ``tokenizer`` in ``startup_seconds`` is the wait for it
        (what it added to the start-up), ``tokenizer_load`` the load itself."""
        if load is None:
            return None
        started = time.perf_counter()
        tokenizer = load.result()
        self.startup_seconds["tokenizer"] = time.perf_counter() - started
        self.startup_seconds["tokenizer_load"] = load.seconds
        return tokenizer

    # ---- requests --------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        lora_name: str | None = None,
    ) -> None:
        """Queue a tokenized request; raises ValueError (LoRAError included) for bad input."""
        if self._sleep_level:
            raise RuntimeError("the engine is sleeping; wake it up first")
        if request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError("cache_salt must be a non-empty string")
        check_prompt(prompt_token_ids, self.vocab_size, self.max_model_len)
        if params.allowed_token_ids is not None and max(params.allowed_token_ids) >= self.vocab_size:
            raise ValueError(f"allowed_token_ids has ids outside the vocabulary (size {self.vocab_size})")
        if params.priority != 0 and self.config.scheduling_policy != "priority":
            raise ValueError(f"priority {params.priority} needs the engine started with --scheduling-policy priority")
        if params.prompt_logprobs is not None and (self.proposer is not None or self.config.pipeline_parallel_size > 1):
            raise ValueError("prompt_logprobs is not supported with speculative decoding or pipeline parallelism")
        max_tokens = params.max_tokens
        room = self.max_model_len - len(prompt_token_ids)
        if max_tokens is None or max_tokens > room:
            max_tokens = room  # the context is the hard limit; finish_reason "length" at it
        params = params.clone(max_tokens=max_tokens, min_tokens=min(params.min_tokens, max_tokens))
        # Compile here, not per sample: errors become the caller's ValueError (a 400), and the
        # n samples (some added later, at fan-out) share one compiled grammar.
        compiled = self._compile_grammar(params) if params.structured_outputs is not None else None
        bad_words = self._bad_words(params)
        if lora_name is not None:
            self._acquire_lora(lora_name)  # last check: nothing below can fail and leak the reference
        parent = _Parent(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            cache_salt=cache_salt,
            arrival_time=arrival_time or time.time(),
            samples=[None] * params.n,
            lora_name=lora_name,
            lora_key=self.lora_manager.cache_key(lora_name) if lora_name is not None and self.lora_manager else None,
            compiled_grammar=compiled,
            bad_words=bad_words,
            reasoning_open=compiled is not None and self._reasoning_open(prompt_token_ids),
        )
        self._parents[request_id] = parent
        self._prompt_tokens_total += len(prompt_token_ids)
        # With prefix caching, samples 1..n-1 start once sample 0's prompt blocks are cached,
        # so they share them instead of computing the prompt n times.
        share_prompt = params.n > 1 and self.config.enable_prefix_caching
        parent.pending_fanout = share_prompt
        for index in range(1 if share_prompt else params.n):
            self._add_sample(parent, index)

    def _add_sample(self, parent: _Parent, index: int) -> None:
        params = parent.params
        if parent.params.n > 1 and params.seed is not None:
            params = params.clone(seed=params.seed + index)  # distinct but reproducible samples
        if index > 0 and params.prompt_logprobs is not None:
            params = params.clone(prompt_logprobs=None)  # the prompt's logprobs come with sample 0
        sample_id = sample_request_id(parent.request_id, index, parent.params.n)
        request = Request(
            request_id=sample_id,
            prompt_token_ids=parent.prompt_token_ids,
            sampling_params=params,
            arrival_time=parent.arrival_time,
            cache_salt=parent.cache_salt,
            lora_name=parent.lora_name,
            lora_key=parent.lora_key,
        )
        sample = _Sample(request=request, parent_id=parent.request_id, index=index,
                         options=sampling_options(params, self.eos_token_ids))
        if parent.compiled_grammar is not None:
            assert self._grammars is not None
            sample.grammar = GrammarMatcher(parent.compiled_grammar, self._grammars.vocab_size)  # type: ignore[arg-type]
            if parent.reasoning_open:
                sample.grammar = ReasoningGate(sample.grammar, self._think_ids()[1], self.vocab_size)  # type: ignore[assignment]
        if has_token_rules(params):
            grammar = sample.grammar is not None  # a grammar alone decides where the output may end
            rules = TokenRules(self.vocab_size, params.allowed_token_ids, parent.bad_words,
                               0 if grammar else params.min_tokens, sample.options.min_tokens_banned)
            sample.grammar = CombinedMatcher(sample.grammar, rules) if sample.grammar is not None else rules  # type: ignore[assignment]
        parent.samples[index] = sample
        self._samples[sample_id] = sample
        self.scheduler.add_request(request)

    def _think_ids(self) -> tuple[list[int], list[int]]:
        """The token ids of <think> and </think> in this tokenizer."""
        assert self.tokenizer is not None
        return (self.tokenizer.encode("<think>", add_special_tokens=False),
                self.tokenizer.encode("</think>", add_special_tokens=False))

    def _reasoning_open(self, prompt_token_ids: list[int]) -> bool:
        """With a reasoning parser, does the answer start inside the reasoning? Not when the
        prompt already closed it (Qwen3's template with enable_thinking false)."""
        if self.config.reasoning_parser is None:
            return False
        start, end = self._think_ids()
        return not reasoning_ended(prompt_token_ids, end, start)

    def _bad_words(self, params: SamplingParams) -> list[list[int]]:
        if not params.bad_words:
            return []
        if self.tokenizer is None:
            raise ValueError("bad_words need the tokenizer (the engine runs with skip_tokenizer_init)")
        return bad_word_token_ids(self.tokenizer, params.bad_words)

    def _compile_grammar(self, params: SamplingParams) -> object:
        assert params.structured_outputs is not None
        if self.tokenizer is None:
            raise ValueError("structured outputs need the tokenizer (the engine runs with skip_tokenizer_init)")
        if self._grammars is None:
            # The logits (and so the bitmask) span the model's vocabulary, which may exceed the tokenizer's.
            self._grammars = GrammarCompilerCache(self.tokenizer, self.vocab_size, sorted(self.eos_token_ids))
        return self._grammars.compile(params.structured_outputs)

    def abort_request(self, request_id: str) -> None:
        """End a request and all its samples (unknown ids are ignored)."""
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return
        if parent.lora_name is not None and self.lora_manager is not None:
            self.lora_manager.release(parent.lora_name)
        for sample in parent.samples:
            if sample is not None and not sample.finished:
                self._drop_sample(sample, RequestStatus.FINISHED_ABORTED)

    def finish_samples(self, sample_ids: list[str]) -> None:
        """End samples whose text hit a stop string (the caller found it); their parent ends
        once every sample has."""
        for sample_id in sample_ids:
            sample = self._samples.get(sample_id)
            if sample is None:
                continue
            self._drop_sample(sample, RequestStatus.FINISHED_STOPPED)
            parent = self._parents.get(sample.parent_id)
            if parent is not None and parent.finished:
                self._end_parent(parent)

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    def has_request(self, request_id: str) -> bool:
        """The request (any of its samples) is still running."""
        return request_id in self._parents

    # ---- the step --------------------------------------------------------------------
    def step(self) -> list[SampleDelta]:
        """One scheduled forward; returns a delta for each sample it advanced. With async
        scheduling the deltas are those of the step launched by the previous call, and the
        next step is already running when this returns."""
        if self._sleep_level:
            return []
        if self.pipeline_depth > 1:
            return self._step_pipelined()
        if self._in_flight is None:
            self._in_flight = self._schedule_and_launch()
            if self._in_flight is None:
                return []
        current, self._in_flight = self._in_flight, None
        if self.async_scheduling and not current.synchronous:
            hold = self._advance_with_placeholders(current)
            if self.proposer is not None:
                self._propose(hold)
            self._in_flight = self._launch(self.scheduler.schedule(hold=hold))
            return self._complete(current)
        deltas = self._complete(current)
        if self.proposer is not None and self._parents:
            # Launch ahead: N's tokens and stops are in, so the next step is scheduled and
            # running before the caller turns N's deltas into outputs (text, stop strings, the
            # API servers' messages). A sample the caller then ends (a stop string, an abort)
            # has that step computed for nothing, as with async scheduling.
            self._in_flight = self._schedule_and_launch()
        return deltas

    def _schedule_and_launch(self) -> _Step | None:
        if self.proposer is not None:
            self._propose()
        return self._launch(self.scheduler.schedule())

    def _step_pipelined(self) -> list[SampleDelta]:
        """Fill the batch queue with batches of requests in no in-flight batch (until the
        pipeline depth, or a batch that must complete first: a grammar or LoRA row), then
        complete the oldest batch."""
        batches = self._batches
        while len(batches) < self.pipeline_depth and not (batches and batches[-1].synchronous):
            in_flight = {c.request.request_id for b in batches for c in b.output.chunks}
            output = self.scheduler.schedule(hold=in_flight)
            step = self._launch(output, flush=not batches)
            if step is None:
                break
            batches.append(step)
            self.max_batches_in_flight = max(self.max_batches_in_flight, len(batches))
        if not batches:
            return []
        return self._complete(batches.popleft())

    def _propose(self, hold: Collection[str] = ()) -> None:
        """Drafts for the running decode rows whose sampling the verifier handles exactly.
        With drafts made on the device, a row whose last token is still in flight gets draft
        slots (placeholders the device fills) instead; its in-flight drafts may all be accepted,
        so its caps count them (``num_lookahead_tokens``). A draft model gives every row draft
        slots (``DEVICE_DRAFT_SLOT`` when its last token is known), which it fills on the workers."""
        assert self.proposer is not None
        rows: list[Request] = []
        caps: list[int] = []
        histories: list[np.ndarray] = []
        k = self.proposer.num_speculative_tokens
        device_only = getattr(self.proposer, "device_only", False)
        for req in self.scheduler.running:
            req.spec_token_ids = []
            sample = self._samples.get(req.request_id)
            if sample is None or req.num_tokens - req.num_computed_tokens != 1 or not spec_eligible(sample) \
                    or req.request_id in hold:
                continue
            params = req.sampling_params
            ahead = req.num_lookahead_tokens
            cap = min((params.max_tokens or 0) - req.num_output_tokens,
                      self.max_model_len - req.num_tokens) - ahead - 1
            if cap > 0 and req.has_placeholder:
                req.spec_token_ids = [PLACEHOLDER_TOKEN] * min(cap, k)
            elif cap > 0 and device_only:  # the draft model writes them on the device
                req.spec_token_ids = [DEVICE_DRAFT_SLOT] * min(cap, k)
            elif cap > 0:
                if sample.history is None:
                    sample.history = TokenHistory(min(req.num_prompt_tokens + (params.max_tokens or 0), 2 * req.num_tokens + 256))
                rows.append(req)
                caps.append(cap)
                histories.append(sample.history.view(req.all_token_ids))
        if not rows:
            return
        drafts = self.proposer.propose(histories, caps, [r.request_id for r in rows])
        for req, draft in zip(rows, drafts):
            req.spec_token_ids = draft.tolist()

    def _launch(self, output: SchedulerOutput, flush: bool = True) -> _Step | None:
        """Send a scheduled step to the workers; nothing here waits for the device. ``flush``:
        with nothing to run, send the finished requests' ids at once (a round trip) rather
        than with the next plan (the batch queue does not wait while batches are in flight)."""
        for request in output.preempted:  # even in a step left empty: they resume with new tables
            if request.request_id in self._blocks_sent:
                self._resumed.add(request.request_id)
        if not output.chunks and (output.kv_transfer is not None or self.scheduler.has_pending_transfers()):
            # Nothing to compute until KV transfers finish: a step that starts and waits for them.
            return _Step(output, [], self.executor.execute(self._plan(output, time.time())), True)
        if not output.chunks:
            if self._forget and flush:  # nothing to run, but let the workers drop finished requests
                self._flush_forgotten()
            return None
        now = time.time()
        self._max_running_seen = max(self._max_running_seen, len(output.chunks))
        plan = self._plan(output, now)
        sampling_chunks = [c for c in output.chunks if c.samples]
        synchronous = bool(plan.grammar_bitmasks) or any(c.request.lora_name is not None for c in output.chunks)
        return _Step(output, sampling_chunks, self.executor.execute(plan), synchronous)

    def _plan(self, output: SchedulerOutput, now: float) -> StepPlan:
        new_requests: list[NewRequest] = []
        scheduled: list[ScheduledRequest] = []
        bitmasks: dict[str, bytes] = {}
        for chunk in output.chunks:
            req = chunk.request
            rid = req.request_id
            sample = self._samples[rid]
            parent = self._parents[sample.parent_id]
            if parent.first_scheduled_time is None:
                parent.first_scheduled_time = now
            sent = self._blocks_sent.get(rid)
            resumed = False
            if sent is None:
                new_requests.append(NewRequest(
                    req_id=rid,
                    prompt_token_ids=req.prompt_token_ids,
                    sampling=sample.options,
                    block_ids=list(chunk.block_ids),
                    num_computed_tokens=req.num_computed_tokens,
                    lora_name=req.lora_name,
                ))
                new_blocks: list[int] = []
            elif rid in self._resumed:
                self._resumed.discard(rid)
                resumed = True
                new_blocks = list(chunk.block_ids)
            else:
                new_blocks = chunk.block_ids[sent:]
            self._blocks_sent[rid] = len(chunk.block_ids)
            new_token_ids: list[int] = []
            if self.pipeline_depth > 1:  # the stages before the last learn the sampled ids here
                sent_out = self._outputs_sent.get(rid, 0)
                new_token_ids = req.output_token_ids[sent_out:]
                self._outputs_sent[rid] = req.num_output_tokens
            scheduled.append(ScheduledRequest(rid, req.num_computed_tokens, chunk.num_new_tokens, new_blocks,
                                              chunk.samples, resumed, list(chunk.draft_token_ids), new_token_ids))
            if chunk.samples and sample.grammar is not None:
                bitmasks[rid] = sample.grammar.bitmask_bytes()
        forget, self._forget = self._forget, []
        self._step_ids += 1
        return StepPlan(step_id=self._step_ids, new_requests=new_requests, scheduled=scheduled,
                        finished_req_ids=forget, grammar_bitmasks=bitmasks, kv_transfer=output.kv_transfer)

    def _flush_forgotten(self) -> None:
        """A plan with nothing to run: the workers drop the finished requests now."""
        result = self.executor.execute(self._plan(SchedulerOutput(), time.time())).result()
        if result.kv_transfer is not None:
            self.scheduler.update_from_kv_transfer(result.kv_transfer)

    def finish_kv_transfers(self) -> None:
        """Run transfer-only steps until the KV connector has nothing queued or in flight (the
        write-through saves of the last requests, before a sleep or a measurement). Only with no
        request left: a step scheduled here would drop their tokens."""
        if self.has_unfinished_requests():
            raise RuntimeError("finish_kv_transfers needs every request finished or aborted first")
        while self.scheduler.has_pending_transfers():
            step = self._launch(self.scheduler.schedule())
            if step is not None:
                self._complete(step)

    def _advance_with_placeholders(self, step: _Step) -> set[str]:
        """Move the scheduler past ``step`` as if its tokens were known (placeholders stand in
        for them). Returns the requests whose placeholder is their last token: hold them."""
        # A verify row advances as if it accepted no draft (one placeholder): the device shifts
        # its next step by what it did accept, and its KV slots cover every draft accepted.
        self.scheduler.update_from_output(step.output, {
            c.request.request_id: [PLACEHOLDER_TOKEN] if c.draft_token_ids else PLACEHOLDER_TOKEN
            for c in step.sampling_chunks})
        step.advanced = True
        hold: set[str] = set()
        for chunk in step.sampling_chunks:
            req = chunk.request
            if chunk.draft_token_ids and req.status == RequestStatus.RUNNING:
                req.num_lookahead_tokens = len(chunk.draft_token_ids)
            if req.has_placeholder and (
                req.num_output_tokens >= (req.sampling_params.max_tokens or 0) or req.num_tokens >= self.max_model_len
            ):
                hold.add(req.request_id)
        return hold

    def _complete(self, step: _Step) -> list[SampleDelta]:
        """Wait for the step's samples, then record them: stops, deltas."""
        result = step.pending.result()
        if result.kv_transfer is not None:
            self.scheduler.update_from_kv_transfer(result.kv_transfer)
        token_of: dict[str, Any] = dict(zip(result.req_ids, result.token_lists or result.token_ids))
        if result.token_lists:
            self._count_accepted(step, token_of)
        if not step.advanced:
            self.scheduler.update_from_output(step.output, token_of)
        logprobs_of = dict(zip(result.req_ids, result.logprobs)) if result.logprobs else {}
        for rid, positions in result.prompt_logprobs.items():
            prompt_sample = self._samples.get(rid)
            if prompt_sample is not None:
                prompt_sample.prompt_logprobs.extend(positions)
        deltas: list[SampleDelta] = []
        for chunk in step.sampling_chunks:
            rid = chunk.request.request_id
            sample = self._samples.get(rid)
            if sample is None or sample.request is not chunk.request or rid not in token_of:
                continue  # finished or aborted since the step was launched
            token_id = token_of[rid]
            if step.advanced:
                self._fill_placeholder(sample, token_id)
            parent = self._parents[sample.parent_id]
            if isinstance(token_id, list):  # verified drafts: each token in turn, until one ends the sample
                first_output = chunk.request.num_output_tokens - len(token_id)
                for j, tid in enumerate(token_id):
                    deltas.append(self._on_token(sample, parent, tid, None, first_output + j + 1))
                    if sample.finished:
                        break
            else:
                deltas.append(self._on_token(sample, parent, token_id, logprobs_of.get(rid)))
            if parent.pending_fanout:
                parent.pending_fanout = False
                for index in range(1, parent.params.n):
                    self._add_sample(parent, index)
            if parent.finished:
                self._end_parent(parent)
        return deltas

    def _fill_placeholder(self, sample: _Sample, token_id: int | list[int]) -> None:
        """The in-flight step's tokens arrived: they replace its placeholder. A verify row was
        advanced as if it accepted no draft: the accepted ones are appended and counted as
        computed now (their KV was written where the device put them)."""
        req = sample.request
        tokens = token_id if isinstance(token_id, list) else [token_id]
        req.fill_placeholder(tokens[0])
        if sample.history is not None:
            sample.history.replace(req.num_tokens - 1, tokens[0])
        for t in tokens[1:]:
            req.append_output_token(t)
        if isinstance(token_id, list):
            req.num_lookahead_tokens = 0
            if req.status == RequestStatus.RUNNING:  # a preempted row recomputes them anyway
                req.num_computed_tokens += len(tokens) - 1

    def _count_accepted(self, step: _Step, token_of: dict[str, Any]) -> None:
        for chunk in step.sampling_chunks:
            tokens = token_of.get(chunk.request.request_id)
            drafts = len(chunk.draft_token_ids)
            if not drafts or not isinstance(tokens, list) or chunk.request.is_finished:
                continue  # (a sample ended since the step was launched: its tokens are dropped)
            accepted = len(tokens) - 1
            self.spec_num_drafts += 1
            self.spec_num_draft_tokens += drafts
            self.spec_num_accepted_tokens += accepted
            for pos in range(accepted):
                self.spec_accepted_per_pos[pos] += 1

    def _on_token(self, sample: _Sample, parent: _Parent, token_id: int, logprobs: SampledLogprobs | None,
                  num_output: int | None = None) -> SampleDelta:
        """One sampled token (already appended by the scheduler): check the stops that need no text.
        ``num_output``: the output length up to this token (default: the request's: it is the last)."""
        self._generation_tokens_total += 1
        req, params = sample.request, sample.request.sampling_params
        if num_output is None:
            num_output = req.num_output_tokens
        past_min = num_output >= params.min_tokens
        is_stop_token = past_min and token_id in params.stop_token_ids
        is_eos = past_min and not params.ignore_eos and token_id in self.eos_token_ids
        grammar_done = False
        if sample.grammar is not None:
            if not sample.grammar.accept_token(token_id):
                # The bitmask allowed only grammar tokens, so this is a bug; end rather than emit garbage.
                logger.warning("request %s: sampled token %d rejected by its grammar", req.request_id, token_id)
                grammar_done = True
            else:
                # The grammar accepted EOS at its end: done, even under ignore_eos or min_tokens.
                grammar_done = sample.grammar.is_terminated()
        reason: str | None = None
        stop_reason: int | str | None = None
        if is_stop_token:
            reason, stop_reason = "stop", token_id
        elif grammar_done or is_eos:
            reason = "stop"
        elif num_output >= (params.max_tokens or 0) or req.num_prompt_tokens + num_output >= self.max_model_len:
            reason = "length"
        # The text of an ending EOS or stop token is not part of the answer (as in vLLM).
        terminated = is_stop_token or is_eos or (grammar_done and token_id in self.eos_token_ids)
        if reason is not None:
            self._drop_sample(sample, RequestStatus.FINISHED_LENGTH if reason == "length" else RequestStatus.FINISHED_STOPPED)
        first = sample.index == 0 and num_output == 1
        prompt_logprobs = None
        if num_output == 1 and sample.options.prompt_logprobs is not None:
            prompt_logprobs, sample.prompt_logprobs = sample.prompt_logprobs, []
        return SampleDelta(
            request_id=parent.request_id,
            index=sample.index,
            new_token_ids=[token_id],
            new_logprobs=[logprobs] if logprobs is not None else None,
            finish_reason=reason,
            stop_reason=stop_reason,
            stop_terminated=terminated,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            first_scheduled_time=parent.first_scheduled_time if first else None,
            prompt_logprobs=prompt_logprobs,
        )

    def _drop_sample(self, sample: _Sample, status: RequestStatus) -> None:
        sample.finished = True
        rid = sample.request.request_id
        self.scheduler.finish_request(rid, status)
        self._samples.pop(rid, None)
        if self.proposer is not None:
            self.proposer.release(rid)
        if self._blocks_sent.pop(rid, None) is not None:
            self._forget.append(rid)
        self._resumed.discard(rid)
        self._outputs_sent.pop(rid, None)

    def _end_parent(self, parent: _Parent) -> None:
        if self._parents.pop(parent.request_id, None) is None:
            return
        if parent.lora_name is not None and self.lora_manager is not None:
            self.lora_manager.release(parent.lora_name)

    def settle(self) -> None:
        """Wait for the steps still in flight and drop their tokens (called with no request
        left: only steps whose requests are all gone are in flight then, so nothing is lost)."""
        step, self._in_flight = self._in_flight, None
        if step is not None:
            self._complete(step)
        while self._batches:
            self._complete(self._batches.popleft())
        if self._forget:
            self._flush_forgotten()

    # ---- state and admin -------------------------------------------------------------
    def get_stats(self) -> CoreStats:
        stats = self.kv_cache_manager.prefix_cache_stats
        lora: dict[str, object] = {}
        if self.lora_manager is not None:
            lora = {
                "max_loras": self.lora_manager.settings.max_loras,
                "running_lora_adapters": tuple(sorted({r.lora_name for r in self.scheduler.running if r.lora_name})),
                "waiting_lora_adapters": tuple(sorted({r.lora_name for r in self.scheduler.waiting if r.lora_name})),
                "lora_adapters": [(a.name, a.path, a.rank, a.unloading) for a in self.lora_manager.list_adapters()],
            }
        return CoreStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_queries=stats.queries,
            prefix_cache_hits=stats.hits,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
            max_num_running_seen=self._max_running_seen,
            sleep_level=self._sleep_level,
            spec_decode_num_drafts=self.spec_num_drafts,
            spec_decode_num_draft_tokens=self.spec_num_draft_tokens,
            spec_decode_num_accepted_tokens=self.spec_num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=list(self.spec_accepted_per_pos),
            prompt_tokens_computed=self.scheduler.num_prompt_tokens_computed,
            **self._offload_stats(),
            **lora,  # type: ignore[arg-type]
        )

    def _offload_stats(self) -> dict[str, object]:
        if self.kv_connector is None:
            return {}
        external = self.scheduler.external_cache_stats
        return {"external_prefix_cache_queries": external.queries, "external_prefix_cache_hits": external.hits,
                "kv_offload_enabled": True, **self.kv_connector.stats()}

    def _lora(self) -> LoRAManager:
        if self.lora_manager is None:
            raise LoRAError("LoRA is not enabled on this server; start it with --enable-lora")
        return self.lora_manager

    def _acquire_lora(self, lora_name: str) -> None:
        if self.lora_manager is None:
            raise LoRAError(f"The model `{lora_name}` does not exist.", status=404)
        self.lora_manager.acquire(lora_name)

    def read_lora(self, lora_name: str, lora_path: str, *, at_startup: bool = False) -> LoRAAdapter:
        """Read and validate an adapter (registers nothing). Runtime loads must come from
        --allowed-lora-roots; start-up ones (--lora-modules) are the operator's own."""
        manager = self._lora()
        if lora_name == self.model_name:
            raise LoRAError(f"The lora adapter '{lora_name}' has the base model's name.")
        if not at_startup and not manager.settings.allowed_roots:
            raise LoRAError("Loading LoRA adapters at run time is off: start the server with "
                            "--allowed-lora-roots DIR [DIR ...] to allow adapters from those folders.")
        return manager.read_adapter(lora_name, lora_path)

    def add_lora(self, adapter: LoRAAdapter) -> None:
        self._lora().add(adapter)
        self.executor.add_lora(adapter)  # workers with their own registry (worker processes)

    def load_lora(self, lora_name: str, lora_path: str) -> None:
        self.add_lora(self.read_lora(lora_name, lora_path))

    def remove_lora(self, lora_name: str) -> bool:
        """Unload an adapter: True when gone now, False when its running requests finish first."""
        gone = self._lora().remove(lora_name)
        if gone:
            self.executor.remove_lora(lora_name)
        return gone

    def list_loras(self) -> list[AdapterInfo]:
        return [] if self.lora_manager is None else self.lora_manager.list_adapters()

    def reset_prefix_cache(self) -> bool:
        """Forget cached prefixes in every tier (the device cache and the connector's)."""
        with self._state_lock:
            done = self.kv_cache_manager.reset_prefix_cache()
            return (self.kv_connector.reset() if self.kv_connector is not None else True) and done

    def is_sleeping(self) -> bool:
        return self._sleep_level > 0

    @property
    def sleep_level(self) -> int:
        return self._sleep_level

    def sleep(self, level: int = 1) -> None:
        """Give the device memory back. Level 1 keeps the weights in host memory, level 2 drops them.
        Callers drain or abort requests first; sleeping twice is a no-op."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        with self._state_lock:
            if self.has_unfinished_requests():
                raise RuntimeError("cannot sleep with requests in flight; drain or abort them first")
            if self._sleep_level:
                return
            self.settle()  # a last step computed for finished requests may still run
            self.finish_kv_transfers()  # saves still reading the device cache finish first
            self.kv_cache_manager.reset_prefix_cache()  # its blocks are about to vanish
            if level == 2 and self.kv_connector is not None:
                self.kv_connector.reset()  # the weights are reloaded: host KV may no longer match them
            self.executor.collective_rpc("sleep", level)
            self._sleep_level = level

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore weights and/or the KV cache (``tags``: "weights", "kv_cache"; default both)."""
        tags = tags or ["weights", "kv_cache"]
        unknown = set(tags) - {"weights", "kv_cache"}
        if unknown:
            raise ValueError(f"unknown wake_up tags {sorted(unknown)}; use 'weights' and/or 'kv_cache'")
        with self._state_lock:
            if not self._sleep_level:
                return
            still_asleep = self.executor.collective_rpc("wake_up", tags)[0]
            if not still_asleep:
                self._sleep_level = 0

    def memory_usage(self) -> dict[str, int]:
        return self.executor.collective_rpc("memory_usage")[0]

    def shutdown(self) -> None:
        self.executor.shutdown()
        if self._heap_frozen:
            unfreeze_heap()
            self._heap_frozen = False


def check_prompt(token_ids: list[int], vocab_size: int, max_model_len: int) -> None:
    """A tokenized prompt fits the vocabulary and leaves room to generate (ValueError: a 400)."""
    if not token_ids:
        raise ValueError("the prompt is empty")
    if min(token_ids) < 0 or max(token_ids) >= vocab_size:
        bad = next(t for t in token_ids if not 0 <= t < vocab_size)
        raise ValueError(f"token id {bad} is out of the vocabulary (size {vocab_size})")
    if len(token_ids) >= max_model_len:
        raise ValueError(
            f"this model's maximum context length is {max_model_len} tokens, but the prompt has "
            f"{len(token_ids)} tokens (at least one must be left to generate)"
        )


def build_executor(config: EngineConfig, source: Any, device: torch.device, dtype: torch.dtype) -> Executor:
    """The configured executor: "uni", "mp", or (as vLLM allows) "package.module:Class", an
    Executor subclass built with the same arguments."""
    backend = config.distributed_executor_backend
    if ":" in backend:
        module_name, class_name = backend.split(":", 1)
        executor_class = getattr(importlib.import_module(module_name), class_name)
        return executor_class(config, source, device, dtype)
    from tidal_engine.executor import create_executor

    return create_executor(config, source, device, dtype)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for, but no CUDA device is available")
    resolved = torch.device(device)
    if resolved.type == "cuda" and resolved.index is None:
        # "cuda" -> "cuda:N": tensors report an indexed device, and device checks compare equal.
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


def eos_ids(config_eos: int | list[int] | None, tokenizer: object) -> set[int]:
    ids: set[int] = set()
    if isinstance(config_eos, int):
        ids.add(config_eos)
    elif isinstance(config_eos, list):
        ids.update(config_eos)
    tok_eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(tok_eos, int):
        ids.add(tok_eos)
    return ids
