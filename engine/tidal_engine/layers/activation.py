"""Activations of gated MLPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tidal_engine.kernels.fused import use_fused


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` for the merged ``[..., 2 * d]`` output of gate_up_proj. Passed to
    gate_up_proj as its ``output_activation`` (layers/linear.py), whose decode GEMV applies it
    in its epilogue; this module runs it everywhere else."""

    name = "silu_and_mul"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_fused(x):  # one Triton kernel on CUDA (fp32 inside, one rounding)
            from tidal_engine.kernels.triton.activation import silu_and_mul

            return silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
