"""Pick, once per weight shape and by measurement, what runs a one-row linear: cuBLAS or the
Triton GEMV (``kernels/triton/gemv.py``) with one of its tile shapes.

The model runner calls ``choose_gemv`` at start-up on CUDA (16-bit weights only: fp32 keeps
cuBLAS, so the fp32 parity tests see the same matmuls as before). Each ``Linear`` then carries
``gemv_config`` (None: cuBLAS) and uses it whenever its input has exactly one row, which is the
single-stream decode step and its CUDA graph. ``TIDAL_GEMV=0`` turns the choice off.
"""

from __future__ import annotations

import logging
import os
import statistics
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

Candidate = Any  # a GemvConfig, or None for cuBLAS


def gemv_wanted(dtype: torch.dtype) -> bool:
    enabled = os.environ.get("TIDAL_GEMV", "1").strip().lower() not in ("0", "false", "off", "no")
    return enabled and dtype in (torch.bfloat16, torch.float16)


def pick_fastest(timings: dict[Candidate, float]) -> Candidate:
    """The candidate with the lowest time; cuBLAS (None) wins ties and anything within 3%,
    so a noisy measurement never swaps a library kernel for a marginal gain."""
    baseline = timings.get(None, float("inf"))
    best, best_time = None, baseline
    for candidate, seconds in timings.items():
        if candidate is not None and seconds < best_time and seconds < 0.97 * baseline:
            best, best_time = candidate, seconds
    return best


def _time_on_device(fn: Callable[[], Any], reps: int = 20) -> float:
    for _ in range(3):
        fn()
    events = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in events) / 1e3


def choose_gemv(model: nn.Module, cache: dict[tuple[int, int, torch.dtype, bool], Candidate]) -> dict[str, int]:
    """Set ``gemv_config`` on every Linear of ``model`` (CUDA, 16-bit); ``cache`` keeps the
    choice per (N, K, dtype, bias) across model reloads (sleep level 2). Returns counts."""
    from tidal_engine.kernels.triton.gemv import GEMV_CONFIGS, gemv
    from tidal_engine.layers.linear import Linear

    chosen = {"cublas": 0, "gemv": 0}
    with torch.inference_mode():
        for module in model.modules():
            if not isinstance(module, Linear) or module.weight.numel() == 0:
                continue
            weight, bias = module.weight, module.bias
            key = (weight.shape[0], weight.shape[1], weight.dtype, bias is not None)
            if key not in cache:
                x = torch.randn(1, weight.shape[1], dtype=weight.dtype, device=weight.device)
                reference = torch.nn.functional.linear(x, weight, bias).float()
                timings: dict[Candidate, float] = {None: _time_on_device(lambda: torch.nn.functional.linear(x, weight, bias))}
                for config in GEMV_CONFIGS:
                    got = gemv(x, weight, bias, config).float()
                    # Same sums in another order: a 16-bit rounding apart, never more.
                    if not torch.allclose(got, reference, rtol=2e-2, atol=2e-2 * reference.abs().max().item()):
                        logger.warning("GEMV %s disagrees with cuBLAS on %s; not used", config, key[:2])
                        continue
                    timings[config] = _time_on_device(lambda c=config: gemv(x, weight, bias, c))
                cache[key] = pick_fastest(timings)
                logger.info("one-row linear %dx%d: %s (%s)", key[0], key[1], cache[key] or "cuBLAS",
                            ", ".join(f"{c or 'cuBLAS'}={t * 1e6:.1f}us" for c, t in timings.items()))
            module.gemv_config = cache[key]
            chosen["gemv" if cache[key] is not None else "cublas"] += 1
    return chosen


def clear_gemv(model: nn.Module) -> None:
    from tidal_engine.layers.linear import Linear

    for module in model.modules():
        if isinstance(module, Linear):
            module.gemv_config = None


__all__ = ["choose_gemv", "clear_gemv", "gemv_wanted", "pick_fastest"]
