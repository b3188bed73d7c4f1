"""Paged KV cache ops: `write_kv` scatters a step's K/V into cache blocks, `paged_attention` attends
through block tables.

A cache is (num_blocks, block_size, kv_heads, head_dim), f32 or bf16; slot = block * block_size +
offset. A step's query tokens are packed (T, heads, head_dim), each tagged with its sequence
(`token_seq`, -1 = padding, whose output is zero), absolute position (`token_pos`) and the last position
it sees (`token_until`, its own by default; the end of its image for an image's tokens, which see their
whole image). Token t sees its sequence's keys at positions [start, until], read through
`block_tables[seq, pos // block_size]`, where start is pos - window + 1 on sliding-window layers and 0
otherwise. Writing a chunk's keys before it attends makes the one rule serve decode, chunked prefill and
prefix-cached blocks.

The compiled ops check every block id, sequence id, slot and position and fail with an error
instead of reading out of bounds; the references below (same signatures) are the tests' oracle and
the fallback on platforms without a compiled handler. On CUDA GPUs attention runs as a Pallas kernel
(paged_attention_pallas); writes are XLA's scatter there. Gradients (q and both caches) come from the
reference's vjp: the engine never differentiates through the cache, but training code may.
"""

from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from tunix_rt.ops._ffi import platform_dispatch
from tunix_rt.ops.paged_attention_pallas import paged_attention_pallas
from tunix_rt.ops.paged_attention_pallas import supported as pallas_supported

_WRITE, _ATTEND, _EMPTY = "tunix_rt_write_kv", "tunix_rt_paged_attention", "tunix_rt_empty_kv"
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _check_array(op: str, name: str, a, ndim: int, dtypes) -> None:
    _require(hasattr(a, "shape") and hasattr(a, "dtype"), f"{op}: {name} must be an array, got {type(a).__name__}")
    _require(a.ndim == ndim, f"{op}: {name} must have {ndim} dimensions, got shape {tuple(a.shape)}")
    allowed = " or ".join(str(d) for d in dtypes)
    _require(jnp.dtype(a.dtype) in dtypes, f"{op}: {name} must be {allowed}, got {jnp.dtype(a.dtype)}")


def _check_caches(op: str, k_cache, v_cache) -> None:
    _check_array(op, "k_cache", k_cache, 4, _DTYPES)
    _check_array(op, "v_cache", v_cache, 4, _DTYPES)
    _require(v_cache.shape == k_cache.shape and v_cache.dtype == k_cache.dtype,
             f"{op}: v_cache must match k_cache's shape {tuple(k_cache.shape)} and dtype {k_cache.dtype}, "
             f"got {tuple(v_cache.shape)} {v_cache.dtype}")


def _check_write(k_cache, v_cache, k, v, slots) -> None:
    _check_caches("write_kv", k_cache, v_cache)
    _check_array("write_kv", "k", k, 3, (k_cache.dtype,))
    _require(k.shape[1:] == k_cache.shape[2:],
             f"write_kv: k must be (tokens, {k_cache.shape[2]}, {k_cache.shape[3]}) to match the cache, got {tuple(k.shape)}")
    _check_array("write_kv", "v", v, 3, (k_cache.dtype,))
    _require(v.shape == k.shape, f"write_kv: v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    _check_array("write_kv", "slots", slots, 1, (jnp.dtype(jnp.int32),))
    _require(slots.shape[0] == k.shape[0], f"write_kv: slots must hold one entry per token ({k.shape[0]}), got {slots.shape[0]}")


def _check_empty(shape, dtype) -> tuple[tuple[int, ...], jnp.dtype]:
    _require(isinstance(shape, (tuple, list)) and len(shape) == 4
             and all(isinstance(d, numbers.Integral) and not isinstance(d, bool) and d > 0 for d in shape),
             f"empty_kv_cache: shape must be four positive ints (num_blocks, block_size, kv_heads, head_dim), got {shape!r}")
    try:
        dt = jnp.dtype(dtype)
    except TypeError as e:
        raise ValueError(f"empty_kv_cache: dtype must be float32 or bfloat16, got {dtype!r}") from e
    _require(dt in _DTYPES, f"empty_kv_cache: dtype must be float32 or bfloat16, got {dt}")
    return tuple(int(d) for d in shape), dt


def empty_kv_cache_reference(shape, dtype):
    """K and V pools of `shape` and `dtype`, zeroed."""
    shape, dtype = _check_empty(shape, dtype)
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)


def empty_kv_cache(shape, dtype):
    """K and V pools of `shape` and `dtype` whose contents are unspecified: no output depends on a slot before
    write_kv writes it. The CPU op leaves the pools' pages untouched, so a large pool costs resident memory (and
    the time to fault pages in and clear them) only as its pages are written; elsewhere, and under jax's
    debug_nans / debug_infs (which check every output, and reused memory may hold NaN bits), they are zeros."""
    shape, dtype = _check_empty(shape, dtype)
    if jax.config.jax_debug_nans or jax.config.jax_debug_infs:
        return empty_kv_cache_reference(shape, dtype)
    out = (jax.ShapeDtypeStruct(shape, dtype),) * 2
    return platform_dispatch(_EMPTY, lambda: tuple(jax.ffi.ffi_call(_EMPTY, out)()),
                             lambda: empty_kv_cache_reference(shape, dtype))


