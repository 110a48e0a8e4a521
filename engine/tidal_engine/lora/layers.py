"""LoRA on the model's linears: device slots, the per-step batch mapping, the delta.

``attach_lora`` gives every LoRA-capable linear of the model (qkv, o, gate_up, down in each
decoder layer) a ``LoRASlotWeights`` module holding ``max_loras`` adapter slots, and a
delta hook (``LinearBase.delta_hooks``) that adds the LoRA delta to the local base output,
before a row-parallel layer's all-reduce. Under tensor parallelism each rank's slots hold
its slice: A's input columns of row-parallel layers, B's output rows of column-parallel
ones (``_rank_slice``). The layers themselves are not
changed: with no adapter in the step, the hook returns at once and the base path (and the
CUDA graphs captured from it) is exactly what it was.

Slot layout, for a module with S shards (qkv: 3, gate_up: 2, o/down: 1) and maximum rank R:
``a`` ``[max_loras, S*R, in]`` (shard s's A in rows ``s*R : s*R+r``) and ``b`` ``[max_loras,
out, R]`` (shard s's B·scale in its output rows, columns ``:r``); the padding is zero, so
an adapter of rank r < R, or one that doesn't target a shard, adds exactly nothing there.

The delta for a step: rows (tokens) are grouped by slot. The torch path, used on CPU and
as the reference, does one gathered ``x[rows] @ A^T @ B^T`` per adapter in the batch; on
CUDA the Triton SGMV kernels do all segments in two launches per module.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from tidal_engine.lora.adapter import MODULE_SHARDS, LoRAAdapter

logger = logging.getLogger(__name__)


@dataclass
class LoRABatch:
    """Which rows of this step's flat batch use which slot (built once, read by every layer)."""

    # Torch path: per slot, its rows: a slice when they are one run, else an index tensor.
    groups: list[tuple[int, slice | torch.Tensor]]
    # Triton path: runs of consecutive rows with one slot (base rows are in no segment).
    seg_starts: torch.Tensor
    seg_lens: torch.Tensor
    seg_slots: torch.Tensor
    max_seg_len: int
    slots: frozenset[int]

    @classmethod
    def build(cls, runs: Sequence[tuple[int, int]], device: torch.device) -> "LoRABatch | None":
        """``runs``: (slot or -1 for the base model, number of rows) in batch order.
        Returns None when no row uses an adapter."""
        segments: list[tuple[int, int, int]] = []  # (start, length, slot)
        start = 0
        for slot, length in runs:
            if length <= 0:
                continue
            if slot >= 0:
                if segments and segments[-1][2] == slot and segments[-1][0] + segments[-1][1] == start:
                    prev = segments[-1]
                    segments[-1] = (prev[0], prev[1] + length, slot)
                else:
                    segments.append((start, length, slot))
            start += length
        if not segments:
            return None
        by_slot: dict[int, list[tuple[int, int]]] = {}
        for seg_start, length, slot in segments:
            by_slot.setdefault(slot, []).append((seg_start, length))
        groups: list[tuple[int, slice | torch.Tensor]] = []
        for slot, spans in by_slot.items():
            if len(spans) == 1:
                groups.append((slot, slice(spans[0][0], spans[0][0] + spans[0][1])))
            else:
                rows = torch.cat([torch.arange(s, s + n) for s, n in spans]).to(device)
                groups.append((slot, rows))
        table = torch.tensor(segments, dtype=torch.int32).T.contiguous().to(device)
        return cls(
            groups=groups,
            seg_starts=table[0],
            seg_lens=table[1],
            seg_slots=table[2],
            max_seg_len=max(n for _, n, _ in segments),
            slots=frozenset(by_slot),
        )


class LoRAContext:
    """The batch mapping of the step being run; shared by every hooked layer of one model."""

    def __init__(self) -> None:
        self.batch: LoRABatch | None = None


def _use_triton(x: torch.Tensor) -> bool:
    if not x.is_cuda or os.environ.get("TIDAL_LORA_TRITON", "1").strip().lower() in ("0", "false", "off", "no"):
        return False
    from tidal_engine.kernels.triton import triton_available

    return triton_available()


