"""Paged KV blocks: free list, ref counts, automatic prefix caching and copy-on-write.

A full block's hash chains its predecessor's hash and its own token ids, so equal hashes mean equal
prefixes (the first block's chain starts from the request's cache salt: KV computed under a LoRA adapter is
never found by the base model or another adapter); hits are still verified against the stored token ids. Freed blocks keep their hash and
stay findable until the free list hands them out again (least recently freed first).
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

from engine.request import Sequence

NULL_BLOCK = 0


@dataclass
class PrefixHit:
    """Cached blocks found for a sequence's leading full blocks (not yet taken)."""
    block_ids: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None
    token_ids: tuple[int, ...] = ()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self.cached: dict[bytes, int] = {}     # hash -> block_id
        self.pending_copies: list[tuple[int, int]] = []  # copy-on-write (src, dst), drained by the runner
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.num_cached_free = 0               # free blocks that still hold a hash (kept up to date, O(1))

    @property
    def num_usable_blocks(self) -> int:
        return len(self.blocks) - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - self.num_free_blocks

    # allocation -----------------------------------------------------------------------------------
    def _take_free(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:   # evict: its content is about to be overwritten
            self.num_cached_free -= 1
            if self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
            block.hash, block.token_ids = None, ()
        block.ref_count = 1
        return block_id

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
            self.num_cached_free -= block.hash is not None
        block.ref_count += 1

    def _unref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"block {block_id} freed twice"
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free[block_id] = None
            self.num_cached_free += block.hash is not None

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        extra = max(0, total - len(seq.block_table))
        # writing into a shared partial block needs a private copy first
        if seq.num_computed_tokens % self.block_size and self._last_block_shared(seq):
            extra += 1
        return extra

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Give seq slots for its next num_new_tokens tokens; False (and no change) if blocks run out."""
        computed, table = seq.num_computed_tokens, seq.block_table
        if (computed < computed + num_new_tokens <= len(table) * self.block_size
                and self.blocks[table[computed // self.block_size]].ref_count == 1):
            return True  # the common decode case: room left in an unshared last block
        if not self.can_allocate(seq, num_new_tokens):
            return False
        if seq.num_computed_tokens % self.block_size and self._last_block_shared(seq):
            src = seq.block_table[-1]
            dst = self._take_free()
            self._unref(src)
            seq.block_table[-1] = dst
            self.pending_copies.append((src, dst))
        total = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        while len(seq.block_table) < total:
            seq.block_table.append(self._take_free())
        return True

    def _last_block_shared(self, seq: Sequence) -> bool:
        last = seq.num_computed_tokens // self.block_size
        return last < len(seq.block_table) and self.blocks[seq.block_table[last]].ref_count > 1

    def free_seq(self, seq: Sequence) -> None:
        # Tail blocks are freed first so they are evicted first: a prefix outlives its extensions.
        for block_id in reversed(seq.block_table):
            self._unref(block_id)
        seq.block_table = []
        seq.num_hashed_blocks = 0
        seq.block_hashes = []

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """child shares all of parent's blocks (copy-on-write on the partial last one)."""
        for block_id in parent.block_table:
            self._ref(block_id)
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_hashed_blocks = parent.num_hashed_blocks
        child.block_hashes = list(parent.block_hashes)

    # prefix caching ---------------------------------------------------------------------------------
    @staticmethod
    def _chain_hash(prev: bytes | None, tokens: tuple[int, ...]) -> bytes:
        # A cryptographic hash: crafted prompts must not collide with another user's prefix.
        return hashlib.blake2b((prev or b"") + array("q", tokens).tobytes(), digest_size=16).digest()

    def find_cached_prefix(self, seq: Sequence) -> PrefixHit:
        """The cached blocks that hold seq's leading full blocks, verified against their tokens. Nothing is
        taken: `admit` takes them together with the rest, or not at all.

        The last token is always recomputed (its logits are needed), so only blocks that end before it count,
        and none past the tokens the sequence lets it reuse (those whose prompt logprobs are wanted).
        """
        hit = PrefixHit()
        if not self.enable_prefix_caching:
            return hit
        bs, prev = self.block_size, seq.request.cache_salt
        for i in range(min(seq.num_tokens - 1, seq.num_reusable_tokens) // bs):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = self._chain_hash(prev, tokens)
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hit.block_ids.append(block_id)
            hit.hashes.append(h)
            prev = h
        return hit

    def admit(self, seq: Sequence, hit: PrefixHit, num_new_tokens: int) -> bool:
        """Give a waiting seq (which holds no block) the hit's cached blocks and slots for its next
        num_new_tokens tokens after them: all of it, or nothing (False, no change).

        A waiting sequence never holds blocks, so whatever is not running can always be evicted: this is
        what keeps the scheduler live (a sequence that fits the cache alone always gets in eventually).
        Hit blocks that sit in the free list (cached, unreferenced) stop being free once taken, so they
        count against the free blocks like new ones.
        """
        assert not seq.block_table and seq.num_computed_tokens == 0, "a waiting sequence holds no blocks"
        bs = self.block_size
        hit_tokens = len(hit.block_ids) * bs
        total = -(-(hit_tokens + num_new_tokens) // bs)
        idle_hits = sum(self.blocks[b].ref_count == 0 for b in hit.block_ids)
        if total - len(hit.block_ids) + idle_hits > self.num_free_blocks:
            return False
        for block_id in hit.block_ids:
            self._ref(block_id)
        seq.block_table = list(hit.block_ids)
        seq.block_hashes = list(hit.hashes)
        seq.num_hashed_blocks = len(hit.block_ids)
        seq.num_computed_tokens = hit_tokens
        while len(seq.block_table) < total:
            seq.block_table.append(self._take_free())
        self.prefix_queries += seq.num_tokens
        self.prefix_hits += hit_tokens
        return True

    def register_full_blocks(self, seq: Sequence) -> None:
        """After a step: publish the blocks that its computed tokens have filled."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        for i in range(seq.num_hashed_blocks, full):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            prev = seq.block_hashes[i - 1] if i else seq.request.cache_salt
            h = self._chain_hash(prev, tokens)
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if block.hash is None:
                block.hash, block.token_ids = h, tokens
                self.cached.setdefault(h, block.block_id)
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, full)
