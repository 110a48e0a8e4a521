"""Linear layers and the vocabulary embedding: where tensor parallelism and quantization hook in.

Every weight of a model goes through these classes. Two seams:

- **Sharding** (the layer's job). A column-parallel layer keeps a run of the output rows,
  a row-parallel one a run of the input columns, followed by one all-reduce over the
  tensor-parallel group; merged layers (QKV, gate+up) keep a run of each shard. Every
  parameter carries a ``weight_loader(param, checkpoint_tensor, shard)`` that copies only
  this rank's slice, so a rank reads only its slices of a safetensors file (the loader
  hands lazy slices, see models/loader.py).
- **Storage and matmul** (a ``LinearMethod``'s job). ``create_weights`` registers the
  parameters of one shard (tagging each with the dimension that is the output rows and
  the one that is the input columns, which the loaders slice), ``apply`` computes ``x W^T
  + b``, and ``process_weights_after_loading`` may repack. ``UnquantizedLinearMethod`` is
  the plain one; a quantization method implements the same three calls. A layer may also
  be called with an ``output_activation`` (a gated MLP's gate_up projection with
  ``SiluAndMul``): where the method ``folds_activation`` for that input (the decode GEMVs
  do), ``apply_activated`` makes the activated output in one kernel; elsewhere the layer
  runs ``apply``, its delta hooks, then the activation.

``in_features`` / ``out_features`` are this rank's sizes (what its matmul sees);
``input_range`` / ``output_ranges`` say where they sit in the checkpoint's full tensor.

``delta_hooks`` run on each local output before any all-reduce (LoRA adds its delta
there, so a row-parallel layer's partial delta is summed with the partial base output).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from tidal_engine.distributed.comm import tp_all_gather, tp_all_reduce
from tidal_engine.distributed.parallel_state import get_parallel
from tidal_engine.distributed.partition import even_runs, head_shard, padded_vocab, vocab_range

DeltaHook = Callable[[torch.Tensor, torch.Tensor], None]  # (input, local output) → add into output


class OutputActivation(Protocol):
    """An activation a linear may apply to its output inside its own kernel (layers/activation.py)."""

    name: str  # what a LinearMethod's folds_activation recognizes, e.g. "silu_and_mul"

    def __call__(self, y: torch.Tensor) -> torch.Tensor: ...


def copy_checked(dst: torch.Tensor, src: Any, what: str) -> None:
    """Copy a checkpoint tensor into a parameter (casting dtype/device), shapes must agree."""
    src = as_tensor(src)
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"shape mismatch for {what}: checkpoint has {tuple(src.shape)}, model expects {tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(src)


def as_tensor(t: Any) -> torch.Tensor:
    """A checkpoint entry as a tensor (a lazy slice, models/loader.py, reads its bytes now)."""
    return t if isinstance(t, torch.Tensor) else t.read()


def _copy_rows(dst: torch.Tensor, dim: int, src: Any, start: int, size: int, full_size: int, what: str) -> None:
    """``dst`` (``size`` long along ``dim``) ← ``src[start : start+size]`` along ``dim``, where the
    checkpoint must be ``full_size`` long; rows past its end (vocabulary padding) become
    zeros. Other dimensions must agree."""
    full = int(src.shape[dim])
    other_dst = [s for i, s in enumerate(dst.shape) if i != dim]
    other_src = [int(s) for i, s in enumerate(src.shape) if i != dim]
    if other_dst != other_src or dst.shape[dim] != size or full != full_size or start > full:
        if full != full_size:
            raise ValueError(f"shape mismatch for {what}: checkpoint has {tuple(int(s) for s in src.shape)}, "
                             f"model expects {full_size} along dimension {dim}")
        raise ValueError(f"shape mismatch for {what}: checkpoint has {tuple(int(s) for s in src.shape)}, "
                         f"model expects rows {start}:{start + size} of dimension {dim} and {tuple(other_dst)} otherwise")
    n = min(size, full - start)
    with torch.no_grad():
        if n > 0:
            dst.narrow(dim, 0, n).copy_(as_tensor(src.narrow(dim, start, n)))
        if n < size:
            dst.narrow(dim, n, size - n).zero_()


def _packed(what: str, pack: int, start: int, size: int, offset: int, full: int) -> tuple[int, int, int, int]:
    """(start, size, offset in the merged tensor, full size) of a row run, counted in elements
    of a parameter that stores ``pack`` rows per element; the run must not split an element."""
    if pack == 1:
        return start, size, offset, full
    if start % pack or size % pack or offset % pack or full % pack:
        raise ValueError(f"{what}: rows {start}:{start + size} of {full} do not split into whole packs of {pack} "
                         "(choose a tensor-parallel size that keeps each rank's share a multiple of it)")
    return start // pack, size // pack, offset // pack, full // pack


# ---- the quantization seam ---------------------------------------------------------------
class LinearMethod(ABC):
    """How one linear stores its (sharded) weights and multiplies by them."""

    # Checkpoint tensors of this layer that the method reads past (e.g. a static input scale).
    ignored_params: tuple[str, ...] = ()

    @abstractmethod
    def create_weights(self, layer: "LinearBase", in_features: int, out_features: int, dtype: torch.dtype | None) -> None:
        """Register this rank's parameters on ``layer``; tag each with ``output_dim`` /
        ``input_dim`` (which tensor dimension holds the output rows / input columns; None
        for neither) so the layer's weight loader can slice checkpoint tensors for it, and
        with ``output_pack`` / ``input_pack`` when one element there stands for several rows
        or columns (packed 4-bit words, per-group scales). A parameter that already has a
        ``weight_loader`` keeps it (it may reshape, then call the layer's)."""

    @abstractmethod
    def apply(self, layer: "LinearBase", x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x [T, in_features]`` → ``[T, out_features]``."""

    def folds_activation(self, layer: "LinearBase", x: torch.Tensor, activation: str) -> bool:
        """Whether ``apply_activated`` has one kernel for this input and ``activation`` (
        "silu_and_mul": the output rows are gate|up, gate first, and the result has half as
        many). No by default."""
        return False

    def apply_activated(self, layer: "LinearBase", x: torch.Tensor, bias: torch.Tensor | None,
                        activation: str) -> torch.Tensor:
        """``act(apply(layer, x, bias))`` in one kernel; only where ``folds_activation``."""
        raise NotImplementedError(f"{type(self).__name__} does not fold {activation} into its matmul")

    def process_weights_after_loading(self, layer: "LinearBase") -> None:  # noqa: B027 - optional
        """Repack after the checkpoint is in (nothing to do for plain weights)."""


class UnquantizedLinearMethod(LinearMethod):
    """Plain ``[out, in]`` weights; one-row inputs may go to the Triton GEMV (``gemv_config``),
    inputs of a few rows to its few-row variant (``gemv_rows_configs``: row count → config)."""

    def create_weights(self, layer: "LinearBase", in_features: int, out_features: int, dtype: torch.dtype | None) -> None:
        weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        weight.output_dim, weight.input_dim = 0, 1  # type: ignore[attr-defined]
        layer.register_parameter("weight", weight)

    def apply(self, layer: "LinearBase", x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        config = layer.gemv_config
        if config is not None and x.dim() == 2 and x.shape[0] == 1:
            from tidal_engine.kernels.triton.gemv import gemv

            return gemv(x, layer.weight, bias, config)
        few = layer.gemv_rows_configs.get(x.shape[0]) if layer.gemv_rows_configs is not None and x.dim() == 2 else None
        if few is not None:
            from tidal_engine.kernels.triton.gemv import gemv_rows

            return gemv_rows(x, layer.weight, bias, few)
        return F.linear(x, layer.weight, bias)

    # The one-row GEMV activates gate/up pairs in its epilogue (tiles of at least one pair).
    def folds_activation(self, layer: "LinearBase", x: torch.Tensor, activation: str) -> bool:
        from tidal_engine.kernels.triton.gemv import tile_folds_silu_and_mul

        return (activation == "silu_and_mul" and x.dim() == 2 and x.shape[0] == 1
                and tile_folds_silu_and_mul(layer.gemv_config, layer.out_features))

    def apply_activated(self, layer: "LinearBase", x: torch.Tensor, bias: torch.Tensor | None,
                        activation: str) -> torch.Tensor:
        from tidal_engine.kernels.triton.gemv import gemv

        return gemv(x, layer.weight, bias, layer.gemv_config, silu_and_mul=True)


# ---- layers ------------------------------------------------------------------------------
class LinearBase(nn.Module):
    """A linear of this rank: ``out_features`` rows of output over ``in_features`` inputs.

    ``output_ranges``: shard name (None for an unmerged layer) → (start in the checkpoint
    tensor, local size); ``input_range``: (start, local size) of the input columns."""

    gemv_config: Any = None  # set per layer by kernels/gemv_choice.py (CUDA, one-row inputs)
    gemv_rows_configs: dict[int, Any] | None = None  # the same per row count 2..8 (kernels/triton/gemv.py gemv_rows)
    # The activation callers may ask this layer to fold into its output (a gated MLP's gate_up:
    # "silu_and_mul"), so the start-up choice compiles those kernels before graphs are captured.
    output_activation_name: str | None = None

    def __init__(
        self,
        input_range: tuple[int, int],
        output_ranges: dict[str | None, tuple[int, int]],
        bias: bool,
        method: LinearMethod | None = None,
        full_in_features: int | None = None,
        full_output_sizes: dict[str | None, int] | None = None,
    ) -> None:
        super().__init__()
        self.full_in_features = full_in_features if full_in_features is not None else input_range[1]
        self.full_output_sizes = full_output_sizes or {s: size for s, (_, size) in output_ranges.items()}
        self.input_range = input_range
        self.output_ranges = dict(output_ranges)
        self.in_features = input_range[1]
        self.out_features = sum(size for _, size in self.output_ranges.values())
        self.shard_offsets: dict[str | None, int] = {}
        offset = 0
        for shard, (_, size) in self.output_ranges.items():
            self.shard_offsets[shard] = offset
            offset += size
        self.method = method or UnquantizedLinearMethod()
        self.method.create_weights(self, self.in_features, self.out_features, None)
        if bias:
            b = nn.Parameter(torch.empty(self.out_features), requires_grad=False)
            b.output_dim, b.input_dim = 0, None  # type: ignore[attr-defined]
            self.bias: nn.Parameter | None = b
        else:
            self.bias = None
        for param in self._parameters.values():
            if param is not None and not hasattr(param, "weight_loader"):
                param.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.delta_hooks: list[DeltaHook] = []

    @property
    def output_sizes(self) -> dict[str | None, int]:
        """Local size of each output shard (in output order)."""
        return {shard: size for shard, (_, size) in self.output_ranges.items()}

    def weight_loader(self, param: torch.Tensor, loaded: Any, shard: str | None = None) -> None:
        """Copy this rank's slice of a checkpoint tensor (one shard of a merged layer) into ``param``."""
        if shard not in self.output_ranges:
            raise ValueError(f"this layer has no shard {shard!r} (it has {sorted(map(str, self.output_ranges))})")
        out_dim = getattr(param, "output_dim", None)
        in_dim = getattr(param, "input_dim", None)
        out_pack = getattr(param, "output_pack", 1)
        in_pack = getattr(param, "input_pack", 1)
        target = param
        what = f"{shard}.{self._param_name(param)}" if shard else self._param_name(param)
        if out_dim is not None:
            start, size, offset, full = _packed(what, out_pack, *self.output_ranges[shard], self.shard_offsets[shard],
                                                self.full_output_sizes[shard])
            target = target.narrow(out_dim, offset, size)
            if in_dim is None or self.input_range[1] == self.full_in_features:
                _copy_rows(target, out_dim, loaded, start, size, full, what)
                return
            if int(loaded.shape[out_dim]) != full:
                raise ValueError(f"shape mismatch for {what}: checkpoint has {tuple(int(s) for s in loaded.shape)}, "
                                 f"model expects {full} along dimension {out_dim}")
            loaded = loaded.narrow(out_dim, start, size)
        if in_dim is not None:
            start, size, _, full = _packed(what, in_pack, *self.input_range, 0, self.full_in_features)
            _copy_rows(target, in_dim, loaded, start, size, full, what)
            return
        copy_checked(target, loaded, what)

    def _param_name(self, param: torch.Tensor) -> str:
        return next((n for n, p in self._parameters.items() if p is param), "param")

    def load(self, param_name: str, tensor: Any, shard: str | None = None) -> None:
        """Copy a checkpoint tensor (or this rank's slice of it) into ``param_name``."""
        if param_name in self.method.ignored_params:
            return
        param = getattr(self, param_name, None)
        if param is None:
            raise ValueError(f"checkpoint has a {param_name} this layer does not use")
        param.weight_loader(param, tensor, shard)

    def load_shard(self, shard: str, param_name: str, tensor: Any) -> None:
        self.load(param_name, tensor, shard)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(y.split(list(self.output_sizes.values()), dim=-1))

    def folds(self, x: torch.Tensor, activation: OutputActivation) -> bool:
        """Whether ``forward(x, output_activation=activation)`` runs the activation inside this
        layer's matmul kernel (the method has one for these rows; no delta hook, which adds to
        the output before the activation)."""
        return not self.delta_hooks and self.method.folds_activation(self, x, activation.name)

    def launch_folded(self, dtype: torch.dtype, max_rows: int) -> None:
        """Launch, once per row count up to ``max_rows``, the kernels that fold
        ``output_activation_name`` into the chosen GEMVs, so none compiles while a decode graph
        is captured (kernels/gemv_choice.py and gemv_step_choice.py call it)."""
        if self.output_activation_name is None:
            return
        device = next(self.parameters()).device
        for rows in range(1, max_rows + 1):
            x = torch.zeros(rows, self.in_features, dtype=dtype, device=device)
            if self.method.folds_activation(self, x, self.output_activation_name):
                self.method.apply_activated(self, x, self.bias, self.output_activation_name)

    def _local(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = self.method.apply(self, x, bias)
        for hook in self.delta_hooks:
            hook(x, y)
        return y

    def forward(self, x: torch.Tensor, output_activation: OutputActivation | None = None) -> torch.Tensor:
        """``x W^T + b``, then ``output_activation`` of it if given (in the matmul's kernel where
        the layer ``folds`` it)."""
        if output_activation is None:
            return self._local(x, self.bias)
        if self.folds(x, output_activation):
            return self.method.apply_activated(self, x, self.bias, output_activation.name)
        return output_activation(self._local(x, self.bias))


class Linear(LinearBase):
    """A replicated linear: the whole ``[out_features, in_features]`` weight on every rank."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, method: LinearMethod | None = None) -> None:
        super().__init__((0, in_features), {None: (0, out_features)}, bias, method)


class MergedColumnParallelLinear(LinearBase):
    """Several linears over the same input, stacked along the output dimension, each split
    over the tensor ranks (``shard_ranges`` overrides the even split, e.g. by heads)."""

    def __init__(
        self,
        in_features: int,
        output_sizes: dict[str, int],
        bias: bool = False,
        method: LinearMethod | None = None,
        shard_ranges: dict[str, tuple[int, int]] | None = None,
    ) -> None:
        layout = get_parallel()
        ranges = shard_ranges or {
            name: even_runs(size, layout.tp_size)[layout.tp_rank] for name, size in output_sizes.items()
        }
        super().__init__((0, in_features), ranges, bias, method, full_output_sizes=dict(output_sizes))


MergedLinear = MergedColumnParallelLinear  # the name the single-device code used


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k and v in one matmul; each rank keeps its query heads and the KV heads they read
    (KV heads replicated when there are fewer than ranks; distributed/partition.py)."""

    def __init__(
        self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool,
        method: LinearMethod | None = None,
    ) -> None:
        layout = get_parallel()
        heads = head_shard(num_heads, num_kv_heads, layout.tp_size, layout.tp_rank)
        self.heads = heads
        ranges = {
            "q": (heads.q_start * head_dim, heads.num_heads * head_dim),
            "k": (heads.kv_start * head_dim, heads.num_kv_heads * head_dim),
            "v": (heads.kv_start * head_dim, heads.num_kv_heads * head_dim),
        }
        sizes = {"q": num_heads * head_dim, "k": num_kv_heads * head_dim, "v": num_kv_heads * head_dim}
        super().__init__(hidden_size, sizes, bias, method, shard_ranges=ranges)


QKVLinear = QKVParallelLinear


class RowParallelLinear(LinearBase):
    """Input columns split over the tensor ranks (``input_range``: this rank's run, matching
    the column-parallel layer before it); the partial outputs are summed with one
    all-reduce. The bias is added once, by tensor rank 0, before the sum."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, method: LinearMethod | None = None,
        input_range: tuple[int, int] | None = None,
    ) -> None:
        layout = get_parallel()
        super().__init__(input_range or even_runs(in_features, layout.tp_size)[layout.tp_rank],
                         {None: (0, out_features)}, bias, method, full_in_features=in_features)
        self._adds_bias = layout.tp_rank == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tp_all_reduce(self._local(x, self.bias if self._adds_bias else None))


class VocabParallelEmbedding(nn.Module):
    """Token id → vector; each tensor rank holds a run of the (padded) vocabulary, looks up
    the ids in its run (zeros for the others) and an all-reduce completes every row."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        layout = get_parallel()
        self.vocab_size = vocab_size
        self.vocab_start, self.num_local = vocab_range(vocab_size, layout.tp_size, layout.tp_rank)
        self.sharded = layout.tp_size > 1
        weight = nn.Parameter(torch.empty(self.num_local, hidden_size), requires_grad=False)
        weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.weight = weight

    def weight_loader(self, param: torch.Tensor, loaded: Any, shard: str | None = None) -> None:
        _copy_rows(param, 0, loaded, self.vocab_start, self.num_local, self.vocab_size, "weight")

    def load(self, param_name: str, tensor: Any) -> None:
        self.weight_loader(self.weight, tensor)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.sharded:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.num_local)
        out = F.embedding(local.clamp(0, self.num_local - 1), self.weight)
        out = out * mine.unsqueeze(-1).to(out.dtype)
        return tp_all_reduce(out)


VocabEmbedding = VocabParallelEmbedding


class ParallelLMHead(LinearBase):
    """The LM head, split over the vocabulary like the embedding (so tied weights shard the
    same way); ``logits`` gathers every rank's columns and drops the padding."""

    def __init__(self, hidden_size: int, vocab_size: int, method: LinearMethod | None = None) -> None:
        layout = get_parallel()
        self.vocab_size = vocab_size
        self.padded_vocab = padded_vocab(vocab_size, layout.tp_size)
        super().__init__((0, hidden_size), {None: vocab_range(vocab_size, layout.tp_size, layout.tp_rank)}, False, method,
                         full_output_sizes={None: vocab_size})

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` → ``[N, vocab_size]`` (every rank gets all of them)."""
        local = self(hidden)
        if get_parallel().tp_size == 1:
            return local
        return tp_all_gather(local)[..., : self.vocab_size]
