"""Linear layers and the vocabulary embedding.

Every weight of a model goes through these classes, so that tensor parallelism and
quantization have one place to hook in later. For now they are plain and unsharded.
Merged layers (QKV, gate+up) hold several checkpoint tensors stacked along the output
dimension; ``load_shard`` copies one of them into its row range.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    """Copy a checkpoint tensor into a parameter (casting dtype/device), shapes must agree."""
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"shape mismatch for {what}: checkpoint has {tuple(src.shape)}, model expects {tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(src)


class Linear(nn.Module):
    """``y = x W^T + b`` with W ``[out_features, in_features]``.

    ``gemv_config`` (set by ``kernels.gemv_choice`` on CUDA, where it measured faster) routes
    one-row inputs, the single-stream decode step, to the Triton GEMV instead of cuBLAS.
    """

    gemv_config: Any = None

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemv_config is not None and x.dim() == 2 and x.shape[0] == 1:
            from tidal_engine.kernels.triton.gemv import gemv

            return gemv(x, self.weight, self.bias, self.gemv_config)
        return F.linear(x, self.weight, self.bias)

    def load(self, param_name: str, tensor: torch.Tensor) -> None:
        """Copy a checkpoint tensor into ``weight`` or ``bias``."""
        param = getattr(self, param_name)
        if param is None:
            raise ValueError(f"checkpoint has a {param_name} this layer does not use")
        copy_checked(param, tensor, param_name)


class MergedLinear(Linear):
    """Several linears over the same input, stacked along the output dimension."""

    def __init__(self, in_features: int, output_sizes: dict[str, int], bias: bool = False) -> None:
        super().__init__(in_features, sum(output_sizes.values()), bias)
        self.output_sizes = dict(output_sizes)
        self.shard_offsets: dict[str, int] = {}
        offset = 0
        for shard, size in self.output_sizes.items():
            self.shard_offsets[shard] = offset
            offset += size

    def load_shard(self, shard: str, param_name: str, tensor: torch.Tensor) -> None:
        """Copy the checkpoint tensor of one shard (e.g. 'k') into its rows."""
        param = getattr(self, param_name)
        if param is None:
            raise ValueError(f"checkpoint has a {param_name} this layer does not use")
        start, size = self.shard_offsets[shard], self.output_sizes[shard]
        copy_checked(param[start : start + size], tensor, f"{shard}.{param_name}")

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(y.split(list(self.output_sizes.values()), dim=-1))


class QKVLinear(MergedLinear):
    """q, k and v projections in one matmul."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool) -> None:
        super().__init__(
            hidden_size,
            {"q": num_heads * head_dim, "k": num_kv_heads * head_dim, "v": num_kv_heads * head_dim},
            bias,
        )


class VocabEmbedding(nn.Module):
    """Token id → vector lookup (the vocabulary-parallel split would go here)."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)

    def load(self, param_name: str, tensor: torch.Tensor) -> None:
        copy_checked(self.weight, tensor, param_name)
