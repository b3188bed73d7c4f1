"""KV block accounting: the ref-counted BlockPool (LRU free list, hashes) and the KVCacheManager's
prefix cache (hash chains, extra keys, last token never cached), checked without a model."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tunix_rt.engine.kv_cache_manager import BlockKey, BlockPool, HybridKVCacheManager, KVCacheManager, block_hash

BS = 4


def _snapshot(kv: KVCacheManager):
    pool = kv.pool
    return (list(pool.ref_count), list(pool.free), dict(pool.key_of), dict(pool.block_of),
            {k: list(v) for k, v in kv.blocks.items()},
            {k: None if v is None else list(v) for k, v in kv.hashes.items()})


def _admit(kv: KVCacheManager, seq_id: str, tokens, num_new=None, extra=()) -> tuple[list[int], int]:
    """What the scheduler does for a waiting request: look up its prefix, then allocate the rest."""
    cached, num_cached = kv.computed_blocks(tokens, extra)
    num_new = len(tokens) - num_cached if num_new is None else num_new
    assert kv.allocate(seq_id, tokens, num_cached, num_new, cached, extra)
    return cached, num_cached


# -- BlockPool -------------------------------------------------------------------------------


def test_pool_starts_free_and_rejects_empty():
    pool = BlockPool(5)
    assert pool.num_free == 5 and pool.ref_count == [0] * 5
    with pytest.raises(ValueError):
        BlockPool(0)


def test_pool_allocate_takes_front_and_refuses_too_many():
    pool = BlockPool(4)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.ref_count == [1, 1, 1, 0] and pool.num_free == 1
    with pytest.raises(RuntimeError):
        pool.allocate(2)
    assert pool.num_free == 1 and pool.ref_count == [1, 1, 1, 0]  # nothing taken on failure
    assert pool.allocate(0) == []


def test_pool_touch_and_release_count_references():
    pool = BlockPool(4)
    a = pool.allocate(2)
    pool.touch(a)  # a second holder
    assert [pool.ref_count[b] for b in a] == [2, 2]
    pool.release(a)
    assert [pool.ref_count[b] for b in a] == [1, 1] and pool.num_free == 2
    pool.release(a[::-1])
    assert pool.num_free == 4 and pool.ref_count == [0] * 4
    # touching a free (cached) block takes it off the free list
    pool.touch([a[0]])
    assert pool.ref_count[a[0]] == 1 and a[0] not in pool.free and pool.num_free == 3
    pool.release([a[0]])
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release([a[0]])


def test_pool_release_order_is_eviction_order():
    pool = BlockPool(6)
    first = pool.allocate(3)  # [0, 1, 2]
    pool.allocate(3)
    pool.release(first[::-1])  # tail first
    assert list(pool.free) == [2, 1, 0]
    assert pool.allocate(1) == [2]  # the tail goes first
    pool.release([2])
    assert list(pool.free) == [1, 0, 2]  # most recently released last


def test_pool_cache_lookup_compares_whole_key():
    pool = BlockPool(3)
    key = BlockKey(None, (1, 2, 3, 4), ())
    h = block_hash(key)
    [b] = pool.allocate(1)
    pool.cache(b, h, key)
    assert pool.lookup(h, key) == b
    # same hash, other contents (a forged collision): no alias
    assert pool.lookup(h, BlockKey(None, (1, 2, 3, 5), ())) is None
    # a second block with the same hash keeps the first
    [b2] = pool.allocate(1)
    pool.cache(b2, h, key)
    assert pool.lookup(h, key) == b and b2 not in pool.key_of
    # a block already cached under one key is not re-keyed
    other = BlockKey(None, (9, 9, 9, 9), ())
    pool.cache(b, block_hash(other), other)
    assert pool.lookup(block_hash(other), other) is None


def test_pool_eviction_drops_hash():
    pool = BlockPool(2)
    key = BlockKey(None, (7, 7), ())
    h = block_hash(key)
    [b] = pool.allocate(1)
    pool.cache(b, h, key)
    pool.release([b])
    assert pool.lookup(h, key) == b  # free but still cached
    pool.allocate(1)  # the never-used block goes first
    assert pool.lookup(h, key) == b
    assert pool.allocate(1) == [b]  # now the cached one is evicted
    assert pool.lookup(h, key) is None and not pool.key_of and not pool.block_of


# -- KVCacheManager --------------------------------------------------------------------------


def test_blocks_needed_and_usage():
    kv = KVCacheManager(10, BS)
    assert [kv.blocks_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert kv.usage() == 0.0
    kv.allocate("a", list(range(10)), 0, 10)
    assert kv.usage() == pytest.approx(0.3)
    kv.free("a")
    assert kv.usage() == 0.0


def test_allocate_failure_changes_nothing():
    kv = KVCacheManager(5, BS)
    a = list(range(12))
    assert kv.allocate("a", a, 0, 12)  # 3 blocks
    kv.free("a")  # cached, free
    assert kv.allocate("b", [50] * 4, 0, 4)  # takes a never-used block
    before = _snapshot(kv)
    # extending b by 12 tokens needs 3 more blocks; only 4 free - fine; by 17 needs 5: refused
    assert not kv.allocate("b", [50] * 21, 4, 17)
    assert _snapshot(kv) == before
    # a prefix hit on free cached blocks does not count them twice: a's 2 hit blocks + 3 new > 4 free
    cached, num = kv.computed_blocks(a + [1] * 10)
    assert num == 12 and len(cached) == 3
    before = _snapshot(kv)
    assert not kv.allocate("c", a + [1] * 10, 12, 10, cached)  # 3 cached (free) + 3 new > 4 free
    assert _snapshot(kv) == before
    assert kv.allocate("c", a + [1] * 4, 12, 4, cached)  # 3 cached + 1 new == 4 free
    assert kv.pool.num_free == 0


def test_prefix_hits_follow_the_hash_chain():
    kv = KVCacheManager(32, BS)
    a = list(range(1, 13))  # 3 full blocks
    kv.allocate("a", a, 0, len(a))
    kv.free("a")
    a_blocks = kv.computed_blocks(a + [99])[0]
    # full match of 3 blocks, one more token to compute
    assert kv.computed_blocks(a + [99]) == (a_blocks, 12) and len(a_blocks) == 3
    # the last token is never served: the exact prompt hits 2 blocks, not 3
    assert kv.computed_blocks(a)[1] == 8
    assert kv.computed_blocks(a[:9])[1] == 8
    assert kv.computed_blocks(a[:8])[1] == 4
    assert kv.computed_blocks(a[:1])[1] == 0
    # a difference inside block 1 stops the chain there
    b = a[:5] + [77] + a[6:] + [1]
    assert kv.computed_blocks(b)[1] == 4
    # same later blocks after a different first block: no hit at all
    c = [0, 0, 0, 0] + a[4:] + [1]
    assert kv.computed_blocks(c)[1] == 0
    # the same tokens under another extra key (cache salt) do not hit
    assert kv.computed_blocks(a + [1], ("salt",))[1] == 0
    # and salted blocks are only found with that salt
    kv.allocate("s", a, 0, len(a), extra=("salt",))
    kv.free("s")
    assert kv.computed_blocks(a + [1], ("salt",))[1] == 12
    assert kv.computed_blocks(a + [1], ("other",))[1] == 0
    assert set(kv.computed_blocks(a + [1], ("salt",))[0]).isdisjoint(kv.computed_blocks(a + [1])[0])


def test_disabled_prefix_caching_never_hits():
    kv = KVCacheManager(16, BS, enable_prefix_caching=False)
    a = list(range(12))
    kv.allocate("a", a, 0, 12)
    assert kv.computed_blocks(a + [1]) == ([], 0)
    assert not kv.pool.key_of
    kv.free("a")
    assert kv.pool.num_free == 16


def test_blocks_cached_at_allocation_are_shared_while_in_flight():
    kv = KVCacheManager(16, BS)
    a = list(range(10))  # 2 full blocks + 2 tokens
    kv.allocate("a", a, 0, 10)
    a_blocks = list(kv.blocks["a"])
    cached, n = _admit(kv, "b", a[:8] + [40, 41, 42])
    assert n == 8 and cached == a_blocks[:2]
    assert [kv.pool.ref_count[x] for x in a_blocks] == [2, 2, 1]
    assert kv.blocks["b"][:2] == a_blocks[:2] and kv.blocks["b"][2] not in a_blocks
    kv.free("a")
    assert [kv.pool.ref_count[x] for x in a_blocks] == [1, 1, 0]
    kv.free("b")
    assert kv.pool.num_free == 16 and all(r == 0 for r in kv.pool.ref_count)
    assert kv.computed_blocks(a[:8] + [40])[1] == 8  # still cached while free


def test_chunked_allocation_caches_blocks_as_they_fill():
    kv = KVCacheManager(16, BS)
    a = list(range(20, 33))  # 13 tokens
    assert kv.allocate("a", a, 0, 6)  # block 0 full, block 1 half
    assert len(kv.blocks["a"]) == 2 and len(kv.hashes["a"]) == 1
    assert kv.computed_blocks(a)[1] == 4
    assert kv.allocate("a", a, 6, 6)  # now 12 computed: 3 full
    assert len(kv.blocks["a"]) == 3 and len(kv.hashes["a"]) == 3
    assert kv.computed_blocks(a)[1] == 12
    # decode growth: generated tokens fill a fourth block, which is cached too
    a = a + [1, 2, 3]
    assert kv.allocate("a", a, 12, 1) and kv.allocate("a", a, 13, 3)
    assert len(kv.blocks["a"]) == 4 and len(kv.hashes["a"]) == 4
    assert kv.computed_blocks(a + [5])[1] == 16


def test_lru_evicts_a_requests_tail_first():
    kv = KVCacheManager(6, BS)
    a = list(range(13))  # 4 blocks, 3 full and cached
    kv.allocate("a", a, 0, 13)
    kv.free("a")
    assert kv.computed_blocks(a)[1] == 12
    kv.allocate("x", [90] * 8, 0, 8)  # the 2 never-used blocks
    assert kv.computed_blocks(a)[1] == 12
    kv.allocate("y", [91] * 4, 0, 4)  # evicts a's partial tail block
    assert kv.computed_blocks(a)[1] == 12
    kv.allocate("z", [92] * 4, 0, 4)  # evicts a's last full block: the prefix before it still hits
    assert kv.computed_blocks(a)[1] == 8
    kv.allocate("w", [93] * 4, 0, 4)
    assert kv.computed_blocks(a)[1] == 4


def test_touching_a_cached_block_moves_it_out_of_eviction():
    kv = KVCacheManager(4, BS)
    a = list(range(9))
    kv.allocate("a", a, 0, 9)
    kv.free("a")
    assert list(kv.pool.free) == [3, 2, 1, 0]  # never used, then a's blocks tail first
    cached, _ = _admit(kv, "b", a[:4] + [60, 61])  # reuses a's first block, takes block 3
    assert cached == [0] and kv.blocks["b"] == [0, 3]
    kv.free("b")
    # a's unused tail is evicted before the blocks b just released, b's tail before its head
    assert list(kv.pool.free) == [2, 1, 3, 0]
    assert kv.computed_blocks(a[:4] + [0])[1] == 4


def test_reset_prefix_cache():
    kv = KVCacheManager(16, BS)
    a = list(range(12))
    kv.allocate("a", a, 0, 8)
    kv.reset_prefix_cache()
    assert kv.computed_blocks(a)[1] == 0 and not kv.pool.key_of and not kv.pool.block_of
    # a request in flight no longer enters its blocks in the cache
    kv.allocate("a", a, 8, 4)
    assert kv.computed_blocks(a + [1])[1] == 0
    kv.free("a")
    # new requests cache again
    kv.allocate("b", a, 0, 12)
    assert kv.computed_blocks(a + [1])[1] == 12
    kv.free("b")
    assert kv.pool.num_free == 16


def test_hit_statistics():
    kv = HybridKVCacheManager([KVCacheManager(16, BS)], [1])
    assert kv.hit_rate() == 0.0
    kv.record_lookup(10, 0)
    kv.record_lookup(10, 8)
    assert (kv.queries, kv.hits) == (20, 8) and kv.hit_rate() == pytest.approx(0.4)


# -- random walks: no leaks, and every hit holds the tokens it claims --------------------------


class _Model:
    """Drives a KVCacheManager like the scheduler does and tracks what each physical block holds."""

    def __init__(self, num_blocks: int, block_size: int, prefix: bool = True):
        self.kv = KVCacheManager(num_blocks, block_size, prefix)
        self.bs = block_size
        self.seqs: dict[str, dict] = {}  # seq id -> tokens, computed, extra
        self.content: dict[int, dict[int, int]] = {}  # block -> offset -> token written
        self.next_id = 0
        self.hits = 0

    def _write(self, seq_id: str, start: int, end: int) -> None:
        s, blocks = self.seqs[seq_id], self.kv.blocks[seq_id]
        for p in range(start, end):
            b = blocks[p // self.bs]
            # a block someone else can read (shared, or found by a lookup) is never written again
            assert self.kv.pool.ref_count[b] == 1, f"writing into block {b} held by {self.kv.pool.ref_count[b]}"
            if p % self.bs == 0:
                self.content[b] = {}
            self.content[b][p % self.bs] = s["tokens"][p]

    def add(self, tokens: list[int], extra: tuple, budget: int) -> bool:
        seq_id = f"s{self.next_id}"
        cached, num_cached = self.kv.computed_blocks(tokens, extra)
        assert num_cached < len(tokens) and num_cached == len(cached) * self.bs
        for i, b in enumerate(cached):  # a hit holds exactly the tokens asked for
            assert self.content.get(b) == dict(enumerate(tokens[i * self.bs:(i + 1) * self.bs]))
        num_new = min(len(tokens) - num_cached, budget)
        before = _snapshot(self.kv)
        if not self.kv.allocate(seq_id, tokens, num_cached, num_new, cached, extra):
            assert _snapshot(self.kv) == before
            return False
        self.hits += num_cached
        self.next_id += 1
        self.seqs[seq_id] = dict(tokens=list(tokens), computed=num_cached + num_new, extra=extra)
        self._write(seq_id, num_cached, num_cached + num_new)
        return True

    def advance(self, seq_id: str, token: int, budget: int) -> bool:
        """Chunked prefill if behind, else a decode step (appending `token` once caught up)."""
        s = self.seqs[seq_id]
        if s["computed"] == len(s["tokens"]):
            s["tokens"].append(token)
        num_new = min(len(s["tokens"]) - s["computed"], budget)
        before = _snapshot(self.kv)
        if not self.kv.allocate(seq_id, s["tokens"], s["computed"], num_new, extra=s["extra"]):
            assert _snapshot(self.kv) == before
            return False
        self._write(seq_id, s["computed"], s["computed"] + num_new)
        s["computed"] += num_new
        return True

    def free(self, seq_id: str) -> None:
        del self.seqs[seq_id]
        self.kv.free(seq_id)

    def check(self) -> None:
        pool, kv = self.kv.pool, self.kv
        refs = [0] * pool.num_blocks
        for seq_id, s in self.seqs.items():
            blocks = kv.blocks[seq_id]
            assert len(blocks) == kv.blocks_needed(s["computed"])
            assert len(set(blocks)) == len(blocks)
            for b in blocks:
                refs[b] += 1
        assert set(kv.blocks) == set(self.seqs)
        assert pool.ref_count == refs
        assert set(pool.free) == {b for b in range(pool.num_blocks) if refs[b] == 0}
        assert len(pool.free) == pool.num_free
        assert all(pool.block_of[h] == b for b, (h, _) in pool.key_of.items())
        assert len(pool.block_of) == len(pool.key_of)
        for b, (h, key) in pool.key_of.items():  # every cached block holds the tokens its key names
            assert block_hash(key) == h
            assert self.content.get(b) == dict(enumerate(key.tokens))

    def drain(self) -> None:
        for seq_id in list(self.seqs):
            self.free(seq_id)
        self.check()
        assert self.kv.pool.num_free == self.kv.pool.num_blocks
        assert all(r == 0 for r in self.kv.pool.ref_count)
        assert not self.kv.blocks and not self.kv.hashes


def _random_tokens(rng: random.Random, known: list[list[int]]) -> list[int]:
    """Often a prefix of an earlier sequence plus a tail, so prefixes are shared."""
    tail = [rng.randrange(4) for _ in range(rng.randrange(1, 12))]
    if known and rng.random() < 0.6:
        base = rng.choice(known)
        return base[:rng.randrange(len(base) + 1)] + tail
    return tail


@pytest.mark.parametrize("num_blocks,block_size,seed", [(6, 1, 0), (8, 2, 1), (16, 2, 2), (16, 4, 3), (32, 4, 4),
                                                         (12, 3, 5)])
@pytest.mark.parametrize("prefix", [True, False])
def test_random_walk_has_no_leaks(num_blocks, block_size, seed, prefix):
    rng = random.Random(seed)
    m = _Model(num_blocks, block_size, prefix)
    known: list[list[int]] = []
    for _ in range(400):
        op = rng.random()
        if op < 0.3 or not m.seqs:
            tokens = _random_tokens(rng, known)
            if m.add(tokens, rng.choice([(), (), ("salt",)]), rng.randrange(1, 9)):
                known.append(tokens)
        elif op < 0.8:
            m.advance(rng.choice(sorted(m.seqs)), rng.randrange(4), rng.randrange(1, 6))
        elif op < 0.97:
            m.free(rng.choice(sorted(m.seqs)))
        else:
            m.kv.reset_prefix_cache()
        m.check()
    assert (m.hits > 0) == prefix  # the walk does exercise the prefix cache
    m.drain()


@settings(max_examples=40, stateful_step_count=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
class KVCacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.m = _Model(num_blocks=8, block_size=2)
        self.known: list[list[int]] = []

    @rule(tail=st.lists(st.integers(0, 2), min_size=1, max_size=8), base=st.integers(0, 100),
          cut=st.integers(0, 20), salt=st.booleans(), budget=st.integers(1, 8))
    def add(self, tail, base, cut, salt, budget):
        prefix = self.known[base % len(self.known)][:cut] if self.known else []
        tokens = prefix + tail
        if self.m.add(tokens, ("salt",) if salt else (), budget):
            self.known.append(tokens)

    @precondition(lambda self: self.m.seqs)
    @rule(pick=st.integers(0, 100), token=st.integers(0, 2), budget=st.integers(1, 6))
    def advance(self, pick, token, budget):
        self.m.advance(sorted(self.m.seqs)[pick % len(self.m.seqs)], token, budget)

    @precondition(lambda self: self.m.seqs)
    @rule(pick=st.integers(0, 100))
    def free(self, pick):
        self.m.free(sorted(self.m.seqs)[pick % len(self.m.seqs)])

    @rule()
    def reset(self):
        self.m.kv.reset_prefix_cache()

    @invariant()
    def consistent(self):
        self.m.check()

    def teardown(self):
        self.m.drain()


TestKVCacheMachine = KVCacheMachine.TestCase
