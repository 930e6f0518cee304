"""Block manager: ref counts, free list, prefix caching with verification and LRU reuse, copy-on-write."""
from __future__ import annotations

import pytest

from engine.block_manager import BlockManager
from engine.request import Request, Sequence
from engine.sampling_params import SamplingParams

BS = 4


def make_seq(tokens: list[int], seq_id: int = 0) -> Sequence:
    req = Request(f"r{seq_id}", list(tokens), SamplingParams(), max_tokens=16)
    return Sequence(seq_id, req, 0, list(tokens), len(tokens))


def match_prefix(bm: BlockManager, seq: Sequence) -> int:
    """Admits seq with its cached prefix and nothing more; returns the number of tokens reused."""
    assert bm.admit(seq, bm.find_cached_prefix(seq), 0)
    return seq.num_computed_tokens


def prefill(bm: BlockManager, seq: Sequence) -> None:
    """What the engine does for a whole-prompt prefill: match and allocate at once, compute, publish."""
    hit = bm.find_cached_prefix(seq)
    assert bm.admit(seq, hit, seq.num_tokens - len(hit.block_ids) * BS)
    seq.num_computed_tokens = seq.num_tokens
    bm.register_full_blocks(seq)


def test_allocate_and_free_return_every_block():
    bm = BlockManager(10, BS, enable_prefix_caching=False)
    seq = make_seq(list(range(10)))
    prefill(bm, seq)
    assert len(seq.block_table) == 3 and 0 not in seq.block_table
    assert bm.num_free_blocks == 9 - 3
    bm.free_seq(seq)
    assert bm.num_free_blocks == 9
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_allocation_fails_cleanly_when_blocks_run_out():
    bm = BlockManager(4, BS, enable_prefix_caching=False)
    seq = make_seq(list(range(13)))       # needs 4 blocks, only 3 usable
    assert not bm.allocate(seq, 13)
    assert seq.block_table == [] and bm.num_free_blocks == 3


def test_double_free_is_caught():
    bm = BlockManager(4, BS, enable_prefix_caching=False)
    seq = make_seq([1, 2, 3])
    prefill(bm, seq)
    table = list(seq.block_table)
    bm.free_seq(seq)
    seq.block_table = table
    with pytest.raises(AssertionError):
        bm.free_seq(seq)


def test_prefix_hit_reuses_full_blocks_but_recomputes_last_token():
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    a = make_seq(list(range(12)), 0)          # exactly 3 blocks
    prefill(bm, a)
    b = make_seq(list(range(12)), 1)
    assert match_prefix(bm, b) == 8            # the block holding the last token is recomputed
    assert b.block_table == a.block_table[:2]
    assert bm.blocks[a.block_table[0]].ref_count == 2
    assert bm.prefix_queries == 24 and bm.prefix_hits == 8


def test_prefix_chain_differs_after_a_different_block():
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    prefill(bm, make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9], 0))
    other = make_seq([9, 9, 9, 9, 5, 6, 7, 8, 9], 1)   # same second block, different first
    assert match_prefix(bm, other) == 0


def test_hit_is_verified_against_stored_tokens():
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    a = make_seq([1, 2, 3, 4, 5], 0)
    prefill(bm, a)
    bm.blocks[a.block_table[0]].token_ids = (7, 7, 7, 7)   # as if a hash collided
    assert match_prefix(bm, make_seq([1, 2, 3, 4, 5], 1)) == 0


def test_freed_blocks_stay_cached_until_reused_lru():
    bm = BlockManager(5, BS, enable_prefix_caching=True)   # 4 usable
    a = make_seq([1, 2, 3, 4, 5], 0)
    prefill(bm, a)
    bm.free_seq(a)
    b = make_seq([1, 2, 3, 4, 6], 1)
    assert match_prefix(bm, b) == 4                          # found after free
    bm.free_seq(b)
    hog = make_seq(list(range(100, 116)), 2)                # takes all 4 blocks: evicts the cached one
    assert bm.allocate(hog, 16)
    bm.free_seq(hog)
    assert match_prefix(bm, make_seq([1, 2, 3, 4, 6], 3)) == 0


def test_fork_shares_blocks_and_copies_partial_last_block_on_write():
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    parent = make_seq([1, 2, 3, 4, 5, 6], 0)                 # one full block + a partial one
    prefill(bm, parent)
    child = make_seq([1, 2, 3, 4, 5, 6], 1)
    bm.fork(parent, child)
    full, partial = parent.block_table
    assert bm.blocks[full].ref_count == 2 and bm.blocks[partial].ref_count == 2
    child.token_ids.append(9)
    assert bm.allocate(child, 1)                             # writes position 6, inside the shared block
    assert child.block_table[0] == full and child.block_table[1] != partial
    assert bm.pending_copies == [(partial, child.block_table[1])]
    assert bm.blocks[partial].ref_count == 1
    parent.token_ids.append(8)
    assert bm.allocate(parent, 1)                            # now sole owner: writes in place
    assert parent.block_table[1] == partial and len(bm.pending_copies) == 1
    bm.free_seq(parent)
    bm.free_seq(child)
    assert bm.num_free_blocks == 15


def test_admit_takes_the_hit_and_new_blocks_together_or_nothing():
    """A waiting sequence that does not get in keeps no block: cached blocks it matched stay evictable."""
    bm = BlockManager(6, BS, enable_prefix_caching=True)    # 5 usable
    a = make_seq(list(range(9)), 0)                         # 2 full blocks + 1 partial
    prefill(bm, a)
    bm.free_seq(a)                                          # all 5 free, 2 of them cached
    b = make_seq(list(range(8)) + list(range(50, 62)), 1)   # 20 tokens: 2 cached blocks + 3 new
    hit = bm.find_cached_prefix(b)
    assert len(hit.block_ids) == 2 and b.block_table == []  # looking takes nothing
    assert bm.admit(b, hit, 12) and len(b.block_table) == 5 and bm.num_free_blocks == 0
    assert bm.prefix_hits == 8 and b.num_computed_tokens == 8
    bm.free_seq(b)
    c = make_seq(list(range(8)) + list(range(50, 66)), 2)   # 24 tokens: 6 blocks, the cache holds 5
    hit = bm.find_cached_prefix(c)
    assert len(hit.block_ids) == 2
    assert not bm.admit(c, hit, 16)                         # 2 idle hits + 4 new > 5 free
    assert c.block_table == [] and c.num_computed_tokens == 0
    assert bm.num_free_blocks == 5 and all(blk.ref_count == 0 for blk in bm.blocks)
    assert bm.prefix_hits == 8                              # a refused admission counts nothing
