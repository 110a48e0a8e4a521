"""Laying out one step's inputs: pure functions over numpy, plus the pinned staging buffers.

Everything the forward pass needs besides the weights and the KV cache is a handful of
small integer arrays. They are packed into ONE int64 array, in this order (each array 32-byte aligned)::

    input_ids[T] | positions[T] | slot_mapping[T] | seq_lens[S] | query_start_loc[S+1]
    | sample_rows[N] | block_tables[S * W] | feed_rows[F] | feed_src[F]

so a step costs one pinned host→device copy (non-blocking), and the device views of the
packed buffer are the model's inputs. For a CUDA-graph step the batch is padded to a
bucket B (T = S = B): the entries up to the end of query_start_loc then have the same
layout as the graph's static buffer (``packed_offsets(B, B, 0, 0)``), so one device copy
refreshes them, and a second one puts the block
table into the graph's fixed-width table.

Async scheduling stages a step before the previous one's tokens are back on the host: a
chunk whose input token is still being sampled is *fed* on the device, ``input_ids[feed_rows[j]]
= previous_sampled_ids[feed_src[j]]``, right after the upload (the host wrote 0 there).

Padding rows (decode-only steps padded to a bucket) are dummy sequences of one token:
token 0 at position 0, ``seq_len`` 1, slot -1 (their K/V is written nowhere) and a block
table row of zeros (they read block 0, which is harmless: their outputs are dropped).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# vLLM's default capture sizes: 1, 2, 4, then every 8 up to 256, then every 16 up to 512.
DEFAULT_MAX_CAPTURE_SIZE = 512
# Mixed steps: token buckets up to the default step budget (max_num_batched_tokens).
DEFAULT_MAX_MIXED_TOKENS = 2048


def default_capture_sizes(max_num_seqs: int, max_size: int = DEFAULT_MAX_CAPTURE_SIZE) -> list[int]:
    """Batch-size buckets for decode CUDA graphs, up to ``min(max_num_seqs, max_size)``;
    the cap itself is always a bucket, so every batch up to it has one."""
    cap = max(1, min(max_num_seqs, max_size))
    sizes = [1, 2, 4, *range(8, 257, 8), *range(272, max_size + 1, 16)]
    out = sorted({s for s in sizes if s <= cap} | {cap})
    return out


def normalize_capture_sizes(sizes: list[int] | None, max_num_seqs: int) -> list[int]:
    """The configured sizes (or the defaults), deduplicated, sorted, capped at max_num_seqs."""
    if not sizes:
        return default_capture_sizes(max_num_seqs)
    if any(int(s) < 1 for s in sizes):
        raise ValueError(f"cuda_graph_sizes must be positive, got {sizes}")
    return sorted({min(int(s), max_num_seqs) for s in sizes})


def default_mixed_token_sizes(max_tokens: int, max_size: int = DEFAULT_MAX_MIXED_TOKENS) -> list[int]:
    """Token-count buckets for mixed/prefill-step graphs, up to ``min(max_tokens, max_size)``
    (the cap itself included): fine steps where prefix hits and short prompts land, then
    every 256 tokens, so padding wastes at most a few percent of a big step."""
    cap = max(1, min(max_tokens, max_size))
    sizes = [16, 32, 64, 128, *range(256, max_size + 1, 256)]
    return sorted({s for s in sizes if s <= cap} | {cap})


def bucket_for(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest bucket that holds ``num_seqs`` sequences, or None (run eagerly)."""
    for size in sizes:
        if size >= num_seqs:
            return size
    return None


@dataclass
class ChunkInput:
    """One scheduled chunk as the runner sees it."""

    token_ids: list[int]  # the chunk's new tokens
    start: int  # position of the first one (= tokens already computed)
    block_ids: list[int]  # the request's block table
    samples: bool  # a token is sampled after this chunk
    # Async scheduling: the chunk's (single) token is the previous step's sample number
    # ``feed_index``, still on the device; -1: the token is known on the host.
    feed_index: int = -1


