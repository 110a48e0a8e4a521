"""CUDA graphs for prefill and mixed steps (prefill chunks and decodes together).

An eager step launches ~13 kernels a layer from Python: ~20 ms a step on the H200 whatever
the token count, which dominated prefix-hit TTFT and the prefill part of offline batches.
Here each graph is one forward (embedding → layers → final norm) for a token bucket T, with
``S = min(T, max_num_seqs)`` sequence slots, reading static buffers laid out like a padded
step of ``input_buffers.plan_step(step, width, S, T)``:

- ``scalars`` (int64): ``input_ids[T] | positions[T] | slot_mapping[T] | seq_lens[S] |
  query_start_loc[S+1]`` at ``packed_offsets(T, S, 0, 0)``;
- ``block_tables`` (int64, ``[S_max, max_blocks_per_seq]``), fixed width as in the decode graphs.

Padding tokens (after the real ones) belong to no sequence: slot -1, and the attention kernel
never writes their rows; every other op is row-wise, so whatever they hold stays in their
rows. Padding sequences have no tokens, so their attention programs return at once.

The graph returns the final hidden states ``[T, hidden]``; the runner picks the sampled rows
and runs the LM head outside (logits of all T rows would cost a vocabulary-wide GEMM).
The attention tiles are the prefill ones (chosen from ``max_query_len = T``): any tile
computes any batch, so one graph serves every step of its bucket.

``VerifyGraphs`` are the same kind of graph for speculative decoding's verify steps: bucket
``T = B * (k + 1)`` tokens over ``B`` sequence slots, each row at most ``k + 1`` query tokens
(its last known token and its drafts). Their ``max_query_len`` is ``k + 1``, so the attention
takes the multi-query decode launch (one program per row and KV head) instead of prefill tiles.
They share the mixed graphs' memory pool when both are captured (never replayed at once).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from tidal_engine.layers.attention import AttentionMetadata
from tidal_engine.runner.input_buffers import packed_offsets

logger = logging.getLogger(__name__)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # [T, hidden] final hidden states, written by each replay


class MixedGraphs:
    kind = "mixed-step"
    # An eager run before every capture (True), or before the first, largest, only (False): one
    # warm-up loads and compiles the kernels; the others cost start-up time and changed nothing
    # (H200, 8B shape: each replay equal to an eager run, bit for bit, also with an empty cache).
    warm_up_each = False

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        token_sizes: list[int],
        max_num_seqs: int,
        max_blocks_per_seq: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.token_sizes = sorted(token_sizes)
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        self.device = device
        end = max(self._scalars_end(t) for t in self.token_sizes)
        self.scalars = torch.zeros(end, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(
            self.seqs_for(self.token_sizes[-1]), max_blocks_per_seq, dtype=torch.int64, device=device
        )
        self.graphs: dict[int, _Graph] = {}
        self.pool: tuple[int, int] | None = None
        self.capture_seconds = 0.0
        self.num_replays = 0

    def seqs_for(self, t: int) -> int:
        """Sequence slots of bucket ``t`` (a step has at most one sequence per token)."""
        return min(t, self.max_num_seqs)

    def bucket(self, num_tokens: int, num_seqs: int, width: int) -> int | None:
        """The smallest token bucket that holds this step, or None (run it eagerly)."""
        if width > self.max_blocks_per_seq:
            return None
        for t in self.token_sizes:
            if t >= num_tokens and self.seqs_for(t) >= num_seqs:
                return t
        return None

    def _scalars_end(self, t: int) -> int:
        return packed_offsets(t, self.seqs_for(t), 0, 0)["query_start_loc"][1]

    def _span(self, t: int, name: str) -> torch.Tensor:
        start, end = packed_offsets(t, self.seqs_for(t), 0, 0)[name]
        return self.scalars[start:end]

    def max_query_len(self, t: int) -> int:
        """The attention's query-length bound in bucket ``t``: any, so the prefill tiles."""
        return t

    def _forward(self, t: int) -> torch.Tensor:
        s = self.seqs_for(t)
        meta = AttentionMetadata(
            slot_mapping=self._span(t, "slot_mapping"),
            query_start_loc=self._span(t, "query_start_loc"),
            seq_lens=self._span(t, "seq_lens"),
            block_tables=self.block_tables[:s],
            max_query_len=self.max_query_len(t),  # picks the tiles and the launch
            max_seq_len=self.max_blocks_per_seq,  # unused by the Triton backend
            query_start_loc_cpu=[0] + [t] * s,  # shapes only: the torch backend never runs here
            seq_lens_cpu=[t] + [0] * (s - 1),
        )
        return self.model(self._span(t, "input_ids"), self._span(t, "positions"), self.kv_caches, meta)

    def _dummy_inputs(self, t: int) -> None:
        """One sequence of ``t`` tokens at positions 0.., stored nowhere; the other slots empty."""
        self._span(t, "input_ids").zero_()
        self._span(t, "positions").copy_(torch.arange(t, device=self.device))
        self._span(t, "slot_mapping").fill_(-1)
        seq_lens = self._span(t, "seq_lens")
        seq_lens.zero_()
        seq_lens[0] = t
        qsl = self._span(t, "query_start_loc")
        qsl.fill_(t)
        qsl[0] = 0
        self.block_tables.zero_()

    @torch.inference_mode()
    def capture(self, pool: tuple[int, int] | None = None) -> None:
        """Capture every bucket, largest first, into ``pool`` (a new one when None; kept in
        ``self.pool`` for graphs captured after these that may reuse its memory)."""
        start = time.perf_counter()
        pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        self.pool = pool
        stream = torch.cuda.Stream(self.device)
        for i, t in enumerate(sorted(self.token_sizes, reverse=True)):  # largest first: one pool serves all
            self._dummy_inputs(t)
            if i == 0 or self.warm_up_each:
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):  # warm-up: Triton compiles, cuBLAS picks kernels
                    self._forward(t)
                torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                hidden = self._forward(t)
            self.graphs[t] = _Graph(graph, hidden)
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start
        logger.info("captured %d %s CUDA graphs (%d..%d tokens) in %.2f s", len(self.graphs), self.kind,
                    self.token_sizes[0], self.token_sizes[-1], self.capture_seconds)

    def replay(self, t: int, staged: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
        """Run bucket ``t`` on a step staged on the device (``plan_step(step, width, seqs_for(t), t)``)
        and its ``[seqs_for(t), width]`` block table (gathered from the persistent batch);
        returns the static ``[t, hidden]`` output (read it before the next replay)."""
        s = self.seqs_for(t)
        end = self._scalars_end(t)
        self.scalars[:end].copy_(staged[:end])
        self.block_tables[:s, : block_tables.shape[1]].copy_(block_tables)
        entry = self.graphs[t]
        entry.graph.replay()
        self.num_replays += 1
        return entry.hidden


class VerifyGraphs(MixedGraphs):
    """Graphs for verify steps: ``rows`` sequence slots of at most ``query_len = k + 1`` query
    tokens each, one graph per decode-graph batch size (the bucket is ``rows * query_len``
    tokens). A step fits when none of its rows has more than ``query_len`` tokens: verify rows,
    plain decodes and short chunks; longer chunks go to the mixed graphs or run eagerly."""

    kind = "verify-step"

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        row_sizes: list[int],
        query_len: int,
        max_blocks_per_seq: int,
        device: torch.device,
    ) -> None:
        if query_len < 2:
            raise ValueError(f"a verify step has at least 2 query tokens per row, got {query_len}")
        self.query_len = query_len
        sizes = sorted({int(b) * query_len for b in row_sizes})
        super().__init__(model, kv_caches, sizes, max(row_sizes), max_blocks_per_seq, device)

    def seqs_for(self, t: int) -> int:
        return t // self.query_len

    def max_query_len(self, t: int) -> int:
        return self.query_len  # the multi-query decode launch

    def bucket_for_step(self, max_query_len: int, num_seqs: int, width: int) -> int | None:
        """The smallest bucket whose rows hold this step (at most ``query_len`` tokens each),
        or None."""
        if max_query_len > self.query_len:
            return None
        return self.bucket(num_seqs * self.query_len, num_seqs, width)

    def _dummy_inputs(self, t: int) -> None:
        """``seqs_for(t)`` sequences of ``query_len`` tokens at positions 0.., stored nowhere."""
        q = self.query_len
        s = self.seqs_for(t)
        self._span(t, "input_ids").zero_()
        self._span(t, "positions").copy_(torch.arange(t, device=self.device) % q)
        self._span(t, "slot_mapping").fill_(-1)
        self._span(t, "seq_lens").fill_(q)
        self._span(t, "query_start_loc").copy_(torch.arange(s + 1, device=self.device) * q)
        self.block_tables.zero_()
