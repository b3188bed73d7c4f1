"""Dense causal attention whose mask comes from token positions alone.

Every key carries its absolute position, -1 for an empty or padding slot. A query at position p
sees keys with 0 <= k_pos <= p (and p - k_pos < window on sliding layers). The same rule serves
training (keys are the tokens themselves), left-padded batches and a dense KV cache, so no
separate mask tensors travel through the model.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def attention_mask(q_pos: jax.Array, k_pos: jax.Array, window: int | None,
                   segment_ids: jax.Array | None = None) -> jax.Array:
    """(B, T) query and (B, S) key positions -> boolean mask (B, T, S).

    With `segment_ids` (B, T) (training on packed rows: queries and keys are the same tokens, each
    packed example numbered, positions restarting at 0), a query sees only keys of its own segment. A
    negative segment id marks a shared prefix: every positive segment of the row sees it as well (so G
    completions of one prompt pack behind a single copy of it, their positions continuing the prompt's),
    and it sees only itself. 0 marks padding.
    """
    q = q_pos[:, :, None]
    k = k_pos[:, None, :]
    mask = (k >= 0) & (k <= q)
    if window is not None:
        mask &= (q - k) < window
    if segment_ids is not None:
        sq, sk = segment_ids[:, :, None], segment_ids[:, None, :]
        mask &= (sq == sk) | ((sk < 0) & (sq > 0))
    return mask


def dot_product_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    *,
    scale: float,
    softcap: float | None = None,
) -> jax.Array:
    """q (B, T, H, D), k/v (B, S, KV, D) with H a multiple of KV (GQA/MQA), mask (B, T, S).

    Scores and softmax run in f32; the output has q's dtype. A query with no visible key gets a
    uniform average instead of NaN (only padding queries are in that state).
    """
    b, t, h, d = q.shape
    kv = k.shape[2]
    qg = q.reshape(b, t, kv, h // kv, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    if softcap is not None:
        scores = jnp.tanh(scores / softcap) * softcap
    scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, d).astype(q.dtype)
