"""KV block accounting: a reference-counted block pool with automatic prefix caching.

A full block is identified by a hash chained from its parent block's hash, its tokens and the
request's extra keys (anything else the cached K/V depends on, e.g. a cache salt), so a block can
be reused exactly when the whole token prefix up to it is the same. Blocks whose count drops to
zero go to the back of an LRU free list and keep their hash until a new allocation takes them, so
a later request with the same prefix finds them again. Samples of one prompt (n > 1) share its
prefix blocks this way, by reference count. The manager only counts and maps blocks; the K/V
memory lives in the runner.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class BlockKey:
    """What a cached block holds: compared in full on a hit, so a hash collision cannot alias."""

    parent: int | None
    tokens: tuple[int, ...]
    extra: tuple


def block_hash(key: BlockKey) -> int:
    return hash((key.parent, key.tokens, key.extra))


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_count = [0] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # front = evicted first
        self.key_of: dict[int, tuple[int, BlockKey]] = {}
        self.block_of: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"allocate({n}) with only {len(self.free)} free blocks")  # callers check first
        blocks = []
        for _ in range(n):
            block, _ = self.free.popitem(last=False)
            self._forget(block)
            self.ref_count[block] = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Sequence[int]) -> None:
        """Take a reference to cached blocks (a prefix hit), pulling free ones off the free list."""
        for block in blocks:
            if self.ref_count[block] == 0:
                del self.free[block]
            self.ref_count[block] += 1

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference each; pass a request's blocks tail first so its tail is evicted first."""
        for block in blocks:
            self.ref_count[block] -= 1
            if self.ref_count[block] < 0:
                raise RuntimeError(f"block {block} released more often than taken")
            if self.ref_count[block] == 0:
                self.free[block] = None

    def lookup(self, h: int, key: BlockKey) -> int | None:
        block = self.block_of.get(h)
        if block is None or self.key_of[block][1] != key:
            return None
        return block

    def cache(self, block: int, h: int, key: BlockKey) -> None:
        if block in self.key_of or h in self.block_of:
            return  # already cached (or an identical block holds this prefix): keep the first
        self.key_of[block] = (h, key)
        self.block_of[h] = block

    def _forget(self, block: int) -> None:
        entry = self.key_of.pop(block, None)
        if entry is not None:
            del self.block_of[entry[0]]

    def reset_prefix_cache(self) -> None:
        self.key_of.clear()
        self.block_of.clear()


class KVCacheManager:
    """Per-request block lists over one BlockPool, with prefix-cache lookups and hit statistics."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks: dict[str, list[int]] = {}
        # Hashes of each request's cached full blocks, in order; None once a reset made its K/V unshareable.
        self.hashes: dict[str, list[int] | None] = {}
        self.queries = 0  # prompt tokens looked up in the prefix cache
        self.hits = 0

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def _key(self, tokens: Sequence[int], i: int, parent: int | None, extra: tuple) -> BlockKey:
        bs = self.block_size
        return BlockKey(parent, tuple(tokens[i * bs:(i + 1) * bs]), extra)

    def computed_blocks(self, tokens: Sequence[int], extra: tuple = ()) -> tuple[list[int], int]:
        """Cached blocks holding a prefix of `tokens` and how many tokens they cover.

        At least the last token is always left to compute: its logits are what the step needs.
        """
        if not self.enable_prefix_caching:
            return [], 0
        found, parent = [], None
        for i in range((len(tokens) - 1) // self.block_size):
            key = self._key(tokens, i, parent, extra)
            h = block_hash(key)
            block = self.pool.lookup(h, key)
            if block is None:
                break
            found.append(block)
            parent = h
        return found, len(found) * self.block_size

    def record_lookup(self, num_tokens: int, num_hit: int) -> None:
        """Count one admitted request's lookup (not retries of one that did not fit yet)."""
        self.queries += num_tokens
        self.hits += num_hit

    def allocate(self, seq_id: str, tokens: Sequence[int], num_computed: int, num_new: int,
                 cached: Sequence[int] = (), extra: tuple = ()) -> bool:
        """Make room for `num_new` more tokens after `num_computed` (which `cached` blocks may cover).

        Returns False, changing nothing, when the pool cannot supply the blocks. Full blocks whose
        tokens this step computes are entered in the prefix cache at once: within one step every
        token's K/V is written before any token attends, so a request scheduled later in the same
        step can already share them.
        """
        own = self.blocks.get(seq_id, [])
        need = self.blocks_needed(num_computed + num_new) - len(own) - len(cached)
        reusable = sum(1 for b in cached if self.pool.ref_count[b] == 0)  # free now, taken by touch()
        if need > self.pool.num_free - reusable:
            return False
        self.pool.touch(cached)
        own = self.blocks.setdefault(seq_id, own)
        own.extend(cached)
        own.extend(self.pool.allocate(max(need, 0)))
        hashes = self.hashes.setdefault(seq_id, [])
        if self.enable_prefix_caching and hashes is not None:
            full = min(num_computed + num_new, len(tokens)) // self.block_size
            for i in range(len(hashes), full):
                key = self._key(tokens, i, hashes[-1] if hashes else None, extra)
                h = block_hash(key)
                self.pool.cache(own[i], h, key)
                hashes.append(h)
        return True

    def uncache(self, seq_id: str) -> None:
        """Take a request's blocks out of the prefix cache and stop caching its later ones: its K/V holds
        values no other request may reuse (a step of it produced NaN or inf)."""
        for block in self.blocks.get(seq_id, []):
            self.pool._forget(block)
        self.hashes[seq_id] = None

    def free(self, seq_id: str) -> None:
        blocks = self.blocks.pop(seq_id, [])
        self.hashes.pop(seq_id, None)
        self.pool.release(blocks[::-1])

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (e.g. new weights); requests in flight stop sharing theirs."""
        self.pool.reset_prefix_cache()
        for seq_id in self.hashes:
            self.hashes[seq_id] = None

    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0
