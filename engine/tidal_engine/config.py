"""Engine configuration, with vLLM's option names."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineConfig:
    model: str
    tokenizer: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda
    seed: int = 0
    max_model_len: int | None = None  # default: the model's own context length
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # default: 2048 with chunked prefill
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None  # explicit KV budget (the CPU default is 1 GiB)
    num_gpu_blocks_override: int | None = None
    # KV-cache storage (vLLM's --kv-cache-dtype): "auto" (the model dtype) or "fp8"/"fp8_e4m3"
    # (float8 e4m3 with per-layer k/v scales, layers/kv_cache_dtype.py): half the bytes per block.
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    enforce_eager: bool = False  # True: no CUDA graphs (every step runs eagerly)
    # Decode batch sizes to capture CUDA graphs for (None: 1, 2, 4, 8, 16, ..., 256, 272, ...,
    # up to min(max_num_seqs, 512)); larger decode batches and mixed steps run eagerly.
    cuda_graph_sizes: list[int] | None = None
    # Prefill and mixed steps of up to 2048 tokens replay CUDA graphs too (token-count
    # buckets, see runner/mixed_graphs.py); False: they run eagerly.
    mixed_cuda_graphs: bool = True
    # Schedule and launch step N+1 while step N runs on the device, feeding N's sampled ids
    # to N+1 on the device (docs/internals.md). None: on for CUDA, off on CPU (no overlap there).
    async_scheduling: bool | None = None
    enable_sleep_mode: bool = False
    # Multi-LoRA (docs/lora.md): adapters active in one batch, max rank, host cache size
    # (None: max_loras), adapters loaded at start (name → folder), and the folders runtime
    # loads may read from (none: runtime loading is refused).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_modules: dict[str, str] | None = None
    allowed_lora_roots: list[str] | None = None
    # Parallelism (docs/parallelism.md): tensor ranks split each layer, pipeline ranks split
    # the layers; tensor × pipeline worker processes (one device each on CUDA, gloo on CPU).
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # Where the workers run: "uni" (in the engine-core process), "mp" (a process per rank), or
    # "package.module:Class" for an Executor subclass (as vLLM allows). None: "mp" when there
    # is more than one rank, else "uni".
    distributed_executor_backend: str | None = None
    # No tokenizer at all (vLLM's skip_tokenizer_init): prompts are token ids, outputs have ids and
    # no text; stop strings and structured outputs, which need the vocabulary, are refused.
    skip_tokenizer_init: bool = False
    # "fcfs", or "priority": requests run by their priority (lower first), then arrival (vLLM's flag).
    scheduling_policy: str = "fcfs"
    # The model reasons in <think>…</think> (--reasoning-parser): grammars start after </think>.
    reasoning_parser: str | None = None
    # vLLM's --runner and --convert: "pooling" serves embeddings, scores and reranking
    # (tidal_engine.pooling) instead of generating; "auto" picks it for encoder and
    # sequence-classification checkpoints. convert (pooling only): auto | embed | classify.
    runner: str = "auto"
    convert: str = "auto"
    # "auto": read the checkpoint; "dummy": random weights (vLLM's --load-format dummy, for benchmarks).
    load_format: str = "auto"
    # vLLM's --speculative-config (docs/speculative-decoding.md): {"method": "ngram", ...}; None: off.
    speculative_config: dict | None = None
    # Start-up cache (Triton's compiled kernels, the one-row-linear choices): None means
    # $TIDAL_CACHE_DIR or ~/.cache/tidal. The operator mounts one per node.
    cache_dir: str | None = None
    # KV offload to host memory (docs/kv-offload.md), vLLM's flags: the host pool in GiB (None: off)
    # and the backend ("native": Tidal's own connector, kv_transfer/).
    kv_offloading_size: float | None = None
    kv_offloading_backend: str = "native"
    # When blocks reach the host pool: "write-through" (after they are computed) or "eviction"
    # (when the device pool reuses them); Tidal's own flag, docs/kv-offload.md has the figures.
    kv_offloading_save: str = "write-through"
    # Weight quantization (docs/quantization.md): None/"none" = what the checkpoint has; fp8 also
    # quantizes a 16/32-bit checkpoint while loading; awq/gptq/compressed-tensors must match it.
    quantization: str | None = None

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def __post_init__(self) -> None:
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two up to 128, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16", "half", "float", "bf16", "fp16", "fp32"):
            raise ValueError(f"unknown dtype {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"unknown device {self.device!r}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.cuda_graph_sizes is not None and any(int(s) < 1 for s in self.cuda_graph_sizes):
            raise ValueError(f"cuda_graph_sizes must be positive, got {self.cuda_graph_sizes}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError("num_gpu_blocks_override must be >= 1")
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be >= 1")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        if self.kv_cache_dtype not in ("auto", "fp8", "fp8_e4m3"):
            raise ValueError(f"kv_cache_dtype must be auto, fp8 or fp8_e4m3, got {self.kv_cache_dtype!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size and pipeline_parallel_size must be >= 1, got "
                             f"{self.tensor_parallel_size} and {self.pipeline_parallel_size}")
        if self.distributed_executor_backend is None:
            self.distributed_executor_backend = "mp" if self.world_size > 1 else "uni"
        if self.distributed_executor_backend == "uni" and self.world_size > 1:
            raise ValueError(f"{self.world_size} ranks (tensor {self.tensor_parallel_size} × pipeline "
                             f"{self.pipeline_parallel_size}) need distributed_executor_backend 'mp'")
        if self.distributed_executor_backend not in ("uni", "mp") and ":" not in self.distributed_executor_backend:
            raise ValueError("distributed_executor_backend must be 'uni', 'mp' or 'package.module:ExecutorClass', "
                             f"got {self.distributed_executor_backend!r}")
        if self.runner not in ("auto", "generate", "pooling"):
            raise ValueError(f"runner must be auto, generate or pooling, got {self.runner!r}")
        if self.convert not in ("auto", "embed", "classify"):
            raise ValueError(f"convert must be auto, embed or classify, got {self.convert!r}")
        if self.convert != "auto" and self.runner == "generate":
            raise ValueError(f"--convert {self.convert} needs --runner pooling")
        if self.kv_offloading_size is not None:
            if not self.kv_offloading_size > 0:
                raise ValueError(f"kv_offloading_size must be > 0 GiB, got {self.kv_offloading_size}")
            if self.kv_offloading_backend != "native":
                raise ValueError(f"kv_offloading_backend must be 'native', got {self.kv_offloading_backend!r}")
            if self.kv_offloading_save not in ("write-through", "eviction"):
                raise ValueError(f"kv_offloading_save must be 'write-through' or 'eviction', "
                                 f"got {self.kv_offloading_save!r}")
            if not self.enable_prefix_caching:
                raise ValueError("KV offloading needs prefix caching (its keys are the prefix-cache block hashes)")
            if self.world_size > 1:
                raise ValueError("KV offloading runs with one worker for now (tensor and pipeline size 1)")
        if self.quantization in ("none", "None"):
            self.quantization = None
        if self.quantization not in (None, "fp8", "awq", "gptq", "compressed-tensors"):
            raise ValueError(f"quantization must be fp8, awq, gptq, compressed-tensors or none, got {self.quantization!r}")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora")