def write_kv_reference(k_cache, v_cache, k, v, slots):
    """Rows k[t], v[t] go to cache slot slots[t]; slot -1 skips the token (padding)."""
    _check_write(k_cache, v_cache, k, v, slots)
    nb, bs = k_cache.shape[:2]
    target = jnp.where(slots < 0, nb * bs, slots)  # out of range: dropped

    def put(cache, rows):
        flat = cache.reshape(nb * bs, *cache.shape[2:])
        return flat.at[target].set(rows, mode="drop").reshape(cache.shape)

    return put(k_cache, k), put(v_cache, v)


def _write_kv_ffi(k_cache, v_cache, k, v, slots):
    out = (jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype), jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype))
    call = jax.ffi.ffi_call(_WRITE, out, input_output_aliases={0: 0, 1: 1}, vmap_method="sequential")
    return call(k_cache, v_cache, k, v, slots)


def write_kv(k_cache, v_cache, k, v, slots):
    """Scatter this step's k/v (T, kv_heads, head_dim) into the caches at `slots` (T,) int32.

    The caches are aliased to the outputs: under a jit that donates them, no copy is made.
    """
    _check_write(k_cache, v_cache, k, v, slots)
    return platform_dispatch(_WRITE, _write_kv_with_grad, write_kv_reference, k_cache, v_cache, k, v, slots)


@jax.custom_vjp
def _write_kv_with_grad(k_cache, v_cache, k, v, slots):
    return _write_kv_ffi(k_cache, v_cache, k, v, slots)


def _write_fwd(k_cache, v_cache, k, v, slots):
    return _write_kv_ffi(k_cache, v_cache, k, v, slots), (k_cache, v_cache, k, v, slots)


def _write_bwd(residuals, g):
    k_cache, v_cache, k, v, slots = residuals
    _, vjp = jax.vjp(lambda kc, vc, kk, vv: write_kv_reference(kc, vc, kk, vv, slots), k_cache, v_cache, k, v)
    return (*vjp(g), np.zeros(slots.shape, jax.dtypes.float0))


_write_kv_with_grad.defvjp(_write_fwd, _write_bwd)


def _check_attention(q, k_cache, v_cache, block_tables, token_seq, token_pos, scale, softcap, window,
                     token_until=None) -> None:
    op = "paged_attention"
    _check_caches(op, k_cache, v_cache)
    _check_array(op, "q", q, 3, _DTYPES)
    kv, d = k_cache.shape[2:]
    _require(q.shape[2] == d, f"{op}: q's head_dim {q.shape[2]} must equal the cache's {d}")
    _require(q.shape[1] > 0 and q.shape[1] % kv == 0,
             f"{op}: q's {q.shape[1]} heads must be a positive multiple of the cache's {kv} kv heads")
    i32 = (jnp.dtype(jnp.int32),)
    _check_array(op, "block_tables", block_tables, 2, i32)
    for name, a in (("token_seq", token_seq), ("token_pos", token_pos), ("token_until", token_until)):
        if a is None:
            continue
        _check_array(op, name, a, 1, i32)
        _require(a.shape[0] == q.shape[0], f"{op}: {name} must hold one entry per query token ({q.shape[0]}), got {a.shape[0]}")
    real = lambda x: isinstance(x, (numbers.Real, np.floating, np.integer)) and not isinstance(x, (bool, np.bool_))
    _require(real(scale) and np.isfinite(scale), f"{op}: scale must be a finite number, got {scale!r}")
    _require(softcap is None or (real(softcap) and softcap > 0 and np.isfinite(softcap)),
             f"{op}: softcap must be None or a positive number, got {softcap!r}")
    _require(window is None or (isinstance(window, (numbers.Integral, np.integer)) and not isinstance(window, (bool, np.bool_))
                                and window > 0), f"{op}: window must be None or a positive integer, got {window!r}")


