"""gpu_memory_utilization as a cap (runner/memory_budget.py): the arithmetic on made-up figures."""

from __future__ import annotations

import pytest

from tidal_engine.runner.memory_budget import (
    GraphShapes,
    InsufficientDeviceMemoryError,
    ProfiledMemory,
    activation_bytes_per_token,
    check_free_memory,
    graph_pool_bytes,
    kv_cache_budget,
    requested_bytes,
)

GiB = 1 << 30
TOTAL = 140 * GiB


def test_start_is_refused_when_free_memory_is_below_the_share() -> None:
    check_free_memory(free=TOTAL // 2, total=TOTAL, utilization=0.45)  # a neighbour holds half: 0.45 fits
    with pytest.raises(InsufficientDeviceMemoryError, match=r"70.00 GiB free of 140.00 GiB.*at most 0\.495"):
        check_free_memory(free=TOTAL // 2, total=TOTAL, utilization=0.9)


def _profile(**kw: int) -> ProfiledMemory:
    base = dict(total=TOTAL, free_before_load=TOTAL - GiB, free_after_profile=TOTAL - GiB - 24 * GiB,
                torch_peak=22 * GiB, torch_reserved=23 * GiB, scratch_bytes=2 * GiB)
    base.update(kw)
    return ProfiledMemory(**base)


def test_kv_budget_is_the_share_minus_everything_else() -> None:
    profile = _profile()
    assert profile.non_torch == GiB  # 24 GiB taken, 23 of them torch's
    budget = kv_cache_budget(profile, 0.9, graph_reserve=3 * GiB)
    # 0.9 × 140 = 126; the peak without the scratch cache 20; outside torch 1; graphs 3.
    assert budget.requested == requested_bytes(TOTAL, 0.9)
    assert budget.kv_cache == budget.requested - 20 * GiB - GiB - 3 * GiB
    assert "CUDA graphs" in budget.describe()


def test_two_engines_at_045_fit_side_by_side() -> None:
    # The second engine starts while the first holds its whole share: its own share still fits,
    # and the two footprints together stay within 0.9 of the device.
    first = kv_cache_budget(_profile(), 0.45, graph_reserve=3 * GiB)
    used_by_first = first.requested
    free = TOTAL - GiB - used_by_first
    check_free_memory(free, TOTAL, 0.45)
    second = kv_cache_budget(_profile(free_before_load=free, free_after_profile=free - 24 * GiB), 0.45, 3 * GiB)
    footprint = lambda b: b.weights_and_activations + b.non_torch + b.graph_reserve + b.kv_cache  # noqa: E731
    assert footprint(first) + footprint(second) <= requested_bytes(TOTAL, 0.9)


def test_no_room_for_a_kv_cache_is_a_clear_error() -> None:
    with pytest.raises(InsufficientDeviceMemoryError, match="no memory is left for the KV cache.*--gpu-memory-utilization"):
        kv_cache_budget(_profile(torch_peak=70 * GiB), 0.45)


def test_graph_reserve_counts_every_static_output_and_the_largest_working_set() -> None:
    shapes = GraphShapes(decode_sizes=[1, 2, 4], mixed_token_sizes=[16, 32], vocab_size=1000, hidden_size=64,
                         dtype_bytes=2, max_blocks_per_seq=10, max_num_seqs=4)
    per_token = 100.0
    decode = (100 * 4 + 4 * 1000 * 2) + (1 + 2 + 4) * 1000 * 4 + 4 * (10 + 6) * 8
    mixed = 100 * 32 + (16 + 32) * 64 * 2 + (3 * 32 + 2 * 4 + 1 + 4 * 10) * 8
    assert graph_pool_bytes(shapes, per_token) == decode + mixed
    no_graphs = GraphShapes([], [], 1000, 64, 2, 10, 4)
    assert graph_pool_bytes(no_graphs, per_token) == 0


def test_activation_per_token_leaves_out_what_stays_resident() -> None:
    profile = _profile(torch_peak=20 * GiB, scratch_bytes=GiB)
    assert activation_bytes_per_token(profile, resident_bytes=16 * GiB, num_tokens=8192) == 3 * GiB / 8192
