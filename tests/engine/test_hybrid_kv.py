"""The hybrid KV-cache manager: sliding-window layers keep only the blocks their window reaches. Outputs equal the
all-global layout's and the reference generator's, blocks come back after finished, aborted and preempted
requests, prefix hits stay where every group holds them, and the blocks held shrink to the windows."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from tests.engine.idle import assert_idle
from tests.engine.test_engine import _reference
from tunix_rt.engine.engine import Engine
from tunix_rt.engine.kv_cache_manager import NULL, HybridKVCacheManager, KVCacheManager
from tunix_rt.engine.params import SamplingParams
from tunix_rt.models.config import FULL, SLIDING, ModelConfig, RopeConfig
from tunix_rt.models.decoder import Decoder
from tunix_rt.models.kv_cache import KVLayout

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
WINDOW = 6
SIZES = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16, block_size=4)


def _gemma3_config(**kw) -> ModelConfig:
    """Gemma 3's shape in miniature: five sliding-window layers to one global one, twice."""
    base = dict(architecture="gemma3_text", vocab_size=97, hidden_size=32, intermediate_size=48, num_layers=6,
                num_heads=4, num_kv_heads=2, head_dim=8, layer_types=(SLIDING,) * 5 + (FULL,),
                sliding_window=WINDOW, rope=((FULL, RopeConfig(theta=10000.0)), (SLIDING, RopeConfig(theta=100.0))),
                norm_offset=1.0, sandwich_norms=True, qk_norm=True, embed_scale=32**0.5, activation="gelu_tanh",
                tie_word_embeddings=True)
    return ModelConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def model():
    return Decoder(_gemma3_config(), rngs=nnx.Rngs(0))


def _prompts(seed: int, count: int, low: int = 5, high: int = 60) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 97, size=int(rng.integers(low, high))).tolist() for _ in range(count)]


def test_layout_groups_layers_by_attention_type():
    cfg = _gemma3_config(num_layers=12, layer_types=((SLIDING,) * 5 + (FULL,)) * 2)
    layout = KVLayout.of(cfg, 100, lambda w: 10)
    assert layout.windows == (None, WINDOW) and layout.blocks == (100, 10)
    assert layout.layer_group == (1, 1, 1, 1, 1, 0) * 2
    assert layout.bases[:7] == (0, 10, 20, 30, 40, 50, 150) and layout.total_blocks == 2 * 100 + 10 * 10
    assert KVLayout.of(cfg, 100).blocks == (100,)  # hybrid off: one group, every layer all its blocks


def test_windows_are_sized_within_the_kv_memory_and_never_shrink_the_full_group(model):
    """64 sequences' windows and a step fit beside the full group in a small kv_cache_memory: a windowed layer
    takes no more than the all-global layout gives a layer, so the full group gets at least as much."""
    sizes = dict(max_model_len=128, kv_cache_memory=4 << 20, block_size=4)
    hybrid, plain = Engine(model, None, **sizes), Engine(model, None, disable_hybrid_kv_cache_manager=True, **sizes)
    assert plain.runner.layout.blocks == (1365,)  # 4 MiB / (6 layers x 512 bytes)
    full, window = hybrid.runner.layout.blocks
    assert window == 64 * (2 + 2) + 512 // 4 and full == 64 * 128 // 4  # the full group capped by 64 sequences
    assert hybrid.runner.cache_shape[0] * 512 <= 4 << 20


def test_a_window_group_gives_back_what_the_next_token_cannot_see():
    kv = KVCacheManager(16, 4, window=6)
    tokens = list(range(40))
    assert kv.allocate("a", tokens, 0, 20)
    assert len(kv.blocks["a"]) == 5 and kv.pool.num_free == 11
    kv.release_behind("a", 20)  # the token at 20 sees 15..20: blocks 0..2 (positions 0..11) are behind it
    assert kv.blocks["a"][:3] == [NULL] * 3 and kv.pool.num_free == 14
    kv.release_behind("a", 20)  # nothing more
    assert kv.pool.num_free == 14
    assert kv.allocate("a", tokens, 20, 8) and len(kv.blocks["a"]) == 7
    kv.free("a")
    assert kv.pool.num_free == 16 and not kv.blocks and not kv.freed


