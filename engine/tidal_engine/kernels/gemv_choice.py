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
from pathlib import Path
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


def time_in_graph(fn: Callable[[torch.Tensor], Any], weights: list[torch.Tensor], calls: int = 32) -> float:
    """Seconds per ``fn(weight)`` call as the decode step runs it: many calls captured in one
    CUDA graph (so launch overhead, which differs between cuBLAS and Triton, doesn't count;
    inside the engine's graphs there is none), cycling through ``weights`` so repeated calls
    don't read the same bytes from L2."""
    for w in weights[:2]:
        fn(w)  # compile / pick the cuBLAS kernel outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(weights[i % len(weights)])
    graph.replay()
    samples = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / calls)
    del graph
    return statistics.median(samples)


def rotation_copies(weight: torch.Tensor, l2_bytes: int = 64 << 20) -> list[torch.Tensor]:
    """The weight plus enough copies that cycling through them overflows the L2 cache."""
    nbytes = weight.numel() * weight.element_size()
    count = max(1, min(16, -(-2 * l2_bytes // max(nbytes, 1))))
    return [weight] + [weight.clone() for _ in range(count - 1)]


def choose_gemv(model: nn.Module, cache: dict[tuple[int, int, torch.dtype, bool], Candidate]) -> dict[str, int]:
    """Set ``gemv_config`` on every Linear of ``model`` (CUDA, 16-bit); ``cache`` keeps the
    choice per (N, K, dtype, bias) across model reloads (sleep level 2). Returns counts."""
    from tidal_engine.kernels.triton.gemv import GEMV_CONFIGS, gemv
    from tidal_engine.layers.linear import LinearBase, UnquantizedLinearMethod

    chosen = {"cublas": 0, "gemv": 0}
    with torch.inference_mode():
        for module in model.modules():
            if not isinstance(module, LinearBase) or not isinstance(module.method, UnquantizedLinearMethod) \
                    or module.weight.numel() == 0:
                continue
            weight, bias = module.weight, module.bias
            key = (weight.shape[0], weight.shape[1], weight.dtype, bias is not None)
            if key not in cache:
                x = torch.randn(1, weight.shape[1], dtype=weight.dtype, device=weight.device)
                reference = torch.nn.functional.linear(x, weight, bias).float()
                copies = rotation_copies(weight)
                timings: dict[Candidate, float] = {
                    None: time_in_graph(lambda w: torch.nn.functional.linear(x, w, bias), copies)
                }
                for config in GEMV_CONFIGS:
                    got = gemv(x, weight, bias, config).float()
                    # Same sums in another order: a 16-bit rounding apart, never more.
                    if not torch.allclose(got, reference, rtol=2e-2, atol=2e-2 * reference.abs().max().item()):
                        logger.warning("GEMV %s disagrees with cuBLAS on %s; not used", config, key[:2])
                        continue
                    timings[config] = time_in_graph(lambda w, c=config: gemv(x, w, bias, c), copies)
                del copies
                cache[key] = pick_fastest(timings)
                logger.info("one-row linear %dx%d: %s (%s)", key[0], key[1], cache[key] or "cuBLAS",
                            ", ".join(f"{c or 'cuBLAS'}={t * 1e6:.1f}us" for c, t in timings.items()))
            module.gemv_config = cache[key]
            chosen["gemv" if cache[key] is not None else "cublas"] += 1
    return chosen


ChoiceKey = tuple[int, int, torch.dtype, bool]


def load_choices(path: Path, candidates: tuple[Any, ...]) -> dict[ChoiceKey, Candidate]:
    """The choices stored in ``path`` (kernels/compile_cache.py) that are still candidates."""
    from tidal_engine.kernels.compile_cache import decode_choice, read_json

    choices: dict[ChoiceKey, Candidate] = {}
    for key, data in read_json(path).items():
        try:
            shape, dtype_name, bias = key.split(":")
            n, k = (int(x) for x in shape.split("x"))
            dtype = getattr(torch, dtype_name)
        except (ValueError, AttributeError):
            continue
        known, choice = decode_choice(data, candidates)
        if known and isinstance(dtype, torch.dtype):
            choices[(n, k, dtype, bias == "bias")] = choice
    return choices


def save_choices(path: Path, choices: dict[ChoiceKey, Candidate]) -> None:
    from tidal_engine.kernels.compile_cache import encode_choice, shape_key, write_json_atomic

    write_json_atomic(path, {shape_key(n, k, dtype, bias): encode_choice(c) for (n, k, dtype, bias), c in choices.items()})


def choices_file(cache_dir: Path) -> Path:
    """This GPU's and these versions' file of choices under the start-up cache."""
    import triton

    from tidal_engine.kernels.compile_cache import gemv_cache_key
    from tidal_engine.kernels.triton.gemv import GEMV_CONFIGS

    versions = {"torch": torch.__version__, "triton": triton.__version__, "candidates": repr(GEMV_CONFIGS),
                "cuda": str(torch.version.cuda)}
    return cache_dir / "gemv" / f"{gemv_cache_key(torch.cuda.get_device_name(), versions)}.json"


__all__ = ["choices_file", "choose_gemv", "gemv_wanted", "load_choices", "pick_fastest", "rotation_copies",
           "save_choices", "time_in_graph"]
