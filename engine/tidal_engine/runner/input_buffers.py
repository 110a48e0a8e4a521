"""Laying out one step's inputs: pure functions over numpy, plus the pinned staging buffers.

The step is described by a few arrays over its sequences (``StepInput``: each sequence's row
in the persistent batch, first position, token count, whether it samples, whether its last
token is fed on the device); the tokens and block tables themselves live in the persistent
batch (runner/persistent_batch.py) and are read from its host arrays with numpy fancy
indexing, no per-request Python loop. Everything the forward pass needs besides the weights,
the KV cache and the persistent device block table is packed into ONE int64 array, in this
order (each array 32-byte aligned)::

    input_ids[T] | positions[T] | slot_mapping[T] | seq_lens[S] | query_start_loc[S+1]
    | sample_rows[N] | batch_rows[S] | sampled_rows[N] | feed_rows[F] | feed_src[F]
    | bt_index[K] | bt_value[K] | feed_seq[F] | feed_drafts[F]

so a step costs one pinned host→device copy (non-blocking), and the device views of the
packed buffer are the model's inputs. ``bt_index``/``bt_value`` are the block-table entries
that changed since the last step (flat indices into the persistent device table, which the
runner scatters them into); ``batch_rows`` picks the step's rows out of that table (row 0 is
all zeros: padding sequences use it). For a CUDA-graph step the batch is padded to a bucket
B (T = S = B): the entries up to the end of query_start_loc then have the same layout as the
graph's static buffer (``packed_offsets(B, B, 0, 0)``), so one device copy refreshes them,
and a second one puts the gathered block table into the graph's fixed-width table (on CUDA one
kernel does both and the feed below: ``DecodeGraphs.replay_fed``).

Async scheduling stages a step before the previous one's tokens are back on the host: a
chunk whose last token is still being sampled is *fed* on the device, ``input_ids[feed_rows[j]]
= last_sampled[feed_src[j]]`` (the persistent batch's per-row last sampled id), right after
the upload (the host wrote 0 there). With speculation (drafts made on the device) a fed row's
``feed_drafts[j]`` drafts follow its fed token; ``feed_seq[j]`` is its sequence in the step, and
the runner shifts its positions by the accepted count of its previous step, on the device.

Padding rows (decode-only steps padded to a bucket) are dummy sequences of one token:
token 0 at position 0, ``seq_len`` 1, slot -1 (their K/V is written nowhere) and a block
table row of zeros (they read block 0, which is harmless: their outputs are dropped).
"""

from __future__ import annotations

import functools
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
class StepInput:
    """One step's sequences in batch order, as int64/bool numpy arrays of length S."""

    rows: np.ndarray  # row in the persistent batch (>= 1; row 0 is the all-zero padding row)
    starts: np.ndarray  # position of the first token computed (= num_computed_tokens)
    q_lens: np.ndarray  # tokens computed
    samples: np.ndarray  # bool: a token is sampled after this chunk
    # bool: the chunk's last token is the row's last sampled id, still on the device (async).
    fed: np.ndarray
    # Speculative decoding: drafts among the last q_lens tokens of each row (None: no drafts);
    # a verifying row needs logits at its last num_drafts + 1 positions.
    num_drafts: np.ndarray | None = None

    @classmethod
    def build(cls, rows: list[int], starts: list[int], q_lens: list[int], samples: list[bool],
              fed: list[bool] | None = None) -> "StepInput":
        n = len(rows)
        return cls(
            rows=np.asarray(rows, dtype=np.int64),
            starts=np.asarray(starts, dtype=np.int64),
            q_lens=np.asarray(q_lens, dtype=np.int64),
            samples=np.asarray(samples, dtype=bool),
            fed=np.zeros(n, dtype=bool) if fed is None else np.asarray(fed, dtype=bool),
        )