def test_a_prefix_hit_needs_every_groups_blocks():
    """A full group holds all the prefix's blocks; a windowed group only the next token's window's. With the
    windowed group's copy evicted the hit is shorter (or none)."""
    full, window = KVCacheManager(32, 4), KVCacheManager(32, 4, window=6)
    kv = HybridKVCacheManager([full, window], [1, 5])
    tokens = list(range(30))
    assert kv.allocate("a", tokens, 0, 30)
    kv.release_behind("a", 30)
    kv.free("a")  # its blocks stay cached, free
    hit, length = kv.computed_blocks(tokens + [99])
    assert length == 28 and len(hit[0]) == 7 and hit[1][:5] == [NULL] * 5 and NULL not in hit[1][5:]
    window.pool.reset_prefix_cache()
    assert kv.computed_blocks(tokens + [99]) == ([[], []], 0)
    assert kv.allocate("b", tokens + [99], 0, 31)


@pytest.mark.slow
@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.8, seed=3, max_tokens=24)],
                         ids=["greedy", "seeded"])
def test_output_is_the_all_global_layouts(model, params):
    hybrid = Engine(model, None, **SIZES)
    plain = Engine(model, None, disable_hybrid_kv_cache_manager=True, **SIZES)
    assert hybrid.runner.layout.windows == (None, WINDOW) and plain.runner.layout.num_groups == 1
    prompts = _prompts(0, 6)
    got, want = hybrid.generate(prompts, params), plain.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    if params.temperature == 0:
        assert [o.token_ids for o in got] == _reference(model, prompts, 24)
    assert_idle(hybrid)


@pytest.mark.slow
def test_windowed_layers_hold_only_their_windows(model):
    """A long request: its full group holds every block, its windowed group at most the window's and a step's."""
    engine = Engine(model, None, max_model_len=256, max_num_seqs=2, max_num_batched_tokens=16, block_size=4)
    held = []
    engine.add_request(_prompts(1, 1, 150, 151)[0], SamplingParams(temperature=0.0, max_tokens=60))
    while engine.has_unfinished_requests():
        engine.step()
        full, window = engine.kv.groups
        for seq, blocks in window.blocks.items():
            held.append((len(full.blocks[seq]), sum(b != NULL for b in blocks)))
    cap = -(-(WINDOW - 1 + 16) // 4) + 2
    assert max(w for _, w in held) <= cap and max(f for f, _ in held) >= (150 + 59) // 4
    assert_idle(engine)


@pytest.mark.slow
def test_no_block_leaks_after_finished_aborted_and_preempted_mixes(model):
    """A pool too small for every request at once: preemptions; some requests aborted midway; stops. Every
    finished request's tokens equal the reference's, and every group's blocks come back."""
    engine = Engine(model, None, num_kv_blocks=40, **SIZES)
    prompts = _prompts(2, 8, 20, 60)
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    done, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        steps += 1
        if steps == 6:
            engine.abort(ids[1])
            engine.abort(ids[5])
    assert engine.stats().num_preemptions > 0
    kept = [i for i in range(8) if i not in (1, 5)]
    assert [done[ids[i]] for i in kept] == _reference(model, [prompts[i] for i in kept], 24)
    assert_idle(engine)


@pytest.mark.slow
def test_prefix_hits_where_every_group_holds_the_prefix(model):
    engine = Engine(model, None, **SIZES)
    prompt = _prompts(3, 1, 50, 51)[0]
    [first] = engine.generate(prompt, GREEDY)
    hits = engine.stats().prefix_cache_hits
    [again] = engine.generate(prompt, GREEDY)
    assert engine.stats().prefix_cache_hits - hits == 48 and again.token_ids == first.token_ids
    follow = prompt + first.token_ids
    [longer] = engine.generate(follow, SamplingParams(temperature=0.0, max_tokens=8))
    assert longer.token_ids == _reference(model, [follow], 8)[0]
    assert_idle(engine)


@pytest.mark.slow
def test_speculative_drafts_with_windows(model):
    """Drafts rolled back inside a windowed group's blocks: plain decoding's tokens."""
    spec = dict(method="ngram", num_speculative_tokens=3, disable_by_batch_size=None)
    engine = Engine(model, None, speculative_config=spec, **SIZES)
    prompts = [(p[:5] * 8)[:40] for p in _prompts(4, 4)]
    got = engine.generate(prompts, GREEDY)
    assert engine.stats().spec_draft_tokens > 0
    assert [o.token_ids for o in got] == _reference(model, prompts, 24)
    assert_idle(engine)
