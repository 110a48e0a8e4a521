"""Decode CUDA graphs and the step layout behind them.

CPU: the bucketing and padding logic (pure functions), the pinned staging on CPU, and the
per-head RMSNorm kernel under the Triton interpreter. GPU (marked ``gpu``; run with
``TRITON_INTERPRET=0 pytest tests/engine/test_cuda_graphs.py -m gpu`` on a CUDA machine):
graph replay gives the same greedy tokens as eager execution, padded buckets included,
and the GPU path gives the torch reference's tokens.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from tidal_engine.runner.input_buffers import (
    PinnedStaging,
    StepInput,
    bucket_for,
    default_capture_sizes,
    default_mixed_token_sizes,
    fill_step,
    normalize_capture_sizes,
    packed_offsets,
    plan_step,
)
from tidal_engine.runner.persistent_batch import PersistentBatch

from tiny_tokenizer import SAMPLE_PROMPTS

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")
gpu = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(INTERPRETING, reason="GPU tests run compiled: set TRITON_INTERPRET=0"),
]


def on_gpu(test):  # type: ignore[no-untyped-def]
    for mark in reversed(gpu):
        test = mark(test)
    return test


# ---------------------------------------------------------------------------------------
# Buckets


def test_default_capture_sizes() -> None:
    sizes = default_capture_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16]
    assert sizes[-1] == 256 and all(b - a == 8 for a, b in zip(sizes[3:], sizes[4:]))
    assert default_capture_sizes(3) == [1, 2, 3]  # the cap itself is a bucket
    assert default_capture_sizes(100)[-2:] == [96, 100]
    assert default_capture_sizes(1024)[-1] == 512  # never past 512 by default
    assert default_capture_sizes(300)[-3:] == [272, 288, 300]


def test_normalize_capture_sizes() -> None:
    assert normalize_capture_sizes(None, 16) == default_capture_sizes(16)
    assert normalize_capture_sizes([8, 1, 8, 64], 32) == [1, 8, 32]
    with pytest.raises(ValueError):
        normalize_capture_sizes([0, 4], 8)


@pytest.mark.parametrize(("n", "expected"), [(1, 1), (3, 4), (4, 4), (9, 16), (17, 24), (256, 256), (257, None)])
def test_bucket_for(n: int, expected: int | None) -> None:
    assert bucket_for(n, default_capture_sizes(256)) == expected


# ---------------------------------------------------------------------------------------
# Step layout (over a persistent batch's host arrays)


@dataclass
class _Chunk:
    token_ids: list[int]  # the chunk's new tokens
    start: int
    block_ids: list[int]
    samples: bool


def _batch(chunks: list[_Chunk], block_size: int) -> tuple[PersistentBatch, StepInput]:
    """A persistent batch holding each chunk's request (tokens up to the chunk's end; the
    tokens before ``start`` are dummies), and the step over it."""
    batch = PersistentBatch(max_rows=len(chunks), max_model_len=64, block_size=block_size, device=torch.device("cpu"))
    rows = [batch.add(f"r{i}", [99] * c.start + c.token_ids, c.block_ids) for i, c in enumerate(chunks)]
    step = StepInput.build(rows, [c.start for c in chunks], [len(c.token_ids) for c in chunks], [c.samples for c in chunks])
    return batch, step


def _stage(chunks: list[_Chunk], bs: int, pad_to: int | None = None, pad_tokens_to: int | None = None,
           fill: int = 12345, extra: int = 0) -> tuple[np.ndarray, object, PersistentBatch]:
    batch, step = _batch(chunks, bs)
    index, value = batch.take_block_updates()
    width = int(batch.num_blocks[step.rows].max())
    layout = plan_step(step, width, pad_to, pad_tokens_to, num_bt_updates=int(index.shape[0]))
    buf = np.full(layout.total + extra, fill, dtype=np.int64)
    fill_step(buf, layout, step, batch.token_ids, batch.block_table, bs, index, value)
    return buf, layout, batch


def _naive(chunks: list[_Chunk], block_size: int) -> dict[str, list[int]]:
    ids, pos, slots = [], [], []
    for c in chunks:
        for j, t in enumerate(c.token_ids):
            p = c.start + j
            ids.append(t)
            pos.append(p)
            slots.append(c.block_ids[p // block_size] * block_size + p % block_size)
    return {"input_ids": ids, "positions": pos, "slot_mapping": slots}


def _unpack(buf: np.ndarray, layout) -> dict[str, np.ndarray]:  # type: ignore[no-untyped-def]
    return {name: buf[a:b] for name, (a, b) in layout.offsets().items()}


def _device_table(batch: PersistentBatch, got: dict[str, np.ndarray], width: int) -> list[list[int]]:
    """The step's block table as the runner builds it: scatter the updates, gather the rows."""
    batch.apply_block_updates(torch.from_numpy(got["bt_index"]), torch.from_numpy(got["bt_value"]))
    rows = torch.from_numpy(got["batch_rows"].copy())
    return batch.block_table_dev[:, :width].index_select(0, rows).tolist()


