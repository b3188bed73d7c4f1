"""The fused chunked output head against its dense reference: log-probs, entropy and distillation KL
(full and top-k), forward and backward (to the hidden states and to the head's weight), on
hypothesis-drawn shapes (vocabularies and token counts not divisible by the chunk, both weight layouts,
temperatures, soft-capping, bf16), plus the argument checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tunix_rt.ops.fused_head import default_chunk, head_distill, head_distill_reference, head_logprobs, head_logprobs_reference

pytestmark = pytest.mark.usefixtures("fast_compiles")  # small programs, compiled once per example


def close(actual, expected, rtol, floor=1e-6):
    """Relative to the largest magnitude of `expected` (gradients hold entries near zero), or to `floor` where
    that is larger: a log-prob is a difference of terms as large as the logits, so near 0 its f32 error is
    relative to them, not to itself."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    scale = max(np.abs(expected).max(initial=0.0), floor)
    assert np.abs(actual - expected).max(initial=0.0) <= rtol * scale, (np.abs(actual - expected).max(), scale)


def draw_case(seed: int, lead: tuple, d: int, v: int, transpose_w: bool, dtype, scale: float = 1.0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 6)
    h = (jax.random.normal(keys[0], (*lead, d)) * scale).astype(dtype)
    w = (jax.random.normal(keys[1], (v, d) if transpose_w else (d, v)) / np.sqrt(d)).astype(dtype)
    targets = jax.random.randint(keys[2], lead, 0, v)
    cot = [jax.random.normal(k, lead) for k in keys[3:]]
    return h, w, targets, cot


def _jit_value_and_grad(objective):
    """value_and_grad over (h, w) as one program: an example compiles once, not once per op and scan."""
    return jax.jit(jax.value_and_grad(objective, (0, 1), has_aux=True))


@pytest.mark.slow
@settings(max_examples=10)
@given(seed=st.integers(0, 2**16), tokens=st.integers(0, 40), d=st.integers(1, 12), v=st.integers(2, 70),
       chunk=st.sampled_from([1, 3, 8, 16, None]), transpose_w=st.booleans(),
       temperature=st.sampled_from([1.0, 0.7, 1.9]), softcap=st.sampled_from([None, 3.0]),
       scale=st.sampled_from([1.0, 30.0]))
def test_logprobs_and_entropy_match_the_dense_head(seed, tokens, d, v, chunk, transpose_w, temperature, softcap,
                                                   scale):
    h, w, targets, (g_logp, g_ent, _) = draw_case(seed, (tokens,), d, v, transpose_w, jnp.float32, scale)
    kw = dict(transpose_w=transpose_w, temperature=temperature, softcap=softcap, entropy=True, chunk=chunk)

    def objective(fn, h, w):
        logp, ent = fn(h, w, targets, **kw)
        return (logp * g_logp).sum() + (ent * g_ent).sum(), (logp, ent)

    (_, (logp, ent)), grads = _jit_value_and_grad(lambda h, w: objective(head_logprobs, h, w))(h, w)
    (_, (logp_ref, ent_ref)), grads_ref = _jit_value_and_grad(lambda h, w: objective(head_logprobs_reference, h, w))(h, w)
    logits = np.asarray(h, np.float64) @ np.asarray(w, np.float64).T if transpose_w else \
        np.asarray(h, np.float64) @ np.asarray(w, np.float64)
    largest_logit = np.abs(logits / temperature).max(initial=0.0)
    close(logp, logp_ref, 1e-5, floor=largest_logit)
    close(ent, ent_ref, 1e-5, floor=largest_logit)
    # A gradient entry sums terms of size |cotangent| |other operand| (1 + |logit|) / T over the vocabulary (the
    # entropy's carries the logits); where they cancel, its f32 error is relative to them.
    cot = max(np.abs(np.asarray(g_logp)).max(initial=0.0), np.abs(np.asarray(g_ent)).max(initial=0.0))
    terms = cot * (1.0 + largest_logit) / temperature
    for grad, grad_ref, other in zip(grads, grads_ref, (w, h)):
        close(grad, grad_ref, 1e-5, floor=terms * np.abs(np.asarray(other)).max(initial=0.0))


@pytest.mark.slow
@settings(max_examples=10)
@given(seed=st.integers(0, 2**16), tokens=st.integers(1, 30), v=st.integers(2, 50), top_k=st.integers(0, 50),
       chunk=st.sampled_from([1, 4, 7, None]), transpose_w=st.booleans(), teacher_transpose_w=st.booleans(),
       temperature=st.sampled_from([1.0, 2.0, 0.5]), softcap=st.sampled_from([None, 4.0]))
def test_distillation_matches_the_dense_heads(seed, tokens, v, top_k, chunk, transpose_w, teacher_transpose_w,
                                              temperature, softcap):
    top_k = min(top_k, v)
    h, w, targets, (g_kl, g_logp, _) = draw_case(seed, (2, tokens), 6, v, transpose_w, jnp.float32)
    th, tw, _, _ = draw_case(seed + 1, (2, tokens), 5, v, teacher_transpose_w, jnp.float32)
    kw = dict(temperature=temperature, top_k=top_k, transpose_w=transpose_w, teacher_transpose_w=teacher_transpose_w,
              softcap=softcap, teacher_softcap=softcap, chunk=chunk)

    def objective(fn, h, w):
        kl, logp = fn(h, w, th, tw, targets, **kw)
        return (kl * g_kl).sum() + (logp * g_logp).sum(), (kl, logp)

    (_, outs), grads = _jit_value_and_grad(lambda h, w: objective(head_distill, h, w))(h, w)
    (_, outs_ref), grads_ref = _jit_value_and_grad(lambda h, w: objective(head_distill_reference, h, w))(h, w)
    for actual, expected in zip((*outs, *grads), (*outs_ref, *grads_ref)):
        close(actual, expected, 2e-5)