@dataclass
class StepLayout:
    """Where each array sits in the packed buffer, and the batch's host-side facts."""

    num_tokens: int  # T, padding included
    num_seqs: int  # S, padding included
    num_real_seqs: int
    num_samples: int  # N
    width: int  # W, block-table columns
    max_query_len: int
    max_seq_len: int
    query_start_loc: list[int]  # host copies (the torch backend reads these)
    seq_lens: list[int]
    sample_rows: list[int]
    feed_rows: list[int]  # rows of input_ids to take from the previous step's samples...
    feed_src: list[int]  # ...and which of them

    @property
    def total(self) -> int:
        return self.offsets()["feed_src"][1]

    def offsets(self) -> dict[str, tuple[int, int]]:
        return packed_offsets(self.num_tokens, self.num_seqs, self.num_samples, self.width, len(self.feed_rows))


# Each array starts on a 32-byte boundary: Triton specialises kernels on 16-byte pointer
# alignment, so unaligned views would compile new kernel variants mid-run.
_ALIGN = 4  # int64 elements


def packed_offsets(
    num_tokens: int, num_seqs: int, num_samples: int, width: int, num_feeds: int = 0
) -> dict[str, tuple[int, int]]:
    """[start, end) of each array in the packed int64 buffer (starts aligned to 32 bytes)."""
    t, s = num_tokens, num_seqs
    spans = [
        ("input_ids", t),
        ("positions", t),
        ("slot_mapping", t),
        ("seq_lens", s),
        ("query_start_loc", s + 1),
        ("sample_rows", num_samples),
        ("block_tables", s * width),
        ("feed_rows", num_feeds),
        ("feed_src", num_feeds),
    ]
    out: dict[str, tuple[int, int]] = {}
    at = 0
    for name, size in spans:
        at = -(-at // _ALIGN) * _ALIGN
        out[name] = (at, at + size)
        at += size
    return out


def plan_step(chunks: list[ChunkInput], pad_to: int | None = None, pad_tokens_to: int | None = None) -> StepLayout:
    """Sizes of the packed step. ``pad_to`` alone (decode-only steps) pads to that many
    one-token sequences. With ``pad_tokens_to`` (a mixed-step graph) the flat batch is padded
    to that many tokens, which belong to no sequence (their attention output is never
    written, and every other op is row-wise), and to ``pad_to`` sequences of length zero."""
    if not chunks:
        raise ValueError("a step needs at least one chunk")
    q_lens = [len(c.token_ids) for c in chunks]
    real = len(chunks)
    num_seqs = real if pad_to is None else pad_to
    if num_seqs < real:
        raise ValueError(f"cannot pad {real} sequences to {pad_to}")
    pad = num_seqs - real
    query_start = [0]
    for n in q_lens:
        query_start.append(query_start[-1] + n)
    if pad_tokens_to is None:
        if pad_to is not None and max(q_lens) != 1:
            raise ValueError("only decode-only steps (one token per sequence) are padded")
        for _ in range(pad):
            query_start.append(query_start[-1] + 1)
        seq_lens = [c.start + n for c, n in zip(chunks, q_lens)] + [1] * pad
        num_tokens = query_start[-1]
    else:
        if pad_tokens_to < query_start[-1]:
            raise ValueError(f"cannot pad {query_start[-1]} tokens to {pad_tokens_to}")
        query_start += [query_start[-1]] * pad
        seq_lens = [c.start + n for c, n in zip(chunks, q_lens)] + [0] * pad
        num_tokens = pad_tokens_to
    rows = [query_start[i + 1] - 1 for i, c in enumerate(chunks) if c.samples]
    fed = [i for i, c in enumerate(chunks) if c.feed_index >= 0]
    if any(q_lens[i] != 1 for i in fed):
        raise ValueError("only one-token chunks take their token from the previous step")
    return StepLayout(
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        num_real_seqs=real,
        num_samples=len(rows),
        width=max(1, max(len(c.block_ids) for c in chunks)),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_start_loc=query_start,
        seq_lens=seq_lens,
        sample_rows=rows,
        feed_rows=[query_start[i] for i in fed],
        feed_src=[chunks[i].feed_index for i in fed],
    )


def fill_step(buf: np.ndarray, layout: StepLayout, chunks: list[ChunkInput], block_size: int) -> None:
    """Write the packed step into ``buf[:layout.total]`` (int64)."""
    off = layout.offsets()
    real = layout.num_real_seqs
    t_real = layout.query_start_loc[real]

    def span(name: str) -> np.ndarray:
        a, b = off[name]
        return buf[a:b]

    # Block tables first: the slot mapping is read from them.
    bt = span("block_tables").reshape(layout.num_seqs, layout.width)
    bt.fill(0)
    for i, c in enumerate(chunks):
        if c.block_ids:
            bt[i, : len(c.block_ids)] = c.block_ids

    ids = span("input_ids")
    pos = span("positions")
    slots = span("slot_mapping")
    if layout.max_query_len == 1:  # decode: one token per sequence, no per-token loops
        ids[:real] = [c.token_ids[0] for c in chunks]
        pos[:real] = [c.start for c in chunks]
    else:
        flat: list[int] = []
        for c in chunks:
            flat.extend(c.token_ids)
        ids[:t_real] = flat
        qsl = np.asarray(layout.query_start_loc[: real + 1], dtype=np.int64)
        starts = np.asarray([c.start for c in chunks], dtype=np.int64)
        q_lens = np.diff(qsl)
        pos[:t_real] = np.repeat(starts - qsl[:-1], q_lens) + np.arange(t_real, dtype=np.int64)
    if t_real:
        seq_of_token = np.repeat(np.arange(real), np.diff(np.asarray(layout.query_start_loc[: real + 1])))
        p = pos[:t_real]
        slots[:t_real] = bt[seq_of_token, p // block_size] * block_size + p % block_size
    # Padding tokens: token 0 at position 0, stored nowhere.
    ids[t_real:] = 0
    pos[t_real:] = 0
    slots[t_real:] = -1
    span("seq_lens")[:] = layout.seq_lens
    span("query_start_loc")[:] = layout.query_start_loc
    span("sample_rows")[:] = layout.sample_rows
    span("feed_rows")[:] = layout.feed_rows
    span("feed_src")[:] = layout.feed_src


class PinnedStaging:
    """Two pinned (page-locked) host buffers used in turn, so filling step k+1 never
    overwrites the bytes of step k's copy before the GPU has read them; a device buffer
    receives the copy. Both grow on demand."""

    def __init__(self, device: torch.device, capacity: int = 1 << 16) -> None:
        self.device = device
        self.pin = device.type == "cuda"
        self._host: list[torch.Tensor] = []
        self._events: list[torch.cuda.Event | None] = []
        self._turn = 0
        self.capacity = 0
        self.dev = torch.empty(0, dtype=torch.int64, device=device)
        self._grow(capacity)

    def _grow(self, need: int) -> None:
        capacity = max(need, 2 * self.capacity, 1024)
        if self.pin:
            torch.cuda.synchronize(self.device)  # old buffers may still be in flight
        self._host = [torch.empty(capacity, dtype=torch.int64, pin_memory=self.pin) for _ in range(2)]
        self._events = [None, None]
        self.dev = torch.empty(capacity, dtype=torch.int64, device=self.device)
        self.capacity = capacity

    def host_buffer(self, need: int) -> np.ndarray:
        """The next host buffer, safe to write (its previous copy has completed)."""
        if need > self.capacity:
            self._grow(need)
        self._turn ^= 1
        event = self._events[self._turn]
        if event is not None:
            event.synchronize()  # normally long done: it is two steps old
        return self._host[self._turn].numpy()

    def upload(self, n: int) -> torch.Tensor:
        """Copy the first ``n`` entries of the current host buffer to the device (async on
        CUDA); returns the device buffer (its first ``n`` entries are the step)."""
        host = self._host[self._turn]
        if self.device.type == "cpu":
            return host  # the CPU path reads the host buffer directly
        self.dev[:n].copy_(host[:n], non_blocking=True)
        if self.pin:
            event = self._events[self._turn] or torch.cuda.Event()
            event.record()
            self._events[self._turn] = event
        return self.dev
