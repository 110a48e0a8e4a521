"""The synchronous engine: requests in, one scheduled forward per ``step()``, outputs back.

``step()`` = schedule → run the model → sample → append tokens → detokenize →
check stops → report. Everything that needs torch lives in the model runner;
everything about batching lives in the scheduler.

Async scheduling (on by default on CUDA) keeps one step in flight: ``step()`` advances the
in-flight step N with placeholder tokens, schedules and launches N+1 (whose decodes read
N's sampled ids on the device), and only then waits for N's ids and does N's host work
(detokenizing, stop checks) while the device runs N+1. A request that stops at N has one
step computed for nothing; one whose N token is its last (max_tokens, the context) is held
out of N+1. Rows whose next draw needs their tokens on the host (penalties, grammars,
logprobs) or a LoRA adapter make that step synchronous.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from tidal_engine.config import EngineConfig
from tidal_engine.core.kv_cache_manager import KVCacheManager
from tidal_engine.core.request import PLACEHOLDER_TOKEN, Request, RequestStatus
from tidal_engine.core.scheduler import ScheduledChunk, Scheduler, SchedulerConfig, SchedulerOutput
from tidal_engine.lora import AdapterInfo, LoRAAdapter, LoRAError, LoRAManager
from tidal_engine.models.loader import resolve_dtype, resolve_model
from tidal_engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from tidal_engine.runner.detokenizer import IncrementalDetokenizer, decode_token
from tidal_engine.runner.model_runner import ModelRunner
from tidal_engine.runner.sampler import SampledTokens, SamplingRow, make_generator, needs_host_history
from tidal_engine.sampling_params import SamplingParams
from tidal_engine.structured import GrammarCompilerCache, GrammarMatcher

logger = logging.getLogger(__name__)

DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    max_num_running_seen: int
    # LoRA (vLLM's lora_requests_info): adapters of running / waiting requests; 0: LoRA off.
    max_loras: int = 0
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()


@dataclass
class _Sample:
    """Engine-side state of one sample (a scheduler request) beyond what the scheduler keeps."""

    request: Request
    parent_id: str
    index: int
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    row: SamplingRow | None = None  # built once: it holds the request's (growing) token lists
    grammar: GrammarMatcher | None = None  # structured outputs: where the sample is in its grammar


@dataclass
class _Step:
    """A launched step: what was scheduled and its samples (on the device until awaited)."""

    output: SchedulerOutput
    sampling_chunks: list[ScheduledChunk]
    rows: list[SamplingRow]
    sampled: SampledTokens | None
    advanced: bool = False  # the scheduler has moved on with placeholder tokens


@dataclass
class _Parent:
    """A user request: ``n`` samples that share one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    metrics: RequestMetrics
    lora_name: str | None = None
    compiled_grammar: object | None = None  # xgrammar CompiledGrammar shared by the samples
    samples: list[_Sample | None] = field(default_factory=list)
    pending_fanout: bool = False  # samples 1..n-1 wait until sample 0 has filled the prefix cache

    @property
    def finished(self) -> bool:
        return not self.pending_fanout and all(s is not None and s.finish_reason for s in self.samples)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = _resolve_device(config.device)
        self.source = resolve_model(config.model)
        arch = self.source.arch_config
        self.dtype = resolve_dtype(arch.torch_dtype, config.dtype, self.device)
        self.tokenizer = self.source.load_tokenizer()
        self.model_name = config.served_model_name or config.model
        self.max_model_len = config.max_model_len or arch.max_position_embeddings
        if self.max_model_len > arch.max_position_embeddings:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) exceeds the model's context length "
                f"({arch.max_position_embeddings})"
            )
        torch.manual_seed(config.seed)
        self.runner = ModelRunner(config, self.source, self.device, self.dtype)
        self.eos_token_ids = _eos_ids(arch.eos_token_id, self.tokenizer)
        budget = config.max_num_batched_tokens or (
            DEFAULT_MAX_NUM_BATCHED_TOKENS if config.enable_chunked_prefill else max(self.max_model_len, DEFAULT_MAX_NUM_BATCHED_TOKENS)
        )
        self.kv_cache_manager = KVCacheManager(
            num_blocks=self.runner.num_blocks,
            block_size=config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=budget,
                max_model_len=self.max_model_len,
                enable_chunked_prefill=config.enable_chunked_prefill,
                block_size=config.block_size,
                max_loras=config.max_loras if config.enable_lora else None,
            ),
            self.kv_cache_manager,
        )
        self._parents: dict[str, _Parent] = {}
        self._samples: dict[str, _Sample] = {}  # scheduler request id → sample
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self._max_running_seen = 0
        self._sleep_level = 0
        self._grammars: GrammarCompilerCache | None = None  # built on the first structured request
        # Guards against concurrent sleep/wake/reset from different threads.
        self._state_lock = threading.Lock()
        self.async_scheduling = config.async_scheduling if config.async_scheduling is not None else self.device.type == "cuda"
        self._in_flight: _Step | None = None
        self.lora_manager: LoRAManager | None = self.runner.lora_manager
        for lora_name, lora_path in (config.lora_modules or {}).items():
            self.add_lora(self.read_lora(lora_name, lora_path, at_startup=True))
        logger.info(
            "engine ready: model=%s device=%s dtype=%s kv_blocks=%d block_size=%d max_model_len=%d",
            self.model_name, self.device, self.dtype, self.runner.num_blocks, config.block_size, self.max_model_len,
        )

    # ---- requests --------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        lora_name: str | None = None,
    ) -> None:
        params = params or SamplingParams()
        if self._sleep_level:
            raise RuntimeError("the engine is sleeping; wake it up first")
        if request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError("cache_salt must be a non-empty string")
        prompt_text, token_ids = self._tokenize(prompt)
        self._check_prompt(token_ids)
        max_tokens = params.max_tokens
        room = self.max_model_len - len(token_ids)
        if max_tokens is None or max_tokens > room:
            max_tokens = room  # the context is the hard limit; finish_reason "length" at it
        params = params.clone(max_tokens=max_tokens, min_tokens=min(params.min_tokens, max_tokens))
        # Compile here, not per sample: errors become the caller's ValueError (a 400), and the
        # n samples (some added later, at fan-out) share one compiled grammar.
        compiled = self._compile_grammar(params) if params.structured_outputs is not None else None
        if lora_name is not None:
            self._acquire_lora(lora_name)  # last check: nothing below can fail and leak the reference
        parent = _Parent(
            request_id=request_id,
            prompt=prompt_text,
            prompt_token_ids=token_ids,
            params=params,
            cache_salt=cache_salt,
            metrics=RequestMetrics(arrival_time=arrival_time or time.time()),
            samples=[None] * params.n,
            lora_name=lora_name,
            compiled_grammar=compiled,
        )
        self._parents[request_id] = parent
        self._prompt_tokens_total += len(token_ids)
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
        sample_id = parent.request_id if parent.params.n == 1 else f"{parent.request_id}#{index}"
        request = Request(
            request_id=sample_id,
            prompt_token_ids=list(parent.prompt_token_ids),
            sampling_params=params,
            arrival_time=parent.metrics.arrival_time,
            cache_salt=parent.cache_salt,
            lora_name=parent.lora_name,
        )
        sample = _Sample(
            request=request,
            parent_id=parent.request_id,
            index=index,
            detokenizer=IncrementalDetokenizer(self.tokenizer, parent.prompt_token_ids, params),
            generator=make_generator(params.seed, self.device) if params.seed is not None else None,
            logprobs=[] if params.logprobs is not None else None,
        )
        if parent.compiled_grammar is not None:
            assert self._grammars is not None
            sample.grammar = GrammarMatcher(parent.compiled_grammar, self._grammars.vocab_size)  # type: ignore[arg-type]
        parent.samples[index] = sample
        self._samples[sample_id] = sample
        self.scheduler.add_request(request)

    def _compile_grammar(self, params: SamplingParams) -> object:
        assert params.structured_outputs is not None
        if self._grammars is None:
            # The logits (and so the bitmask) span the model's vocabulary, which may exceed the tokenizer's.
            self._grammars = GrammarCompilerCache(
                self.tokenizer, self.source.arch_config.vocab_size, sorted(self.eos_token_ids)
            )
        return self._grammars.compile(params.structured_outputs)

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        # set(map(type, ...)): one C-level pass, which matters for prompts of thousands of ids.
        if isinstance(prompt, list) and set(map(type, prompt)) <= {int}:
            return None, list(prompt)
        raise ValueError("prompt must be a string or a list of token ids")

    def _check_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.source.arch_config.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            bad = next(t for t in token_ids if not 0 <= t < vocab)
            raise ValueError(f"token id {bad} is out of the vocabulary (size {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the prompt has "
                f"{len(token_ids)} tokens (at least one must be left to generate)"
            )

    def abort_request(self, request_id: str) -> None:
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return
        if parent.lora_name is not None and self.lora_manager is not None:
            self.lora_manager.release(parent.lora_name)
        for sample in parent.samples:
            if sample is not None:
                self.scheduler.abort_request(sample.request.request_id)
                self._samples.pop(sample.request.request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    # ---- the step --------------------------------------------------------------------
    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """One scheduled forward; returns an output for each request it advanced (with
        ``final_only``, for each request it finished: offline callers skip building the rest).
        With async scheduling the outputs are those of the step launched by the previous call,
        and the next step is already running when this returns."""
        if self._sleep_level:
            return []
        if self._in_flight is None:
            self._in_flight = self._launch(self.scheduler.schedule(), previous=None)
            if self._in_flight is None:
                return []
        current, self._in_flight = self._in_flight, None
        if self.async_scheduling and self._can_run_ahead(current):
            hold = self._advance_with_placeholders(current)
            self._in_flight = self._launch(self.scheduler.schedule(hold=hold), previous=current)
        return self._complete(current, final_only)

    def _launch(self, output: SchedulerOutput, previous: _Step | None) -> _Step | None:
        """Queue a scheduled step on the device; chunks whose token is one of ``previous``'s
        samples read it there."""
        if not output.chunks:
            return None
        now = time.time()
        self._max_running_seen = max(self._max_running_seen, len(output.chunks))
        for chunk in output.chunks:
            parent = self._parents[self._samples[chunk.request.request_id].parent_id]
            if parent.metrics.first_scheduled_time is None:
                parent.metrics.first_scheduled_time = now
        feeds: dict[int, int] = {}
        if previous is not None:
            sample_index = {c.request.request_id: i for i, c in enumerate(previous.sampling_chunks)}
            for i, chunk in enumerate(output.chunks):
                if chunk.request.has_placeholder:
                    feeds[i] = sample_index[chunk.request.request_id]
        sampling_chunks = [c for c in output.chunks if c.samples]
        rows = [self._sampling_row(self._samples[c.request.request_id]) for c in sampling_chunks]
        sampled = self.runner.execute(output, rows, feeds, previous.sampled if previous else None)
        return _Step(output, sampling_chunks, rows, sampled)

    def _can_run_ahead(self, step: _Step) -> bool:
        """May the next step be scheduled before this one's tokens are known on the host?"""
        return not any(needs_host_history(row) for row in step.rows) and not any(
            c.request.lora_name is not None for c in step.output.chunks
        )

    def _advance_with_placeholders(self, step: _Step) -> set[str]:
        """Move the scheduler past ``step`` as if its tokens were known (placeholders stand in
        for them). Returns the requests whose placeholder is their last token: hold them."""
        self.scheduler.update_from_output(step.output, {c.request.request_id: PLACEHOLDER_TOKEN for c in step.sampling_chunks})
        step.advanced = True
        hold: set[str] = set()
        for chunk in step.sampling_chunks:
            req = chunk.request
            if req.has_placeholder and (
                req.num_output_tokens >= (req.sampling_params.max_tokens or 0) or req.num_tokens >= self.max_model_len
            ):
                hold.add(req.request_id)
        return hold

    def _complete(self, step: _Step, final_only: bool) -> list[RequestOutput]:
        """Wait for the step's samples, then record them: stops, text, outputs."""
        sampled = step.sampled.result() if step.sampled is not None else None
        if not step.advanced:
            tokens = {c.request.request_id: sampled.token_ids[i] for i, c in enumerate(step.sampling_chunks)} if sampled else {}
            self.scheduler.update_from_output(step.output, tokens)
        now = time.time()
        touched: dict[str, _Parent] = {}
        for i, chunk in enumerate(step.sampling_chunks):
            sample = self._samples.get(chunk.request.request_id)
            if sample is None or sample.request is not chunk.request:
                continue  # finished or aborted since the step was launched
            assert sampled is not None
            if step.advanced:
                chunk.request.fill_placeholder(sampled.token_ids[i])
            parent = self._parents[sample.parent_id]
            touched[parent.request_id] = parent
            self._on_token(sample, sampled.token_ids[i], sampled.logprobs[i], sampled.sampled_logprob[i])
            parent.metrics.first_token_time = parent.metrics.first_token_time or now
            parent.metrics.last_token_time = now
            if parent.pending_fanout:
                parent.pending_fanout = False
                for index in range(1, parent.params.n):
                    self._add_sample(parent, index)
        return [self._finish_output(parent, now) for parent in touched.values() if not final_only or parent.finished]

    def _settle_in_flight(self) -> None:
        """Wait for a step still in flight and drop it (only steps whose requests are all
        gone are left in flight between calls, so nothing is lost)."""
        step, self._in_flight = self._in_flight, None
        if step is not None:
            self._complete(step, final_only=True)

    def _sampling_row(self, sample: _Sample) -> SamplingRow:
        req, row = sample.request, sample.row
        if row is None or row.output_token_ids is not req.output_token_ids or row.params is not req.sampling_params:
            row = sample.row = SamplingRow(
                params=req.sampling_params,
                prompt_token_ids=req.prompt_token_ids,
                output_token_ids=req.output_token_ids,
                generator=sample.generator,
                eos_token_ids=self.eos_token_ids,
                grammar=sample.grammar,
            )
        return row

    def _on_token(
        self, sample: _Sample, token_id: int, logprobs: dict[int, Logprob] | None, logprob: float | None
    ) -> None:
        """Record one sampled token (already appended by the scheduler) and check every stop rule."""
        self._generation_tokens_total += 1
        req, params = sample.request, sample.request.sampling_params
        if logprob is not None:
            sample.cumulative_logprob += logprob
        if sample.logprobs is not None and logprobs is not None:
            for tid, entry in logprobs.items():
                entry.decoded_token = decode_token(self.tokenizer, tid)
            sample.logprobs.append(logprobs)
        past_min = req.num_output_tokens >= params.min_tokens
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
        # The text of an ending EOS or stop token is not part of the answer (as in vLLM).
        matched_stop = sample.detokenizer.add_token(
            token_id, stop_terminated=is_stop_token or is_eos or (grammar_done and token_id in self.eos_token_ids)
        )
        if grammar_done and not is_stop_token:
            self._finish_sample(sample, "stop", None)
        elif is_stop_token:
            self._finish_sample(sample, "stop", token_id)
        elif is_eos:
            self._finish_sample(sample, "stop", None)
        elif matched_stop is not None:
            self._finish_sample(sample, "stop", matched_stop)
        elif req.num_output_tokens >= (params.max_tokens or 0) or req.num_tokens >= self.max_model_len:
            self._finish_sample(sample, "length", None)

    def _finish_sample(self, sample: _Sample, reason: str, stop_reason: int | str | None) -> None:
        sample.finish_reason = reason
        sample.stop_reason = stop_reason
        status = RequestStatus.FINISHED_LENGTH if reason == "length" else RequestStatus.FINISHED_STOPPED
        self.scheduler.finish_request(sample.request.request_id, status)
        self._samples.pop(sample.request.request_id, None)

    def _finish_output(self, parent: _Parent, now: float) -> RequestOutput:
        finished = parent.finished
        if finished:
            parent.metrics.finished_time = now
            del self._parents[parent.request_id]
            if parent.lora_name is not None and self.lora_manager is not None:
                self.lora_manager.release(parent.lora_name)
        outputs = [self._completion(s, i) for i, s in enumerate(parent.samples)]
        first = parent.samples[0]
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            num_cached_tokens=max(first.request.num_cached_tokens, 0) if first else 0,
            metrics=parent.metrics,
        )

    @staticmethod
    def _completion(sample: _Sample | None, index: int) -> CompletionOutput:
        if sample is None:  # a fanned-out sample not started yet
            return CompletionOutput(index=index, text="", token_ids=[])
        return CompletionOutput(
            index=index,
            text=sample.detokenizer.safe_text(finished=sample.finish_reason is not None),
            token_ids=list(sample.request.output_token_ids),
            # Only with logprobs on, as in vLLM V1 (the sampler computes them for those rows only).
            cumulative_logprob=sample.cumulative_logprob if sample.logprobs is not None else None,
            logprobs=sample.logprobs,
            finish_reason=sample.finish_reason,
            stop_reason=sample.stop_reason,
        )

    # ---- state and admin -------------------------------------------------------------
    def get_stats(self) -> EngineStats:
        stats = self.kv_cache_manager.prefix_cache_stats
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_queries=stats.queries,
            prefix_cache_hits=stats.hits,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
            max_num_running_seen=self._max_running_seen,
            **self._lora_stats(),
        )

    # ---- LoRA ------------------------------------------------------------------------
    def _lora(self) -> LoRAManager:
        if self.lora_manager is None:
            raise LoRAError("LoRA is not enabled on this server; start it with --enable-lora")
        return self.lora_manager

    def _acquire_lora(self, lora_name: str) -> None:
        if self.lora_manager is None:
            raise LoRAError(f"The model `{lora_name}` does not exist.", status=404)
        self.lora_manager.acquire(lora_name)

    def read_lora(self, lora_name: str, lora_path: str, *, at_startup: bool = False) -> LoRAAdapter:
        """Read and validate an adapter (any thread; registers nothing). Runtime loads must
        come from --allowed-lora-roots; start-up ones (--lora-modules) are the operator's own."""
        manager = self._lora()
        if lora_name == self.model_name:
            raise LoRAError(f"The lora adapter '{lora_name}' has the base model's name.")
        if not at_startup and not manager.settings.allowed_roots:
            raise LoRAError("Loading LoRA adapters at run time is off: start the server with "
                            "--allowed-lora-roots DIR [DIR ...] to allow adapters from those folders.")
        return manager.read_adapter(lora_name, lora_path)

    def add_lora(self, adapter: LoRAAdapter) -> None:
        """Register an adapter from read_lora (the loop thread)."""
        self._lora().add(adapter)

    def remove_lora(self, lora_name: str) -> bool:
        """Unload an adapter: True when gone now, False when its running requests finish first."""
        return self._lora().remove(lora_name)

    def list_loras(self) -> list[AdapterInfo]:
        """Adapters requests may use (those waiting to unload excluded)."""
        return [] if self.lora_manager is None else self.lora_manager.list_adapters()

    def _lora_stats(self) -> dict[str, object]:
        if self.lora_manager is None:
            return {}
        running = {r.lora_name for r in self.scheduler.running if r.lora_name is not None}
        waiting = {r.lora_name for r in self.scheduler.waiting if r.lora_name is not None}
        return {
            "max_loras": self.lora_manager.settings.max_loras,
            "running_lora_adapters": tuple(sorted(running)),
            "waiting_lora_adapters": tuple(sorted(waiting)),
        }

    def reset_prefix_cache(self) -> bool:
        with self._state_lock:
            return self.kv_cache_manager.reset_prefix_cache()

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
            self._settle_in_flight()  # a last step computed for finished requests may still run
            self.kv_cache_manager.reset_prefix_cache()  # its blocks are about to vanish
            self.runner.release_kv_cache()
            if level == 1:
                self.runner.offload_weights()
            else:
                self.runner.discard_weights()
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
            if "weights" in tags and self._weights_asleep():
                if self._sleep_level == 1:
                    self.runner.onload_weights()
                else:
                    self.runner.reload_weights()
            if "kv_cache" in tags:
                self.runner.restore_kv_cache()
            if not self._weights_asleep() and self.runner.kv_caches:
                self._sleep_level = 0

    def _weights_asleep(self) -> bool:
        first = next(self.runner.model.parameters())
        return first.device != self.device or first.numel() == 0

    def memory_usage(self) -> dict[str, int]:
        return self.runner.memory_usage()


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for, but no CUDA device is available")
    resolved = torch.device(device)
    if resolved.type == "cuda" and resolved.index is None:
        # "cuda" -> "cuda:N": tensors report an indexed device, and device checks compare equal.
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


def _eos_ids(config_eos: int | list[int] | None, tokenizer: object) -> set[int]:
    ids: set[int] = set()
    if isinstance(config_eos, int):
        ids.add(config_eos)
    elif isinstance(config_eos, list):
        ids.update(config_eos)
    tok_eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(tok_eos, int):
        ids.add(tok_eos)
    return ids
