"""The SGMV Triton kernels against their torch reference, and the slot layer's two paths.

On CPU they run under the Triton interpreter (the root conftest sets TRITON_INTERPRET=1);
on a CUDA machine run ``TRITON_INTERPRET=0 pytest tests/engine/test_lora_kernels.py``.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from tidal_engine.kernels.triton.lora_sgmv import (  # noqa: E402
    sgmv_expand,
    sgmv_expand_reference,
    sgmv_shrink,
    sgmv_shrink_reference,
)
from tidal_engine.lora import layers as lora_layers  # noqa: E402
from tidal_engine.lora.layers import LoRABatch, LoRASlotWeights  # noqa: E402

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")
DEVICE = "cpu" if INTERPRETING else "cuda"
if not INTERPRETING and not torch.cuda.is_available():
    pytest.skip("needs TRITON_INTERPRET=1 or a CUDA device", allow_module_level=True)

TOLS = {torch.float32: 1e-5, torch.float16: 2e-2}


def _segments(spec: list[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    table = torch.tensor(spec, dtype=torch.int32).T.contiguous().to(DEVICE)
    return table[0], table[1], table[2], max(n for _, n, _ in spec)


# (start, length, slot): decode-sized and prefill-sized segments, a gap of base rows,
# a segment longer than one 16-row block, and a slot used twice.
SEGMENTS = [(0, 1, 2), (1, 3, 0), (6, 21, 1), (27, 1, 2), (30, 2, 0)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("in_features, n", [(64, 16), (40, 24)])
def test_shrink_matches_reference(dtype: torch.dtype, in_features: int, n: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(33, in_features, dtype=dtype, device=DEVICE)
    a = (torch.randn(3, n, in_features) * 0.1).to(dtype).to(DEVICE)
    starts, lens, slots, longest = _segments(SEGMENTS)
    ours = sgmv_shrink(x, a, starts, lens, slots, longest)
    reference = sgmv_shrink_reference(x, a, starts, lens, slots)
    for start, length, _ in SEGMENTS:
        rows = slice(start, start + length)
        torch.testing.assert_close(ours[rows], reference[rows], atol=TOLS[dtype], rtol=TOLS[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("out_features, rank", [(48, 8), (100, 16), (20, 5)])
def test_expand_matches_reference(dtype: torch.dtype, out_features: int, rank: int) -> None:
    torch.manual_seed(1)
    t = torch.randn(33, rank, dtype=torch.float32, device=DEVICE)
    b = (torch.randn(3, out_features, rank) * 0.1).to(dtype).to(DEVICE)
    y = torch.randn(33, out_features, dtype=dtype, device=DEVICE)
    starts, lens, slots, longest = _segments(SEGMENTS)
    expected = sgmv_expand_reference(t, b, y.clone(), starts, lens, slots)
    ours = sgmv_expand(t, b, y.clone(), starts, lens, slots, longest)
    torch.testing.assert_close(ours, expected, atol=TOLS[dtype], rtol=TOLS[dtype])
    # Base rows (in no segment) are untouched, bit for bit.
    for row in (4, 5, 28, 29, 32):
        assert torch.equal(ours[row], y[row])


def test_expand_into_column_views() -> None:
    """Merged layers expand per shard through column views of t, B and y."""
    t = torch.randn(8, 12, device=DEVICE)
    b = torch.randn(2, 30, 4, device=DEVICE)
    y = torch.zeros(8, 30, device=DEVICE)
    starts, lens, slots, longest = _segments([(0, 3, 1), (5, 3, 0)])
    sgmv_expand(t.narrow(1, 4, 4), b.narrow(1, 10, 20), y.narrow(1, 10, 20), starts, lens, slots, longest)
    expected = torch.zeros(8, 30, device=DEVICE)
    expected[0:3, 10:] = t[0:3, 4:8] @ b[1, 10:].T
    expected[5:8, 10:] = t[5:8, 4:8] @ b[0, 10:].T
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)


def test_kernels_reject_bad_inputs() -> None:
    starts, lens, slots, longest = _segments([(0, 1, 0)])
    with pytest.raises(ValueError, match="shapes"):
        sgmv_shrink(torch.randn(2, 8, device=DEVICE), torch.randn(1, 4, 9, device=DEVICE), starts, lens, slots, 1)
    with pytest.raises(TypeError, match="dtype"):
        sgmv_shrink(torch.randn(2, 8, device=DEVICE), torch.randn(1, 4, 8, device=DEVICE).half(),
                    starts, lens, slots, 1)
    with pytest.raises(TypeError, match="float32"):
        sgmv_expand(torch.randn(2, 4, device=DEVICE).half(), torch.randn(1, 8, 4, device=DEVICE).half(),
                    torch.randn(2, 8, device=DEVICE).half(), starts, lens, slots, longest)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_slot_layer_triton_path_matches_torch_path(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """A merged (3-shard) module with adapters of different ranks in 3 slots, mixed batch."""
    torch.manual_seed(2)
    sizes, max_rank = [32, 16, 16], 8
    layer = LoRASlotWeights(24, sizes, max_loras=3, max_rank=max_rank, dtype=dtype, device=torch.device(DEVICE))
    for slot, rank in ((0, 8), (1, 3), (2, 5)):
        shards = {i: (torch.randn(rank, 24) * 0.2, torch.randn(size, rank) * 0.2)
                  for i, size in enumerate(sizes) if not (slot == 1 and i == 1)}  # slot 1 skips shard k
        layer.write(slot, shards)
    batch = LoRABatch.build([(-1, 2), (1, 4), (0, 1), (-1, 3), (2, 6), (0, 2), (1, 1)], torch.device(DEVICE))
    assert batch is not None
    x = torch.randn(19, 24, dtype=dtype, device=DEVICE)
    base = torch.randn(19, 64, dtype=dtype, device=DEVICE)
    monkeypatch.setattr(lora_layers, "_use_triton", lambda _: False)
    expected = base.clone()
    layer.add_delta(x, expected, batch)
    monkeypatch.setattr(lora_layers, "_use_triton", lambda _: True)
    ours = base.clone()
    layer.add_delta(x, ours, batch)
    torch.testing.assert_close(ours, expected, atol=TOLS[dtype] * 2, rtol=TOLS[dtype])
    assert torch.equal(ours[:2], base[:2]) and torch.equal(ours[7:10], base[7:10])  # base rows untouched
    assert not torch.equal(ours[2:7], base[2:7])


def test_batch_build_merges_runs_and_groups_slots() -> None:
    batch = LoRABatch.build([(-1, 2), (0, 3), (0, 1), (1, 2), (-1, 1), (0, 2)], torch.device("cpu"))
    assert batch is not None
    assert batch.seg_starts.tolist() == [2, 6, 9]
    assert batch.seg_lens.tolist() == [4, 2, 2]
    assert batch.seg_slots.tolist() == [0, 1, 0]
    groups = dict(batch.groups)
    assert groups[0].tolist() == [2, 3, 4, 5, 9, 10]  # type: ignore[union-attr]
    assert groups[1] == slice(6, 8)
    assert LoRABatch.build([(-1, 5)], torch.device("cpu")) is None
