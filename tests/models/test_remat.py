"""Gradient checkpointing (models/remat.py): the same gradients as no checkpointing, and activations
actually freed on XLA:CPU, where jax.checkpoint frees none."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.train import sharded_worker as W
from tunix_rt.models.decoder import Decoder
from tunix_rt.models.lora import apply_lora
from tunix_rt.models.remat import recompute_in_backward

pytestmark = pytest.mark.usefixtures("fast_compiles")  # compile-bound (conftest.fast_compiles says when)


def _layer(w, x, scale):
    a, b = w["a"], w["b"]
    return x + jax.nn.silu(x @ a) @ b * scale


def _stack(n, d, f, seed=0):
    keys = jax.random.split(jax.random.key(seed), 2 * n)
    return [{"a": jax.random.normal(keys[2 * i], (d, f)) / d ** 0.5, "b": jax.random.normal(keys[2 * i + 1], (f, d)) / f ** 0.5}
            for i in range(n)]


def _loss(ws, x, mode):
    for w in ws:
        if mode == "remat":
            x = recompute_in_backward(_layer, w, x, (jnp.float32(0.5),))
        else:
            x = _layer(w, x, jnp.float32(0.5))
    return jnp.sum(jnp.sin(x))


@pytest.mark.slow
@settings(max_examples=12)
@given(n=st.integers(1, 4), t=st.integers(1, 9), d=st.integers(1, 12), f=st.integers(1, 20), seed=st.integers(0, 99))
def test_gradients_equal_no_checkpointing(n, t, d, f, seed):
    ws = _stack(n, d, f, seed)
    x = jax.random.normal(jax.random.key(seed + 1), (t, d))
    grad = jax.jit(jax.grad(_loss, argnums=(0, 1)), static_argnums=2)
    (gw, gx), (rw, rx) = grad(ws, x, "plain"), grad(ws, x, "remat")
    for a, b in zip(jax.tree.leaves((gw, gx)), jax.tree.leaves((rw, rx))):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_frozen_leaves_get_no_gradient_and_values_pass_through():
    """Differentiating x only: the weights' cotangents are never formed (no (d, f) dot in the backward)."""
    ws = _stack(2, 8, 16)
    x = jax.random.normal(jax.random.key(3), (5, 8))
    value, gx = jax.value_and_grad(lambda x: _loss(ws, x, "remat"))(x)
    want_value, want_gx = jax.value_and_grad(lambda x: _loss(ws, x, "plain"))(x)
    np.testing.assert_allclose(value, want_value, rtol=1e-6)
    np.testing.assert_allclose(gx, want_gx, rtol=1e-6, atol=1e-6)
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda x: _loss(ws, x, "remat")))(x))
    assert "f32[8,16] = dot_general" not in jaxpr and "f32[16,8] = dot_general" not in jaxpr


def test_activations_are_freed_on_cpu():
    """Compiled temp memory of 12 layers x 512 tokens: checkpointing keeps a layer's input, not its
    (512, 256) hidden activations; jax.checkpoint alone keeps them all on XLA:CPU."""
    if jax.default_backend() != "cpu":
        pytest.skip("the measured case is XLA:CPU's scheduling; other backends honour jax.checkpoint")
    ws = _stack(12, 64, 256)
    x = jax.random.normal(jax.random.key(1), (512, 64))
    temp = {mode: jax.jit(jax.grad(_loss), static_argnums=2).lower(ws, x, mode).compile()
            .memory_analysis().temp_size_in_bytes for mode in ("plain", "remat")}
    hidden = 512 * 256 * 4
    assert temp["plain"] > 12 * hidden  # what is kept without checkpointing
    assert temp["remat"] < temp["plain"] / 3, temp


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True])
def test_decoder_gradients_with_checkpointing(lora):
    """The decoder's layers under remat: the same loss and gradients, full and LoRA."""
    model = Decoder(W.model_config(), rngs=nnx.Rngs(0))
    if lora:
        apply_lora(model, rank=4, alpha=8.0)
        nnx.update(model, jax.tree.map(lambda v: v + 0.01, nnx.state(model, nnx.LoRAParam)))
    trainable = nnx.LoRAParam if lora else nnx.Param
    graphdef, params, rest = nnx.split(model, trainable, ...)
    tokens = jax.random.randint(jax.random.key(0), (2, 7), 0, model.config.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(7), (2, 7))

    def loss(params, remat):
        m = nnx.merge(graphdef, params, rest)
        m.remat = remat
        h, _ = m.hidden_states(tokens, positions)
        return jnp.sum(m.token_logprobs(h[:, :-1], tokens[:, 1:])[0])

    (l0, g0), (l1, g1) = (jax.jit(jax.value_and_grad(loss), static_argnums=1)(params, r) for r in (False, True))
    np.testing.assert_allclose(l1, l0, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)
