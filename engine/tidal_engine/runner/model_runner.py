"""The model runner: turns a scheduled step into one forward pass over a flat batch.

It owns the model weights, the paged KV cache and the sampler. The scheduler says
which tokens of which requests to compute; the runner lays them out flat, builds
the attention metadata (positions, slots, block tables) and samples one token for
every request whose chunk reached the end of its known tokens.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass

import torch

from tidal_engine.config import EngineConfig
from tidal_engine.core.scheduler import SchedulerOutput
from tidal_engine.layers.attention import AttentionBackend, AttentionMetadata, TorchAttentionBackend, set_attention_backend
from tidal_engine.models.loader import ModelSource, load_model
from tidal_engine.runner.sampler import Sampler, SamplerOutput, SamplingRow

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_BYTES = 1 << 30  # 1 GiB: enough for tens of thousands of tokens of a small model


@dataclass
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element


class ModelRunner:
    def __init__(self, config: EngineConfig, source: ModelSource, device: torch.device, dtype: torch.dtype) -> None:
        self.config = config
        self.source = source
        self.device = device
        self.dtype = dtype
        self.arch = source.arch_config
        self.model = load_model(source, dtype, device)
        self.backend = choose_attention_backend(device)
        set_attention_backend(self.model, self.backend)
        self.kv_spec = KVCacheSpec(
            num_layers=self.arch.num_hidden_layers,
            num_kv_heads=self.arch.num_key_value_heads,
            head_dim=self.arch.head_dim,
            block_size=config.block_size,
            dtype=dtype,
        )
        self.num_blocks = self._decide_num_blocks()
        self.kv_caches: list[torch.Tensor] = self._allocate_kv_caches()
        self.sampler = Sampler()

    # ---- KV cache sizing -------------------------------------------------------------
    def _decide_num_blocks(self) -> int:
        if self.config.num_gpu_blocks_override is not None:
            return self.config.num_gpu_blocks_override
        per_block = self.kv_spec.bytes_per_block
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

    def _profile_cuda_budget(self) -> int:
        """Run the largest step once, then give the KV cache what the utilisation target leaves."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        num_tokens = self.config.max_num_batched_tokens or 2048
        self._dummy_forward(num_tokens)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        total = torch.cuda.get_device_properties(self.device).total_memory
        budget = int(total * self.config.gpu_memory_utilization) - peak
        logger.info("KV cache budget: %.2f GiB (peak during profiling %.2f GiB)", budget / 2**30, peak / 2**30)
        return max(budget, 0)

    def _dummy_forward(self, num_tokens: int) -> None:
        """One prefill of ``num_tokens`` tokens over a throwaway one-block-per-16-tokens cache."""
        bs = self.config.block_size
        num_blocks = (num_tokens + bs - 1) // bs
        caches = [
            torch.zeros(2, num_blocks, bs, self.kv_spec.num_kv_heads, self.kv_spec.head_dim, dtype=self.dtype, device=self.device)
            for _ in range(self.kv_spec.num_layers)
        ]
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(num_tokens, device=self.device)
        meta = AttentionMetadata(
            slot_mapping=positions.clone(),
            query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=self.device),
            block_tables=torch.arange(num_blocks, dtype=torch.int32, device=self.device)[None],
            max_query_len=num_tokens,
            max_seq_len=num_tokens,
            query_start_loc_cpu=[0, num_tokens],
            seq_lens_cpu=[num_tokens],
        )
        with torch.inference_mode():
            hidden = self.model(ids, positions, caches, meta)
            self.model.compute_logits(hidden[-1:])
        del caches, hidden

    def _allocate_kv_caches(self) -> list[torch.Tensor]:
        shape = (2, self.num_blocks, self.config.block_size, self.kv_spec.num_kv_heads, self.kv_spec.head_dim)
        return [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.kv_spec.num_layers)]

    # ---- one step --------------------------------------------------------------------
    def prepare_inputs(self, output: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Flatten the scheduled chunks. Returns ids, positions, metadata and the row of
        each sampling request's last token in the flat batch."""
        bs = self.config.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        for chunk in output.chunks:
            req = chunk.request
            start = req.num_computed_tokens
            end = start + chunk.num_new_tokens
            tokens = req.all_token_ids[start:end]
            input_ids.extend(tokens)
            positions.extend(range(start, end))
            blocks = chunk.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            query_start.append(query_start[-1] + chunk.num_new_tokens)
            seq_lens.append(end)
            tables.append(blocks)
            if chunk.samples:
                sample_rows.append(query_start[-1] - 1)
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=dev),
            max_query_len=max(c.num_new_tokens for c in output.chunks),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=query_start,
            seq_lens_cpu=seq_lens,
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=dev)
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        return ids, pos, meta, sample_rows

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput, rows: list[SamplingRow]) -> SamplerOutput | None:
        """Run the forward pass; sample for the chunks that ask for it (``rows`` in chunk order)."""
        ids, positions, meta, sample_rows = self.prepare_inputs(output)
        hidden = self.model(ids, positions, self.kv_caches, meta)
        if not sample_rows:
            return None
        logits = self.model.compute_logits(hidden[sample_rows])
        return self.sampler(logits, rows)

    # ---- sleep mode ------------------------------------------------------------------
    def release_kv_cache(self) -> None:
        self.kv_caches = []
        _free_device_memory(self.device)

    def restore_kv_cache(self) -> None:
        if not self.kv_caches:
            self.kv_caches = self._allocate_kv_caches()

    def offload_weights(self) -> None:
        """Level 1: keep the weights in host memory (pinned on CUDA) for a fast wake."""
        pin = self.device.type == "cuda"
        with torch.no_grad():
            for tensor in _module_tensors(self.model):
                host = tensor.data.to("cpu")
                tensor.data = host.pin_memory() if pin else host
        _free_device_memory(self.device)

    def onload_weights(self) -> None:
        with torch.no_grad():
            for tensor in _module_tensors(self.model):
                tensor.data = tensor.data.to(self.device, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def discard_weights(self) -> None:
        """Level 2: drop the weights entirely; wake reloads them from the model source."""
        with torch.no_grad():
            for tensor in _module_tensors(self.model):
                tensor.data = torch.empty(0, dtype=tensor.dtype, device=self.device)
        _free_device_memory(self.device)

    def reload_weights(self) -> None:
        self.model = load_model(self.source, self.dtype, self.device)
        set_attention_backend(self.model, self.backend)

    def memory_usage(self) -> dict[str, int]:
        """Bytes held on the engine's device by the weights and the KV cache."""
        weights = sum(t.numel() * t.element_size() for t in _module_tensors(self.model) if t.device == self.device)
        kv = sum(t.numel() * t.element_size() for t in self.kv_caches)
        return {"weights_bytes": weights, "kv_cache_bytes": kv}


def choose_attention_backend(device: torch.device) -> AttentionBackend:
    """The one switch: Triton kernels on GPU, the torch reference elsewhere."""
    if device.type == "cuda":
        try:
            from tidal_engine.kernels.triton_backend import TritonAttentionBackend

            return TritonAttentionBackend()
        except ImportError as exc:  # no triton: still correct, only slower
            logger.warning("Triton attention unavailable (%s); using the torch reference", exc)
    return TorchAttentionBackend()


def _module_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    return [*model.parameters(), *model.buffers()]


def _free_device_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
