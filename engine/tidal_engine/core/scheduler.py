"""Continuous batching with chunked prefill, prefix caching and preemption by recompute.

One ``schedule()`` call builds one forward pass, under a token budget
(``max_num_batched_tokens``) and a sequence cap (``max_num_seqs``):

1. running requests in the decode phase get their 1 token each, oldest first;
2. running requests still in prefill get their next chunk, oldest first;
3. if nothing was preempted this step, waiting requests are admitted in order (preempted ones
   sit at the front), each with a prefix-cache lookup.

Pooling requests (``Request.is_pooling``: embeddings, scores) go through the same queue and
budgets but are admitted whole and take no KV blocks: their forward writes no cache, so they
cannot be chunked or preempted. The engine finishes them after their one step.

Decodes go before prefill chunks so a long prompt never stalls running generations.
When a running request cannot get blocks, the newest running request (by arrival; never one
held out of the step) is preempted:
its blocks are freed, ``num_computed_tokens`` goes back to 0 and it returns to the front of the
waiting queue, keeping its output tokens (prompt + outputs are recomputed later; the prefix
cache usually makes that cheap). If the request needing blocks is itself the newest, it is the
one preempted.

Decisions:
- Without chunked prefill a prompt is scheduled whole or not at all, and a waiting request that
  doesn't fit blocks the ones behind it (FCFS). ``SchedulerConfig`` rejects
  ``max_num_batched_tokens < max_model_len`` in that mode (vLLM's rule), so any admissible
  prompt fits an empty step.
- ``Scheduler`` raises at construction if the KV cache cannot hold one ``max_model_len``
  sequence, and ``add_request`` rejects prompts longer than ``max_model_len``. With both, the
  oldest running request can always make progress (everything else can be preempted), so the
  scheduler cannot deadlock. Finishing a request that reaches ``max_model_len`` or its
  ``max_tokens`` is the engine's job; the scheduler never schedules a position
  ``>= max_model_len`` (such a request just idles until finished).
- ``num_cached_tokens`` is set when a request is first admitted (its prefix hit then) and
  kept across preemptions.
"""

from __future__ import annotations

import itertools
from bisect import insort
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tidal_engine.core.kv_cache_manager import KVCacheManager, PrefixCacheStats
from tidal_engine.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from tidal_engine.config import EngineConfig
    from tidal_engine.kv_transfer.base import KVConnectorScheduler, KVTransferPlan, KVTransferReport

DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048  # per step, with chunked prefill, on CPU
# On CUDA, as vLLM does on large GPUs: bigger prefill chunks keep the matmuls efficient and cost
# fewer steps, so decodes that share steps with prefills wait less in total.
CUDA_DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192


def default_max_num_batched_tokens(on_cuda: bool, chunked_prefill: bool, max_model_len: int) -> int:
    """vLLM's rule: a fixed budget with chunked prefill, else room for a whole prompt."""
    base = CUDA_DEFAULT_MAX_NUM_BATCHED_TOKENS if on_cuda else DEFAULT_MAX_NUM_BATCHED_TOKENS
    return base if chunked_prefill else max(max_model_len, base)

SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    block_size: int = 16
    # At most this many distinct LoRA adapters in the running batch (the device slots); None: no limit.
    max_loras: int | None = None
    # "fcfs": by arrival. "priority": by (SamplingParams.priority, arrival), lower first, for
    # admission and (reversed) for preemption, as vLLM's --scheduling-policy priority.
    policy: str = "fcfs"

    def __post_init__(self) -> None:
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {self.policy!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}) when chunked prefill is disabled, or long prompts could never run"
            )

    @classmethod
    def from_engine_config(cls, config: EngineConfig, max_model_len: int, on_cuda: bool = False) -> SchedulerConfig:
        """The scheduler's part of the engine config; an unset budget gets vLLM's default."""
        budget = config.max_num_batched_tokens or default_max_num_batched_tokens(
            on_cuda, config.enable_chunked_prefill, max_model_len)
        return cls(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            block_size=config.block_size,
            max_loras=config.max_loras if config.enable_lora else None,
            policy=config.scheduling_policy,
        )

