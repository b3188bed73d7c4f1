"""Causal attention whose mask comes from token positions alone, dense and as an XLA FFI op.

Every key carries its absolute position, -1 for an empty or padding slot. A query at position p
sees keys with 0 <= k_pos <= p (and p - k_pos < window on sliding layers). The same rule serves
training (keys are the tokens themselves), left-padded batches and a dense KV cache, so no
separate mask tensors travel through the model.

`attention(q, k, v, positions, segment_ids, ...)` is training's self-attention (keys are the
queries' own tokens) as the FFI op of csrc/attention.cc: flash attention's tiling on CPU, which
never materialises the (heads, T, T) scores and skips the tiles packed rows never attend across,
with a custom_vjp on its own backward handler. `attention_reference` (same signature) is
`dot_product_attention` under `attention_mask`, what the dense KV cache also runs. On CUDA GPUs the op
runs as Pallas kernels in bf16 with a power-of-two head_dim (`attention_pallas`: flash attention under the same
rule, forward and backward); f32 and other head dims take the reference there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from tunix_rt.ops import attention_pallas
from tunix_rt.ops._ffi import platform_dispatch, require_array

_FWD = "tunix_rt_attention_fwd"
_BWD = "tunix_rt_attention_bwd"
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def attention_mask(q_pos: jax.Array, k_pos: jax.Array, window: int | None,
                   segment_ids: jax.Array | None = None, attend_until: jax.Array | None = None) -> jax.Array:
    """(B, T) query and (B, S) key positions -> boolean mask (B, T, S).

    `attend_until` (B, T), when given, is the last key position each query sees in place of its own (an image's
    tokens see their whole image: models/vision.image_attend_until); the window still counts from the query.

    With `segment_ids` (B, T) (training on packed rows: queries and keys are the same tokens, each
    packed example numbered, positions restarting at 0), a query sees only keys of its own segment. A
    negative segment id marks a shared prefix, seen as well by the positive segments of its group: segment s
    belongs to group s >> 16, whose prefix is -(group + 1) (`prefix_segment`). So G completions of one prompt
    pack behind a single copy of it (prefix -1, completions 1..G, their positions continuing the prompt's),
    and several such groups share a row (a reward model's pairs: prefix -(g + 1), chosen and rejected
    (g << 16) + 1 and + 2). A prefix sees only itself; 0 marks padding.
    """
    q = q_pos[:, :, None]
    k = k_pos[:, None, :]
    mask = (k >= 0) & (k <= (q if attend_until is None else attend_until[:, :, None]))
    if window is not None:
        mask &= (q - k) < window
    if segment_ids is not None:
        sq, sk = segment_ids[:, :, None], segment_ids[:, None, :]
        mask &= (sq == sk) | ((sq > 0) & (sk == prefix_segment(sq)))
    return mask


def prefix_segment(segment):
    """The id of the shared prefix the positive segment id(s) `segment` see (attention_mask's rule)."""
    return -(segment >> 16) - 1


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


def _check(q, k, v, positions, segment_ids, scale, window, softcap, attend_until=None) -> None:
    for name, arr in (("q", q), ("k", k), ("v", v)):
        if jnp.dtype(require_array("attention", name, arr).dtype) not in _DTYPES:
            raise ValueError(f"attention: {name} must be float32 or bfloat16, got {jnp.dtype(arr.dtype)}")
        if arr.ndim != 4:
            raise ValueError(f"attention: {name} must be (B, T, heads, head_dim), got shape {arr.shape}")
    if k.shape != v.shape or k.dtype != v.dtype:
        raise ValueError(f"attention: k and v must match, got {k.shape} {k.dtype} and {v.shape} {v.dtype}")
    b, t, h, d = q.shape
    if k.shape[:2] != (b, t) or k.shape[3] != d or k.shape[2] < 1 or h % k.shape[2]:
        raise ValueError(f"attention: k must be (B, T, KV, D) with q's B, T, D and KV dividing q's {h} heads, got "
                         f"q {q.shape} and k {k.shape}")
    for name, ids in (("positions", positions), ("segment_ids", segment_ids), ("attend_until", attend_until)):
        if ids is None:
            continue
        if require_array("attention", name, ids).shape != (b, t) or not jnp.issubdtype(ids.dtype, jnp.integer):
            raise ValueError(f"attention: {name} must be integer (B, T) = {(b, t)}, got {ids.dtype} {ids.shape}")
    if not np.isfinite(scale):
        raise ValueError(f"attention: scale must be finite, got {scale!r}")
    if window is not None and (not isinstance(window, (int, np.integer)) or window < 1):
        raise ValueError(f"attention: window must be a positive integer or None, got {window!r}")
    if softcap is not None and not (np.isfinite(softcap) and softcap > 0):
        raise ValueError(f"attention: softcap must be positive and finite or None, got {softcap!r}")


def attention_reference(q, k, v, positions, segment_ids=None, *, scale: float, window: int | None = None,
                        softcap: float | None = None, attend_until=None):
    """Self-attention of q (B, T, H, D) over k, v (B, T, KV, D) of the same tokens, masked by
    `attention_mask(positions, positions, window, segment_ids, attend_until)`: the dense reference."""
    _check(q, k, v, positions, segment_ids, scale, window, softcap, attend_until)
    mask = attention_mask(positions, positions, window, segment_ids, attend_until)
    return dot_product_attention(q, k, v, mask, scale=scale, softcap=softcap)


def _attrs(scale, window, softcap, segments):
    return dict(scale=np.float32(scale), window=np.int64(window or 0), softcap=np.float32(softcap or 0.0),
                segments=bool(segments))


def _fwd_call(q, k, v, positions, segment_ids, attrs, out_dtype):
    b, t, h, _ = q.shape
    out = (jax.ShapeDtypeStruct(q.shape, out_dtype), jax.ShapeDtypeStruct((b, t, h), jnp.float32))
    return jax.ffi.ffi_call(_FWD, out, vmap_method="sequential")(q, k, v, positions, segment_ids, **attrs)


SAVED_NAMES = ("attention_out_f32", "attention_lse")  # the forward's residuals, as checkpoint names


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _attention_ffi(q, k, v, positions, segment_ids, attrs_key):
    return _fwd_call(q, k, v, positions, segment_ids, dict(attrs_key), q.dtype)[0]


def _vjp_fwd(q, k, v, positions, segment_ids, attrs_key):
    """The output in f32 for the backward's D = rowsum(dO * O): rounded to bf16 first, its error would
    land in every score gradient where one key takes all the mass. The output and the log-sum-exps are
    named (SAVED_NAMES) so that a rematerialisation policy can keep them: without them the backward would
    run the forward kernel again."""
    out, lse = _fwd_call(q, k, v, positions, segment_ids, dict(attrs_key), jnp.float32)
    out, lse = checkpoint_name(out, SAVED_NAMES[0]), checkpoint_name(lse, SAVED_NAMES[1])
    return out.astype(q.dtype), (q, k, v, positions, segment_ids, out, lse)


def _vjp_bwd(attrs_key, residuals, dout):
    q, k, v, positions, segment_ids, out, lse = residuals
    dout = dout.astype(q.dtype)
    dsum = jnp.einsum("bthd,bthd->bth", dout.astype(jnp.float32), out)
    grads = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
             jax.ShapeDtypeStruct(v.shape, v.dtype))
    dq, dk, dv = jax.ffi.ffi_call(_BWD, grads, vmap_method="sequential")(
        q, k, v, positions, segment_ids, lse, dsum, dout, **dict(attrs_key))
    return dq, dk, dv, None, None


_attention_ffi.defvjp(_vjp_fwd, _vjp_bwd)


def attention(q, k, v, positions, segment_ids=None, *, scale: float, window: int | None = None,
              softcap: float | None = None, attend_until=None):
    """Self-attention of q (B, T, H, D) over k, v (B, T, KV, D) of the same tokens (GQA when KV < H),
    query t seeing key s by `attention_mask`'s rule; f32 math, the output in q's dtype; differentiable
    in q, k and v. A call with `attend_until` (images' tokens seeing their whole image) takes the dense
    reference, all of it: the FFI kernel's tiles skip what positions alone rule out."""
    _check(q, k, v, positions, segment_ids, scale, window, softcap, attend_until)
    if attend_until is not None:
        return attention_reference(q, k, v, positions, segment_ids, scale=scale, window=window, softcap=softcap,
                                   attend_until=attend_until)
    segments = segment_ids is not None
    ids = (positions.astype(jnp.int32), (segment_ids if segments else positions).astype(jnp.int32))
    attrs_key = tuple(_attrs(scale, window, softcap, segments).items())
    opts = dict(scale=scale, window=window, softcap=softcap)
    cuda = None
    if attention_pallas.supported(q, k, v):
        cuda = lambda q, k, v, p, s, interpret: attention_pallas.attention_pallas(  # noqa: E731
            q, k, v, p, s if segments else None, **opts, interpret=interpret)
    return platform_dispatch(
        _FWD,
        lambda q, k, v, p, s: _attention_ffi(q, k, v, p, s, attrs_key),
        lambda q, k, v, p, s: attention_reference(q, k, v, p, s if segments else None, **opts),
        q, k, v, *ids, cuda=cuda)