def test_top_k_of_the_whole_vocabulary_is_full_distillation():
    h, w, targets, _ = draw_case(0, (9,), 8, 33, False, jnp.float32)
    th, tw, _, _ = draw_case(1, (9,), 8, 33, False, jnp.float32)
    full = head_distill(h, w, th, tw, targets, temperature=2.0)[0]
    np.testing.assert_allclose(head_distill(h, w, th, tw, targets, temperature=2.0, top_k=33)[0], full, rtol=1e-5,
                               atol=1e-6)


@pytest.mark.slow
def test_bf16_operands_within_their_rounding():
    h, w, targets, (g, _, _) = draw_case(3, (4, 37), 64, 301, True, jnp.bfloat16)
    loss = lambda fn, h, w: (fn(h, w, targets, transpose_w=True, chunk=16)[0] * g).sum()
    value, grads = jax.value_and_grad(lambda h, w: loss(head_logprobs, h, w), (0, 1))(h, w)
    # The reference on the same bf16 inputs, computed in f32: the fused head's products are bf16 x bf16 -> f32.
    h32, w32 = h.astype(jnp.float32), w.astype(jnp.float32)
    value_ref, grads_ref = jax.value_and_grad(lambda h, w: loss(head_logprobs_reference, h, w), (0, 1))(h32, w32)
    close(value, value_ref, 1e-5)
    assert grads[0].dtype == jnp.bfloat16 and grads[1].dtype == jnp.bfloat16
    for grad, grad_ref in zip(grads, grads_ref):
        close(grad, grad_ref, 2e-2)


def test_frozen_head_forms_no_weight_gradient():
    """Under LoRA the head is frozen: the backward pass must not form the (D, V) weight gradient, one
    product per chunk (forward: logits; backward: logits again, dh, and dW only when w is trained)."""
    h, w, targets, _ = draw_case(0, (16,), 8, 40, False, jnp.float32)
    dots = lambda fn, x: str(jax.make_jaxpr(jax.grad(fn))(x)).count("dot_general")
    assert dots(lambda h: head_logprobs(h, w, targets, chunk=8)[0].sum(), h) == 3
    assert dots(lambda w: head_logprobs(h, w, targets, chunk=8)[0].sum(), w) == 4


def test_out_of_range_target_is_nan_not_a_neighbour():
    h, w, _, _ = draw_case(0, (3,), 4, 10, False, jnp.float32)
    logp, _ = head_logprobs(h, w, jnp.array([0, 10, -1]))
    assert np.isfinite(logp[0]) and np.isnan(logp[1]) and np.isnan(logp[2])


def test_never_holds_the_whole_logits():
    """The jitted forward and backward hold logits of one chunk at a time, not (tokens, vocab)."""
    h, w, targets, _ = draw_case(0, (512,), 8, 1000, False, jnp.float32)
    text = jax.jit(jax.grad(lambda h, w: head_logprobs(h, w, targets, chunk=64)[0].sum(), (0, 1))).lower(h, w).as_text()
    assert "512x1000" not in text and "64x1000" in text


def test_default_chunk():
    assert default_chunk(49152, 10_000) == 128
    assert default_chunk(128_256, 10_000) == 64
    assert default_chunk(100, 5) == 8 and default_chunk(100, 0) == 8
    assert default_chunk(100, 100_000) == 1024


@pytest.mark.parametrize("call, message", [
    (lambda h, w, t: head_logprobs(h.astype(jnp.int32), w, t), "h must be a float array"),
    (lambda h, w, t: head_logprobs(h, w.T, t), "w (7, 4) does not match h's hidden size 4"),
    (lambda h, w, t: head_logprobs(h, w, t.astype(jnp.float32)), "targets must be an integer array"),
    (lambda h, w, t: head_logprobs(h, w, t[:2]), "targets shape (2,) must equal h shape[:-1] (3,)"),
    (lambda h, w, t: head_logprobs(h, w, t, temperature=0.0), "temperature must be a finite number > 0"),
    (lambda h, w, t: head_logprobs(h, w, t, softcap=-1.0), "softcap must be a finite number > 0"),
    (lambda h, w, t: head_logprobs(h, w, t, chunk=0), "chunk must be a positive integer"),
    (lambda h, w, t: head_logprobs([1.0], w, t), "h must be an array"),
    (lambda h, w, t: head_distill(h, w, h, w[:, :3], t, temperature=1.0), "teacher_w has a vocabulary of 3"),
    (lambda h, w, t: head_distill(h, w, h[:2], w, t, temperature=1.0), "teacher_h shape[:-1] (2,)"),
    (lambda h, w, t: head_distill(h, w, h, w, t, temperature=1.0, top_k=8), "top_k must be an integer in [0, 7]"),
])
def test_bad_arguments_are_named(call, message):
    h, w, targets, _ = draw_case(0, (3,), 4, 7, False, jnp.float32)
    with pytest.raises(ValueError) as error:
        call(h, w, targets)
    assert message in str(error.value)