def paged_attention_reference(q, k_cache, v_cache, block_tables, token_seq, token_pos, token_until=None, *,
                              scale: float, softcap: float | None = None, window: int | None = None):
    """Gathers each token's whole block-table row of keys and masks by position (simple, memory-hungry)."""
    _check_attention(q, k_cache, v_cache, block_tables, token_seq, token_pos, scale, softcap, window, token_until)
    t, h, d = q.shape
    nb, bs, kv, _ = k_cache.shape
    seq = jnp.clip(token_seq, 0, block_tables.shape[0] - 1)
    tables = block_tables[seq]  # (T, MB)
    keys = k_cache[tables].reshape(t, tables.shape[1] * bs, kv, d)  # (T, MB*BS, KV, D)
    values = v_cache[tables].reshape(t, tables.shape[1] * bs, kv, d)
    k_pos = jnp.arange(keys.shape[1])[None, :]
    p = token_pos[:, None]
    visible = (k_pos <= (p if token_until is None else token_until[:, None])) & (token_seq[:, None] >= 0)
    if window is not None:
        visible &= p - k_pos < window
    # a reused block's unwritten slots (and padding's block 0, and a pool never written) may hold anything, NaN
    # included; masked scores keep them out of the output, but q's gradient would take 0 x NaN from the keys
    keys = jnp.where(visible[:, :, None, None], keys, jnp.zeros_like(keys))
    qg = q.reshape(t, kv, h // kv, d)
    scores = jnp.einsum("tkgd,tskd->tkgs", qg, keys, preferred_element_type=jnp.float32) * scale
    if softcap is not None:
        scores = jnp.tanh(scores / softcap) * softcap
    scores = jnp.where(visible[:, None, None, :], scores, jnp.finfo(jnp.float32).min)  # finite: clean grads
    probs = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
    probs = jnp.where(visible[:, None, None, :], probs, 0.0)
    probs = probs / jnp.maximum(jnp.sum(probs, axis=-1, keepdims=True), 1e-30)
    values = jnp.where(visible[:, :, None, None], values, jnp.zeros_like(values))
    out = jnp.einsum("tkgs,tskd->tkgd", probs, values.astype(jnp.float32))
    out = jnp.where((token_seq >= 0)[:, None, None, None], out, 0.0)
    return out.reshape(t, h, d).astype(q.dtype)


def _attention_ffi(q, k_cache, v_cache, block_tables, token_seq, token_pos, token_until, scale, softcap, window):
    call = jax.ffi.ffi_call(_ATTEND, jax.ShapeDtypeStruct(q.shape, q.dtype), vmap_method="sequential")
    return call(q, k_cache, v_cache, block_tables, token_seq, token_pos, token_until, scale=np.float32(scale),
                softcap=np.float32(softcap or 0.0), window=np.int64(window or 0))


def _with_reference_vjp(forward):
    """`forward` (the FFI op or the Pallas kernel, neither differentiable) with the reference's gradients."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
    def attend(q, k_cache, v_cache, block_tables, token_seq, token_pos, token_until, scale, softcap, window):
        return forward(q, k_cache, v_cache, block_tables, token_seq, token_pos, token_until, scale, softcap, window)

    def fwd(q, k_cache, v_cache, block_tables, token_seq, token_pos, token_until, scale, softcap, window):
        out = attend(q, k_cache, v_cache, block_tables, token_seq, token_pos, token_until, scale, softcap, window)
        return out, (q, k_cache, v_cache, block_tables, token_seq, token_pos, token_until)

    def bwd(scale, softcap, window, residuals, g):
        q, k_cache, v_cache, block_tables, token_seq, token_pos, token_until = residuals
        ref = functools.partial(paged_attention_reference, block_tables=block_tables, token_seq=token_seq,
                                token_pos=token_pos, token_until=token_until, scale=scale, softcap=softcap,
                                window=window)
        _, vjp = jax.vjp(lambda a, b, c: ref(a, b, c), q, k_cache, v_cache)
        zeros = tuple(np.zeros(x.shape, jax.dtypes.float0) for x in (block_tables, token_seq, token_pos, token_until))
        return (*vjp(g), *zeros)

    attend.defvjp(fwd, bwd)
    return attend


_attention_with_grad = _with_reference_vjp(_attention_ffi)


@functools.cache
def _pallas_with_grad(interpret: bool):
    def forward(q, k_cache, v_cache, block_tables, token_seq, token_pos, token_until, scale, softcap, window):
        return paged_attention_pallas(q, k_cache, v_cache, block_tables, token_seq, token_pos, token_until,
                                      scale=scale, softcap=softcap, window=window, interpret=interpret)

    return _with_reference_vjp(forward)


def paged_attention(q, k_cache, v_cache, block_tables, token_seq, token_pos, token_until=None, *, scale: float,
                    softcap: float | None = None, window: int | None = None):
    """Attention of packed query tokens q (T, heads, head_dim) over their sequences' cached keys.

    block_tables (S, max_blocks) int32; token_seq, token_pos (T,) int32; token_until (T,) int32 >= token_pos,
    the last position each token sees (None: its own). GQA/MQA when heads is a multiple of the cache's kv
    heads; `softcap` applies tanh capping to the scaled scores; `window` limits each query to the `window`
    positions up to its own. Output: (T, heads, head_dim) in q's dtype.
    """
    _check_attention(q, k_cache, v_cache, block_tables, token_seq, token_pos, scale, softcap, window, token_until)
    if token_until is None:
        token_until = token_pos
    scale = float(scale)
    softcap = None if softcap is None else float(softcap)
    window = None if window is None else int(window)
    reference = functools.partial(paged_attention_reference, scale=scale, softcap=softcap, window=window)
    pallas = None
    if pallas_supported(k_cache):
        pallas = lambda *a, interpret: _pallas_with_grad(interpret)(*a, scale, softcap, window)  # noqa: E731
    return platform_dispatch(_ATTEND, lambda *a: _attention_with_grad(*a, scale, softcap, window), reference,
                             q, k_cache, v_cache, block_tables, token_seq, token_pos, token_until, cuda=pallas)