def test_mixed_step_layout_matches_naive() -> None:
    bs = 4
    chunks = [
        _Chunk(token_ids=[5, 6, 7, 8, 9], start=3, block_ids=[7, 2], samples=True),  # prefill chunk
        _Chunk(token_ids=[11], start=9, block_ids=[1, 4, 3], samples=True),  # decode
        _Chunk(token_ids=[1, 2], start=0, block_ids=[6], samples=False),  # chunk, no sample
    ]
    buf, layout, batch = _stage(chunks, bs, extra=10)
    assert (layout.num_tokens, layout.num_seqs, layout.width) == (8, 3, 3)
    assert layout.query_start_loc == [0, 5, 6, 8]
    assert layout.seq_lens == [8, 10, 2]
    assert layout.sample_rows.tolist() == [4, 5]
    assert layout.max_query_len == 5 and layout.max_seq_len == 10
    got = _unpack(buf, layout)
    for name, values in _naive(chunks, bs).items():
        assert got[name].tolist() == values, name
    assert got["seq_lens"].tolist() == [8, 10, 2]
    assert got["query_start_loc"].tolist() == [0, 5, 6, 8]
    assert got["sample_rows"].tolist() == [4, 5]
    assert got["batch_rows"].tolist() == [1, 2, 3] and got["sampled_rows"].tolist() == [1, 2]
    assert _device_table(batch, got, 3) == [[7, 2, 0], [1, 4, 3], [6, 0, 0]]
    assert (buf[layout.total :] == 12345).all()  # nothing written past the step


def test_decode_step_padded_to_bucket() -> None:
    bs = 16
    chunks = [
        _Chunk(token_ids=[42], start=20, block_ids=[3, 9], samples=True),
        _Chunk(token_ids=[43], start=0, block_ids=[5], samples=True),
        _Chunk(token_ids=[44], start=31, block_ids=[1, 2], samples=True),
    ]
    buf, layout, batch = _stage(chunks, bs, pad_to=8, fill=-7)
    assert (layout.num_tokens, layout.num_seqs, layout.num_real_seqs) == (8, 8, 3)
    got = _unpack(buf, layout)
    assert got["input_ids"].tolist() == [42, 43, 44] + [0] * 5
    assert got["positions"].tolist() == [20, 0, 31] + [0] * 5
    # Real slots from the block tables; padding writes nowhere.
    assert got["slot_mapping"].tolist() == [9 * 16 + 4, 5 * 16, 2 * 16 + 15] + [-1] * 5
    assert got["seq_lens"].tolist() == [21, 1, 32] + [1] * 5
    assert got["query_start_loc"].tolist() == list(range(9))
    assert got["sample_rows"].tolist() == [0, 1, 2] and layout.samples_in_order
    bt = _device_table(batch, got, 2)
    assert bt[:3] == [[3, 9], [5, 0], [1, 2]] and all(r == [0, 0] for r in bt[3:])  # padding: the zero row
    # The graph's static buffer has the same layout up to the end of query_start_loc.
    static = packed_offsets(8, 8, 0, 0)
    assert all(layout.offsets()[k] == static[k] for k in ("input_ids", "positions", "slot_mapping", "seq_lens", "query_start_loc"))


def test_steady_decode_uploads_no_block_table() -> None:
    # Once a request's blocks are on the device, a step ships only the entries that changed.
    bs = 4
    chunks = [_Chunk([1], 5, [3, 8], True), _Chunk([2], 2, [6], True)]
    buf, layout, batch = _stage(chunks, bs)
    assert layout.num_bt_updates == 3
    _device_table(batch, _unpack(buf, layout), 2)
    batch.append_blocks(batch.row_of["r1"], [9])  # r1 crosses into its second block
    step = StepInput.build([1, 2], [6, 4], [1, 1], [True, True])
    index, value = batch.take_block_updates()
    layout = plan_step(step, 2, num_bt_updates=int(index.shape[0]))
    assert layout.num_bt_updates == 1 and value.tolist() == [9]
    buf = np.zeros(layout.total, dtype=np.int64)
    batch.token_ids[1, 6] = 1
    batch.token_ids[2, 4] = 2
    fill_step(buf, layout, step, batch.token_ids, batch.block_table, bs, index, value)
    got = _unpack(buf, layout)
    assert _device_table(batch, got, 2) == [[3, 8], [6, 9]]
    assert got["slot_mapping"].tolist() == [8 * 4 + 2, 9 * 4 + 0]


