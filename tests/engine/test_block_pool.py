"""BlockPool: ref counts, the LRU free queue, the hash map and the block hash chain."""

from __future__ import annotations

import pytest

from tidal_engine.core.block_pool import BlockPool, hash_block_tokens
from tidal_engine.core.request import Request


def test_hash_is_deterministic_sha256_and_chained() -> None:
    a = hash_block_tokens(None, [1, 2, 3])
    assert a == hash_block_tokens(None, [1, 2, 3])
    assert isinstance(a, bytes) and len(a) == 32
    assert a != hash_block_tokens(None, [1, 2, 4])
    # Same tokens under a different parent give a different hash.
    assert hash_block_tokens(a, [5, 6]) != hash_block_tokens(hash_block_tokens(None, [9]), [5, 6])
    # Extra keys are part of the hash and cannot be confused with tokens.
    assert hash_block_tokens(None, [1], ("lora=x",)) != hash_block_tokens(None, [1])
    assert hash_block_tokens(None, [1], ("a", "b")) != hash_block_tokens(None, [1], ("ab",))


def test_request_block_hashes_are_incremental_and_keyed() -> None:
    tokens = list(range(40))
    plain = Request("a", tokens)
    assert len(plain.update_block_hashes(16)) == 2  # 40 tokens: two full blocks
    for t in range(8):
        plain.append_output_token(t)
    hashes = plain.update_block_hashes(16)
    assert len(hashes) == 3 and hashes[:2] == Request("b", tokens).update_block_hashes(16)
    with pytest.raises(ValueError):
        plain.update_block_hashes(8)

    salted = Request("c", tokens, cache_salt="s1").update_block_hashes(16)
    lora = Request("d", tokens, lora_name="adapter").update_block_hashes(16)
    # The salt enters block 0 only, but the chain carries it to every later block.
    assert all(s != p for s, p in zip(salted, hashes))
    assert all(l != p for l, p in zip(lora, hashes))
    assert salted != Request("e", tokens, cache_salt="s2").update_block_hashes(16)


def test_alloc_and_free_ref_counts() -> None:
    pool = BlockPool(4, block_size=16)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert all(b.ref_count == 1 for b in blocks)
    assert pool.num_free_blocks == 1 and pool.usage == pytest.approx(0.75)
    pool.touch(blocks[:1])
    assert blocks[0].ref_count == 2
    pool.free_blocks(blocks)
    assert blocks[0].ref_count == 1 and pool.num_free_blocks == 3
    pool.free_blocks(blocks[:1])
    assert pool.num_free_blocks == 4 and pool.usage == 0.0
    with pytest.raises(ValueError):
        pool.free_blocks(blocks[:1])  # double free
    with pytest.raises(ValueError):
        pool.get_new_blocks(5)


def test_lru_eviction_order() -> None:
    pool = BlockPool(4, block_size=2)
    blocks = pool.get_new_blocks(4)
    hashes = [hash_block_tokens(None, [i]) for i in range(4)]
    for block, h in zip(blocks, hashes):
        assert pool.cache_block(block, h)
    # Free 2, 0, 3, 1: the free queue (head first) follows that order.
    pool.free_blocks([blocks[2], blocks[0], blocks[3], blocks[1]])
    assert pool.free_block_ids == [2, 0, 3, 1]
    # A prefix hit on block 0 pulls it out of the queue.
    pool.touch([pool.get_cached_block(hashes[0])])
    assert pool.free_block_ids == [2, 3, 1]
    # Allocation evicts from the head: block 2 first, and its hash leaves the map.
    (evicted,) = pool.get_new_blocks(1)
    assert evicted.block_id == 2 and evicted.block_hash is None
    assert pool.get_cached_block(hashes[2]) is None
    assert pool.get_cached_block(hashes[3]) is blocks[3]
    # Freed again, block 0 (cached) goes to the tail: most recently used.
    pool.free_blocks([blocks[0]])
    assert pool.free_block_ids == [3, 1, 0]


def test_uncached_freed_blocks_are_reused_first() -> None:
    pool = BlockPool(3, block_size=2)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_block(a, hash_block_tokens(None, [1]))
    pool.free_blocks([a])
    pool.free_blocks([b])  # uncached: goes to the head
    assert pool.free_block_ids == [1, 0]
    assert pool.get_new_blocks(1)[0] is b
    assert pool.get_cached_block(hash_block_tokens(None, [1])) is a  # cached one survived


def test_cache_block_keeps_existing_mapping() -> None:
    pool = BlockPool(2, block_size=2)
    a, b = pool.get_new_blocks(2)
    h = hash_block_tokens(None, [7, 7])
    assert pool.cache_block(a, h)
    assert not pool.cache_block(b, h)
    assert pool.get_cached_block(h) is a and b.block_hash is None


def test_reset_prefix_cache() -> None:
    pool = BlockPool(2, block_size=2)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, hash_block_tokens(None, [1]))
    pool.cache_block(b, hash_block_tokens(None, [2]))
    pool.free_blocks([a])
    assert pool.reset_prefix_cache() is True
    assert pool.cached_blocks == {} and a.block_hash is None and b.block_hash is None
    assert b.ref_count == 1 and pool.num_free_blocks == 1  # in-use blocks unaffected
