"""Choose the one-row linears' kernels by the decode step's time, not by timing each alone.

``kernels/gemv_choice.py`` times every candidate of a weight shape alone; the tile fastest alone
is not always the fastest in the batch-1 decode step (the kernels around each linear and what
they leave in the L2 differ), and for small weights the order alone flips from run to run. So
those timings only shortlist (``note_shortlist``), and the runner
(``ModelRunner._refine_choices_in_step``) times the shortlist inside a captured batch-1 decode
step (``refine_in_step``).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

Candidate = Any  # a GemvConfig (or a quantized format's tile), or None for cuBLAS / the general path

# The one-row tile that is fastest alone is not always the fastest in the decode step: the
# kernels around it and what they leave in the L2 change the order (0.6B: up to ~7% of the step
# between two choices, benchmarks/results/h200-2026-12-01f-lead call 4; 8B: 220.5 against 214.1
# tok/s, h200-2026-12-01g-lead). So the isolated timings only shortlist, and the runner times the
# shortlist inside the batch-1 decode step (``refine_in_step``). A weight this small is read in a
# few microseconds and its order flips from run to run: every candidate is timed in the step.
IN_STEP_MAX_BYTES = 16 << 20
# A larger weight's alternatives, only where timing alone could not tell (each costs a capture
# and a few replays of the 8B cold start's 10 s): the other kind's best (a tile against the
# library kernel, or the reverse) within IN_STEP_OTHER_KIND_WITHIN of the choice alone (the 3%
# rule keeps cuBLAS on a near-tie; in the 8B step a tile then won by 2.5% on gate_up), and a tile
# within IN_STEP_LARGE_WITHIN of the fastest alone.
IN_STEP_OTHER_KIND_WITHIN = 0.05
IN_STEP_LARGE_WITHIN = 0.03
# Start-up seconds the larger weights' step timings may take, the most ambiguous shape first: a
# larger shape is compared only while those before it took less (unbounded, they added 0.66 s to
# an 8B cold start: h200-2026-12-01g-lead call 4).
IN_STEP_LARGE_BUDGET_S = 0.3


@dataclass
class StepShortlist:
    """The one-row candidates of one weight shape to time inside the decode step (the isolated
    choice first, then the rest by isolated time) and the linears of that shape."""
    candidates: list[Candidate]
    modules: list[nn.Module] = field(default_factory=list)
    small: bool = True  # at most IN_STEP_MAX_BYTES: every candidate, outside the time budget
    gap: float = 0.0  # the first alternative's time alone over the choice's, less one: how ambiguous
    dtype: torch.dtype = torch.bfloat16  # the run dtype of the activations


def shortlist(timings: dict[Candidate, float], choice: Candidate) -> list[Candidate]:
    """``choice``, then every other timed candidate, fastest alone first."""
    return [choice, *(c for c in sorted(timings, key=timings.__getitem__) if c != choice)]


def large_shortlist(timings: dict[Candidate, float], choice: Candidate) -> list[Candidate]:
    """``choice``, the fastest alone of the other kind (cuBLAS / the general path against the
    tiles) if within ``IN_STEP_OTHER_KIND_WITHIN`` of the choice, and the fastest other tile
    within ``IN_STEP_LARGE_WITHIN`` of the fastest alone."""
    ranked = sorted(timings, key=timings.__getitem__)
    other_kind = next((c for c in ranked if (c is None) != (choice is None)
                       and timings[c] <= timings[choice] * (1 + IN_STEP_OTHER_KIND_WITHIN)), choice)
    near_tie = next((c for c in ranked if c is not None and c not in (choice, other_kind)
                     and timings[c] <= timings[ranked[0]] * (1 + IN_STEP_LARGE_WITHIN)), choice)
    return list(dict.fromkeys([choice, other_kind, near_tie]))


def note_shortlist(shortlists: dict[Any, StepShortlist] | None, key: Any, timings: dict[Candidate, float],
                    choice: Candidate, weight_bytes: int, dtype: torch.dtype) -> None:
    """Add ``key``'s shortlist (from its isolated ``timings``) when it has more than one candidate."""
    if shortlists is None:
        return
    small = weight_bytes <= IN_STEP_MAX_BYTES
    candidates = shortlist(timings, choice) if small else large_shortlist(timings, choice)
    if len(candidates) > 1:
        shortlists[key] = StepShortlist(candidates, small=small, gap=timings[candidates[1]] / timings[choice] - 1,
                                        dtype=dtype)


def refine_in_step(shortlists: dict[Any, StepShortlist], cache: dict[Any, Candidate],
                   compare_steps: Callable[[list[Callable[[], None]]], list[float]], min_gain: float = 0.005,
                   large_budget_s: float = IN_STEP_LARGE_BUDGET_S,
                   clock: Callable[[], float] = time.perf_counter) -> dict[str, dict[str, float]]:
    """Choose each shortlisted shape's one-row candidate by the decode step's time: one pass of
    coordinate descent, each shape's candidates compared in one ``compare_steps`` call (one
    setup per candidate, which sets that shape's linears to it; the other shapes stay at their
    current choice; returns the step's seconds under each). The choice is the first candidate
    (the current one first) within ``min_gain`` of the fastest, so noise never swaps. Small
    weights' shapes come first; the larger ones', most ambiguous first, each only if the larger
    shapes timed so far took under ``large_budget_s``. Updates ``cache`` and the linears' ``gemv_config``;
    returns the step times per shape and candidate."""
    report: dict[str, dict[str, float]] = {}
    for entry in shortlists.values():
        _launch_folded(entry)
    ordered = [k for k, e in shortlists.items() if e.small] + sorted(
        (k for k, e in shortlists.items() if not e.small), key=lambda k: shortlists[k].gap)
    large_started: float | None = None
    for key in ordered:
        entry = shortlists[key]
        if not entry.small:
            large_started = clock() if large_started is None else large_started
            if clock() - large_started >= large_budget_s:
                break
        candidates = list(dict.fromkeys([cache[key], *entry.candidates]))  # the current choice first
        seconds = compare_steps([functools.partial(_set_one_row, entry.modules, c) for c in candidates])
        # The first candidate (the current choice, then by time alone) within min_gain of the fastest.
        cache[key] = next(c for c, t in zip(candidates, seconds) if t <= min(seconds) * (1 + min_gain))
        _set_one_row(entry.modules, cache[key])
        times = {str(c): t for c, t in zip(candidates, seconds)}
        report[f"{key[0]}x{key[1]}"] = times
        logger.info("one-row linear %dx%d in the decode step: %s (%s)", key[0], key[1], cache[key] or "general path",
                    ", ".join(f"{c}={t * 1e6:.1f}us" for c, t in times.items()))
    return report


def _launch_folded(entry: StepShortlist) -> None:
    """Launch each candidate's activation-folded form once (every plain form ran while timed
    alone), so that no kernel is first launched while a step is captured."""
    module = entry.modules[0]
    chosen = module.gemv_config
    for candidate in entry.candidates:
        module.gemv_config = candidate
        module.launch_folded(entry.dtype, 1)
    module.gemv_config = chosen


def _set_one_row(modules: list[nn.Module], candidate: Candidate) -> None:
    for module in modules:
        module.gemv_config = candidate


__all__ = ["IN_STEP_LARGE_BUDGET_S", "IN_STEP_LARGE_WITHIN", "IN_STEP_MAX_BYTES", "IN_STEP_OTHER_KIND_WITHIN",
           "Candidate", "StepShortlist", "large_shortlist", "note_shortlist", "refine_in_step", "shortlist"]
