"""Pick, once per weight shape and by measurement, what runs a one-row linear: cuBLAS or the
Triton GEMV (``kernels/triton/gemv.py``) with one of its tile shapes.

The model runner calls ``choose_gemv`` at start-up on CUDA (16-bit weights only: fp32 keeps
cuBLAS, so the fp32 parity tests see the same matmuls as before). Each ``Linear`` then carries
``gemv_config`` (None: cuBLAS) and uses it whenever its input has exactly one row, which is the
single-stream decode step and its CUDA graph; ``gemv_rows_configs`` (row count → config or None)
for 2 to ``GEMV_ROWS_MAX`` rows: the few-row GEMV, chosen per row bucket 2 / 4 / 8 (key kinds
``bfloat16r2`` ... ``bfloat16r8``; a speculative verify step of one sequence has k + 1 rows, a
small decode batch B). ``TIDAL_GEMV=0`` turns the choice off.

Quantized linears whose method has a small-batch kernel (quantization/base.py's
``SmallBatchKernel``: FP8 and INT4) get the same treatment against their own general path
(``_scaled_mm``, the INT4 GEMM): once for one row (``gemv_config``) and once for
``GEMV_MAX_ROWS`` rows (``gemv_config_few``, used for 2 to that many rows). Their keys carry
the format and the row count instead of a torch dtype (``fp8r1``, ``int4g128r4``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tidal_engine.kernels.gemv_step_choice import Candidate, StepShortlist, note_shortlist

logger = logging.getLogger(__name__)


def gemv_wanted(dtype: torch.dtype) -> bool:
    enabled = os.environ.get("TIDAL_GEMV", "1").strip().lower() not in ("0", "false", "off", "no")
    return enabled and dtype in (torch.bfloat16, torch.float16)


def is_device_fault(exc: BaseException) -> bool:
    """A kernel faulted on the device (an illegal address, say): the error is sticky, every later
    CUDA call of the process fails, so it must end start-up rather than count as a bad tile."""
    accelerator_error = getattr(torch, "AcceleratorError", None)
    return (accelerator_error is not None and isinstance(exc, accelerator_error)) or "CUDA error" in str(exc)


def pick_fastest(timings: dict[Candidate, float]) -> Candidate:
    """The candidate with the lowest time; cuBLAS (None) wins ties and anything within 3%,
    so a noisy measurement never swaps a library kernel for a marginal gain."""
    baseline = timings.get(None, float("inf"))
    best, best_time = None, baseline
    for candidate, seconds in timings.items():
        if candidate is not None and seconds < best_time and seconds < 0.97 * baseline:
            best, best_time = candidate, seconds
    return best


def time_in_graphs(fns: dict[Candidate, Callable[[Any], Any]], weights: list[Any], calls: int = 32,
                   rounds: int = 5) -> dict[Candidate, float]:
    """Seconds per ``fn(weight)`` call of each candidate's ``fn`` as the decode step runs it:
    ``calls`` calls captured in one CUDA graph per candidate (so launch overhead, which differs
    between cuBLAS and Triton, doesn't count; inside the engine's graphs there is none), cycling
    through ``weights`` so repeated calls don't read the same bytes from L2. The graphs replay
    in turn, ``rounds`` times, and each candidate keeps its fastest replay: the H200 now and then
    runs a stretch of work up to 10x slower (benchmarks/results/h200-2026-12-02-lead), and timed
    one after the other, whichever candidates fell in that stretch lost."""
    for fn in fns.values():
        for w in weights[:2]:
            fn(w)  # compile / pick the cuBLAS kernel outside the capture
    torch.cuda.synchronize()
    graphs = {}
    for candidate, fn in fns.items():
        graphs[candidate] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[candidate]):
            for i in range(calls):
                fn(weights[i % len(weights)])
        graphs[candidate].replay()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for candidate, graph in graphs.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            best[candidate] = min(best[candidate], start.elapsed_time(end) / 1e3 / calls)
    del graphs
    return best


def time_in_graph(fn: Callable[[Any], Any], weights: list[Any], calls: int = 32) -> float:
    """``time_in_graphs`` of one function."""
    return time_in_graphs({None: fn}, weights, calls)[None]


def rotation_copies(weight: torch.Tensor, l2_bytes: int = 64 << 20) -> list[torch.Tensor]:
    """The weight plus enough copies that cycling through them overflows the L2 cache."""
    nbytes = weight.numel() * weight.element_size()
    count = max(1, min(16, -(-2 * l2_bytes // max(nbytes, 1))))
    return [weight] + [weight.clone() for _ in range(count - 1)]


def rotation_sets(tensors: tuple[torch.Tensor, ...], l2_bytes: int = 64 << 20) -> list[tuple[torch.Tensor, ...]]:
    """As ``rotation_copies`` for a matmul that reads several tensors (weights and scales)."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    count = max(1, min(16, -(-2 * l2_bytes // max(nbytes, 1))))
    return [tensors] + [tuple(t.clone() for t in tensors) for _ in range(count - 1)]


