"""The pool of fixed-size KV blocks: ref counts, an LRU free queue and the prefix-cache map.

Decisions:
- Every block id in ``[0, num_blocks)`` is handed out; none is reserved as a "null" block
  (the runner pads unused slots with slot -1 instead).
- The free queue holds exactly the blocks with ``ref_count == 0``, oldest first. A freed block
  that carries a cached hash goes to the tail (most recently used); a freed block without one
  goes to the head, since it is worthless and should be reused before any cached block.
  Allocation pops from the head; popping a cached block evicts it from the hash map.
- ``BlockHash`` is a sha256 digest chained through the parent block's hash, so a hit on block
  i implies the whole prefix matches. sha256 rather than ``hash()``: tenants share the cache,
  so a collision would leak or corrupt another tenant's KV.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

BlockHash = bytes  # 32-byte sha256 digest

_HASH_DOMAIN = b"tidal-kv-block-v1"


def hash_block_tokens(
    parent_hash: BlockHash | None, token_ids: Sequence[int], extra_keys: Sequence[str] = ()
) -> BlockHash:
    """sha256 over (parent hash, token ids, extra keys), encoded without ambiguity.

    Each field is length-prefixed so that, e.g., moving a token between the ids and the
    extra keys can never produce the same byte string.
    """
    h = hashlib.sha256(_HASH_DOMAIN)
    parent = parent_hash if parent_hash is not None else b""
    h.update(struct.pack("<I", len(parent)))
    h.update(parent)
    h.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    h.update(struct.pack("<I", len(extra_keys)))
    for key in extra_keys:
        data = key.encode("utf-8")
        h.update(struct.pack("<I", len(data)))
        h.update(data)
    return h.digest()


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: BlockHash | None = None  # set while the block is in the prefix cache

    def __repr__(self) -> str:
        cached = "cached" if self.block_hash is not None else "-"
        return f"Block({self.block_id}, ref={self.ref_count}, {cached})"


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks: list[Block] = [Block(i) for i in range(num_blocks)]
        # OrderedDict: O(1) pop at the head, append at either end, and removal from the middle
        # when a cached free block gets a prefix hit.
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached_blocks: dict[BlockHash, Block] = {}
        # Told (block id, hash) when a cached block is taken for reuse: a KV connector that
        # saves on eviction copies it out before the step that overwrites it.
        self.on_evict: Callable[[int, BlockHash], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def free_block_ids(self) -> list[int]:
        """The free queue, head (next to be allocated/evicted) first. For tests and debugging."""
        return list(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (ref_count > 0)."""
        return 1.0 - len(self._free) / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> Block | None:
        return self.cached_blocks.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[Block]:
        """Take ``num_blocks`` from the head of the free queue (evicting cached ones), ref 1."""
        if num_blocks > len(self._free):
            raise ValueError(f"asked for {num_blocks} blocks, only {len(self._free)} free")
        blocks: list[Block] = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_count = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on blocks found in the prefix cache (pulling free ones off the queue)."""
        for block in blocks:
            if block.ref_count == 0:
                del self._free[block.block_id]
            block.ref_count += 1

    def free_blocks(self, blocks: Iterable[Block]) -> None:
        """Drop one reference each; blocks reaching 0 join the free queue in the given order."""
        for block in blocks:
            if block.ref_count <= 0:
                raise ValueError(f"double free of block {block.block_id}")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block.block_id] = block
                if block.block_hash is None:
                    self._free.move_to_end(block.block_id, last=False)  # reuse uncached first

    def cache_block(self, block: Block, block_hash: BlockHash) -> bool:
        """Register ``block`` under ``block_hash``; False (and no change) if the hash is taken.

        Keeping the existing mapping means blocks already handed out as hits stay valid.
        """
        if block_hash in self.cached_blocks or block.block_hash is not None:
            return False
        block.block_hash = block_hash
        self.cached_blocks[block_hash] = block
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Safe while blocks are in use: their KV stays, only the
        ability to hit on it goes. Free blocks keep their queue position."""
        for block in self.cached_blocks.values():
            block.block_hash = None
        self.cached_blocks.clear()
        return True

    def _evict(self, block: Block) -> None:
        if block.block_hash is None:
            return
        if self.cached_blocks.get(block.block_hash) is block:
            del self.cached_blocks[block.block_hash]
            if self.on_evict is not None:
                self.on_evict(block.block_id, block.block_hash)
        block.block_hash = None