@dataclass
class StepLayout:
    """Where each array sits in the packed buffer, and the batch's host-side facts."""

    num_tokens: int  # T, padding included
    num_seqs: int  # S, padding included
    num_real_seqs: int
    num_real_tokens: int
    num_samples: int  # N
    num_feeds: int  # F
    num_bt_updates: int  # K
    width: int  # W, block-table columns the step reads
    max_query_len: int
    max_seq_len: int
    query_start_loc_np: np.ndarray  # [S + 1] int64, padding included
    seq_lens_np: np.ndarray  # [S] int64, padding included
    sample_rows: np.ndarray  # rows of the flat batch whose hidden state is sampled
    feed_rows: np.ndarray  # rows of input_ids fed from the last sampled ids...
    feed_src: np.ndarray  # ...of these persistent-batch rows

    @property
    def query_start_loc(self) -> list[int]:
        """Host copy as a list (the torch backend reads it; graph steps never ask)."""
        return self.query_start_loc_np.tolist()

    @property
    def seq_lens(self) -> list[int]:
        return self.seq_lens_np.tolist()

    @property
    def total(self) -> int:
        return self.offsets()["feed_drafts"][1]

    def offsets(self) -> dict[str, tuple[int, int]]:
        return packed_offsets(self.num_tokens, self.num_seqs, self.num_samples, self.num_feeds, self.num_bt_updates)

    @property
    def samples_in_order(self) -> bool:
        """The sampled rows are the first N rows (a decode-only batch that all samples)."""
        n = self.num_samples
        return n == 0 or (int(self.sample_rows[-1]) == n - 1)


# Each array starts on a 32-byte boundary: Triton specialises kernels on 16-byte pointer
# alignment, so unaligned views would compile new kernel variants mid-run.
_ALIGN = 4  # int64 elements