def test_fed_tokens_are_placeholders_on_the_host() -> None:
    bs = 4
    batch, step = _batch([_Chunk([7, 8], 0, [2], True), _Chunk([9], 3, [5], True)], bs)
    batch.take_block_updates()
    # Row 2 has 4 known tokens and computes position 4: its token is still on the device.
    fed = StepInput.build([2, 1], [4, 1], [1, 2], [True, True])
    fed.fed = fed.starts + fed.q_lens > batch.num_tokens[fed.rows]
    assert fed.fed.tolist() == [True, True]  # row 1 knows 2 tokens, computes 1..2
    layout = plan_step(fed, 2)
    assert layout.feed_rows.tolist() == [0, 2] and layout.feed_src.tolist() == [2, 1]
    buf = np.full(layout.total, 5, dtype=np.int64)
    fill_step(buf, layout, fed, batch.token_ids, batch.block_table, bs)
    got = _unpack(buf, layout)
    assert got["input_ids"].tolist() == [0, 8, 0]
    assert got["feed_rows"].tolist() == [0, 2] and got["feed_src"].tolist() == [2, 1]


def test_packed_arrays_are_32_byte_aligned() -> None:
    # Triton compiles a kernel variant per pointer alignment: every array must start aligned.
    for t, s, n, f, k in [(1, 1, 1, 0, 0), (7, 3, 2, 1, 5), (2048, 9, 4, 3, 33)]:
        offsets = packed_offsets(t, s, n, f, k)
        assert all(a % 4 == 0 for a, _ in offsets.values())
        ends = sorted(offsets.values())
        assert all(e1 <= s2 for (_, e1), (s2, _) in zip(ends, ends[1:]))  # no overlap


def test_only_decode_steps_are_padded() -> None:
    with pytest.raises(ValueError, match="decode-only"):
        plan_step(StepInput.build([1], [0], [2], [True]), 1, pad_to=4)
    with pytest.raises(ValueError, match="cannot pad"):
        plan_step(StepInput.build([1, 2, 3], [0] * 3, [1] * 3, [True] * 3), 1, pad_to=2)


def test_mixed_step_padded_to_token_bucket() -> None:
    # A mixed-step graph: padding tokens belong to no sequence, padding sequences are empty.
    bs = 4
    chunks = [
        _Chunk(token_ids=[5, 6, 7], start=2, block_ids=[7, 2], samples=True),
        _Chunk(token_ids=[11], start=9, block_ids=[1, 4, 3], samples=True),
    ]
    buf, layout, batch = _stage(chunks, bs, pad_to=4, pad_tokens_to=8, fill=-7)
    assert (layout.num_tokens, layout.num_seqs, layout.num_real_seqs) == (8, 4, 2)
    assert layout.query_start_loc == [0, 3, 4, 4, 4]
    assert layout.seq_lens == [5, 10, 0, 0]
    assert layout.sample_rows.tolist() == [2, 3]
    got = _unpack(buf, layout)
    naive = _naive(chunks, bs)
    assert got["input_ids"].tolist() == naive["input_ids"] + [0] * 4
    assert got["positions"].tolist() == naive["positions"] + [0] * 4
    assert got["slot_mapping"].tolist() == naive["slot_mapping"] + [-1] * 4
    assert _device_table(batch, got, 3) == [[7, 2, 0], [1, 4, 3], [0, 0, 0], [0, 0, 0]]
    # The graph's static buffer has this layout up to the end of query_start_loc.
    static = packed_offsets(8, 4, 0, 0)
    assert all(layout.offsets()[k] == static[k] for k in ("input_ids", "seq_lens", "query_start_loc"))
    with pytest.raises(ValueError, match="cannot pad"):
        plan_step(StepInput.build([1, 2], [2, 9], [3, 1], [True, True]), 3, pad_to=4, pad_tokens_to=3)


