"""Token selection from logits: greedy, temperature, top-k, top-p, all traced (no recompiles)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def filter_logits(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Mask (to -inf) tokens outside the top_k (0 = all) and outside the top_p nucleus, per row.

    logits (B, V) f32; top_k (B,) int32; top_p (B,) f32 in (0, 1]. The most likely token always
    survives; ties at the threshold survive together.
    """
    vocab = logits.shape[-1]
    sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    cum_before = jnp.cumsum(probs, axis=-1) - probs
    in_nucleus = cum_before < top_p[:, None]
    in_top_k = jnp.arange(vocab)[None, :] < k[:, None]
    keep = jnp.maximum(jnp.sum(in_nucleus & in_top_k, axis=-1), 1)
    threshold = jnp.take_along_axis(sorted_logits, (keep - 1)[:, None], axis=-1)
    return jnp.where(logits >= threshold, logits, -jnp.inf)


def sample(logits: jax.Array, key: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Next token per row: argmax where temperature == 0, else a draw from the filtered softmax."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw():  # skipped at run time when every row is greedy: the vocab sort is the costly part
        scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
        drawn = jax.random.categorical(key, filter_logits(scaled, top_k, top_p), axis=-1)
        return jnp.where(temperature > 0, drawn, greedy).astype(jnp.int32)

    return jax.lax.cond(jnp.any(temperature > 0), draw, lambda: greedy)
