"""How much device memory the KV cache may take: ``gpu_memory_utilization`` as vLLM defines it.

The engine's whole footprint — weights, the activations of the largest step, the sampler's
buffers at ``max_num_seqs``, memory outside torch's allocator (cuBLAS workspaces, the
sleep-mode weight arena), the CUDA graph pools and the KV cache — stays within
``utilization × total``. Pure functions over measured numbers, so the arithmetic is tested
on a CPU with made-up figures; the runner measures (``torch.cuda.mem_get_info`` before the
weights load and after the profiling step, the allocator's peak) and calls these.
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = float(1 << 30)


class InsufficientDeviceMemoryError(ValueError):
    """The device has less free memory than the engine was told it may use, or the model
    leaves no room for a KV cache within that share."""


def requested_bytes(total: int, utilization: float) -> int:
    """The engine's share of the device: ``utilization × total``."""
    return int(total * utilization)


def check_free_memory(free: int, total: int, utilization: float) -> None:
    """Refuse to start when the device's free memory is below the engine's share (another
    process holds the rest): the KV cache would be sized for memory that is not there."""
    want = requested_bytes(total, utilization)
    if free < want:
        raise InsufficientDeviceMemoryError(
            f"the device has {free / GiB:.2f} GiB free of {total / GiB:.2f} GiB, less than "
            f"gpu_memory_utilization {utilization} asks for ({want / GiB:.2f} GiB): other processes use "
            f"{(total - free) / GiB:.2f} GiB. Lower --gpu-memory-utilization to at most "
            f"{max(free / total - 0.005, 0.0):.3f}, or free the device."
        )


@dataclass(frozen=True)
class ProfiledMemory:
    """What the runner measured, in bytes."""

    total: int  # the device's memory
    free_before_load: int  # free before the engine put anything on the device
    free_after_profile: int  # free after the weights loaded and the largest step ran
    torch_peak: int  # torch's allocated peak over loading and profiling (weights + activations + sampler)
    torch_reserved: int  # torch's reserved memory when free_after_profile was read
    scratch_bytes: int = 0  # throwaway buffers inside the peak that the real steps don't hold (profiling KV)

    @property
    def non_torch(self) -> int:
        """Memory the engine took outside torch's allocator (cuBLAS/NCCL workspaces, mapped arenas)."""
        return max(0, self.free_before_load - self.free_after_profile - self.torch_reserved)


@dataclass(frozen=True)
class GraphShapes:
    """What the CUDA graphs will hold, to reserve their pools before sizing the KV cache."""

    decode_sizes: list[int]  # decode batch buckets (each keeps a [B, vocab] float32 logits output)
    mixed_token_sizes: list[int]  # mixed-step token buckets (each keeps a [T, hidden] output)
    vocab_size: int
    hidden_size: int
    dtype_bytes: int
    max_blocks_per_seq: int
    max_num_seqs: int


def graph_pool_bytes(shapes: GraphShapes, activation_bytes_per_token: float) -> int:
    """An upper estimate of the graph pools. Each capture family shares one pool, captured
    largest first: the pool holds the largest graph's working set once, plus every graph's
    static output; the static inputs (packed scalars, a fixed-width block table) sit beside."""
    total = 0
    if shapes.decode_sizes:
        b_max = max(shapes.decode_sizes)
        logits_f32 = 4 * shapes.vocab_size
        working = activation_bytes_per_token * b_max + b_max * shapes.vocab_size * shapes.dtype_bytes
        outputs = sum(shapes.decode_sizes) * logits_f32
        inputs = b_max * (shapes.max_blocks_per_seq + 6) * 8
        total += int(working) + outputs + inputs
    if shapes.mixed_token_sizes:
        t_max = max(shapes.mixed_token_sizes)
        s_max = min(t_max, shapes.max_num_seqs)
        working = activation_bytes_per_token * t_max
        outputs = sum(shapes.mixed_token_sizes) * shapes.hidden_size * shapes.dtype_bytes
        inputs = (3 * t_max + 2 * s_max + 1 + s_max * shapes.max_blocks_per_seq) * 8
        total += int(working) + outputs + inputs
    return total


@dataclass(frozen=True)
class KVBudget:
    requested: int  # utilization × total
    weights_and_activations: int  # torch's peak without the profiling scratch
    non_torch: int
    graph_reserve: int
    kv_cache: int

    def describe(self) -> str:
        return (
            f"KV cache {self.kv_cache / GiB:.2f} GiB = {self.requested / GiB:.2f} GiB requested − "
            f"{self.weights_and_activations / GiB:.2f} GiB weights+activations+sampler − "
            f"{self.non_torch / GiB:.2f} GiB outside torch − {self.graph_reserve / GiB:.2f} GiB CUDA graphs"
        )


def kv_cache_budget(profile: ProfiledMemory, utilization: float, graph_reserve: int = 0) -> KVBudget:
    """The KV cache's bytes: the engine's share minus everything else it holds at its peak.
    Raises ``InsufficientDeviceMemoryError`` when nothing is left."""
    requested = requested_bytes(profile.total, utilization)
    used = max(0, profile.torch_peak - profile.scratch_bytes)
    budget = KVBudget(requested, used, profile.non_torch, graph_reserve,
                      requested - used - profile.non_torch - graph_reserve)
    if budget.kv_cache <= 0:
        raise InsufficientDeviceMemoryError(
            f"no memory is left for the KV cache within gpu_memory_utilization {utilization}: "
            f"{budget.describe()}. Raise --gpu-memory-utilization, or lower --max-num-batched-tokens, "
            f"--max-num-seqs or --max-model-len."
        )
    return budget


def activation_bytes_per_token(profile: ProfiledMemory, resident_bytes: int, num_tokens: int) -> float:
    """Torch's peak above what stays resident (weights, sampler), per profiled token."""
    return max(0, profile.torch_peak - profile.scratch_bytes - resident_bytes) / max(1, num_tokens)