def _choose_small_batch(module: nn.Module, cache: dict[Any, Candidate], dtype: torch.dtype,
                        shortlists: dict[Any, StepShortlist] | None = None) -> bool:
    """Time a quantized linear's small-batch kernel candidates against its general path at one
    row and at ``GEMV_MAX_ROWS`` rows of ``dtype`` activations; set ``gemv_config`` /
    ``gemv_config_few``. Returns whether the one-row input uses the kernel."""
    from tidal_engine.quantization.base import GEMV_MAX_ROWS

    method, bias = module.method, module.bias
    weights = method.gemv_weights(module)
    if weights[0].numel() == 0:
        return False
    kind = method.gemv_kind(module)
    copies: list[tuple[torch.Tensor, ...]] | None = None
    # A gate|up linear is timed as the decode step runs it (as ``one_row_as_in_the_step`` does for
    # 16-bit weights): the folded kernel where the tile folds, else the matmul then the activation.
    activated = method.times_output_activation and getattr(module, "output_activation_name", None) == "silu_and_mul"
    for rows, attr in ((1, "gemv_config"), (GEMV_MAX_ROWS, "gemv_config_few")):
        key = (module.out_features, module.in_features, f"{kind}r{rows}", bias is not None)
        if key not in cache:
            if copies is None:
                copies = rotation_sets(weights)
            x = torch.randn(rows, module.in_features, dtype=dtype, device=weights[0].device)
            reference = method.run_general(module, x, weights, bias).float()
            runs: dict[Candidate, Callable[[Any], Any]] = {None: lambda ws: method.run_general(module, x, ws, bias)}
            if activated:
                from tidal_engine.kernels.triton.activation import silu_and_mul

                runs[None] = lambda ws: silu_and_mul(method.run_general(module, x, ws, bias))
            for config in method.gemv_candidates:
                try:
                    got = method.run_gemv(module, x, weights, bias, config).float()
                    folded = method.run_gemv_activated(module, x, weights, bias, config, "silu_and_mul").float() \
                        if activated else None
                except ValueError:  # the tile does not fit this shape
                    continue
                except Exception as exc:  # e.g. Triton out of resources on this GPU: not a candidate here
                    if is_device_fault(exc):
                        raise  # the CUDA context is unusable after a fault: skipping would hide it
                    logger.warning("small-batch kernel %s failed on %s: %s; not used", config, key, exc)
                    continue
                # The general path may quantize the activations (W8A8) where the kernel does not:
                # this only catches a broken kernel, not a rounding difference.
                if not torch.allclose(got, reference, rtol=0.1, atol=0.1 * reference.abs().max().item()):
                    logger.warning("small-batch kernel %s disagrees with the general path on %s; not used", config, key)
                    continue
                if folded is None:
                    runs[config] = lambda ws, c=config: method.run_gemv(module, x, ws, bias, c)
                    continue
                # An activation folded into the epilogue must give that of the plain kernel's output.
                expected = silu_and_mul(got.to(dtype)).float()
                if not torch.allclose(folded, expected, rtol=0.1, atol=0.1 * expected.abs().max().item()):
                    logger.warning("small-batch kernel %s with SiLU-and-mul disagrees with its plain form on %s; "
                                   "not used", config, key)
                    continue
                runs[config] = lambda ws, c=config: method.run_gemv_activated(module, x, ws, bias, c, "silu_and_mul")
            timings = time_in_graphs(runs, copies)
            cache[key] = pick_fastest(timings)
            logger.info("%d-row %s linear %dx%d: %s (%s)", rows, kind, key[0], key[1], cache[key] or "general path",
                        ", ".join(f"{c or 'general'}={t * 1e6:.1f}us" for c, t in timings.items()))
            if rows == 1:
                note_shortlist(shortlists, key, timings, cache[key], sum(t.numel() * t.element_size() for t in weights),
                               dtype)
        setattr(module, attr, cache[key])
        if rows == 1 and shortlists is not None and key in shortlists:
            shortlists[key].modules.append(module)
    del copies
    method.warm_up(module, dtype)
    return module.gemv_config is not None


