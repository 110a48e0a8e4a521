"""KVCacheManager: slot allocation, prefix hits, ref-count sharing, eviction and stats."""

from __future__ import annotations

from tidal_engine.core.kv_cache_manager import KVCacheManager
from tidal_engine.core.request import Request

BS = 16


def admit(kv: KVCacheManager, request: Request) -> list[int] | None:
    """What the scheduler does for a waiting request scheduled whole."""
    blocks, hit = kv.get_computed_blocks(request)
    block_ids = kv.allocate_slots(request, request.num_tokens - hit, blocks)
    if block_ids is not None:
        request.num_computed_tokens = hit
    return block_ids


def compute_all(kv: KVCacheManager, request: Request) -> None:
    """Pretend the model ran the scheduled tokens."""
    request.num_computed_tokens = request.num_tokens
    kv.cache_full_blocks(request)


def test_allocate_grows_and_fails_cleanly() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS, enable_prefix_caching=False)
    req = Request("a", list(range(20)))
    ids = kv.allocate_slots(req, 20)
    assert ids == [0, 1]
    req.num_computed_tokens = 20
    assert kv.allocate_slots(req, 12) == [0, 1]  # 32 tokens still fit in two blocks
    assert kv.allocate_slots(req, 13) == [0, 1, 2]
    big = Request("b", list(range(40)))
    assert kv.allocate_slots(big, 40) is None  # needs 3, 1 free
    assert kv.get_block_ids("b") == [] and kv.num_free_blocks == 1
    kv.free(req)
    assert kv.num_free_blocks == 4 and kv.usage == 0.0


def test_prefix_hit_shares_blocks_by_ref_count() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    prefix = list(range(100, 140))  # 40 tokens: 2 full blocks
    a = Request("a", prefix + [1, 2])
    assert admit(kv, a) == [0, 1, 2]
    compute_all(kv, a)

    b = Request("b", prefix + [3, 4, 5])
    blocks, hit = kv.get_computed_blocks(b)
    assert hit == 32 and [x.block_id for x in blocks] == [0, 1]
    ids = kv.allocate_slots(b, b.num_tokens - hit, blocks)
    assert ids is not None and ids[:2] == [0, 1] and len(ids) == 3
    pool = kv.block_pool
    assert [pool.blocks[i].ref_count for i in (0, 1, 2)] == [2, 2, 1]

    kv.free(a)
    assert [pool.blocks[i].ref_count for i in (0, 1, 2)] == [1, 1, 0]
    assert kv.num_free_blocks == 10 - 3  # shared blocks stay out of the free queue
    kv.free(b)
    assert kv.num_free_blocks == 10
    assert pool.get_cached_block(b.block_hashes[0]) is pool.blocks[0]  # still cached after free


def test_hit_never_covers_the_whole_sequence() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a = Request("a", list(range(32)))
    admit(kv, a)
    compute_all(kv, a)
    same = Request("same", list(range(32)))
    assert kv.get_computed_blocks(same)[1] == 16  # capped at (32 - 1) // 16 blocks
    longer = Request("longer", list(range(33)))
    assert kv.get_computed_blocks(longer)[1] == 32


def test_cache_salt_and_lora_isolate() -> None:
    kv = KVCacheManager(num_blocks=20, block_size=BS)
    tokens = list(range(50))
    a = Request("a", tokens, cache_salt="tenant-1")
    admit(kv, a)
    compute_all(kv, a)
    assert kv.get_computed_blocks(Request("b", tokens, cache_salt="tenant-1"))[1] == 48
    assert kv.get_computed_blocks(Request("c", tokens, cache_salt="tenant-2"))[1] == 0
    assert kv.get_computed_blocks(Request("d", tokens))[1] == 0
    assert kv.get_computed_blocks(Request("e", tokens, cache_salt="tenant-1", lora_name="x"))[1] == 0


def test_stats_count_admissions_once() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    a = Request("a", list(range(40)))
    admit(kv, a)
    compute_all(kv, a)
    assert (kv.prefix_cache_stats.queries, kv.prefix_cache_stats.hits) == (40, 0)
    b = Request("b", list(range(40)) + [7])
    kv.get_computed_blocks(b)  # a lookup alone (request still waiting) counts nothing
    kv.get_computed_blocks(b)
    assert kv.prefix_cache_stats.queries == 40
    admit(kv, b)
    stats = kv.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (2, 81, 32)
    assert abs(stats.hit_rate - 32 / 81) < 1e-9
    # Growing a running request is not a new query.
    b.num_computed_tokens = b.num_tokens
    kv.allocate_slots(b, 1)
    assert stats.queries == 81


def test_prefix_caching_disabled() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=BS, enable_prefix_caching=False)
    a = Request("a", list(range(40)))
    admit(kv, a)
    compute_all(kv, a)
    assert kv.block_pool.cached_blocks == {}
    assert kv.get_computed_blocks(Request("b", list(range(40)) + [1])) == ([], 0)
    assert kv.prefix_cache_stats.queries == 0


def test_identical_block_keeps_first_mapping() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    a, b = Request("a", list(range(20))), Request("b", list(range(20)))
    admit(kv, a)
    admit(kv, b)  # same step: no hit yet, computes its own copy
    compute_all(kv, a)
    compute_all(kv, b)
    first = kv.block_pool.get_cached_block(a.block_hashes[0])
    assert first is not None and first.block_id == kv.get_block_ids("a")[0]
    b_copy = kv.block_pool.blocks[kv.get_block_ids("b")[0]]
    assert b_copy.block_hash is None


def test_free_in_reverse_evicts_tail_blocks_first() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = Request("a", list(range(13)))  # 3 full blocks + 1 token
    assert admit(kv, a) == [0, 1, 2, 3]
    compute_all(kv, a)
    kv.free(a)
    # Uncached tail block 3 first, then the cached ones tail-first: 2, 1, 0.
    assert kv.block_pool.free_block_ids == [3, 2, 1, 0]
    # A new 8-token request takes blocks 3 and 2: block 2 (the prefix tail) is evicted,
    # the first two blocks of the old prefix survive.
    c = Request("c", [900 + i for i in range(8)])
    assert admit(kv, c) == [3, 2]
    again = Request("again", list(range(13)))
    assert kv.get_computed_blocks(again)[1] == 8


def test_hits_on_free_blocks_count_against_free_space() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = Request("a", list(range(9)))
    admit(kv, a)
    compute_all(kv, a)
    kv.free(a)  # blocks 0, 1 cached and free; block 2 free
    b = Request("b", list(range(8)) + [50, 51, 52, 53, 54])  # hit 8 tokens, needs 2 new blocks
    blocks, hit = kv.get_computed_blocks(b)
    assert hit == 8
    assert kv.allocate_slots(b, b.num_tokens - hit, blocks) is None  # 2 hits + 2 new > 3 free
    assert kv.num_free_blocks == 3 and all(x.ref_count == 0 for x in blocks)
    c = Request("c", list(range(8)) + [60])  # hit 8, needs 1 new: fits exactly
    assert admit(kv, c) == [0, 1, 2]


def test_reset_prefix_cache_drops_hits() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    a = Request("a", list(range(40)))
    admit(kv, a)
    compute_all(kv, a)
    assert kv.reset_prefix_cache() is True
    assert kv.get_computed_blocks(Request("b", list(range(41))))[1] == 0
    kv.free(a)
    assert kv.num_free_blocks == 6
