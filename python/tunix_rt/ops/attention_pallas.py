"""Training self-attention as Pallas kernels (flash attention, forward and backward): the path `attention`
takes on CUDA GPUs (Triton lowering), and on any platform in interpret mode (`TUNIX_RT_KERNELS=interpret`),
where the tests check it.

Same rule as the op (tunix_rt.ops.attention): a key is visible by its position alone (-1: padding), within
a window, softcapped, with GQA, and on packed rows by segment, a shared prefix seen by its group's
completions. JAX's own GPU flash attention (pallas.ops.gpu.attention) masks by storage order and equal
segment ids, with as many kv heads as query heads, so it cannot serve this rule; this kernel walks the same
tiles and builds the mask in each from the tile's positions and segments.

Forward: one program per (row, query head, query tile) walks the key tiles with an online softmax in f32,
skipping a tile no query of its tile sees (a causal row's upper triangle, the other examples of a packed
row), and writes the f32 output and the log-sum-exp. Backward (FlashAttention-2's): D = rowsum(dO * O) in
XLA; one program per (row, query head, key tile) sums dk and dv over the query tiles, one per (row, query
head, query tile) sums dq over the key tiles; each query head's dk and dv are summed over its kv head's
group after. A query that sees no key (padding) is left zero by the kernels; the wrapper gives it the
reference's answer, the mean of every value (its softmax over equal scores), and that mean's gradient.

Triton needs power-of-two tiles: head_dim must be a power of two (`supported`); the sequence is padded to
whole tiles with position -1.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

# Pallas (and its Triton backend) is imported where a kernel is traced, not with this module (see
# paged_attention_pallas).

# Query and key rows per tile: Triton's dot needs at least 16; 64 measured best on one H200 at head dims 64
# and 256 (bf16, forward + backward: 16 and 32 rows 1.2-2.7x slower, 128 rows 2x slower at head dim 64 and
# past the shared memory at 256). Heads past 64 run twice the warps.
_MIN_TILE, _MAX_TILE = 16, 64


def supported(q, k, v) -> bool:
    """Whether the kernels run on q, k, v: all bf16, a power-of-two head_dim from 16 (Triton's tiles) to 256
    (the largest measured; 128-row tiles already passed the shared memory there).

    f32 keeps XLA's reference: with f32 tiles in IEEE precision (tensor cores take TF32 only) the kernels
    measured 15-42x slower than the reference on one H200; bf16 ones 1.1-3.5x faster forward, 1.4-4.9x
    forward + backward (benchmarks/device_check.py's train_attention part)."""
    d = q.shape[-1]
    bf16 = all(jnp.dtype(x.dtype) == jnp.bfloat16 for x in (q, k, v))
    return bf16 and _MIN_TILE <= d <= 256 and d & (d - 1) == 0


def tile_size(t: int, tile: int | None = None) -> int:
    """Rows per tile for t tokens: `tile` if given (benchmarks/device_check.py sweeps it), else
    the next power of two of t, between 16 and 64."""
    if tile is not None:
        if tile < _MIN_TILE or tile & (tile - 1):
            raise ValueError(f"attention_pallas: tile must be a power of two of at least {_MIN_TILE}, got {tile}")
        return tile
    return min(_MAX_TILE, max(_MIN_TILE, 1 << max(t - 1, 0).bit_length()))


def _visible(q_pos, q_seg, k_pos, k_seg, window, segments):
    """attention_mask's rule on one (query tile, key tile)."""
    q, k = q_pos[:, None], k_pos[None, :]
    mask = (k >= 0) & (k <= q)
    if window:
        mask &= (q - k) < window
    if segments:
        from tunix_rt.ops.attention import prefix_segment

        sq, sk = q_seg[:, None], k_seg[None, :]
        mask &= (sq == sk) | ((sq > 0) & (sk == prefix_segment(sq)))
    return mask


def _any(mask):
    """Whether a 2-D mask holds anywhere (Triton reduces one axis at a time)."""
    return jnp.max(jnp.max(mask.astype(jnp.int32), axis=1), axis=0) > 0


def _dot(a, b, dims):
    """a . b contracting dims, f32 result; f32 tiles in IEEE precision, not TF32."""
    return jax.lax.dot_general(a, b, (dims, ((), ())), precision=jax.lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32)


_NT = ((1,), (1,))  # a @ b.T
_NN = ((1,), (0,))  # a @ b
_TN = ((0,), (0,))  # a.T @ b


def _scores(q, k, scale, softcap):
    """Raw scores of a (query tile, key tile) and, with a softcap, tanh of the capped ones (for the backward)."""
    s = _dot(q, k, _NT) * scale
    if not softcap:
        return s, None
    t = jnp.tanh(s / softcap)
    return t * softcap, t


def _fwd_kernel(pos_ref, seg_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, scale, softcap, window, segments, tile):
    from jax.experimental import pallas as pl

    i = pl.program_id(2)
    rows = pl.ds(i * tile, tile)
    q_pos, q_seg, q = pos_ref[rows], seg_ref[rows], q_ref[...]

    def body(j, carry):
        keys = pl.ds(j * tile, tile)
        visible = _visible(q_pos, q_seg, pos_ref[keys], seg_ref[keys], window, segments)

        def step(carry):
            acc, m, total = carry
            v = v_ref[keys, :]
            s, _ = _scores(q, k_ref[keys, :], scale, softcap)
            s = jnp.where(visible, s, jnp.finfo(jnp.float32).min)
            m_next = jnp.maximum(m, jnp.max(s, axis=1))
            p = jnp.where(visible, jnp.exp(s - m_next[:, None]), 0.0)
            correction = jnp.exp(m - m_next)
            pv = _dot(p.astype(v.dtype), v, _NN)
            return acc * correction[:, None] + pv, m_next, total * correction + jnp.sum(p, axis=1)

        return jax.lax.cond(_any(visible), step, lambda c: c, carry)

    d = q.shape[1]
    init = (jnp.zeros((tile, d), jnp.float32), jnp.full((tile,), jnp.finfo(jnp.float32).min, jnp.float32),
            jnp.zeros((tile,), jnp.float32))
    acc, m, total = jax.lax.fori_loop(0, pos_ref.shape[0] // tile, body, init)
    seen = total > 0
    o_ref[...] = jnp.where(seen[:, None], acc / jnp.where(seen, total, 1.0)[:, None], 0.0)
    lse_ref[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, total, 1.0)), jnp.inf)


def _grad_terms(q, k, v, do, lse, delta, visible, scale, softcap):
    """p, and ds, the loss's gradient in the scaled scores scale * q.k (the callers apply the scale to their
    sums), of one tile pair."""
    s, t = _scores(q, k, scale, softcap)
    p = jnp.where(visible, jnp.exp(s - lse[:, None]), 0.0)
    ds = p * (_dot(do, v, _NT) - delta[:, None])
    if softcap:
        ds *= 1.0 - t * t
    return p, ds


def _dkv_kernel(pos_ref, seg_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *, scale,
                softcap, window, segments, tile):
    from jax.experimental import pallas as pl

    j = pl.program_id(2)
    keys = pl.ds(j * tile, tile)
    k_pos, k_seg, k, v = pos_ref[keys], seg_ref[keys], k_ref[...], v_ref[...]

    def body(i, carry):
        rows = pl.ds(i * tile, tile)
        visible = _visible(pos_ref[rows], seg_ref[rows], k_pos, k_seg, window, segments)

        def step(carry):
            dk, dv = carry
            q, do = q_ref[rows, :], do_ref[rows, :]
            p, ds = _grad_terms(q, k, v, do, lse_ref[rows], delta_ref[rows], visible, scale, softcap)
            return dk + _dot(ds.astype(q.dtype), q, _TN), dv + _dot(p.astype(do.dtype), do, _TN)

        return jax.lax.cond(_any(visible), step, lambda c: c, carry)

    d = k.shape[1]
    zeros = jnp.zeros((tile, d), jnp.float32)
    dk, dv = jax.lax.fori_loop(0, pos_ref.shape[0] // tile, body, (zeros, zeros))
    dk_ref[...] = dk * scale
    dv_ref[...] = dv


def _dq_kernel(pos_ref, seg_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *, scale, softcap, window,
               segments, tile):
    from jax.experimental import pallas as pl

    i = pl.program_id(2)
    rows = pl.ds(i * tile, tile)
    q_pos, q_seg, q, do = pos_ref[rows], seg_ref[rows], q_ref[...], do_ref[...]
    lse, delta = lse_ref[rows], delta_ref[rows]

    def body(j, dq):
        keys = pl.ds(j * tile, tile)
        visible = _visible(q_pos, q_seg, pos_ref[keys], seg_ref[keys], window, segments)

        def step(dq):
            k = k_ref[keys, :]
            _, ds = _grad_terms(q, k, v_ref[keys, :], do, lse, delta, visible, scale, softcap)
            return dq + _dot(ds.astype(k.dtype), k, _NN)

        return jax.lax.cond(_any(visible), step, lambda c: c, dq)

    dq = jax.lax.fori_loop(0, pos_ref.shape[0] // tile, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = dq * scale


def _specs(tp, h, kv, d, tile):
    """BlockSpecs over grid (row, query head, tile): the row's positions and segments whole, a (tile, D)
    block of one query head, and the row's whole sequence of the head's kv head."""
    from jax.experimental import pallas as pl

    group = h // kv
    row_ids = pl.BlockSpec((None, tp), lambda r, hd, i: (r, 0))
    head_tile = pl.BlockSpec((None, tile, None, d), lambda r, hd, i: (r, i, hd, 0))
    head_all = pl.BlockSpec((None, tp, None, d), lambda r, hd, i: (r, 0, hd, 0))
    kv_all = pl.BlockSpec((None, tp, None, d), lambda r, hd, i: (r, 0, hd // group, 0))
    kv_tile = pl.BlockSpec((None, tile, None, d), lambda r, hd, i: (r, i, hd // group, 0))
    per_query = pl.BlockSpec((None, None, tp), lambda r, hd, i: (r, hd, 0))
    tile_of_query = pl.BlockSpec((None, None, tile), lambda r, hd, i: (r, hd, i))
    return row_ids, head_tile, head_all, kv_all, kv_tile, per_query, tile_of_query


def _call(kernel, name, grid, in_specs, out_specs, out_shape, interpret, d, **static):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pl_triton

    return pl.pallas_call(functools.partial(kernel, **static), out_shape=out_shape, grid=grid, in_specs=in_specs,
                          out_specs=out_specs, interpret=interpret, name=name,
                          compiler_params=pl_triton.CompilerParams(num_warps=4 if d <= 64 else 8, num_stages=2))


def _pad(x, tp, value=0):
    t = x.shape[1]
    return x if t == tp else jnp.pad(x, [(0, 0), (0, tp - t)] + [(0, 0)] * (x.ndim - 2), constant_values=value)


def _kernel_static(opts: dict, tile: int) -> dict:
    return dict(scale=opts["scale"], softcap=opts["softcap"], window=opts["window"], segments=opts["segments"],
                tile=tile)


def _forward(q, k, v, positions, segment_ids, opts):
    """(out f32 (B, T, H, D), lse (B, H, Tp), the padded operands) of the forward kernel; queries that see
    nothing are left zero (lse +inf)."""
    b, t, h, d = q.shape
    kv = k.shape[2]
    tile = tile_size(t, opts["tile"])
    tp = -(-t // tile) * tile
    pos = _pad(positions.astype(jnp.int32), tp, -1)
    seg = pos if segment_ids is None else _pad(segment_ids.astype(jnp.int32), tp)  # unread without segments
    qp, kp, vp = (_pad(x, tp) for x in (q, k, v))
    row_ids, head_tile, _, kv_all, _, _, tile_of_query = _specs(tp, h, kv, d, tile)
    out, lse = _call(_fwd_kernel, "tunix_rt_attention_fwd", (b, h, tp // tile),
                     [row_ids, row_ids, head_tile, kv_all, kv_all], [head_tile, tile_of_query],
                     [jax.ShapeDtypeStruct((b, tp, h, d), jnp.float32), jax.ShapeDtypeStruct((b, h, tp), jnp.float32)],
                     opts["interpret"], d, **_kernel_static(opts, tile))(pos, seg, qp, kp, vp)
    return out[:, :t], lse, (pos, seg, qp, kp, vp)


def _mean_v(v, heads):
    """Each query head's mean of its kv head's values over the row (B, 1, H, D) f32: the reference's output
    for a query that sees no key."""
    mean = jnp.mean(v.astype(jnp.float32), axis=1)  # (B, KV, D)
    return jnp.repeat(mean, heads // v.shape[2], axis=1)[:, None]


def _complete(out, lse, v, heads):
    """The kernels' output with the rows that saw nothing given the mean of the values."""
    empty = jnp.isinf(lse[:, :, : out.shape[1]]).transpose(0, 2, 1)  # (B, T, H)
    return jnp.where(empty[..., None], _mean_v(v, heads), out), empty


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _attention(q, k, v, positions, segment_ids, static):
    return _attention_fwd(q, k, v, positions, segment_ids, static)[0]


def _attention_fwd(q, k, v, positions, segment_ids, static):
    from tunix_rt.ops.attention import SAVED_NAMES  # a remat policy keeps these as it keeps the CPU op's

    out, lse, padded = _forward(q, k, v, positions, segment_ids, dict(static))
    out, lse = checkpoint_name(out, SAVED_NAMES[0]), checkpoint_name(lse, SAVED_NAMES[1])
    out, empty = _complete(out, lse, v, q.shape[2])
    return out.astype(q.dtype), (padded, out, lse, empty)


def _attention_bwd(static, residuals, dout):
    opts = dict(static)
    (pos, seg, qp, kp, vp), out, lse, empty = residuals
    b, tp, h, d = qp.shape
    t, kv = out.shape[1], kp.shape[2]
    tile = tile_size(t, opts["tile"])
    do = dout.astype(qp.dtype)
    delta = _pad(jnp.einsum("bthd,bthd->bth", do.astype(jnp.float32), out), tp).transpose(0, 2, 1)  # (B, H, Tp)
    dop = _pad(do, tp)
    row_ids, head_tile, head_all, kv_all, kv_tile, per_query, _ = _specs(tp, h, kv, d, tile)
    kernel_static = _kernel_static(opts, tile)
    f32 = jnp.float32
    dk, dv = _call(_dkv_kernel, "tunix_rt_attention_dkv", (b, h, tp // tile),
                   [row_ids, row_ids, head_all, kv_tile, kv_tile, head_all, per_query, per_query],
                   [head_tile, head_tile], [jax.ShapeDtypeStruct((b, tp, h, d), f32)] * 2, opts["interpret"], d,
                   **kernel_static)(pos, seg, qp, kp, vp, dop, lse, delta)
    dq = _call(_dq_kernel, "tunix_rt_attention_dq", (b, h, tp // tile),
               [row_ids, row_ids, head_tile, kv_all, kv_all, head_tile, per_query, per_query], head_tile,
               jax.ShapeDtypeStruct((b, tp, h, d), f32), opts["interpret"], d,
               **kernel_static)(pos, seg, qp, kp, vp, dop, lse, delta)
    group = h // kv
    dk = dk[:, :t].reshape(b, t, kv, group, d).sum(3)
    dv = dv[:, :t].reshape(b, t, kv, group, d).sum(3)
    # the rows that saw nothing took the mean of v: each gives every key 1/T of its dO
    spread = jnp.sum(jnp.where(empty[..., None], do.astype(f32), 0.0), axis=1).reshape(b, kv, group, d).sum(2) / t
    dv = dv + spread[:, None]
    return (dq[:, :t].astype(qp.dtype), dk.astype(kp.dtype), dv.astype(vp.dtype), None, None)


_attention.defvjp(_attention_fwd, _attention_bwd)


def attention_pallas(q, k, v, positions, segment_ids=None, *, scale: float, window: int | None = None,
                     softcap: float | None = None, interpret: bool = False, tile: int | None = None):
    """The op's self-attention as Pallas kernels, differentiable in q, k and v; arguments as `attention`'s
    (checked there). `tile` overrides `tile_size`'s rows per tile."""
    tile_size(q.shape[1], tile)  # a bad tile is refused here, before any tracing
    static = (("scale", float(scale)), ("window", window), ("softcap", softcap), ("interpret", bool(interpret)),
              ("segments", segment_ids is not None), ("tile", tile))
    return _attention(q, k, v, positions, segment_ids, static)