def _choose_few_rows(weight: torch.Tensor, bias: torch.Tensor | None, cache: dict[Any, Candidate],
                     copies: list[torch.Tensor] | None) -> dict[int, Candidate] | None:
    """The few-row GEMV tile for a 16-bit weight, per row bucket of ``GEMV_ROW_BUCKETS`` (timed
    at the bucket's row count against cuBLAS; key kind ``bfloat16r2`` / ``r4`` / ``r8``). Returns
    row count (2..GEMV_ROWS_MAX) → its bucket's choice, or None when cuBLAS won every bucket."""
    from tidal_engine.kernels.triton.gemv import GEMV_ROW_BUCKETS, GEMV_ROWS_CONFIGS, gemv_rows

    per_bucket: dict[int, Candidate] = {}
    for rows in GEMV_ROW_BUCKETS:
        key = (weight.shape[0], weight.shape[1], f"{str(weight.dtype).removeprefix('torch.')}r{rows}", bias is not None)
        if key not in cache:
            copies = copies or rotation_copies(weight)
            x = torch.randn(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
            reference = torch.nn.functional.linear(x, weight, bias).float()
            runs: dict[Candidate, Callable[[Any], Any]] = {None: lambda w: torch.nn.functional.linear(x, w, bias)}
            for config in GEMV_ROWS_CONFIGS:
                try:
                    got = gemv_rows(x, weight, bias, config).float()
                except Exception as exc:  # e.g. Triton out of shared memory on this GPU: not a candidate here
                    if is_device_fault(exc):
                        raise  # the CUDA context is unusable after a fault: skipping would hide it
                    logger.warning("few-row GEMV %s failed on %s: %s; not used", config, key[:2], exc)
                    continue
                if not torch.allclose(got, reference, rtol=2e-2, atol=2e-2 * reference.abs().max().item()):
                    logger.warning("few-row GEMV %s disagrees with cuBLAS on %s; not used", config, key[:2])
                    continue
                runs[config] = lambda w, c=config: gemv_rows(x, w, bias, c)
            timings = time_in_graphs(runs, copies)
            cache[key] = pick_fastest(timings)
            logger.info("%d-row linear %dx%d: %s (%s)", rows, key[0], key[1], cache[key] or "cuBLAS",
                        ", ".join(f"{c or 'cuBLAS'}={t * 1e6:.1f}us" for c, t in timings.items()))
        per_bucket[rows] = cache[key]
    if all(c is None for c in per_bucket.values()):
        return None
    return {m: per_bucket[min(b for b in GEMV_ROW_BUCKETS if b >= m)] for m in range(2, max(GEMV_ROW_BUCKETS) + 1)}


def _run_dtype(module: nn.Module, fallback: torch.dtype) -> torch.dtype:
    """The dtype of the module's first 16-bit parameter (the model's run dtype), else ``fallback``."""
    for t in module.parameters():
        if t.dtype in (torch.bfloat16, torch.float16):
            return t.dtype
    return fallback


def one_row_as_in_the_step(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           config: Candidate, silu_and_mul: bool = False) -> torch.Tensor:
    """A one-row linear as the decode step runs it with ``config`` (None: cuBLAS). A gate|up
    weight (``silu_and_mul``) runs the folded GEMV where the tile holds gate/up pairs, and
    otherwise the matmul then the activation kernel: timing the plain matmul alone would hide
    that kernel (in the 8B step a tile that cannot fold lost ~2.5% to one that can,
    benchmarks/results/h200-2026-12-02-lead)."""
    from tidal_engine.kernels.triton.activation import silu_and_mul as activate
    from tidal_engine.kernels.triton.gemv import gemv, tile_folds_silu_and_mul

    if silu_and_mul and tile_folds_silu_and_mul(config, weight.shape[0]):
        return gemv(x, weight, bias, config, silu_and_mul=True)
    y = torch.nn.functional.linear(x, weight, bias) if config is None else gemv(x, weight, bias, config)
    return activate(y) if silu_and_mul else y


def choose_gemv(model: nn.Module, cache: dict[tuple[int, int, torch.dtype, bool], Candidate],
                dtype: torch.dtype | None = None, few_rows: bool = True,
                shortlists: dict[Any, StepShortlist] | None = None) -> dict[str, int]:
    """Set ``gemv_config`` on every Linear of ``model`` (CUDA, 16-bit); ``cache`` keeps the
    choice per (N, K, dtype, bias) across model reloads (sleep level 2). ``dtype`` is the run
    dtype (the activations of quantized linears; default: the model's first 16-bit parameter).
    ``few_rows``: also time and set the few-row tiles (``gemv_rows_configs``).
    ``shortlists``: filled, for each one-row key timed now that has more than one candidate
    worth timing in the decode step, with those candidates and its linears
    (kernels/gemv_step_choice.py).
    Returns counts (quantized linears count as "gemv" when their one-row input uses the kernel)."""
    from tidal_engine.kernels.triton.gemv import GEMV_CONFIGS, GEMV_ROWS_MAX, gemv
    from tidal_engine.layers.linear import LinearBase, UnquantizedLinearMethod
    from tidal_engine.quantization.base import SmallBatchKernel

    chosen = {"cublas": 0, "gemv": 0}
    run_dtype = dtype or _run_dtype(model, torch.bfloat16)
    with torch.inference_mode():
        for module in model.modules():
            if isinstance(module, LinearBase) and isinstance(module.method, SmallBatchKernel):
                chosen["gemv" if _choose_small_batch(module, cache, run_dtype, shortlists) else "cublas"] += 1
                module.launch_folded(run_dtype, GEMV_ROWS_MAX)
                continue
            if not isinstance(module, LinearBase) or not isinstance(module.method, UnquantizedLinearMethod) \
                    or module.weight.numel() == 0:
                continue
            weight, bias = module.weight, module.bias
            key = (weight.shape[0], weight.shape[1], weight.dtype, bias is not None)
            copies: list[torch.Tensor] | None = None
            if key not in cache:
                x = torch.randn(1, weight.shape[1], dtype=weight.dtype, device=weight.device)
                reference = torch.nn.functional.linear(x, weight, bias).float()
                copies = rotation_copies(weight)
                activated = getattr(module, "output_activation_name", None) == "silu_and_mul"
                runs: dict[Candidate, Callable[[Any], Any]] = {
                    None: lambda w: one_row_as_in_the_step(x, w, bias, None, activated)
                }
                for config in GEMV_CONFIGS:
                    got = gemv(x, weight, bias, config).float()
                    # Same sums in another order: a 16-bit rounding apart, never more.
                    if not torch.allclose(got, reference, rtol=2e-2, atol=2e-2 * reference.abs().max().item()):
                        logger.warning("GEMV %s disagrees with cuBLAS on %s; not used", config, key[:2])
                        continue
                    runs[config] = lambda w, c=config: one_row_as_in_the_step(x, w, bias, c, activated)
                timings = time_in_graphs(runs, copies)
                cache[key] = pick_fastest(timings)
                logger.info("one-row linear %dx%d: %s (%s)", key[0], key[1], cache[key] or "cuBLAS",
                            ", ".join(f"{c or 'cuBLAS'}={t * 1e6:.1f}us" for c, t in timings.items()))
                note_shortlist(shortlists, key, timings, cache[key], weight.numel() * weight.element_size(),
                               weight.dtype)
            module.gemv_config = cache[key]
            if shortlists is not None and key in shortlists:
                shortlists[key].modules.append(module)
            if few_rows:
                module.gemv_rows_configs = _choose_few_rows(weight, bias, cache, copies)
            del copies
            module.launch_folded(weight.dtype, GEMV_ROWS_MAX)
            chosen["gemv" if cache[key] is not None else "cublas"] += 1
    return chosen


def launch_candidates(model: nn.Module, cache: dict[Any, Candidate], few_rows: bool = True) -> int:
    """Launch every GEMV tile (one-row, and few-row at each row bucket) once on each 16-bit
    weight shape ``choose_gemv`` has yet to time, with made-up inputs: under a compile-ahead dry
    run (kernels/compile_ahead.py) this hands the tiles' compiles to its pool. Returns the
    launches made."""
    from tidal_engine.kernels.triton.gemv import GEMV_CONFIGS, GEMV_ROW_BUCKETS, GEMV_ROWS_CONFIGS, gemv, gemv_rows
    from tidal_engine.layers.linear import LinearBase, UnquantizedLinearMethod

    launched, shapes = 0, set()
    with torch.inference_mode():
        for module in model.modules():
            if not isinstance(module, LinearBase) or not isinstance(module.method, UnquantizedLinearMethod) \
                    or module.weight.numel() == 0 or module.weight.dtype not in (torch.bfloat16, torch.float16):
                continue
            weight, bias = module.weight, module.bias
            dtype_name = str(weight.dtype).removeprefix("torch.")
            buckets = GEMV_ROW_BUCKETS if few_rows else ()
            for rows, kernel, configs in [(1, gemv, GEMV_CONFIGS)] + [(r, gemv_rows, GEMV_ROWS_CONFIGS)
                                                                     for r in buckets]:
                kind = weight.dtype if rows == 1 else f"{dtype_name}r{rows}"
                key = (weight.shape[0], weight.shape[1], kind, bias is not None)
                if key in cache or key in shapes:
                    continue
                shapes.add(key)
                x = torch.empty(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
                # A gate|up weight's tiles may be timed in the decode step, with SiLU-and-mul folded in.
                fold = rows == 1 and getattr(module, "output_activation_name", None) == "silu_and_mul"
                for config in configs:
                    for folded in (False, True) if fold else (False,):
                        try:
                            kernel(x, weight, bias, config, silu_and_mul=True) if folded else kernel(x, weight, bias, config)
                        except ValueError:
                            continue
                        launched += 1
    return launched


ChoiceKey = tuple[int, int, Any, bool]  # (N, K, torch dtype or a quantized kind such as "fp8r1", bias)


def load_choices(path: Path, candidates: tuple[Any, ...]) -> dict[ChoiceKey, Candidate]:
    """The choices stored in ``path`` (kernels/compile_cache.py) that are still candidates
    (``candidates`` for 16-bit weights, the formats' own for quantized kinds)."""
    from tidal_engine.kernels.compile_cache import decode_choice, read_json

    choices: dict[ChoiceKey, Candidate] = {}
    for key, data in read_json(path).items():
        try:
            shape, dtype_name, bias = key.split(":")
            n, k = (int(x) for x in shape.split("x"))
        except ValueError:
            continue
        dtype = getattr(torch, dtype_name, None)
        if isinstance(dtype, torch.dtype):
            known, choice = decode_choice(data, candidates)
        else:
            kind_candidates = _quantized_candidates(dtype_name)
            if kind_candidates is None:
                continue
            dtype = dtype_name
            known, choice = decode_choice(data, kind_candidates)
        if known:
            choices[(n, k, dtype, bias == "bias")] = choice
    return choices


def _quantized_candidates(kind: str) -> tuple[Any, ...] | None:
    """The small-batch kernel candidates of a quantized kind (``fp8r1``, ``int4g64r4``...), or
    of the 16-bit few-row GEMV (``bfloat16r8``, ``float16r8``)."""
    if kind.startswith(("bfloat16r", "float16r")):
        from tidal_engine.kernels.triton.gemv import GEMV_ROWS_CONFIGS

        return GEMV_ROWS_CONFIGS
    if kind.startswith("fp8r"):
        from tidal_engine.kernels.triton.quant_fp8 import FP8_GEMV_CONFIGS

        return FP8_GEMV_CONFIGS
    if kind.startswith("int4g"):
        from tidal_engine.kernels.triton.quant_int4 import INT4_GEMV_CONFIGS

        return INT4_GEMV_CONFIGS
    return None


def save_choices(path: Path, choices: dict[ChoiceKey, Candidate]) -> None:
    from tidal_engine.kernels.compile_cache import encode_choice, shape_key, write_json_atomic

    write_json_atomic(path, {shape_key(n, k, dtype, bias): encode_choice(c) for (n, k, dtype, bias), c in choices.items()})


def choices_file(cache_dir: Path) -> Path:
    """This GPU's and these versions' file of choices under the start-up cache."""
    import triton

    from tidal_engine.kernels.compile_cache import gemv_cache_key
    from tidal_engine.kernels.triton.gemv import GEMV_CONFIGS
    from tidal_engine.kernels.triton.quant_fp8 import FP8_GEMV_CONFIGS
    from tidal_engine.kernels.triton.quant_int4 import INT4_GEMV_CONFIGS

    # A new FP8 or INT4 candidate must be timed, not lost behind a stored choice that is still a candidate.
    versions = {"torch": torch.__version__, "triton": triton.__version__, "candidates": repr(GEMV_CONFIGS),
                "fp8_candidates": repr(FP8_GEMV_CONFIGS), "int4_candidates": repr(INT4_GEMV_CONFIGS),
                "cuda": str(torch.version.cuda)}
    return cache_dir / "gemv" / f"{gemv_cache_key(torch.cuda.get_device_name(), versions)}.json"


__all__ = ["choices_file", "choose_gemv", "one_row_as_in_the_step", "gemv_wanted", "is_device_fault", "launch_candidates",
           "load_choices", "pick_fastest", "rotation_copies", "save_choices", "time_in_graph",
           "time_in_graphs"]