class LoRASlotWeights(nn.Module):
    """The adapter slots of one linear (see the module docstring for the layout)."""

    def __init__(
        self,
        in_features: int,
        shard_sizes: Sequence[int],
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.max_rank = max_rank
        self.shard_sizes = list(shard_sizes)
        self.shard_offsets = [sum(self.shard_sizes[:i]) for i in range(len(self.shard_sizes))]
        out_features = sum(self.shard_sizes)
        num_shards = len(self.shard_sizes)
        self.register_buffer(
            "a", torch.zeros(max_loras, num_shards * max_rank, in_features, dtype=dtype, device=device), persistent=False
        )
        self.register_buffer(
            "b", torch.zeros(max_loras, out_features, max_rank, dtype=dtype, device=device), persistent=False
        )
        # Slots whose adapter touches this module; the others are skipped in the forward.
        self.active: set[int] = set()

    def write(self, slot: int, shards: dict[int, tuple[torch.Tensor, torch.Tensor]] | None) -> None:
        """Fill ``slot`` with {shard index: (A [r, in], B·scale [out_shard, r])}; None clears it."""
        with torch.no_grad():
            self.a[slot].zero_()
            self.b[slot].zero_()
            if not shards:
                self.active.discard(slot)
                return
            r_max = self.max_rank
            for index, (a, b) in shards.items():
                rank = a.shape[0]
                row, size = self.shard_offsets[index], self.shard_sizes[index]
                self.a[slot, index * r_max : index * r_max + rank].copy_(a)
                self.b[slot, row : row + size, :rank].copy_(b)
            self.active.add(slot)

    def add_delta(self, x: torch.Tensor, y: torch.Tensor, batch: LoRABatch) -> None:
        """``y[rows of slot] += x[rows] A[slot]^T B[slot]^T`` for every slot in the batch, in place."""
        if not (batch.slots & self.active):
            return
        if _use_triton(x):
            self._add_delta_triton(x, y, batch)
        else:
            self._add_delta_torch(x, y, batch)

    def _add_delta_torch(self, x: torch.Tensor, y: torch.Tensor, batch: LoRABatch) -> None:
        r_max = self.max_rank
        for slot, rows in batch.groups:
            if slot not in self.active:
                continue
            shrunk = x[rows] @ self.a[slot].T  # [n, S*R]
            if len(self.shard_sizes) == 1:
                delta = shrunk @ self.b[slot].T
            else:
                delta = torch.cat(
                    [
                        shrunk[:, i * r_max : (i + 1) * r_max] @ self.b[slot, off : off + size].T
                        for i, (off, size) in enumerate(zip(self.shard_offsets, self.shard_sizes))
                    ],
                    dim=-1,
                )
            if isinstance(rows, slice):
                y[rows] += delta
            else:
                y.index_add_(0, rows, delta)

    def _add_delta_triton(self, x: torch.Tensor, y: torch.Tensor, batch: LoRABatch) -> None:
        from tidal_engine.kernels.triton.lora_sgmv import sgmv_expand, sgmv_shrink

        segs = (batch.seg_starts, batch.seg_lens, batch.seg_slots)
        shrunk = sgmv_shrink(x, self.a, *segs, batch.max_seg_len)
        r_max = self.max_rank
        for i, (off, size) in enumerate(zip(self.shard_offsets, self.shard_sizes)):
            sgmv_expand(
                shrunk.narrow(1, i * r_max, r_max),
                self.b.narrow(1, off, size),
                y.narrow(1, off, size),
                *segs,
                batch.max_seg_len,
            )


class LoRAModelSlots:
    """The slots of every LoRA-capable linear of one model, and the hooks that use them."""

    CONTAINER = "lora_slots"  # the submodule name: slot buffers move with the model on sleep/wake

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int) -> None:
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.context = LoRAContext()
        self.modules: dict[tuple[int, str], LoRASlotWeights] = {}
        self.linears: dict[tuple[int, str], nn.Module] = {}
        self._hooks: list[tuple[nn.Module, object]] = []
        self.model = model
        self._attach(model)

    def _attach(self, model: nn.Module) -> None:
        weight = next(model.parameters())
        dtype, device = weight.dtype, weight.device
        container = nn.ModuleDict()
        for index, layer in enumerate(model.layers):  # type: ignore[attr-defined]
            if not hasattr(layer, "self_attn"):
                continue  # another pipeline stage's layer
            for module_name, shards in MODULE_SHARDS.items():
                linear = layer.get_submodule(module_name)
                sizes = [linear.output_sizes[s] for s in shards] if shards != (None,) else [linear.out_features]
                slots = LoRASlotWeights(linear.in_features, sizes, self.max_loras, self.max_rank, dtype, device)
                container[f"{index}_{module_name.replace('.', '_')}"] = slots
                self.modules[(index, module_name)] = slots
                self.linears[(index, module_name)] = linear
                hook = _make_hook(slots, self.context)
                linear.delta_hooks.append(hook)
                self._hooks.append((linear, hook))
        model.add_module(self.CONTAINER, container)

    def detach(self) -> None:
        for linear, hook in self._hooks:
            linear.delta_hooks.remove(hook)
        self._hooks.clear()
        if hasattr(self.model, self.CONTAINER):
            delattr(self.model, self.CONTAINER)

    def write_slot(self, slot: int, adapter: LoRAAdapter | None) -> None:
        """Copy an adapter into ``slot`` of every module (modules it doesn't target get zeros)."""
        if not 0 <= slot < self.max_loras:
            raise IndexError(f"slot {slot} out of range (max_loras={self.max_loras})")
        for (layer, module_name), slots in self.modules.items():
            entry = adapter.weights.get((layer, module_name)) if adapter is not None else None
            if entry is None:
                slots.write(slot, None)
                continue
            order = MODULE_SHARDS[module_name]
            linear = self.linears[(layer, module_name)]
            slots.write(slot, {order.index(shard): _rank_slice(linear, shard, a, b) for shard, (a, b) in entry.items()})

    def num_bytes(self) -> int:
        return sum(s.a.numel() * s.a.element_size() + s.b.numel() * s.b.element_size() for s in self.modules.values())


def _rank_slice(linear: nn.Module, shard: str | None, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This tensor rank's part of one shard's (A ``[r, in]``, B ``[out, r]``): A's columns follow
    the layer's input run (row-parallel layers), B's rows its output run (column-parallel)."""
    in_start, in_size = linear.input_range  # type: ignore[attr-defined]
    out_start, out_size = linear.output_ranges[shard]  # type: ignore[attr-defined]
    return a[:, in_start : in_start + in_size], b[out_start : out_start + out_size]


def _make_hook(slots: LoRASlotWeights, context: LoRAContext):  # type: ignore[no-untyped-def]
    def hook(x: torch.Tensor, output: torch.Tensor) -> None:
        """Runs on the linear's local output, before a row-parallel all-reduce."""
        batch = context.batch
        if batch is None:
            return  # no adapter in this step: the base output as is
        slots.add_delta(x, output, batch)

    return hook
