"""Paged attention as a Pallas kernel: the path `paged_attention` takes on CUDA GPUs (Triton lowering),
and on any platform in interpret mode (`TUNIX_RT_KERNELS=interpret`), where the tests check it.

Same layout and rule as the op (tunix_rt.ops.paged_attention): packed query tokens, each tagged with
its sequence and position, read their sequence's keys through the block table, with a sliding window,
softcap and GQA. JAX's own GPU paged-attention kernel takes one query per sequence over a
(kv_heads, pages, page, head_dim) cache; the engine packs prefill chunks and decode tokens into one
step over a (blocks, block, kv_heads, head_dim) cache, so this kernel walks that layout instead.

One program per (query token, kv head): it loads the token's group of query heads once, walks the
token's visible blocks with an online softmax in f32, and writes the group's output. A device kernel
cannot raise, so a block id read from the table is clamped into the pool: never an out-of-bounds read
(the CPU op raises instead; the engine's own tables only ever hold ids of its pool). Triton needs
power-of-two tensor shapes: block_size and head_dim must be powers of two (`supported` says whether a cache
qualifies); the group of query heads is padded to one.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# Pallas (and its Triton backend) is imported where a kernel is traced, not with this module: the import
# costs ~0.1 s, a twentieth of a warm `generate`, which on a CPU host never traces this kernel.


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def supported(k_cache) -> bool:
    """Whether the kernel can run over this cache: power-of-two block_size and head_dim (Triton)."""
    return _pow2(k_cache.shape[1]) and _pow2(k_cache.shape[3])


def _kernel(seq_ref, pos_ref, tables_ref, q_ref, k_ref, v_ref, o_ref, *, scale, softcap, window):
    from jax.experimental import pallas as pl

    t, h = pl.program_id(0), pl.program_id(1)
    num_blocks, block_size = k_ref.shape[0], k_ref.shape[1]
    max_blocks = tables_ref.shape[1]
    seq, pos = seq_ref[t], pos_ref[t]
    real = seq >= 0
    row = jnp.maximum(seq, 0)
    start = jnp.maximum(pos - window + 1, 0) if window else 0
    first = start // block_size
    last = jnp.where(real & (pos >= 0), jnp.minimum(pos // block_size + 1, max_blocks), first)
    q = q_ref[...].astype(jnp.float32)  # (G, D)

    def body(j, carry):
        acc, m, total = carry
        block = jnp.clip(tables_ref[row, j], 0, num_blocks - 1)
        k = k_ref[block, :, h, :].astype(jnp.float32)  # (BS, D)
        v = v_ref[block, :, h, :].astype(jnp.float32)
        k_pos = j * block_size + jnp.arange(block_size)
        visible = k_pos <= pos
        if window:
            visible &= pos - k_pos < window
        s = jnp.sum(q[:, None, :] * k[None, :, :], axis=-1) * scale  # (G, BS)
        if softcap:
            s = jnp.tanh(s / softcap) * softcap
        s = jnp.where(visible[None, :], s, jnp.finfo(jnp.float32).min)
        m_next = jnp.maximum(m, jnp.max(s, axis=-1))
        p = jnp.where(visible[None, :], jnp.exp(s - m_next[:, None]), 0.0)
        correction = jnp.exp(m - m_next)
        v = jnp.where(visible[:, None], v, 0.0)  # an unwritten slot may hold NaN, and 0 x NaN is NaN
        acc = acc * correction[:, None] + jnp.sum(p[:, :, None] * v[None, :, :], axis=1)
        return acc, m_next, total * correction + jnp.sum(p, axis=-1)

    g, d = q.shape
    init = (jnp.zeros((g, d), jnp.float32), jnp.full((g,), jnp.finfo(jnp.float32).min, jnp.float32),
            jnp.zeros((g,), jnp.float32))
    acc, _, total = jax.lax.fori_loop(first, last, body, init)
    o_ref[...] = jnp.where(total[:, None] > 0, acc / jnp.maximum(total, 1e-30)[:, None], 0.0).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "softcap", "window", "interpret"))
def paged_attention_pallas(q, k_cache, v_cache, block_tables, token_seq, token_pos, *, scale: float,
                           softcap: float | None = None, window: int | None = None, interpret: bool = False):
    """The op's forward as a Pallas kernel; arguments as `paged_attention`'s (checked there)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pl_triton

    t, heads, d = q.shape
    kv = k_cache.shape[2]
    group = heads // kv
    padded = max(1 << (group - 1).bit_length(), 1)
    qg = q.reshape(t, kv, group, d)
    if padded != group:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, padded - group), (0, 0)))
    whole = pl.BlockSpec()  # no blocking: the kernel indexes the whole array
    out = pl.pallas_call(
        functools.partial(_kernel, scale=scale, softcap=softcap, window=window),
        out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
        grid=(t, kv),
        in_specs=[
            whole, whole, whole,
            pl.BlockSpec((None, None, padded, d), lambda i, j: (i, j, 0, 0)),
            whole, whole,
        ],
        out_specs=pl.BlockSpec((None, None, padded, d), lambda i, j: (i, j, 0, 0)),
        interpret=interpret,
        compiler_params=pl_triton.CompilerParams(num_warps=4, num_stages=2),  # Triton, not Mosaic GPU
        name="tunix_rt_paged_attention",
    )(token_seq, token_pos, block_tables, qg, k_cache, v_cache)
    return out[:, :, :group].reshape(t, heads, d)