def test_default_mixed_token_sizes() -> None:
    assert default_mixed_token_sizes(2048) == [16, 32, 64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048]
    assert default_mixed_token_sizes(100) == [16, 32, 64, 100]
    assert default_mixed_token_sizes(8192)[-1] == 2048  # bigger steps run eagerly


def test_pinned_staging_on_cpu_grows_and_alternates() -> None:
    staging = PinnedStaging(torch.device("cpu"), capacity=8)
    a = staging.host_buffer(4)
    a[:4] = [1, 2, 3, 4]
    dev_a = staging.upload(4)
    b = staging.host_buffer(4)
    assert not np.shares_memory(a, b)  # the two buffers take turns
    b[:4] = 9
    assert dev_a[:4].tolist() == [1, 2, 3, 4]
    big = staging.host_buffer(5000)
    assert big.shape[0] >= 5000 and staging.capacity >= 5000


# ---------------------------------------------------------------------------------------
# Per-head RMSNorm (Qwen3's q/k norm) on a strided view, against the reference


@pytest.mark.skipif(not INTERPRETING, reason="CPU kernels need TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_heads_on_strided_view(dtype: torch.dtype) -> None:
    pytest.importorskip("triton")
    from tidal_engine.kernels import reference as ref
    from tidal_engine.kernels.triton.rms_norm import rms_norm_heads

    g = torch.Generator().manual_seed(3)
    t, h, hkv, d = 5, 4, 2, 32
    qkv = (2 * torch.randn(t, (h + 2 * hkv) * d, generator=g)).to(dtype)
    weight = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype)
    k = qkv[:, h * d : (h + hkv) * d].reshape(t, hkv, d)  # strided [T, Hkv, D] view
    out = rms_norm_heads(k, weight, 1e-6)
    assert out.is_contiguous() and out.shape == (t, hkv, d)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.rms_norm_ref(k, weight, 1e-6).float(), atol=tol, rtol=tol)


# ---------------------------------------------------------------------------------------
# GPU: graphs vs eager


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_models import make_tiny_model
    from tiny_tokenizer import EOS_ID, save_byte_tokenizer

    folder = tmp_path_factory.mktemp("tiny-qwen3-graphs")
    make_tiny_model("qwen3", folder, eos_token_id=EOS_ID, bos_token_id=None, max_position_embeddings=512)
    save_byte_tokenizer(folder, vocab_size=1000)
    return folder


PROMPTS = SAMPLE_PROMPTS


def _generate(folder: Path, prompts: list[str], max_tokens: list[int], **options: object) -> tuple[list[list[int]], object]:
    from tidal_engine import LLM, SamplingParams

    defaults: dict[str, object] = dict(device="cuda", dtype="bfloat16", max_model_len=256, num_gpu_blocks_override=256)
    defaults.update(options)
    llm = LLM(str(folder), **defaults)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    outs = llm.generate(prompts, params)
    return [o.outputs[0].token_ids for o in outs], llm


@on_gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_graph_matches_eager_exact_buckets(tiny_dir: Path, dtype: str) -> None:
    # 8 requests of equal length: every decode step is exactly the bucket 8, no padding.
    # Prefill eagerly in both: a prefill padded to a token bucket runs other GEMM shapes,
    # which may flip a bf16 token (the mixed-step graphs are checked in fp32 below).
    eager, _ = _generate(tiny_dir, PROMPTS, [48] * 8, dtype=dtype, enforce_eager=True)
    graph, llm = _generate(tiny_dir, PROMPTS, [48] * 8, dtype=dtype, max_num_seqs=8, mixed_cuda_graphs=False)
    runner = llm.engine.runner  # type: ignore[attr-defined]
    assert runner.graphs is not None and runner.graphs.num_replays >= 47
    assert graph == eager


@on_gpu
def test_graph_padded_buckets_match_eager(tiny_dir: Path) -> None:
    # Requests end at different steps, so decode batches shrink through 8..1 and are padded
    # to the buckets 8 and 16 (fp32: different GEMM shapes don't flip a token).
    prompts = PROMPTS + [p[::-1] for p in PROMPTS]
    lengths = [10 + 5 * i for i in range(16)]
    eager, _ = _generate(tiny_dir, prompts, lengths, dtype="float32", enforce_eager=True)
    graph, llm = _generate(tiny_dir, prompts, lengths, dtype="float32", cuda_graph_sizes=[8, 16])
    assert llm.engine.runner.graphs.num_replays > 0  # type: ignore[attr-defined]
    assert graph == eager


