"""RMSNorm, with the residual add fused in (vLLM's calling convention)."""

from __future__ import annotations

import torch
from torch import nn

from tidal_engine.kernels.fused import use_fused


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in float32, then back to the input dtype before the weight, as HF does,
        # so low-precision runs round exactly like the reference.
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``norm(x)``; or, given a residual, ``(norm(x + residual), x + residual)``."""
        if use_fused(x):
            return self._forward_triton(x, residual)
        if residual is None:
            return self._normalize(x)
        # The add happens in the model dtype, like HF's ``residual + hidden_states``.
        summed = x + residual
        return self._normalize(summed), summed

    def _forward_triton(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # One kernel instead of ~8 elementwise ones; same rounding points as _normalize.
        from tidal_engine.kernels.triton import rms_norm as k

        if residual is not None:
            return k.fused_add_rms_norm(x, residual, self.weight, self.eps)
        if x.dim() == 3:  # per-head q/k norm on a (possibly strided) [T, H, D] view
            return k.rms_norm_heads(x, self.weight, self.eps)
        return k.rms_norm(x, self.weight, self.eps)
