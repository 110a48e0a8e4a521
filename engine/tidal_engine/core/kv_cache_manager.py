"""Per-request block tables on top of the ``BlockPool``, with prefix caching.

A request's blocks are a list whose i-th entry holds tokens ``[i*block_size, (i+1)*block_size)``.
Full, computed blocks are registered in the prefix cache under their chained hash; another
request with the same prefix (same tokens, same LoRA, same cache salt) takes a reference on
them instead of recomputing. n>1 samples share their prompt the same way.

Decisions:
- A prefix hit never covers the whole sequence: at least one token is recomputed so the step
  has logits to sample from. The hit is capped at ``(num_tokens - 1) // block_size`` blocks.
- ``prefix_cache_stats`` is updated when a fresh or preempted request (no blocks, nothing
  computed) is *admitted*, i.e. on its first successful ``allocate_slots``, rather than in
  ``get_computed_blocks``: the scheduler may look a waiting request up on several steps before
  it fits, and those repeated lookups must not be counted as separate queries.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tidal_engine.core.block_pool import Block, BlockHash, BlockPool
from tidal_engine.core.request import Request


@dataclass
class PrefixCacheStats:
    """Cumulative counters, in tokens (vLLM's prefix_cache_queries / prefix_cache_hits)."""

    requests: int = 0  # admissions counted (fresh or preempted requests)
    queries: int = 0  # tokens looked up: request.num_tokens at admission
    hits: int = 0  # tokens served from the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks, block_size)
        self.prefix_cache_stats = PrefixCacheStats()
        self._req_blocks: dict[str, list[Block]] = {}
        self._req_block_ids: dict[str, list[int]] = {}  # the same tables as ids (read every step)
        # How many leading blocks of each request cache_full_blocks has already processed.
        self._num_cached_blocks: dict[str, int] = {}

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._req_blocks.get(request_id, ())]

    def get_computed_blocks(self, request: Request) -> tuple[list[Block], int]:
        """Longest run of cached full blocks at the start of the request, and its token count.

        Takes no references: pass the blocks to ``allocate_slots`` right away.
        """
        if not self.enable_prefix_caching or request.skips_prefix_cache:
            return [], 0
        # The last token is always recomputed, so the hit never needs its block's hash.
        hashes = request.update_block_hashes(self.block_size, request.num_tokens - 1)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[Block] = []
        for block_hash in hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break  # hashes chain, so nothing after a miss can hit
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[Block] | None = None
    ) -> list[int] | None:
        """Make room for ``num_new_tokens`` more tokens; return the full block table, or None.

        ``computed_blocks`` (from ``get_computed_blocks``) is only for a request holding no
        blocks yet; their tokens count as computed on top of ``request.num_computed_tokens``
        (0 then), so the caller advances ``num_computed_tokens`` by the hit after success.
        On None nothing changed. Cached free blocks are evicted LRU-first as needed.
        """
        blocks = self._req_blocks.get(request.request_id)
        computed = computed_blocks or []
        if blocks and not computed and request.num_computed_tokens + num_new_tokens <= len(blocks) * self.block_size:
            return list(self._req_block_ids[request.request_id])  # the common decode step: room left
        if computed and blocks:
            raise ValueError(f"request {request.request_id} already has blocks; prefix hits are for new requests")
        num_held = len(blocks) if blocks else 0
        total_tokens = request.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        num_new_blocks = max(0, _cdiv(total_tokens, self.block_size) - num_held - len(computed))
        # Hit blocks with ref 0 sit in the free queue; taking them shrinks what is free.
        num_free_hits = sum(1 for b in computed if b.ref_count == 0)
        if num_new_blocks + num_free_hits > self.block_pool.num_free_blocks:
            return None

        if blocks is None:  # admission of a fresh or preempted request
            blocks = self._req_blocks[request.request_id] = []
            self._req_block_ids[request.request_id] = []
            self._num_cached_blocks[request.request_id] = len(computed)
            if self.enable_prefix_caching and request.num_computed_tokens == 0:
                stats = self.prefix_cache_stats
                stats.requests += 1
                stats.queries += request.num_tokens
                stats.hits += len(computed) * self.block_size
        self.block_pool.touch(computed)
        added = computed + self.block_pool.get_new_blocks(num_new_blocks)
        blocks.extend(added)
        ids = self._req_block_ids[request.request_id]
        ids.extend(b.block_id for b in added)
        return list(ids)

    def cache_full_blocks(self, request: Request) -> list[tuple[int, BlockHash]]:
        """Register the request's newly full, computed blocks in the prefix cache; return them
        as (block id, hash), for a KV connector that saves them.

        Call after ``num_computed_tokens`` advances. If an identical block is already cached
        (e.g. a sibling computed the same prompt in the same step), the existing mapping wins
        and this request's copy stays private, to be reused first once freed.
        """
        if not self.enable_prefix_caching or request.skips_prefix_cache:
            return []
        blocks = self._req_blocks.get(request.request_id)
        if not blocks:
            return []
        start = self._num_cached_blocks.get(request.request_id, 0)
        num_full = min(request.num_computed_tokens // self.block_size, len(blocks))
        if num_full <= start:
            return []
        hashes = request.update_block_hashes(self.block_size, request.num_computed_tokens)
        for index in range(start, num_full):
            self.block_pool.cache_block(blocks[index], hashes[index])
        self._num_cached_blocks[request.request_id] = num_full
        return [(blocks[i].block_id, hashes[i]) for i in range(start, num_full)]

    # ---- blocks a KV connector is copying (kv_transfer.base.BlockHolder) -----------------
    def hold_blocks(self, block_ids: list[int]) -> None:
        """An extra reference on each block: it stays out of reuse until released."""
        self.block_pool.touch(self.block_pool.blocks[i] for i in block_ids)

    def release_blocks(self, block_ids: list[int]) -> None:
        self.block_pool.free_blocks(self.block_pool.blocks[i] for i in block_ids)

    def watch_evictions(self, callback: Callable[[int, BlockHash], None]) -> None:
        """``callback(block id, hash)`` whenever a cached block is taken for reuse."""
        self.block_pool.on_evict = callback

    def free(self, request: Request) -> None:
        """Release the request's blocks (no-op if it holds none).

        Freed in reverse so the tail blocks, the least likely to be shared by a future prompt,
        land nearer the head of the free queue and are evicted first.
        """
        blocks = self._req_blocks.pop(request.request_id, None)
        self._req_block_ids.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()
