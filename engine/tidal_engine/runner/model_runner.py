"""The model runner: one forward pass over a flat batch, taken from the persistent batch.

It owns the model weights, the paged KV cache, the attention backend, the CUDA graphs,
the LoRA slots, the sampler and the persistent batch (runner/persistent_batch.py: each
live request's tokens and block table in a row of arrays kept between steps). The worker
(worker/worker.py) applies the engine core's per-step diffs to the persistent batch and
hands the runner a ``StepInput`` (rows, first positions, token counts, which sample); the
runner gathers the inputs from the batch with numpy, ships them in one packed upload,
builds the attention metadata and samples one token for every sampling sequence.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from tidal_engine.config import EngineConfig
from tidal_engine.distributed.parallel_state import get_parallel
from tidal_engine.kernels.compile_ahead import (
    CompileAhead,
    device_thread_setup,
    prepare_triton,
    prepare_triton_in_background,
)
from tidal_engine.kernels.compile_cache import triton_cache_filled, use_cache_dir
from tidal_engine.layers.attention import AttentionBackend, AttentionMetadata, TorchAttentionBackend, set_attention_backend
from tidal_engine.layers.kv_cache_dtype import kv_cache_torch_dtype
from tidal_engine.lora.manager import create_lora_manager
from tidal_engine.models.loader import ModelSource, fill_weights, load_model
from tidal_engine.runner.cuda_graphs import DecodeGraphs, specialization_sizes
from tidal_engine.runner.cuda_vmm import VmmRange
from tidal_engine.runner.input_buffers import (
    PinnedStaging,
    StepInput,
    StepLayout,
    bucket_for,
    default_mixed_token_sizes,
    fill_step,
    normalize_capture_sizes,
    plan_step,
)
from tidal_engine.runner.memory_budget import (
    GraphShapes,
    ProfiledMemory,
    activation_bytes_per_token,
    check_free_memory,
    graph_pool_bytes,
    kv_cache_budget,
)
from tidal_engine.runner.mixed_graphs import MixedGraphs, VerifyGraphs
from tidal_engine.runner.persistent_batch import PersistentBatch
from tidal_engine.runner.prompt_logprobs import PromptLogprobsJob
from tidal_engine.runner.startup_clock import StartupClock
from tidal_engine.runner.weight_store import WeightStore, pack_offsets

if TYPE_CHECKING:  # the sampler's module is imported lazily (see default_sampler)
    from tidal_engine.runner.sampler import SampledTokens
    from tidal_engine.spec_decode.draft_model import DraftModel

# (vocab_size, max_num_seqs, device) -> a sampler with the runner/sampler.py interface.
SamplerFactory = Callable[[int, int, torch.device], Any]


def default_sampler(vocab_size: int, max_num_seqs: int, device: torch.device) -> Any:
    from tidal_engine.runner.sampler import Sampler

    return Sampler(vocab_size, max_num_seqs, device)


logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_BYTES = 1 << 30  # 1 GiB: enough for tens of thousands of tokens of a small model


@dataclass
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    query_group: int = 1  # query heads per KV head on this rank

    @property
    def bytes_per_block(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element


def kv_cache_spec(model: Any, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
    """The KV cache of this rank: its pipeline stage's layers, its tensor shard's KV heads."""
    attn = model.layers[model.start_layer].self_attn
    return KVCacheSpec(
        num_layers=model.num_local_layers,
        num_kv_heads=attn.num_kv_heads,
        head_dim=attn.head_dim,
        block_size=block_size,
        dtype=dtype,
        query_group=attn.num_heads // attn.num_kv_heads,
    )


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        source: ModelSource,
        device: torch.device,
        dtype: torch.dtype,
        sampler_factory: SamplerFactory | None = None,
    ) -> None:
        self.config = config
        self.source = source
        self.device = device
        self.dtype = dtype
        self.arch = source.arch_config
        # Triton's compiled kernels and the one-row-linear choices persist here (kernels/compile_cache.py).
        self.cache_dir = use_cache_dir(getattr(config, "cache_dir", None))
        self.max_model_len = config.max_model_len or self.arch.max_position_embeddings
        self.cuda_graph_sizes = normalize_capture_sizes(config.cuda_graph_sizes, config.max_num_seqs)
        # What the engine may use of the device (gpu_memory_utilization, runner/memory_budget.py):
        # free memory is read before anything of ours is on the device.
        clock = StartupClock(device)
        self._free_before_load = self._check_device_memory()
        clock.mark("device_init")  # the CUDA context, when this is the process's first use of the device
        # Triton's one-off cache key, computed while the weights load (kernels/compile_ahead.py).
        triton_setup = prepare_triton_in_background() if device.type == "cuda" else None
        self.model = load_model(source, dtype, device, getattr(config, "load_format", "auto"),
                                getattr(config, "quantization", None))
        clock.mark("load_weights")
        if triton_setup is not None:
            triton_setup.join()
            clock.mark("triton_setup")
        self.backend = choose_attention_backend(device)
        set_attention_backend(self.model, self.backend)
        # Multi-LoRA: adapter slots and hooks on the linears; None unless enable_lora.
        self.lora_manager = create_lora_manager(self.model, self.arch, config)
        # The parameters as views into one flat buffer: sleep and wake are one copy each way;
        # with sleep mode on CUDA its addresses (and the KV cache's) survive sleep, so the
        # CUDA graphs are kept (runner/weight_store.py, runner/cuda_vmm.py).
        self.weights = WeightStore(self.model, device, fixed_addresses=config.enable_sleep_mode)
        clock.mark("weight_store")
        self._kv_range: VmmRange | None = None
        self._kv_resident = False
        # The cache's storage dtype: the model's, or fp8 (half the bytes, so twice the blocks).
        self.kv_dtype = kv_cache_torch_dtype(getattr(config, "kv_cache_dtype", "auto"), dtype)
        self.kv_spec = kv_cache_spec(self.model, config.block_size, self.kv_dtype)
        self.sampler = (sampler_factory or default_sampler)(self.arch.vocab_size, config.max_num_seqs, device)
        self.staging = PinnedStaging(device)
        # Every live request's row: tokens, block table (mirrored on the device), last sample.
        self.batch = PersistentBatch(config.max_num_seqs, self.max_model_len, config.block_size, device)
        self._use_device_drafts()
        self.graphs: DecodeGraphs | None = None
        self.mixed_graphs: MixedGraphs | None = None
        self.verify_graphs: VerifyGraphs | None = None  # speculative decoding's verify steps
        self._gemv_choices: dict = {}  # (N, K, dtype, bias) → GEMV config or None (cuBLAS)
        self.gemv_step_timings: dict[str, dict[str, float]] = {}  # shape → candidate → step seconds (start-up)
        clock.mark("sampler_and_buffers")
        self.compile_ahead_report: dict[str, Any] = {}
        self._compile_ahead()
        clock.mark("compile_ahead")
        self._choose_one_row_linears()
        clock.mark("one_row_linear_choice")
        self._warm_up_kernels()
        clock.mark("kernel_warm_up")
        self.memory_report: dict[str, Any] = {}
        self.num_blocks = self._decide_num_blocks()
        clock.mark("memory_profile")
        self.kv_caches: list[torch.Tensor] = self._allocate_kv_caches()
        clock.mark("kv_cache")
        self.capture_cuda_graphs()
        clock.mark("cuda_graphs")
        self._report_footprint()
        self.startup_seconds = clock.seconds
        clock.log()
        self._prepare_sleep()

    def _prepare_sleep(self) -> None:
        """With sleep mode on a GPU, lock the level-1 host buffer now, off the request path: the
        first sleep then only copies (runner/host_buffer.py). It holds the weights' size of host
        memory from here on, as every sleep after the first would anyway."""
        if self.config.enable_sleep_mode and self.device.type == "cuda":
            self.weights.prepare_host_buffer()

    # ---- KV cache sizing -------------------------------------------------------------
    def _decide_num_blocks(self) -> int:
        if self.config.num_gpu_blocks_override is not None:
            return self.config.num_gpu_blocks_override
        per_block = self.kv_bytes_per_block
        if self.config.kv_cache_memory_bytes is not None:
            budget = self.config.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            budget = self._profile_cuda_budget()
        else:
            budget = CPU_DEFAULT_KV_BYTES
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(
                f"the KV cache budget ({budget} bytes) is smaller than one block ({per_block} bytes)"
            )
        return int(num_blocks)

    @property
    def kv_bytes_per_block(self) -> int:
        """What one KV block id costs: the target's layers, plus the draft model's (its KV shares
        the block ids, spec_decode/draft_model.py)."""
        draft = self.draft.bytes_per_block if self.draft is not None else 0
        return self.kv_spec.bytes_per_block + draft

    def _budget_from_utilization(self) -> bool:
        c = self.config
        return self.device.type == "cuda" and c.num_gpu_blocks_override is None and c.kv_cache_memory_bytes is None

    def _check_device_memory(self) -> int | None:
        """Free device memory before the engine loads anything; refuses to start when it is
        below ``gpu_memory_utilization × total``. None when the KV cache is not sized from it."""
        if not self._budget_from_utilization():
            return None
        torch.cuda.init()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        check_free_memory(free, total, self.config.gpu_memory_utilization)
        return free

    def _profile_cuda_budget(self) -> int:
        """Run the largest step (``max_num_batched_tokens``, logits and sampling for
        ``max_num_seqs`` rows) and give the KV cache what the utilisation target leaves after
        the weights, that step's activations, the memory outside torch and the CUDA graphs."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        resident = torch.cuda.memory_allocated(self.device)  # weights, sampler, persistent batch
        num_tokens = self.config.max_num_batched_tokens or 2048
        scratch = self._dummy_forward(num_tokens, sample=True)
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        assert self._free_before_load is not None
        profile = ProfiledMemory(
            total=total,
            free_before_load=self._free_before_load,
            free_after_profile=free,
            torch_peak=torch.cuda.max_memory_allocated(self.device),
            torch_reserved=torch.cuda.memory_reserved(self.device),
            scratch_bytes=scratch,
        )
        graph_reserve = 0
        if self._graphs_wanted():
            per_token = activation_bytes_per_token(profile, resident, num_tokens)
            graph_reserve = graph_pool_bytes(self._graph_shapes(), per_token)
        budget = kv_cache_budget(profile, self.config.gpu_memory_utilization, graph_reserve)
        self.memory_report.update(
            total_bytes=total, requested_bytes=budget.requested,
            weights_and_activations_bytes=budget.weights_and_activations, non_torch_bytes=budget.non_torch,
            graph_reserve_bytes=graph_reserve, kv_cache_budget_bytes=budget.kv_cache, profiled_tokens=num_tokens,
        )
        logger.info("%s", budget.describe())
        torch.cuda.empty_cache()  # the profiling step's activations go back before the KV cache is allocated
        return budget.kv_cache

    def _graph_shapes(self) -> GraphShapes:
        mixed = self.config.mixed_cuda_graphs and get_parallel().pp_size == 1
        token_sizes = default_mixed_token_sizes(self.config.max_num_batched_tokens or 2048) if mixed else []
        return GraphShapes(
            decode_sizes=list(self.cuda_graph_sizes),
            # The verify graphs' [B * (k + 1), hidden] outputs, in the mixed graphs' pool when both exist.
            mixed_token_sizes=token_sizes + self._verify_token_sizes(),
            vocab_size=self.arch.vocab_size,
            hidden_size=self.arch.hidden_size,
            dtype_bytes=torch.empty((), dtype=self.dtype).element_size(),
            max_blocks_per_seq=-(-self.max_model_len // self.config.block_size),
            max_num_seqs=self.config.max_num_seqs,
        )

    def _report_footprint(self) -> None:
        """Log what the engine holds on the device against its share (CUDA, utilisation budget)."""
        if self._free_before_load is None:
            return
        torch.cuda.synchronize(self.device)
        free, _total = torch.cuda.mem_get_info(self.device)
        used = self._free_before_load - free
        self.memory_report["engine_used_bytes"] = used
        requested = self.memory_report.get("requested_bytes", 0)
        logger.info("device memory held by the engine: %.2f GiB of its %.2f GiB share", used / 2**30, requested / 2**30)
        if used > requested:
            logger.warning("the engine holds %.2f GiB, over its gpu_memory_utilization share by %.2f GiB",
                           used / 2**30, (used - requested) / 2**30)

    def _dummy_forward(self, num_tokens: int, sample: bool = False) -> int:
        """One prefill of ``num_tokens`` tokens over a throwaway one-block-per-16-tokens cache;
        ``sample``: also the logits and a sampling pass for as many rows as a step can sample.
        Returns the throwaway cache's bytes."""
        bs = self.config.block_size
        num_blocks = (num_tokens + bs - 1) // bs
        caches = [
            torch.zeros(2, num_blocks, bs, self.kv_spec.num_kv_heads, self.kv_spec.head_dim, dtype=self.kv_dtype,
                        device=self.device)
            for _ in range(self.kv_spec.num_layers)
        ]
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(num_tokens, device=self.device)
        meta = AttentionMetadata(
            slot_mapping=positions.clone(),
            # int64 like the real steps' metadata (the kernels are compiled per pointer dtype)
            query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int64, device=self.device),
            seq_lens=torch.tensor([num_tokens], dtype=torch.int64, device=self.device),
            block_tables=torch.arange(num_blocks, dtype=torch.int64, device=self.device)[None],
            max_query_len=num_tokens,
            max_seq_len=num_tokens,
            query_start_loc_cpu=[0, num_tokens],
            seq_lens_cpu=[num_tokens],
        )
        with torch.inference_mode():
            intermediate = None
            if not self.model.is_first_stage:  # a stand-in for the previous stage's activations
                zeros = torch.zeros(num_tokens, self.arch.hidden_size, dtype=self.dtype, device=self.device)
                intermediate = (zeros, zeros.clone())
            hidden = self.model(ids, positions, caches, meta, intermediate)
            if self.model.is_last_stage:
                rows = min(num_tokens, self.config.max_num_seqs) if sample else 1
                logits = self.model.compute_logits(hidden[-rows:])
                if sample:
                    self._dummy_sample(logits)
        scratch = sum(c.numel() * c.element_size() for c in caches)
        del caches, hidden
        return scratch

    def _dummy_sample(self, logits: torch.Tensor) -> None:
        """Sample every row with the options that need the most scratch (top-k/top-p,
        penalties, logprobs), so the sampler's peak is part of the profile."""
        sampler = self.sampler
        if not hasattr(sampler, "add_request"):
            return
        from tidal_engine.executor.plan import SamplingOptions

        options = SamplingOptions(temperature=0.8, top_k=50, top_p=0.95, min_p=0.05, repetition_penalty=1.1,
                                  presence_penalty=0.1, frequency_penalty=0.1, logprobs=20)
        ids = [f"_profile{i}" for i in range(logits.shape[0])]
        for rid in ids:
            sampler.add_request(rid, options, [0])
        try:
            sampler.sample(logits, ids).result()
        finally:
            for rid in ids:
                sampler.remove_request(rid)

    def _uses_triton(self) -> bool:
        return self.device.type == "cuda" and getattr(self.backend, "name", "") == "triton"

    def _warm_up_token_counts(self) -> list[int]:
        """The attention kernel's tile variants (16, 32, 64 rows) and a larger prefill."""
        group = max(1, self.kv_spec.query_group)
        return sorted({1, max(1, 32 // group), max(1, 64 // group), 256})

    def _warm_up_kernels(self) -> None:
        """Compile the attention kernel's tile variants (16, 32, 64 rows) now, not mid-run:
        a first prefix-cache hit or a short chunk would otherwise wait for Triton's JIT."""
        if not self._uses_triton():
            return
        for num_tokens in self._warm_up_token_counts():
            self._dummy_forward(num_tokens)
        torch.cuda.synchronize(self.device)

    def _compile_ahead(self) -> None:
        """On a cold start (nothing in Triton's cache yet), compile the kernels the next phases
        meet (the GEMV tiles to time, the warm-up and profiling forwards, decode steps of a few
        batch sizes) in parallel, from dry runs of those phases (kernels/compile_ahead.py); they
        then find every kernel compiled. The kernels are the same, only compiled sooner. A warm
        cache skips this: loading a kernel costs milliseconds."""
        if not self._uses_triton() or not CompileAhead.enabled or triton_cache_filled():
            return
        from tidal_engine.kernels.gemv_choice import is_device_fault

        prepare_triton()
        ahead = CompileAhead(thread_setup=device_thread_setup(self.device))
        try:
            with ahead.dry_run():
                if self._gemv_choice_applies():
                    from tidal_engine.kernels.gemv_choice import launch_candidates

                    self._load_gemv_choices()
                    launch_candidates(self.model, self._gemv_choices, few_rows=self._few_row_linears_wanted())
                for num_tokens in [*self._warm_up_token_counts(), self.config.max_num_batched_tokens or 2048]:
                    self._dummy_forward(num_tokens)
                self._dry_decode_steps()
        except Exception as exc:  # the phases themselves then compile as before
            if is_device_fault(exc):
                raise
            logger.warning("compiling ahead stopped: %s", exc)
        finally:
            ahead.close()
        self.compile_ahead_report = {"kernels": ahead.submitted, "failed": ahead.failed, "threads": ahead.workers,
                                     "wait_s": ahead.wait_seconds}
        logger.info("compiled %d kernel specializations ahead on %d threads (%d failed)",
                    ahead.submitted, ahead.workers, ahead.failed)

    def _dry_decode_steps(self) -> None:
        """Decode forwards as the CUDA graphs capture them, for batch sizes of each kind Triton
        specializes on (1, a multiple of 16, neither) and the largest, over throwaway one-block
        caches (a dry run launches no kernel, so nothing reads them)."""
        if not self._graphs_wanted():
            return
        wanted = specialization_sizes(self.cuda_graph_sizes)
        graphs = self._throwaway_decode_graphs(wanted)
        for b in wanted:
            graphs.run_eager(b)

    def _throwaway_decode_graphs(self, sizes: list[int]) -> DecodeGraphs:
        """Decode graphs over one-block caches of their own (the dummy inputs write no KV and
        read block 0 only), for dry runs and start-up timings before the real cache exists."""
        shape = (2, 1, self.config.block_size, self.kv_spec.num_kv_heads, self.kv_spec.head_dim)
        caches = [torch.zeros(shape, dtype=self.kv_dtype, device=self.device) for _ in range(self.kv_spec.num_layers)]
        max_blocks = -(-self.max_model_len // self.config.block_size)
        return DecodeGraphs(self.model, caches, sizes, max_blocks, self.device)

    def _gemv_choice_applies(self) -> bool:
        if not self._uses_triton() or self.lora_manager is not None:
            return False
        from tidal_engine.kernels.fused import fused_kernels_enabled
        from tidal_engine.kernels.gemv_choice import gemv_wanted

        return fused_kernels_enabled() and gemv_wanted(self.dtype)

    def _few_row_linears_wanted(self) -> bool:
        """The few-row GEMV tiles are timed (three more row buckets per shape, ~2 s of an 8B cold
        start on the H200) only where steps of a few rows are the rule: speculative decoding's
        verify steps, k + 1 rows per request. Plain 2–8-row decode batches keep cuBLAS, 0–9% slower
        per linear there (8B shapes, benchmarks/results/h200-2026-12-01c-spec), a trade for the
        cold start (h200-2026-12-01d-lead)."""
        return self._num_speculative_tokens() > 0

    def _load_gemv_choices(self) -> None:
        """The choices stored on this node, once (a second engine on the node times nothing)."""
        if self._gemv_choices:
            return
        from tidal_engine.kernels.gemv_choice import choices_file, load_choices
        from tidal_engine.kernels.triton.gemv import GEMV_CONFIGS

        self._gemv_choices.update(load_choices(choices_file(self.cache_dir), GEMV_CONFIGS))

    def _choose_one_row_linears(self) -> None:
        """Time cuBLAS against the Triton GEMV for each weight shape at one input row (the
        single-stream decode step) and route each Linear to the faster (kernels/gemv_choice.py)."""
        if self._gemv_choice_applies():
            from tidal_engine.kernels.gemv_choice import choices_file, choose_gemv, save_choices

            disk = choices_file(self.cache_dir)
            self._load_gemv_choices()
            known = len(self._gemv_choices)
            shortlists: dict = {}
            counts = choose_gemv(self.model, self._gemv_choices, few_rows=self._few_row_linears_wanted(),
                                 shortlists=shortlists)
            self._refine_choices_in_step(shortlists)
            if len(self._gemv_choices) > known:
                save_choices(disk, self._gemv_choices)
            logger.info("one-row linears: %d on the Triton GEMV, %d on cuBLAS", counts["gemv"], counts["cublas"])

    def _refine_choices_in_step(self, shortlists: dict) -> None:
        """One-row tiles chosen by the batch-1 decode step's time among the isolated timings'
        shortlist (kernels/gemv_step_choice.py); only shapes timed now, so a start
        with the choices on disk does none of it. One process only: ranks timing different
        candidates would stall each other's collectives."""
        if not shortlists or not self._graphs_wanted() or get_parallel().world_size > 1:
            return
        from tidal_engine.kernels.gemv_step_choice import refine_in_step

        graphs = self._throwaway_decode_graphs([1])
        # Compiles the step's kernels outside a capture (the start-up's warm-up then finds them);
        # every candidate already ran eagerly while timed alone (kernels/gemv_choice.py).
        graphs.run_eager(1)
        self.gemv_step_timings = refine_in_step(shortlists, self._gemv_choices,
                                                lambda setups: graphs.compare_steps(1, setups))

    def _allocate_kv_caches(self) -> list[torch.Tensor]:
        """One cache per layer. With sleep mode on CUDA they are views into one fixed-address
        range whose memory sleep gives back and wake maps again at the same addresses."""
        shape = (2, self.num_blocks, self.config.block_size, self.kv_spec.num_kv_heads, self.kv_spec.head_dim)
        self._kv_resident = True
        if self.draft is not None:
            self.draft.allocate(self.num_blocks)
        if self.config.enable_sleep_mode and self.device.type == "cuda":
            layer_bytes = self.num_blocks * self.kv_spec.bytes_per_block // self.kv_spec.num_layers
            offsets, total = pack_offsets([layer_bytes] * self.kv_spec.num_layers)
            self._kv_range = VmmRange.create(total, self.device)
            if self._kv_range is not None:
                flat = self._kv_range.tensor
                caches = [flat[o: o + layer_bytes].view(self.kv_dtype).view(shape) for o in offsets]
                for cache in caches:
                    cache.zero_()
                return caches
        return [torch.zeros(shape, dtype=self.kv_dtype, device=self.device) for _ in range(self.kv_spec.num_layers)]

    # ---- one step ----------------------------------------------------------------------
    def _graph_bucket(self, step: StepInput, width: int) -> int | None:
        """The CUDA-graph bucket for this step, or None to run it eagerly."""
        if self.graphs is None or int(step.q_lens.max()) != 1:
            return None
        if width > self.graphs.max_blocks_per_seq:
            return None
        return bucket_for(int(step.rows.shape[0]), self.graphs.sizes)

    def _mixed_bucket(self, step: StepInput, width: int) -> int | None:
        """The mixed-step graph (token bucket) for a step no decode graph takes, or None."""
        if self.mixed_graphs is None:
            return None
        return self.mixed_graphs.bucket(int(step.q_lens.sum()), int(step.rows.shape[0]), width)

    def _stage(
        self, step: StepInput, width: int, pad_to: int | None, pad_tokens_to: int | None = None,
        feed: bool = True,
    ) -> tuple[StepLayout, torch.Tensor]:
        """Pack the step into a pinned buffer and start its (async) copy to the device; then,
        on the device, apply the block-table changes to the persistent table and feed the
        chunks whose last token is still only on the device (``feed``: in the staged buffer;
        else the caller does, as ``DecodeGraphs.replay_fed``)."""
        batch = self.batch
        bt_index, bt_value = batch.take_block_updates()
        layout = plan_step(step, width, pad_to, pad_tokens_to, num_bt_updates=int(bt_index.shape[0]))
        buf = self.staging.host_buffer(layout.total)
        fill_step(buf, layout, step, batch.token_ids, batch.block_table, self.config.block_size, bt_index, bt_value)
        staged = self.staging.upload(layout.total)
        off = layout.offsets()
        if layout.num_bt_updates:
            (ia, ib), (va, vb) = off["bt_index"], off["bt_value"]
            batch.apply_block_updates(staged[ia:ib], staged[va:vb])
        if layout.num_feeds and feed:
            _feed_input_ids(staged, layout, batch.last_sampled_dev)
            if batch.device_drafts is not None:
                self._shift_fed_rows(layout, staged)
        if batch.device_drafts is not None:  # bounds the histories the proposer reads after the step
            self._history_width = int(batch.num_tokens[step.rows].max()) + 2 * (batch.device_drafts.k + 1)
        return layout, staged

    def _graph_feeds(self) -> bool:
        """Whether a decode graph's inputs go in with one kernel (``DecodeGraphs.replay_fed``,
        where its kernel was made at capture), when nothing but the graph reads the staged
        tokens (no draft model, no drafts made on the device)."""
        return (self.graphs is not None and self.graphs.stages_inputs and self.draft is None
                and self.batch.device_drafts is None)

    def _use_device_drafts(self) -> None:
        """Drafts made on the device: a draft model (always; loaded here, after the target, so
        it is inside the engine's memory share), or n-gram lookup under async scheduling (the
        host does not know a step's tokens when it schedules the next one)."""
        from tidal_engine.spec_decode.config import SpeculativeConfig, drafts_on_device

        self.draft: DraftModel | None = None
        raw = getattr(self.config, "speculative_config", None)
        spec = SpeculativeConfig.parse(raw) if raw else None
        if not drafts_on_device(spec, getattr(self.config, "async_scheduling", None), self.device.type):
            return
        from tidal_engine.spec_decode.device_drafts import DeviceDrafts, DeviceNgramProposer

        assert spec is not None
        rows = self.batch.capacity + 1
        if spec.method == "draft_model":
            from tidal_engine.spec_decode.draft_model import DraftModel

            assert spec.model is not None
            self.draft = DraftModel(spec.model, spec.num_speculative_tokens, dtype=self.dtype, device=self.device,
                                    block_size=self.config.block_size, backend=choose_attention_backend(self.device),
                                    cache_dir=getattr(self.config, "cache_dir", None),
                                    load_format=getattr(self.config, "load_format", "auto"))
            self.batch.device_drafts = DeviceDrafts(None, rows, self.max_model_len, self.device,
                                                    num_speculative_tokens=spec.num_speculative_tokens)
            return
        proposer = DeviceNgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
        self.batch.device_drafts = DeviceDrafts(proposer, rows, self.max_model_len, self.device)

    def draft_forward(self, layout: StepLayout, staged: torch.Tensor) -> None:
        """The draft model's KV for the step just queued: one draft forward over the step's own
        inputs and metadata (no-op without a draft model)."""
        if self.draft is None:
            return
        ids, positions, meta, _ = self._views(layout, staged)
        self.draft.forward_step(ids, positions, meta)

    def _shift_fed_rows(self, layout: StepLayout, staged: torch.Tensor) -> None:
        """Device drafts: the host scheduled each fed row as if its previous step (still in
        flight then) accepted no draft. Shift its positions, slots and sequence length by the
        count it did accept, and write its drafts after its fed token; all on the device."""
        drafts = self.batch.device_drafts
        assert drafts is not None
        off = layout.offsets()

        def span(name: str) -> torch.Tensor:
            a, b = off[name]
            return staged[a:b]

        feed_rows, src = span("feed_rows"), span("feed_src")
        seq, num_drafts = span("feed_seq"), span("feed_drafts")
        k = drafts.k
        shift = drafts.accepted.index_select(0, src)
        j = torch.arange(k + 1, device=staged.device)
        valid = j[None, :] <= num_drafts[:, None]
        # [F, k + 1] flat token rows; past a row's drafts, its fed token again (same values).
        tokens = torch.where(valid, feed_rows[:, None] + j[None, :], feed_rows[:, None]).view(-1)
        positions = span("positions")
        pos = (positions.index_select(0, tokens).view(-1, k + 1) + shift[:, None])
        bs = self.config.block_size
        blocks = self.batch.block_table_dev[src[:, None].expand(-1, k + 1), pos // bs]
        positions.index_copy_(0, tokens, pos.view(-1))
        span("slot_mapping").index_copy_(0, tokens, (blocks * bs + pos % bs).view(-1))
        seq_lens = span("seq_lens")
        seq_lens.index_copy_(0, seq, seq_lens.index_select(0, seq) + shift)
        if drafts.proposer is None:  # the draft model writes them (runner/verify.py)
            self._bound_seq_lens(layout, seq_lens, k)
            return
        ids = span("input_ids")
        fed = ids.index_select(0, feed_rows)
        new_ids = torch.cat([fed[:, None], drafts.drafts.index_select(0, src)], dim=1)
        ids.index_copy_(0, tokens, torch.where(valid, new_ids, fed[:, None]).view(-1))
        self._bound_seq_lens(layout, seq_lens, k)

    @staticmethod
    def _bound_seq_lens(layout: StepLayout, seq_lens: torch.Tensor, k: int) -> None:
        if seq_lens.device.type == "cpu":  # the torch backend reads the host copies: they are these
            layout.seq_lens_np = seq_lens.numpy()[: layout.num_seqs].copy()
            layout.max_seq_len = int(layout.seq_lens_np.max())
        else:
            layout.max_seq_len += k  # a bound (only the torch backend reads it)

    def _block_tables(self, layout: StepLayout, staged: torch.Tensor) -> torch.Tensor:
        """The step's [S, W] block table, gathered on the device from the persistent one."""
        a, b = layout.offsets()["batch_rows"]
        return self.batch.block_table_dev[:, : layout.width].index_select(0, staged[a:b])

    def _views(self, layout: StepLayout, staged: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        off = layout.offsets()

        def view(name: str) -> torch.Tensor:
            a, b = off[name]
            return staged[a:b]

        meta = AttentionMetadata(
            slot_mapping=view("slot_mapping"),
            query_start_loc=view("query_start_loc"),
            seq_lens=view("seq_lens"),
            block_tables=self._block_tables(layout, staged),
            max_query_len=layout.max_query_len,
            max_seq_len=layout.max_seq_len,
            query_start_loc_cpu=layout.query_start_loc,
            seq_lens_cpu=layout.seq_lens,
        )
        return view("input_ids"), view("positions"), meta, view("sample_rows")

    def prepare_inputs(self, step: StepInput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, np.ndarray]:
        """Flatten a step over the persistent batch (no padding). Returns ids, positions,
        metadata and the row of each sampling sequence's last token in the flat batch."""
        layout, staged = self._stage(step, self._width(step), None)
        ids, positions, meta, _ = self._views(layout, staged)
        return ids, positions, meta, layout.sample_rows

    def _width(self, step: StepInput) -> int:
        return max(1, int(self.batch.num_blocks[step.rows].max()))

    @torch.inference_mode()
    def execute(
        self,
        step: StepInput,
        sample_req_ids: list[str],
        grammar_bitmasks: dict[str, bytes] | None = None,
        lora_chunks: list[Any] | None = None,
        drafts: list[list[int]] | None = None,
        prompt_logprobs: PromptLogprobsJob | None = None,
    ) -> SampledTokens | None:
        """Queue the forward pass over the persistent batch's ``step.rows`` and the sampling
        of the sequences that sample (``sample_req_ids``, in batch order); nothing here waits
        for the device. The sampled ids are also scattered into the persistent batch's
        ``last_sampled_dev`` rows, where the next step's fed tokens come from.

        ``lora_chunks``: the step's chunks as the LoRA manager wants them (``.request.lora_name``,
        ``.num_new_tokens``), when any row uses an adapter; those steps run eagerly.

        ``drafts``: each sampling sequence's draft tokens (speculative decoding, see
        runner/verify.py): the step replays a verify graph (or a mixed one, else runs eagerly)
        and its result gives 1..k+1 tokens per row.

        ``prompt_logprobs``: prompt positions whose logprobs the step's hidden states give
        (runner/prompt_logprobs.py); the step runs eagerly and the job gets them queued."""
        if prompt_logprobs and (drafts is not None or get_parallel().pp_size > 1):
            raise ValueError("prompt_logprobs are not computed with speculative decoding or pipeline parallelism")
        if drafts is not None:
            from tidal_engine.runner.verify import execute_verify

            use_lora = lora_chunks is not None and self.lora_manager is not None and self.lora_manager.begin_step(lora_chunks)
            try:  # rows with adapters: eager (the graphs hold the base path only)
                return execute_verify(self, step, sample_req_ids, drafts, grammar_bitmasks, allow_graphs=not use_lora)
            finally:
                if use_lora:
                    self.lora_manager.end_step()
        if lora_chunks is not None and self.lora_manager is not None and self.lora_manager.begin_step(lora_chunks):
            try:  # rows use adapters: run eagerly (the graphs hold the base path only)
                return self._execute(step, sample_req_ids, grammar_bitmasks, allow_graphs=False,
                                     prompt_logprobs=prompt_logprobs)
            finally:
                self.lora_manager.end_step()
        return self._execute(step, sample_req_ids, grammar_bitmasks, allow_graphs=not prompt_logprobs,
                             prompt_logprobs=prompt_logprobs)

    def _execute(
        self,
        step: StepInput,
        sample_req_ids: list[str],
        grammar_bitmasks: dict[str, bytes] | None,
        allow_graphs: bool = True,
        prompt_logprobs: PromptLogprobsJob | None = None,
    ) -> SampledTokens | None:
        width = self._width(step)
        if get_parallel().pp_size > 1:
            return self._execute_stage(step, width, sample_req_ids, grammar_bitmasks)
        bucket = self._graph_bucket(step, width) if allow_graphs else None
        mixed = self._mixed_bucket(step, width) if allow_graphs and bucket is None else None
        if mixed is not None:
            assert self.mixed_graphs is not None
            layout, staged = self._stage(step, width, self.mixed_graphs.seqs_for(mixed), mixed)
            hidden = self.mixed_graphs.replay(mixed, staged, self._block_tables(layout, staged))
            self.draft_forward(layout, staged)
            if not layout.num_samples:
                return None
            a, b = layout.offsets()["sample_rows"]
            logits = self.model.compute_logits(hidden.index_select(0, staged[a:b]))
            return self._sample(logits, layout, staged, sample_req_ids, grammar_bitmasks)
        fed_by_graph = bucket is not None and self._graph_feeds()
        layout, staged = self._stage(step, width, bucket, feed=not fed_by_graph)
        if bucket is not None:
            assert self.graphs is not None
            if fed_by_graph:
                logits = self.graphs.replay_fed(bucket, staged, layout, self.batch.last_sampled_dev,
                                                self.batch.block_table_dev)
            else:
                logits = self.graphs.replay(bucket, staged, self._block_tables(layout, staged))
            self.draft_forward(layout, staged)
            if not layout.num_samples:
                return None
            if layout.samples_in_order:
                logits = logits[: layout.num_samples]
            else:
                a, b = layout.offsets()["sample_rows"]
                logits = logits.index_select(0, staged[a:b])
        else:
            ids, positions, meta, sample_rows = self._views(layout, staged)
            hidden = self.model(ids, positions, self.kv_caches, meta)
            if self.draft is not None:
                self.draft.forward_step(ids, positions, meta)
            if prompt_logprobs:
                prompt_logprobs.compute(hidden, self.model.compute_logits)
            if not layout.num_samples:
                return None
            logits = self.model.compute_logits(hidden.index_select(0, sample_rows))
        return self._sample(logits, layout, staged, sample_req_ids, grammar_bitmasks)

    def _execute_stage(
        self, step: StepInput, width: int, sample_req_ids: list[str], grammar_bitmasks: dict[str, bytes] | None
    ) -> SampledTokens | None:
        """One pipeline stage's share of a step (eager): take the previous stage's activations,
        run this stage's layers, hand them on; the last stage samples. The stages before it
        return None at once: they never wait for the sampled ids (the engine core sends them
        with each request's next chunk), so they can run the next micro-batch meanwhile."""
        from tidal_engine.distributed.comm import pp_recv, pp_send

        bucket = self._graph_bucket(step, width)  # decode steps replay this stage's graph
        layout, staged = self._stage(step, width, bucket)
        ids, positions, meta, sample_rows = self._views(layout, staged)
        model = self.model
        pp = get_parallel()
        intermediate = None
        if not model.is_first_stage:
            shape = (int(ids.shape[0]), self.arch.hidden_size)
            hidden_in, residual_in = pp_recv([shape, shape], self.dtype, self.device, pp.pp_rank - 1)
            intermediate = (hidden_in, residual_in)
        if bucket is not None:
            assert self.graphs is not None
            out = self.graphs.replay(bucket, staged, self._block_tables(layout, staged), intermediate)
        else:
            out = model(ids, positions, self.kv_caches, meta, intermediate)
        if not model.is_last_stage:
            pp_send(list(out), pp.pp_rank + 1)
            return None
        if not layout.num_samples:
            return None
        if bucket is not None:  # the graph gave the logits of every (padded) row
            a, b = layout.offsets()["sample_rows"]
            logits = out.index_select(0, staged[a:b])
        else:
            logits = model.compute_logits(out.index_select(0, sample_rows))
        return self._sample(logits, layout, staged, sample_req_ids, grammar_bitmasks)

    def _sample(
        self,
        logits: torch.Tensor,
        layout: StepLayout,
        staged: torch.Tensor,
        sample_req_ids: list[str],
        grammar_bitmasks: dict[str, bytes] | None,
    ) -> SampledTokens:
        if len(sample_req_ids) != layout.num_samples:
            raise ValueError(f"{layout.num_samples} sequences sample, but {len(sample_req_ids)} request ids were given")
        a, b = layout.offsets()["sampled_rows"]
        sampled = self.sampler.sample(logits, sample_req_ids, grammar_bitmasks or None,
                                      record_into=(self.batch.last_sampled_dev, staged[a:b]))
        ids = sampled.device_ids.view(-1).long()
        drafts = self.batch.device_drafts
        if drafts is not None:  # the histories grow by the sampled ids; the next drafts follow
            drafts.record(staged[a:b], ids[:, None], torch.ones_like(ids))
            drafts.propose(staged[a:b], self._history_width)
        return sampled

    # ---- CUDA graphs -----------------------------------------------------------------
    def _graphs_wanted(self) -> bool:
        return (
            self.device.type == "cuda"
            and not self.config.enforce_eager
            and getattr(self.backend, "name", "") == "triton"
        )

    def capture_cuda_graphs(self) -> None:
        """(Re)capture the decode and mixed-step graphs for the current weights and KV cache."""
        self._drop_cuda_graphs()
        if not self._graphs_wanted() or not self.kv_caches:
            return
        max_blocks = -(-self.max_model_len // self.config.block_size)
        graphs = DecodeGraphs(self.model, self.kv_caches, self.cuda_graph_sizes, max_blocks, self.device)
        graphs.capture()
        self.graphs = graphs
        if self.config.mixed_cuda_graphs and get_parallel().pp_size == 1:  # pipeline stages: prefill runs eagerly
            token_sizes = default_mixed_token_sizes(self.config.max_num_batched_tokens or 2048)
            mixed = MixedGraphs(self.model, self.kv_caches, token_sizes, self.config.max_num_seqs, max_blocks, self.device)
            mixed.capture()
            self.mixed_graphs = mixed
        k = self._num_speculative_tokens()
        if k and get_parallel().pp_size == 1:
            verify = VerifyGraphs(self.model, self.kv_caches, self.cuda_graph_sizes, k + 1, max_blocks, self.device)
            verify.capture(self.mixed_graphs.pool if self.mixed_graphs is not None else None)
            self.verify_graphs = verify

    def _num_speculative_tokens(self) -> int:
        """k of ``--speculative-config`` (0: no speculation), for the verify graphs' buckets."""
        spec = getattr(self.config, "speculative_config", None)
        if not spec:
            return 0
        from tidal_engine.spec_decode.config import SpeculativeConfig

        return SpeculativeConfig.parse(spec).num_speculative_tokens

    def _verify_token_sizes(self) -> list[int]:
        k = self._num_speculative_tokens()
        if not k or get_parallel().pp_size != 1:
            return []
        return [b * (k + 1) for b in self.cuda_graph_sizes]

    def _drop_cuda_graphs(self) -> None:
        self.graphs = None
        self.mixed_graphs = None
        self.verify_graphs = None

    def _maybe_recapture(self) -> None:
        if self.graphs is None and self.weights.resident and self._kv_resident:
            self.capture_cuda_graphs()

    # ---- sleep mode ------------------------------------------------------------------
    def weights_resident(self) -> bool:
        return self.weights.resident

    def kv_cache_resident(self) -> bool:
        return self._kv_resident

    def release_kv_cache(self) -> None:
        if not self._kv_resident:
            return
        if self.draft is not None:
            self.draft.release()
        if self._kv_range is not None:
            self._kv_range.unmap()  # the graphs keep pointing at the same addresses
        else:
            self._drop_cuda_graphs()  # they point into the cache
            self.kv_caches = []
            _free_device_memory(self.device)
        self._kv_resident = False

    def restore_kv_cache(self) -> None:
        """The KV cache again, at its old size: no re-profiling."""
        if not self._kv_resident:
            if self._kv_range is not None:
                self._kv_range.map()
                for cache in self.kv_caches:
                    cache.zero_()
                if self.draft is not None:
                    self.draft.allocate(self.num_blocks)
                self._kv_resident = True
            else:
                self.kv_caches = self._allocate_kv_caches()
        self._maybe_recapture()

    def offload_weights(self) -> None:
        """Level 1: the weights into a host buffer (pinned on CUDA, allocated once and reused),
        one copy. (On a CPU engine the store is the same RAM: only level 2 frees memory there.)"""
        if not self.weights.stable_addresses:
            self._drop_cuda_graphs()  # they point at the weights' device addresses
        self.weights.offload()
        if not self.weights.stable_addresses:
            _free_device_memory(self.device)

    def onload_weights(self) -> None:
        self.weights.onload()
        self._maybe_recapture()

    def wake_from_level1(self) -> None:
        """Weights and KV cache back from level 1 at once: the KV range is mapped and zeroed on
        a side stream first, so the zeroing runs on the device while the weights are mapped and
        copied in (the copy's synchronisation waits for both)."""
        if self._kv_resident or self._kv_range is None or self.device.type != "cuda":
            self.onload_weights()
            self.restore_kv_cache()
            return
        self._kv_range.map()
        if self.draft is not None:
            self.draft.allocate(self.num_blocks)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for cache in self.kv_caches:
                cache.zero_()
        self._kv_resident = True
        self.weights.onload()  # ends with a device-wide synchronize: the zeroing is done too
        torch.cuda.current_stream(self.device).wait_stream(side)
        self._maybe_recapture()

    def discard_weights(self) -> None:
        """Level 2: drop the weights entirely; wake reloads them from the model source."""
        if not self.weights.stable_addresses:
            self._drop_cuda_graphs()
        self.weights.discard()
        if not self.weights.stable_addresses:
            _free_device_memory(self.device)

    def reload_weights(self) -> None:
        """Level 2 wake: the checkpoint read again (in parallel, from the page cache when warm)
        into the same parameters; the one-row-linear choices and the graphs stay."""
        self.weights.acquire()
        fill_weights(self.model, self.source, getattr(self.config, "load_format", "auto"))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()  # the reads' device staging tensors: not part of the engine's share
        self._maybe_recapture()
        self._prepare_sleep()  # level 2 gave the host buffer back

    def memory_usage(self) -> dict[str, int]:
        """Bytes held on the engine's device by the weights and the KV cache, and in host memory
        by the weights while asleep at level 1."""
        weights = self.weights.nbytes if self.weights.resident else 0
        caches = self.kv_caches + (self.draft.caches if self.draft is not None else [])
        kv = sum(t.numel() * t.element_size() for t in caches) if self._kv_resident else 0
        offloaded = self.weights.host_bytes if not self.weights.resident else 0
        return {"weights_bytes": weights, "kv_cache_bytes": kv, "offloaded_weights_bytes": offloaded}


def _feed_input_ids(staged: torch.Tensor, layout: StepLayout, last_sampled: torch.Tensor) -> None:
    """input_ids[feed_rows] = last_sampled[feed_src], on the device, before anything reads them."""
    off = layout.offsets()
    a, b = off["input_ids"]
    ra, rb = off["feed_rows"]
    sa, sb = off["feed_src"]
    staged[a:b].index_copy_(0, staged[ra:rb], last_sampled.index_select(0, staged[sa:sb]))


def choose_attention_backend(device: torch.device) -> AttentionBackend:
    """The one switch: Triton kernels on GPU, the torch reference elsewhere."""
    if device.type == "cuda":
        try:
            from tidal_engine.kernels.triton_backend import TritonAttentionBackend

            return TritonAttentionBackend()
        except ImportError as exc:  # no triton: still correct, only slower
            logger.warning("Triton attention unavailable (%s); using the torch reference", exc)
    return TorchAttentionBackend()


def _free_device_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