@on_gpu
def test_mixed_graphs_match_eager_with_prefix_hits(tiny_dir: Path) -> None:
    # Chunked prefills mixed with decodes (small step budget), then the same prompts again
    # (prefix-cache hits: short chunks over a long cached context), all through mixed-step
    # graphs; fp32, so padded GEMM shapes don't flip a token.
    from tidal_engine import SamplingParams

    prompts = [p * 6 for p in PROMPTS]
    lengths = [20 + 3 * i for i in range(8)]
    options = dict(dtype="float32", max_num_batched_tokens=96, max_model_len=512)
    eager, eager_llm = _generate(tiny_dir, prompts, lengths, enforce_eager=True, **options)
    graph, llm = _generate(tiny_dir, prompts, lengths, **options)
    runner = llm.engine.runner  # type: ignore[attr-defined]
    assert runner.mixed_graphs is not None and runner.mixed_graphs.num_replays > 0
    assert graph == eager
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    again = llm.generate(prompts, params)  # type: ignore[attr-defined]
    assert sum(o.num_cached_tokens for o in again) > 0
    assert [o.outputs[0].token_ids for o in again] == eager
    again_eager = eager_llm.generate(prompts, params)  # type: ignore[attr-defined]
    assert [o.outputs[0].token_ids for o in again_eager] == eager


@on_gpu
def test_gpu_path_matches_torch_reference(tiny_dir: Path) -> None:
    """Acceptance: 8 prompts x 64 greedy steps, Triton kernels + graphs on the GPU (fp32)
    against the torch reference on the CPU (fp32)."""
    gpu_tokens, _ = _generate(tiny_dir, PROMPTS, [64] * 8, dtype="float32")
    cpu_tokens, _ = _generate(tiny_dir, PROMPTS, [64] * 8, dtype="float32", device="cpu")
    assert gpu_tokens == cpu_tokens


@on_gpu
def test_sleep_wake_recaptures(tiny_dir: Path) -> None:
    from tidal_engine import SamplingParams

    first, llm = _generate(tiny_dir, PROMPTS, [24] * 8, max_num_seqs=8)
    engine = llm.engine  # type: ignore[attr-defined]
    for level in (1, 2):
        engine.sleep(level)
        assert engine.runner.graphs is None
        engine.wake_up()
        assert engine.runner.graphs is not None and engine.runner.mixed_graphs is not None
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        again = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]  # type: ignore[attr-defined]
        assert again == first


@on_gpu
def test_sleep_mode_keeps_the_graphs_across_sleep_and_wake(tiny_dir: Path) -> None:
    # With sleep mode the weights and the KV cache sit at fixed addresses (CUDA VMM): sleep
    # gives the memory back, wake maps it again, and the captured graphs are replayed as they are.
    from tidal_engine import SamplingParams

    first, llm = _generate(tiny_dir, PROMPTS, [24] * 8, max_num_seqs=8, enable_sleep_mode=True)
    runner = llm.engine.runner  # type: ignore[attr-defined]
    assert runner.weights.stable_addresses
    graphs = runner.graphs
    for level in (1, 2, 1):
        llm.engine.sleep(level)  # type: ignore[attr-defined]
        assert runner.memory_usage()["weights_bytes"] == runner.memory_usage()["kv_cache_bytes"] == 0
        llm.engine.wake_up()  # type: ignore[attr-defined]
        assert runner.graphs is graphs
        replays = graphs.num_replays
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        again = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]  # type: ignore[attr-defined]
        assert again == first and graphs.num_replays > replays


@on_gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_async_scheduling_matches_sync_on_gpu(tiny_dir: Path, dtype: str) -> None:
    # Steps launched before the previous tokens are on the host, fed on the device, through
    # both graph kinds. bf16: equal lengths, so both modes run the same batches; fp32: requests
    # end at different steps (async computes one extra step for none of them: held at length).
    prompts = PROMPTS + [p[::-1] for p in PROMPTS]
    lengths = [48] * 16 if dtype == "bfloat16" else [10 + 5 * i for i in range(16)]
    sync, _ = _generate(tiny_dir, prompts, lengths, dtype=dtype, async_scheduling=False)
    got, llm = _generate(tiny_dir, prompts, lengths, dtype=dtype, async_scheduling=True)
    assert llm.engine.async_scheduling and llm.engine.runner.graphs.num_replays > 0  # type: ignore[attr-defined]
    assert got == sync
