"""The reference generator: cached decoding equals recomputing from scratch; sampling filters; seeds."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tunix_rt.engine.reference_generator import GenerationConfig, generate
from tunix_rt.engine.sampler import filter_logits, sample
from tunix_rt.models.config import FULL, SLIDING, ModelConfig, RopeConfig
from tunix_rt.models.decoder import Decoder

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fast_compiles")]  # compile-bound (conftest.fast_compiles says when)


def _tiny(sliding: bool) -> Decoder:
    cfg = ModelConfig(
        architecture="gemma2" if sliding else "llama", vocab_size=97, hidden_size=32, intermediate_size=48,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
        layer_types=(SLIDING, FULL) if sliding else (), sliding_window=5 if sliding else None,
        rope=((FULL, RopeConfig(theta=10000.0)),) + (((SLIDING, RopeConfig(theta=100.0)),) if sliding else ()),
        attn_logit_softcap=20.0 if sliding else None, norm_offset=1.0 if sliding else 0.0,
    )
    return Decoder(cfg, rngs=nnx.Rngs(0))


def _greedy_by_recompute(model, prompt, steps):
    seq = list(prompt)
    for _ in range(steps):
        logits = model(jnp.asarray([seq]), jnp.arange(len(seq))[None])
        seq.append(int(jnp.argmax(logits[0, -1])))
    return seq[len(prompt):]


@pytest.mark.parametrize("sliding", [False, True])
def test_cached_greedy_equals_recompute(sliding):
    model = _tiny(sliding)
    prompts = [[3, 14, 15, 92, 65, 35, 89], [7, 1]]  # different lengths: left padding in one batch
    outs = generate(model, prompts, GenerationConfig(max_tokens=9))
    for prompt, out in zip(prompts, outs):
        assert out.prompt_token_ids == prompt
        assert out.token_ids == _greedy_by_recompute(model, prompt, 9)
        assert out.finish_reason == "length"


def test_stop_token_ends_sequence_and_is_kept():
    model = _tiny(False)
    free = generate(model, [[5, 6, 7]], GenerationConfig(max_tokens=6))[0].token_ids
    stop_at = free[2]
    out = generate(model, [[5, 6, 7]], GenerationConfig(max_tokens=6, stop_token_ids=(stop_at,)))[0]
    assert out.token_ids == free[: free.index(stop_at) + 1]
    assert out.finish_reason == "stop"


def test_seeded_sampling_is_reproducible_and_seed_dependent():
    model = _tiny(False)
    cfg = dict(max_tokens=12, temperature=1.5)
    a = generate(model, [[1, 2, 3]], GenerationConfig(seed=7, **cfg))[0].token_ids
    b = generate(model, [[1, 2, 3]], GenerationConfig(seed=7, **cfg))[0].token_ids
    c = generate(model, [[1, 2, 3]], GenerationConfig(seed=8, **cfg))[0].token_ids
    assert a == b
    assert a != c


def _numpy_filter(logits, top_k, top_p):
    order = np.argsort(-logits, kind="stable")
    probs = np.exp(logits[order] - logits.max())
    probs /= probs.sum()
    keep = np.zeros(len(logits), bool)
    cum = 0.0
    for rank, idx in enumerate(order):
        if (top_k and rank >= top_k) or cum >= top_p:
            break
        keep[idx] = True
        cum += probs[rank]
    return keep


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (1, 1.0), (5, 1.0), (0, 0.5), (0, 0.9), (3, 0.7), (200, 0.3)])
def test_filter_logits_matches_numpy(top_k, top_p):
    logits = np.random.default_rng(top_k).normal(size=(4, 50)).astype(np.float32) * 3
    got = filter_logits(jnp.asarray(logits), jnp.full((4,), top_k, jnp.int32), jnp.full((4,), top_p, jnp.float32))
    for row in range(4):
        assert (np.isfinite(np.asarray(got[row])) == _numpy_filter(logits[row], top_k, top_p)).all()


def test_sample_greedy_rows_and_top_k_one():
    logits = jax.random.normal(jax.random.key(0), (3, 40))
    temperature = jnp.array([0.0, 1.0, 2.0])
    top_k = jnp.array([0, 1, 0], jnp.int32)
    out = sample(logits, jax.random.key(1), temperature, top_k, jnp.ones(3))
    argmax = jnp.argmax(logits, -1)
    assert int(out[0]) == int(argmax[0]) and int(out[1]) == int(argmax[1])


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1)])
def test_bad_generation_config(bad):
    with pytest.raises(ValueError):
        GenerationConfig(**bad)


def test_bad_prompts():
    model = _tiny(False)
    with pytest.raises(ValueError, match=r"prompts\[0\] is empty"):
        generate(model, [[]], GenerationConfig())
    with pytest.raises(ValueError, match="outside"):
        generate(model, [[1, 97]], GenerationConfig())