@dataclass
class ScheduledChunk:
    """Tokens ``request.all_token_ids[start : start + num_new_tokens]`` for this step.

    ``request.num_computed_tokens`` is still ``start`` until ``update_from_output``.
    ``samples``: the chunk reaches ``request.num_tokens``, so this step yields a token for it.
    """

    request: Request
    num_new_tokens: int
    block_ids: list[int]
    samples: bool
    draft_token_ids: list[int] = field(default_factory=list)  # the chunk's last tokens are these drafts

    @property
    def start(self) -> int:
        return self.request.num_computed_tokens

    @property
    def token_ids(self) -> list[int]:
        return self.request.all_token_ids[self.start : self.start + self.num_new_tokens]


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_batched_tokens: int = 0
    kv_transfer: KVTransferPlan | None = None  # the KV connector's loads and saves to start

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, kv_cache_manager: KVCacheManager, connector: KVConnectorScheduler | None = None
    ) -> None:
        if kv_cache_manager.block_size != config.block_size:
            raise ValueError(
                f"block_size mismatch: scheduler {config.block_size}, KV cache {kv_cache_manager.block_size}"
            )
        blocks_needed = -(-config.max_model_len // config.block_size)
        if kv_cache_manager.num_blocks < blocks_needed:
            raise ValueError(
                f"the KV cache has {kv_cache_manager.num_blocks} blocks of {config.block_size} tokens, "
                f"fewer than the {blocks_needed} one sequence of max_model_len={config.max_model_len} needs; "
                "lower max_model_len or give the KV cache more memory"
            )
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # kept sorted by _order: oldest (or most urgent) first
        self.num_preemptions = 0
        # KV connector (kv_transfer/): requests whose KV it loads wait here, holding blocks;
        # value: num_computed_tokens once the load is done.
        self.connector = connector
        self.loading: dict[str, tuple[Request, int]] = {}
        self.external_cache_stats = PrefixCacheStats()  # the connector's tier, in tokens
        self.num_prompt_tokens_computed = 0  # prompt tokens scheduled for computation (not hits)
        # (priority, arrival, order of add_request); priority is 0 under fcfs.
        self._order: dict[str, tuple[int, float, int]] = {}
        self._counter = itertools.count()

    # ---- queue management ---------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already scheduled")
        if request.num_tokens == 0:
            raise ValueError("a request needs at least one prompt token")
        if request.num_tokens > self.config.max_model_len:
            raise ValueError(
                f"request {request.request_id!r} has {request.num_tokens} tokens, "
                f"more than max_model_len={self.config.max_model_len}"
            )
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        priority = request.sampling_params.priority if self.config.policy == "priority" else 0
        self._order[request.request_id] = (priority, request.arrival_time, next(self._counter))
        self._enqueue(request)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Remove a request in any state, free its blocks and set its final status."""
        if not status.is_finished:
            raise ValueError(f"{status} is not a finished status")
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self._order.pop(request_id, None)
        if request in self.running:
            self.running.remove(request)
        elif self.loading.pop(request_id, None) is None:
            self.waiting.remove(request)
        if self.connector is not None:
            self.connector.request_finished(request)  # its in-flight copies keep their blocks held
        self.kv_cache_manager.free(request)
        request.status = status
        return request

    def abort_request(self, request_id: str) -> Request | None:
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.loading)

    def has_pending_transfers(self) -> bool:
        return self.connector is not None and self.connector.has_pending()

    # ---- one step -----------------------------------------------------------------------
    def schedule(self, hold: Collection[str] = ()) -> SchedulerOutput:
        """Build the next step. Running requests named in ``hold`` sit it out and are not
        preempted in it (async scheduling holds those whose in-flight token is their last;
        pipeline parallelism those in a batch still in flight, whose blocks it is writing)."""
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, ScheduledChunk] = {}  # insertion order = batch order
        preempted: list[Request] = []

        def preempt_newest() -> Request:
            nonlocal budget
            index = len(self.running) - 1
            while self.running[index].request_id in hold:  # stops at the request asking, never held
                index -= 1
            victim = self.running.pop(index)
            chunk = scheduled.pop(victim.request_id, None)
            if chunk is not None:  # give back what it was granted earlier in this step
                budget += chunk.num_new_tokens
            self._preempt(victim)
            preempted.append(victim)
            return victim

        # Phase 1: decodes; phase 2: prefill chunks of running requests. Snapshots, because
        # preemption removes requests from self.running while we iterate.
        active = [r for r in self.running if r.request_id not in hold] if hold else self.running
        decodes = [r for r in active if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in active if r.num_tokens - r.num_computed_tokens > 1]
        for request in decodes + prefills:
            if budget == 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            num_new = self._num_new_tokens(request, budget)
            if num_new == 0:
                continue
            drafts: list[int] = []
            ahead = request.num_lookahead_tokens  # in-flight drafts the device may have accepted
            if request.spec_token_ids and num_new == 1 and request.num_tokens - request.num_computed_tokens == 1:
                # Drafts ride as extra query tokens of the decode row (clipped to budget and context).
                room = min(budget, self.config.max_model_len - request.num_computed_tokens - ahead) - 1
                drafts = request.spec_token_ids[: max(0, room)]
                num_new += len(drafts)
            request.spec_token_ids = []
            if ahead and not drafts:
                # Its position waits on the device for the in-flight step's accepted count,
                # which only draft rows apply: it sits out until that step's tokens are in.
                continue
            while True:
                block_ids = self.kv_cache_manager.allocate_slots(request, num_new + ahead)
                if block_ids is not None:
                    break
                if preempt_newest() is request:
                    break
            if block_ids is None:
                # It was the newest itself. Older running requests later in the list (prefills
                # come after decodes) may still fit, so keep going rather than stop.
                continue
            chunk = self._chunk(request, num_new - len(drafts), block_ids)
            chunk.num_new_tokens, chunk.draft_token_ids = num_new, drafts
            scheduled[request.request_id] = chunk
            budget -= num_new

        # Phase 3: admissions. Skipped after a preemption so the victim isn't readmitted at
        # once and the cache gets a step to drain.
        # A request whose adapter would exceed max_loras is skipped (it keeps its place in the
        # queue), so requests for adapters already running, or for the base model, still go.
        adapters = {r.lora_name for r in self.running if r.lora_name is not None}
        adapters |= {r.lora_name for r, _ in self.loading.values() if r.lora_name is not None}
        skipped: list[Request] = []
        # No running request computes in this step: a load may carry its request's tail into
        # it (the forward waits for the load on the device; nobody else waits with it).
        fuse_loads = not scheduled and self.connector is not None and self.connector.fuses_loads
        while not preempted and self.waiting and budget > 0 \
                and len(self.running) + len(self.loading) < self.config.max_num_seqs:
            request = self.waiting[0]
            lora = request.lora_name
            if lora is not None and lora not in adapters and self.config.max_loras is not None \
                    and len(adapters) >= self.config.max_loras:
                skipped.append(self.waiting.popleft())
                continue
            if request.is_pooling:
                # A pooling forward keeps no KV: its whole prompt goes in one step (never
                # chunked, FCFS) and takes no blocks and no prefix-cache lookup.
                if request.num_tokens > budget:
                    break
                num_hit, num_new, block_ids = 0, request.num_tokens, []
            else:
                computed_blocks, num_hit = self.kv_cache_manager.get_computed_blocks(request)
                if self.connector is not None and not request.skips_prefix_cache:
                    loaded = self._start_load(request, computed_blocks, num_hit, budget if fuse_loads else 0)
                    if loaded is not None:
                        if isinstance(loaded, ScheduledChunk):
                            scheduled[request.request_id] = loaded
                            budget -= loaded.num_new_tokens
                        if lora is not None:
                            adapters.add(lora)
                        continue
                num_new = request.num_tokens - num_hit  # >= 1: a hit never covers the last token
                if num_new > budget:
                    if not self.config.enable_chunked_prefill:
                        break  # whole prompts only; FCFS, so the queue waits behind it
                    num_new = budget
                block_ids = self.kv_cache_manager.allocate_slots(request, num_new, computed_blocks)
                if block_ids is None:
                    break  # no room; retry next step, after running requests have moved on
            self.waiting.popleft()
            if self.connector is not None:
                self._count_external(request, num_hit, 0)
            request.num_computed_tokens = num_hit
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            request.status = RequestStatus.RUNNING
            insort(self.running, request, key=lambda r: self._order[r.request_id])
            scheduled[request.request_id] = self._chunk(request, num_new, block_ids)
            budget -= num_new
            if lora is not None:
                adapters.add(lora)
        self.waiting.extendleft(reversed(skipped))

        chunks = list(scheduled.values())
        for c in chunks:
            self.num_prompt_tokens_computed += max(0, min(c.start + c.num_new_tokens, c.request.num_prompt_tokens) - c.start)
        return SchedulerOutput(
            chunks=chunks,
            preempted=preempted,
            num_batched_tokens=sum(c.num_new_tokens for c in chunks),
            kv_transfer=self.connector.build_plan() if self.connector is not None else None,
        )

    # ---- KV connector ---------------------------------------------------------------------
    def _start_load(
        self, request: Request, computed_blocks: list, num_hit: int, fuse_budget: int
    ) -> ScheduledChunk | bool | None:
        """Start loading ``request``'s blocks past its device hit if the connector has them:
        allocate them and start the load. None: nothing to load (or no room yet: then the
        normal admission finds no room either and waits).

        With ``fuse_budget`` > 0 (a step with no other work, a connector that fuses loads)
        the tail is allocated and scheduled in this same step, ordered after the load on the
        device: returns its chunk. Otherwise (or with no room for the tail) the request waits
        in WAITING_FOR_REMOTE_KV for the load's report: returns True."""
        assert self.connector is not None
        num_external = self.connector.num_matched_tokens(request, num_hit)
        bs = self.config.block_size
        num_external = min(num_external, (request.num_tokens - 1) // bs * bs - num_hit)  # compute >= 1 token
        if num_external <= 0:
            self.connector.match_dropped(request)
            return None
        block_ids = self.kv_cache_manager.allocate_slots(request, num_external, computed_blocks)
        if block_ids is None:
            self.connector.match_dropped(request)
            return None
        self.waiting.popleft()
        self._count_external(request, num_hit, num_external)
        first, end = num_hit // bs, (num_hit + num_external) // bs
        target = num_hit + num_external
        chunk = self._fused_tail(request, target, fuse_budget) if fuse_budget > 0 else None
        self.connector.start_load(request, block_ids[first:end], request.block_hashes[first:end],
                                  before_forward=chunk is not None)
        if chunk is not None:
            return chunk
        request.num_computed_tokens = num_hit
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.loading[request.request_id] = (request, target)
        return True

    def _fused_tail(self, request: Request, target: int, budget: int) -> ScheduledChunk | None:
        """Run ``request`` from ``target`` (its load's end) in this step, if its tail fits."""
        num_new = request.num_tokens - target
        if num_new > budget:
            if not self.config.enable_chunked_prefill:
                return None
            num_new = budget
        request.num_computed_tokens = target
        block_ids = self.kv_cache_manager.allocate_slots(request, num_new)
        if block_ids is None:
            return None  # the caller resets num_computed_tokens and waits for the load
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = target
        request.status = RequestStatus.RUNNING
        insort(self.running, request, key=lambda r: self._order[r.request_id])
        return self._chunk(request, num_new, block_ids)

    def _count_external(self, request: Request, num_hit: int, num_external: int) -> None:
        stats = self.external_cache_stats
        stats.requests += 1
        stats.queries += request.num_tokens - num_hit  # what the device tier missed
        stats.hits += num_external

    def update_from_kv_transfer(self, report: KVTransferReport) -> None:
        """A worker's transfer report: loaded requests run from the loaded position, failed
        ones recompute from their device hit (their blocks are already allocated)."""
        if self.connector is None or report.is_empty:
            return
        loaded, failed = self.connector.on_report(report)
        for request_id in loaded + failed:
            entry = self.loading.pop(request_id, None)
            if entry is None:
                if request_id in failed and request_id in self.requests:  # it computed on that KV
                    raise RuntimeError(f"the KV connector failed request {request_id!r}'s load after its "
                                       "tail was computed on it (a connector that fuses loads must not fail them)")
                continue  # finished since, or its load was fused with its tail
            request, target = entry
            if request_id in loaded:
                request.num_computed_tokens = target
                self.kv_cache_manager.cache_full_blocks(request)  # the loaded blocks now hit on the device
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = request.num_computed_tokens
            request.status = RequestStatus.RUNNING
            insort(self.running, request, key=lambda r: self._order[r.request_id])

    def update_from_output(self, output: SchedulerOutput, sampled: dict[str, int] | dict[str, list[int]]) -> list[Request]:
        """Advance each scheduled request by its chunk, append sampled tokens, cache full blocks.

        ``sampled`` maps request_id to the token drawn for chunks with ``samples`` set.
        Returns the requests that received a token. Requests finished or aborted since
        ``schedule()`` are skipped.
        """
        got_token: list[Request] = []
        for chunk in output.chunks:
            request = chunk.request
            if request.status != RequestStatus.RUNNING or self.requests.get(request.request_id) is not request:
                continue
            got = sampled.get(request.request_id) if chunk.samples else None
            if isinstance(got, list):
                # Verified drafts: only the accepted ones count as computed; the KV of rejected
                # ones sits past num_computed_tokens and is overwritten (never hashed or cached).
                request.num_computed_tokens += chunk.num_new_tokens - len(chunk.draft_token_ids) + len(got) - 1
                for token_id in got:
                    request.append_output_token(token_id)
                got_token.append(request)
            else:
                request.num_computed_tokens += chunk.num_new_tokens - len(chunk.draft_token_ids)
                if got is not None:
                    request.append_output_token(got)
                    got_token.append(request)
            new_full = self.kv_cache_manager.cache_full_blocks(request)
            if new_full and self.connector is not None:
                self.connector.blocks_computed(request, new_full)
        return got_token

    # ---- helpers ------------------------------------------------------------------------
    def _num_new_tokens(self, request: Request, budget: int) -> int:
        num_new = request.num_tokens - request.num_computed_tokens
        # A running request is only mid-prefill with chunking on, so clipping to the budget
        # is a chunk split; without chunking num_new is 1 here.
        num_new = min(num_new, budget)
        # Never write KV past the model's context; the engine finishes such a request.
        return max(0, min(num_new, self.config.max_model_len - request.num_computed_tokens))

    def _chunk(self, request: Request, num_new: int, block_ids: list[int]) -> ScheduledChunk:
        samples = not request.is_pooling and request.num_computed_tokens + num_new == request.num_tokens
        return ScheduledChunk(request=request, num_new_tokens=num_new, block_ids=block_ids, samples=samples)

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        if self.config.policy == "priority":
            self._enqueue(request)
        else:
            self.waiting.appendleft(request)  # FCFS: the victim resumes first

    def _enqueue(self, request: Request) -> None:
        if self.config.policy == "priority":
            insort(self.waiting, request, key=lambda r: self._order[r.request_id])
        else:
            self.waiting.append(request)
