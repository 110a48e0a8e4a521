"""CUDA graphs for decode-only steps.

A decode step launches a few hundred small kernels; launched one by one from Python that
costs far more than the GPU work (transformers' eager decode: ~80 ms a step). Each graph
here is one decode forward (embedding → layers → final norm → LM head) captured for a
batch-size bucket B, reading static input buffers:

- ``scalars`` (int64): ``input_ids[B] | positions[B] | slot_mapping[B] | seq_lens[B] |
  query_start_loc[B+1]`` at the (aligned) offsets ``input_buffers.packed_offsets(B, B, 0, 0)``,
  the layout ``input_buffers.fill_step`` writes for a padded step;
- ``block_tables`` (int64, ``[max_bucket, max_blocks_per_seq]``): fixed width, so the
  kernels' row stride is a constant of the graph.

A replay refreshes those buffers with two device copies (the block table comes gathered
from the runner's persistent device table, ``[B, width]`` with ``width`` <= the fixed width), or,
``replay_fed``, with one kernel that also feeds the tokens still only on the device, and returns
the float32 logits of all B rows (a static output: read it before the next replay). The sampler stays outside.
The graphs bake in the addresses of the weights and the KV cache: anything that moves
them (sleep mode) must drop the graphs and capture again.

The Triton attention kernel is graph-safe: its grid is ``(B // BLOCK_Q + B, num_kv_heads)``,
fixed per bucket, and the per-sequence lengths are read on the device.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tidal_engine.layers.attention import AttentionMetadata
from tidal_engine.runner.input_buffers import StepLayout, packed_offsets

logger = logging.getLogger(__name__)


def specialization_sizes(sizes: list[int]) -> list[int]:
    """One batch size of each kind Triton specializes a launch's integers on (1, a multiple of
    16, any other), and the largest: the decode steps a compile-ahead dry run goes through."""
    ordered = sorted(sizes)
    if not ordered:
        return []
    of_16 = next((b for b in ordered if b % 16 == 0), None)
    other = next((b for b in ordered if b > 1 and b % 16), None)
    return sorted({ordered[0], ordered[-1]} | {b for b in (of_16, other) if b is not None})


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    # [B, vocab] float32 logits, written by each replay; a pipeline stage before the last
    # gives its (hidden, residual) instead.
    logits: torch.Tensor | tuple[torch.Tensor, torch.Tensor]


class DecodeGraphs:
    # An eager run before every capture (True), or before the first, largest, only (False): one
    # warm-up loads and compiles the kernels; the others cost start-up time and changed nothing
    # (H200, 8B shape: each replay equal to an eager run, bit for bit, also with an empty cache).
    warm_up_each = False

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        sizes: list[int],
        max_blocks_per_seq: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = sorted(sizes)
        self.max_blocks_per_seq = max_blocks_per_seq
        self.device = device
        max_b = self.sizes[-1]
        self.scalars = torch.zeros(self._scalars_end(max_b), dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(max_b, max_blocks_per_seq, dtype=torch.int64, device=device)
        self.graphs: dict[int, _Graph] = {}
        # Pipeline stages after the first read the previous stage's activations from here.
        self.stage_input: tuple[torch.Tensor, torch.Tensor] | None = None
        if not getattr(model, "is_first_stage", True):
            hidden_size = model.config.hidden_size  # type: ignore[attr-defined]
            dtype = next(model.parameters()).dtype
            self.stage_input = (torch.zeros(max_b, hidden_size, dtype=dtype, device=device),
                                torch.zeros(max_b, hidden_size, dtype=dtype, device=device))
        self.capture_seconds = 0.0
        self.num_replays = 0
        self._timing_stream: torch.cuda.Stream | None = None  # compare_steps' captures, made once
        self.stages_inputs = False  # replay_fed's kernel is ready (capture makes it)

    @staticmethod
    def _scalars_end(b: int) -> int:
        return packed_offsets(b, b, 0, 0)["query_start_loc"][1]

    def _span(self, b: int, name: str) -> torch.Tensor:
        start, end = packed_offsets(b, b, 0, 0)[name]
        return self.scalars[start:end]

    def _meta(self, b: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        meta = AttentionMetadata(
            slot_mapping=self._span(b, "slot_mapping"),
            query_start_loc=self._span(b, "query_start_loc"),
            seq_lens=self._span(b, "seq_lens"),
            block_tables=self.block_tables[:b],
            max_query_len=1,
            max_seq_len=self.max_blocks_per_seq,  # unused by the Triton backend
            query_start_loc_cpu=list(range(b + 1)),  # shapes only: the torch backend never runs here
            seq_lens_cpu=[1] * b,
        )
        return self._span(b, "input_ids"), self._span(b, "positions"), meta

    def _dummy_inputs(self, b: int) -> None:
        """A valid decode batch: B one-token sequences at position 0, stored nowhere."""
        self._span(b, "input_ids").zero_()
        self._span(b, "positions").zero_()
        self._span(b, "slot_mapping").fill_(-1)
        self._span(b, "seq_lens").fill_(1)
        self._span(b, "query_start_loc").copy_(torch.arange(b + 1, device=self.device))
        self.block_tables[:b].zero_()

    def _forward(self, b: int) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        ids, pos, meta = self._meta(b)
        if self.stage_input is None:
            hidden = self.model(ids, pos, self.kv_caches, meta)
        else:
            hidden = self.model(ids, pos, self.kv_caches, meta, (self.stage_input[0][:b], self.stage_input[1][:b]))
        if not getattr(self.model, "is_last_stage", True):
            return hidden  # (hidden, residual) for the next stage
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def run_eager(self, b: int) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The forward a capture of bucket ``b`` records, run eagerly on the dummy inputs."""
        self._dummy_inputs(b)
        return self._forward(b)

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        # Largest first: the smaller graphs then fit in the memory the big one pooled.
        for i, b in enumerate(sorted(self.sizes, reverse=True)):
            self._dummy_inputs(b)
            if i == 0 or self.warm_up_each:
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):  # warm-up: Triton compiles, cuBLAS picks kernels
                    self._forward(b)
                torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                logits = self._forward(b)
            self.graphs[b] = _Graph(graph, logits)
        self._compile_staging()
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start
        logger.info("captured %d decode CUDA graphs (batch %d..%d) in %.2f s",
                    len(self.graphs), self.sizes[0], self.sizes[-1], self.capture_seconds)

    @torch.inference_mode()
    def compare_steps(self, b: int, setups: list[Callable[[], None]], rounds: int = 5,
                      sample_seconds: float = 0.003, max_replays: int = 5) -> list[float]:
        """GPU seconds of one decode step of bucket ``b`` on the dummy inputs under each of
        ``setups`` (each sets the model up, e.g. a linear's kernel, before its own capture): a
        graph per setup, then ``rounds`` rounds that time each graph in turn over about
        ``sample_seconds`` of replays (at most ``max_replays``: 0.6B 3, 8B 1), and each setup's
        fastest round. Interleaved, a stretch of slow GPU work slows every setup's sample of
        that round, not one setup's timing. Start-up times kernel choices inside the step with
        it; run the step eagerly once first (``run_eager``), so no kernel compiles under capture."""
        self._dummy_inputs(b)
        if self._timing_stream is None:
            self._timing_stream = torch.cuda.Stream(self.device)
        stream = self._timing_stream
        graphs = []
        for setup in setups:
            setup()
            stream.wait_stream(torch.cuda.current_stream(self.device))
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                self._forward(b)
            graph.replay()  # the first replay after a capture also uploads the graph
            graphs.append(graph)
        replays = max(1, min(max_replays, round(sample_seconds / self._replays_seconds(graphs[0], 1))))
        best = [float("inf")] * len(graphs)
        for _ in range(rounds):
            for i, graph in enumerate(graphs):
                best[i] = min(best[i], self._replays_seconds(graph, replays))
        del graphs
        return best

    @staticmethod
    def _replays_seconds(graph: torch.cuda.CUDAGraph, replays: int) -> float:
        """GPU seconds per replay over ``replays`` back-to-back replays."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / replays

    def replay(
        self, b: int, staged: torch.Tensor, block_tables: torch.Tensor,
        stage_input: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Run bucket ``b`` on a padded step staged on the device (layout of fill_step with
        T = S = b) and its ``[b, width]`` block table (gathered from the persistent batch);
        returns the [b, vocab] float32 logits (a stage before the last: its activations).
        ``stage_input``: the previous pipeline stage's ``[b, hidden]`` activations."""
        end = self._scalars_end(b)
        self.scalars[:end].copy_(staged[:end])
        self.block_tables[:b, : block_tables.shape[1]].copy_(block_tables)
        if stage_input is not None:
            assert self.stage_input is not None
            self.stage_input[0][:b].copy_(stage_input[0])
            self.stage_input[1][:b].copy_(stage_input[1])
        return self._replay_captured(b)

    def _replay_captured(self, b: int) -> torch.Tensor:
        entry = self.graphs[b]
        entry.graph.replay()
        self.num_replays += 1
        return entry.logits

    def _compile_staging(self) -> None:
        """``replay_fed``'s kernel, compiled (or loaded) now rather than on the first decode step;
        ``stages_inputs`` says whether it exists (Triton is installed)."""
        from tidal_engine.kernels.triton import triton_available

        self.stages_inputs = triton_available()
        if self.stages_inputs:
            from tidal_engine.kernels.triton.graph_inputs import stage_decode_graph

            stage_decode_graph(self.scalars, 0, self.scalars, (0, 0, 0), self.scalars, self.block_tables, 0, 0, 0,
                               self.block_tables)

    def replay_fed(self, b: int, staged: torch.Tensor, layout: StepLayout, last_sampled: torch.Tensor,
                   table: torch.Tensor) -> torch.Tensor:
        """``replay`` of a step whose fed tokens are still only on the device: one kernel puts the
        staged scalars (the fed tokens from ``last_sampled`` in place) and the step's rows of the
        persistent block ``table`` into the graph's buffers (kernels/triton/graph_inputs.py)."""
        from tidal_engine.kernels.triton.graph_inputs import stage_decode_graph

        off = layout.offsets()
        stage_decode_graph(staged, self._scalars_end(b), self.scalars,
                           (off["feed_rows"][0], off["feed_src"][0], layout.num_feeds), last_sampled, table,
                           off["batch_rows"][0], layout.num_seqs, layout.width, self.block_tables)
        return self._replay_captured(b)
