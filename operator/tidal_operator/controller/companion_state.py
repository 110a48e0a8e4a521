"""What a controller of one companion object (an HPA or ScaledObject, a GPU-share
ResourceClaim) reports for its condition, and how it tells that a stored object already
holds what it wants."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping


@dataclass(frozen=True)
class CompanionState:
    ok: bool
    reason: str
    message: str


def covers(have: Any, want: Any) -> bool:
    """Whether `have` holds everything `want` sets (the API server may add defaults)."""
    if isinstance(want, Mapping):
        return isinstance(have, Mapping) and all(covers(have.get(k), v) for k, v in want.items())
    if isinstance(want, list):
        return isinstance(have, list) and len(have) == len(want) and all(covers(h, w) for h, w in zip(have, want))
    return have == want