@functools.lru_cache(maxsize=4096)  # a pure function of a few sizes, asked several times a step
def packed_offsets(
    num_tokens: int, num_seqs: int, num_samples: int, num_feeds: int = 0, num_bt_updates: int = 0
) -> dict[str, tuple[int, int]]:
    """[start, end) of each array in the packed int64 buffer (starts aligned to 32 bytes).
    Shared between callers: read it, don't change it."""
    t, s = num_tokens, num_seqs
    spans = [
        ("input_ids", t),
        ("positions", t),
        ("slot_mapping", t),
        ("seq_lens", s),
        ("query_start_loc", s + 1),
        ("sample_rows", num_samples),
        ("batch_rows", s),
        ("sampled_rows", num_samples),
        ("feed_rows", num_feeds),
        ("feed_src", num_feeds),
        ("bt_index", num_bt_updates),
        ("bt_value", num_bt_updates),
        ("feed_seq", num_feeds),
        ("feed_drafts", num_feeds),
    ]
    out: dict[str, tuple[int, int]] = {}
    at = 0
    for name, size in spans:
        at = -(-at // _ALIGN) * _ALIGN
        out[name] = (at, at + size)
        at += size
    return out


def plan_step(
    step: StepInput,
    width: int,
    pad_to: int | None = None,
    pad_tokens_to: int | None = None,
    num_bt_updates: int = 0,
) -> StepLayout:
    """Sizes of the packed step. ``pad_to`` alone (decode-only steps) pads to that many
    one-token sequences. With ``pad_tokens_to`` (a mixed-step graph) the flat batch is padded
    to that many tokens, which belong to no sequence (their attention output is never
    written, and every other op is row-wise), and to ``pad_to`` sequences of length zero."""
    real = int(step.rows.shape[0])
    if not real:
        raise ValueError("a step needs at least one sequence")
    q_lens = step.q_lens
    max_q = int(q_lens.max())
    num_seqs = real if pad_to is None else pad_to
    if num_seqs < real:
        raise ValueError(f"cannot pad {real} sequences to {pad_to}")
    pad = num_seqs - real
    qsl = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(q_lens, out=qsl[1 : real + 1])
    t_real = int(qsl[real])
    seq_lens = np.empty(num_seqs, dtype=np.int64)
    np.add(step.starts, q_lens, out=seq_lens[:real])
    if pad_tokens_to is None:
        if pad_to is not None and max_q != 1:
            raise ValueError("only decode-only steps (one token per sequence) are padded")
        if pad:
            qsl[real + 1 :] = t_real + np.arange(1, pad + 1)
            seq_lens[real:] = 1
        num_tokens = t_real + pad
    else:
        if pad_tokens_to < t_real:
            raise ValueError(f"cannot pad {t_real} tokens to {pad_tokens_to}")
        if pad:
            qsl[real + 1 :] = t_real
            seq_lens[real:] = 0
        num_tokens = pad_tokens_to
    ends = qsl[1 : real + 1] - 1
    sample_rows = ends[step.samples]
    # A fed token is the chunk's last known one: before the drafts, when the row has drafts
    # (async scheduling with speculation: they come from the device too).
    feed_rows = (ends if step.num_drafts is None else ends - step.num_drafts)[step.fed]
    return StepLayout(
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        num_real_seqs=real,
        num_real_tokens=t_real,
        num_samples=int(sample_rows.shape[0]),
        num_feeds=int(feed_rows.shape[0]),
        num_bt_updates=num_bt_updates,
        width=max(1, width),
        max_query_len=max_q,
        max_seq_len=int(seq_lens.max()),
        query_start_loc_np=qsl,
        seq_lens_np=seq_lens,
        sample_rows=sample_rows,
        feed_rows=feed_rows,
        feed_src=step.rows[step.fed],
    )


def fill_step(
    buf: np.ndarray,
    layout: StepLayout,
    step: StepInput,
    token_ids: np.ndarray,
    block_table: np.ndarray,
    block_size: int,
    bt_index: np.ndarray | None = None,
    bt_value: np.ndarray | None = None,
) -> None:
    """Write the packed step into ``buf[:layout.total]`` (int64). ``token_ids`` [rows, cols]
    and ``block_table`` [rows, W] are the persistent batch's host arrays; a fed token's
    column may hold anything (it is written as 0, the device fills it)."""
    off = layout.offsets()
    real = layout.num_real_seqs
    t_real = layout.num_real_tokens

    def span(name: str) -> np.ndarray:
        a, b = off[name]
        return buf[a:b]

    ids = span("input_ids")
    pos = span("positions")
    slots = span("slot_mapping")
    if layout.max_query_len == 1:  # decode: one token per sequence, no per-token repeats
        tok_rows = step.rows
        p = step.starts
    elif real == 1:  # one sequence (a single stream's verify step): a plain range
        tok_rows = step.rows[0]
        p = np.arange(step.starts[0], step.starts[0] + t_real, dtype=np.int64)
    else:
        tok_rows = np.repeat(step.rows, step.q_lens)
        p = np.repeat(step.starts - layout.query_start_loc_np[:real], step.q_lens) + np.arange(t_real, dtype=np.int64)
    pos[:t_real] = p
    ids[:t_real] = token_ids[tok_rows, p]
    if layout.num_feeds:
        ids[layout.feed_rows] = 0  # the placeholder; the device writes the real id
    block, within = np.divmod(p, block_size)
    slots[:t_real] = block_table[tok_rows, block] * block_size + within
    if layout.num_tokens > t_real:  # padding tokens: token 0 at position 0, stored nowhere
        ids[t_real:] = 0
        pos[t_real:] = 0
        slots[t_real:] = -1
    span("seq_lens")[:] = layout.seq_lens_np
    span("query_start_loc")[:] = layout.query_start_loc_np
    span("sample_rows")[:] = layout.sample_rows
    batch_rows = span("batch_rows")
    batch_rows[:real] = step.rows
    if layout.num_seqs > real:
        batch_rows[real:] = 0
    span("sampled_rows")[:] = step.rows[step.samples]
    if layout.num_feeds:
        span("feed_rows")[:] = layout.feed_rows
        span("feed_src")[:] = layout.feed_src
        span("feed_seq")[:] = np.flatnonzero(step.fed)
        span("feed_drafts")[:] = 0 if step.num_drafts is None else step.num_drafts[step.fed]
    if layout.num_bt_updates:
        assert bt_index is not None and bt_value is not None
        span("bt_index")[:] = bt_index
        span("bt_value")[:] = bt_value


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
