"""The draft model's own paged KV cache: a separate block pool, one state per request.

A request's state is the tokens whose draft KV is written and the blocks that hold them.
Rollback is a prefix match: before each proposal the state is cut back to the longest common
prefix of its tokens and the request's real sequence, so the KV of rejected drafts (or of any
token that changed) is simply overwritten by the next forward. Blocks go back to the pool when
the engine releases the request (finished, aborted) or when a request in the current batch
needs them and an idle state is evicted.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from tidal_engine.layers.attention import AttentionMetadata


@dataclass
class DraftState:
    tokens: list[int] = field(default_factory=list)  # draft KV is written for exactly these positions
    blocks: list[int] = field(default_factory=list)

    def rollback_to(self, sequence: np.ndarray) -> int:
        """Keep the longest common prefix with ``sequence`` (never its last token, which the next
        forward feeds); returns how many positions are still valid."""
        n = min(len(self.tokens), len(sequence) - 1)
        if n > 0:
            same = np.asarray(self.tokens[:n], dtype=np.int64) == sequence[:n]
            n = n if same.all() else int(np.argmin(same))
        del self.tokens[n:]
        return n


@dataclass
class DraftRow:
    """One sequence's share of a draft forward: ``new_tokens`` at positions ``start``.."""

    state: DraftState
    new_tokens: list[int]
    start: int


class DraftKVPool:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        if num_blocks < 2:
            raise ValueError("the draft KV pool needs at least 2 blocks")
        shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
        self.caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.block_size = block_size
        self.device = device
        self._free = list(range(num_blocks - 1, 0, -1))  # block 0 is never handed out (table padding)
        self._states: OrderedDict[str, DraftState] = OrderedDict()  # least recently proposed first

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def state(self, request_id: str) -> DraftState:
        state = self._states.pop(request_id, None) or DraftState()
        self._states[request_id] = state  # now the most recent
        return state

    def release(self, request_id: str) -> None:
        state = self._states.pop(request_id, None)
        if state is not None:
            self._free.extend(reversed(state.blocks))

    def reserve(self, request_id: str, num_positions: int, keep: Sequence[str]) -> bool:
        """Blocks for ``num_positions`` positions of the request, evicting idle states (not in
        ``keep``) oldest first when the pool runs short; False when it still cannot."""
        state = self._states[request_id]
        need = -(-num_positions // self.block_size) - len(state.blocks)
        if need <= 0:
            return True
        for victim in [r for r in self._states if r not in keep]:
            if len(self._free) >= need:
                break
            self.release(victim)
        if len(self._free) < need:
            return False
        state.blocks.extend(self._free.pop() for _ in range(need))
        return True

    def metadata(self, rows: list[DraftRow]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input ids, positions, attention metadata) of one forward over ``rows``."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        for row in rows:
            for offset, token in enumerate(row.new_tokens):
                pos = row.start + offset
                ids.append(token)
                positions.append(pos)
                slots.append(row.state.blocks[pos // bs] * bs + pos % bs)
            query_start_loc.append(len(ids))
            seq_lens.append(row.start + len(row.new_tokens))
        width = max(len(row.state.blocks) for row in rows)
        tables = np.zeros((len(rows), width), dtype=np.int32)
        for i, row in enumerate(rows):
            tables[i, : len(row.state.blocks)] = row.state.blocks
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.from_numpy(tables).to(dev),
            max_query_len=max(len(row.new_tokens) for row in rows),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
        )
        return (torch.tensor(ids, dtype=torch.int64, device=dev), torch.tensor(positions, dtype=torch.int64, device=dev),
                meta)
