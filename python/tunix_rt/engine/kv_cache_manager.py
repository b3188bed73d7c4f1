"""KV block accounting: a reference-counted block pool with automatic prefix caching, one per KV group.

A full block is identified by a hash chained from its parent block's hash, its tokens and the
request's extra keys (anything else the cached K/V depends on, e.g. a cache salt), so a block can
be reused exactly when the whole token prefix up to it is the same. Blocks whose count drops to
zero go to the back of an LRU free list and keep their hash until a new allocation takes them, so
a later request with the same prefix finds them again. Samples of one prompt (n > 1) share its
prefix blocks this way, by reference count. The manager only counts and maps blocks; the K/V
memory lives in the runner.

Models whose layers mix attention types (Gemma 2/3: sliding-window layers beside global ones) keep one
manager per KV group (models/kv_cache.KVLayout), in HybridKVCacheManager, as vLLM's hybrid KV-cache manager
does. A sliding-window group gives back each block no future query can see (every position before the
window of the next token to compute), leaving NULL in its place: the kernels read only blocks inside a
token's window. A prefix hit must hold for every group: all blocks before it in a full group, the blocks the
next token's window reaches in a sliding-window one.
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


NULL = -1  # a sliding-window group's block given back: no token reads it


class KVCacheManager:
    """Per-request block lists over one BlockPool, with prefix-cache lookups (one KV group; the statistics are
    HybridKVCacheManager's). With a `window`, blocks wholly before the window of a request's next token are given
    back as it advances."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 window: int | None = None):
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.window = window
        self.blocks: dict[str, list[int]] = {}
        self.freed: dict[str, int] = {}  # a windowed request's leading blocks given back (NULL in its list)
        # Hashes of each request's cached full blocks, in order; None once a reset made its K/V unshareable.
        self.hashes: dict[str, list[int] | None] = {}

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def _key(self, tokens: Sequence[int], i: int, parent: int | None, extra: tuple) -> BlockKey:
        bs = self.block_size
        return BlockKey(parent, tuple(tokens[i * bs:(i + 1) * bs]), extra)

    def computed_blocks(self, tokens: Sequence[int], extra: tuple = ()) -> tuple[list[int], int]:
        """Cached blocks holding a prefix of `tokens` and how many tokens they cover (a full-attention group).

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

    def _first_needed(self, position: int) -> int:
        """The first block a token at `position` (or any later one) can see: 0 without a window."""
        return 0 if self.window is None else max(0, position - self.window + 1) // self.block_size

    def window_hit(self, tokens: Sequence[int], extra: tuple, length: int) -> list[int] | None:
        """The blocks a request whose first `length` tokens (whole blocks) come from the cache holds, NULL before
        the next token's window, or None when a block inside it is not cached."""
        blocks, parent = [], None
        first = self._first_needed(length)
        for i in range(length // self.block_size):
            key = self._key(tokens, i, parent, extra)
            parent = block_hash(key)
            if i < first:
                blocks.append(NULL)
                continue
            block = self.pool.lookup(parent, key)
            if block is None:
                return None
            blocks.append(block)
        return blocks

    def release_behind(self, seq_id: str, num_computed: int) -> None:
        """Give back the request's blocks wholly before the window of its token at `num_computed` (a windowed
        group; nothing otherwise): no query from there on reads them."""
        own = self.blocks.get(seq_id)
        first = self._first_needed(num_computed)
        done = self.freed.get(seq_id, 0)
        if not own or first <= done:
            return
        gone = [b for b in own[done:first] if b != NULL]
        own[done:first] = [NULL] * (first - done)
        self.freed[seq_id] = first
        self.pool.release(gone[::-1])

    def allocate(self, seq_id: str, tokens: Sequence[int], num_computed: int, num_new: int,
                 cached: Sequence[int] = (), extra: tuple = ()) -> bool:
        """Make room for `num_new` more tokens after `num_computed` (which `cached` blocks may cover).

        Returns False, changing nothing, when the pool cannot supply the blocks. Full blocks whose
        tokens this step computes are entered in the prefix cache at once: within one step every
        token's K/V is written before any token attends, so a request scheduled later in the same
        step can already share them.
        """
        own = self.blocks.get(seq_id, [])
        if not self.check(seq_id, num_computed, num_new, cached):
            return False
        taken = [b for b in cached if b != NULL]
        self.pool.touch(taken)
        need = self.blocks_needed(num_computed + num_new) - len(own) - len(cached)
        own = self.blocks.setdefault(seq_id, own)
        own.extend(cached)
        own.extend(self.pool.allocate(max(need, 0)))
        if cached and self.window is not None:
            self.freed[seq_id] = next((i for i, b in enumerate(own) if b != NULL), len(own))
        hashes = self.hashes.setdefault(seq_id, [])
        if self.enable_prefix_caching and hashes is not None:
            full = min(num_computed + num_new, len(tokens)) // self.block_size
            for i in range(len(hashes), full):
                key = self._key(tokens, i, hashes[-1] if hashes else None, extra)
                h = block_hash(key)
                if own[i] != NULL:
                    self.pool.cache(own[i], h, key)
                hashes.append(h)
        return True

    def check(self, seq_id: str, num_computed: int, num_new: int, cached: Sequence[int] = ()) -> bool:
        """Whether allocate() would find the blocks."""
        own = self.blocks.get(seq_id, [])
        need = self.blocks_needed(num_computed + num_new) - len(own) - len(cached)
        reusable = sum(1 for b in cached if b != NULL and self.pool.ref_count[b] == 0)  # free now, taken by touch()
        return need <= self.pool.num_free - reusable

    def uncache(self, seq_id: str) -> None:
        """Take a request's blocks out of the prefix cache and stop caching its later ones: its K/V holds
        values no other request may reuse (a step of it produced NaN or inf)."""
        for block in self.blocks.get(seq_id, []):
            if block != NULL:
                self.pool._forget(block)
        self.hashes[seq_id] = None

    def free(self, seq_id: str) -> None:
        blocks = self.blocks.pop(seq_id, [])
        self.hashes.pop(seq_id, None)
        self.freed.pop(seq_id, None)
        self.pool.release([b for b in blocks[::-1] if b != NULL])

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (e.g. new weights); requests in flight stop sharing theirs."""
        self.pool.reset_prefix_cache()
        for seq_id in self.hashes:
            self.hashes[seq_id] = None


class HybridKVCacheManager:
    """The engine's KV accounting: one KVCacheManager per KV group (models/kv_cache.KVLayout), a request's
    blocks allocated in every group or in none, prefix hits valid in every group. One group (a model whose
    layers all attend alike, or the hybrid manager turned off) is the plain manager."""

    def __init__(self, groups: Sequence[KVCacheManager], layers: Sequence[int]):
        self.groups = list(groups)
        self.layers = tuple(layers)  # each group's layer count: what a block of it weighs
        self.block_size = self.groups[0].block_size
        self.queries = 0  # prompt tokens looked up in the prefix cache
        self.hits = 0

    def blocks_needed(self, num_tokens: int) -> int:
        return self.groups[0].blocks_needed(num_tokens)

    def group_blocks(self) -> list[dict[str, list[int]]]:
        """Each group's block lists by sequence: what the runner builds its tables from."""
        return [g.blocks for g in self.groups]

    def computed_blocks(self, tokens: Sequence[int], extra: tuple = ()) -> tuple[list[list[int]], int]:
        """Each group's cached blocks of the longest prefix of `tokens` (whole blocks) that every group holds, and
        its length: every block before it in a full group, those the next token's window reaches in a windowed
        one."""
        full = [g for g in self.groups if g.window is None]
        if not self.groups[0].enable_prefix_caching:
            return [[] for _ in self.groups], 0
        found = [g.computed_blocks(tokens, extra)[0] for g in full]
        length = min((len(f) for f in found), default=(len(tokens) - 1) // self.block_size) * self.block_size
        while length > 0:
            hit, at = [], iter(found)
            for g in self.groups:
                hit.append(next(at)[:length // self.block_size] if g.window is None else
                           g.window_hit(tokens, extra, length))
            if all(h is not None for h in hit):
                return hit, length
            length -= self.block_size
        return [[] for _ in self.groups], 0

    def most_blocks(self, num_tokens: int, step_tokens: int) -> list[int]:
        """The most blocks of each group one request of `num_tokens` holds at once, when a step adds at most
        `step_tokens` of its tokens: all of them in a full group, its window's and a step's in a windowed one."""
        need = self.blocks_needed(num_tokens)
        return [need if g.window is None else min(need, -(-(g.window - 1 + step_tokens) // self.block_size) + 2)
                for g in self.groups]

    def record_lookup(self, num_tokens: int, num_hit: int) -> None:
        """Count one admitted request's lookup (not retries of one that did not fit yet)."""
        self.queries += num_tokens
        self.hits += num_hit

    def allocate(self, seq_id: str, tokens: Sequence[int], num_computed: int, num_new: int,
                 cached: Sequence[Sequence[int]] = (), extra: tuple = ()) -> bool:
        """Room for `num_new` more tokens after `num_computed` in every group, or (returning False) in none."""
        cached = cached or [()] * len(self.groups)
        if not all(g.check(seq_id, num_computed, num_new, c) for g, c in zip(self.groups, cached)):
            return False
        for g, c in zip(self.groups, cached):
            g.allocate(seq_id, tokens, num_computed, num_new, c, extra)
        return True

    def release_behind(self, seq_id: str, num_computed: int) -> None:
        """Windowed groups give back the request's blocks no query from its token at `num_computed` on reads."""
        for g in self.groups:
            g.release_behind(seq_id, num_computed)

    def free(self, seq_id: str) -> None:
        for g in self.groups:
            g.free(seq_id)

    def uncache(self, seq_id: str) -> None:
        for g in self.groups:
            g.uncache(seq_id)

    def reset_prefix_cache(self) -> None:
        for g in self.groups:
            g.reset_prefix_cache()

    def usage(self) -> float:
        """The share of the KV memory in use, each group's blocks weighed by its layers."""
        used = sum(n * (g.pool.num_blocks - g.pool.num_free) for g, n in zip(self.groups, self.layers))
        return used / sum(n * g.pool.num_blocks for g, n in zip(self.groups, self.layers))

    def layer_blocks_in_use(self) -> int:
        """Blocks held, each counted once per layer of its group: KV bytes in use / (one layer's block bytes)."""
        return sum(n * (g.pool.num_blocks - g.pool.num_free) for g, n in zip(self.groups, self.layers))

    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0
