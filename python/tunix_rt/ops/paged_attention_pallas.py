"""Paged attention as a Pallas kernel: the path `paged_attention` takes on CUDA GPUs (Triton lowering),
and on any platform in interpret mode (`TUNIX_RT_KERNELS=interpret`), where the tests check it.

Same layout and rule as the op (tunix_rt.ops.paged_attention): packed query tokens, each tagged with
its sequence and position, read their sequence's keys through the block table, with a sliding window,
softcap and GQA. JAX's own GPU paged-attention kernel takes one query per sequence over a
(kv_heads, pages, page, head_dim) cache; the engine packs prefill chunks and decode tokens into one
step over a (blocks, block, kv_heads, head_dim) cache, so this kernel walks that layout instead.

One program per (query token, kv head, split): it loads the token's group of query heads once, walks its
share of the token's visible blocks a few at a time (`launch_shape`) with an online softmax in f32, and writes
the group's output, or, where the blocks are split over several programs, its partial softmax for a fold
after the kernel. A device kernel
cannot raise, so a block id read from the table is clamped into the pool: never an out-of-bounds read
(the CPU op raises instead; the engine's own tables only ever hold ids of its pool). Triton needs
power-of-two tensor shapes: block_size and head_dim must be powers of two (`supported` says whether a cache
qualifies); the group of query heads is padded to a tile of Triton's dot.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# Pallas (and its Triton backend) is imported where a kernel is traced, not with this module: the import
# costs ~0.1 s, a twentieth of a warm `generate`, which on a CPU host never traces this kernel.


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def supported(k_cache) -> bool:
    """Whether the kernel can run over this cache: power-of-two block_size and head_dim (Triton)."""
    return _pow2(k_cache.shape[1]) and _pow2(k_cache.shape[3])


# Triton's dot needs every side of a tile to be at least 16.
_MIN_TILE = 16
# Keys one loop step loads: 32 measured best on one H100 (bf16, head dim 128; 16 keys 1.5x slower, 64 keys ten
# times slower: the step's tiles no longer fit the registers). benchmarks/device_check.py's attention part sweeps it.
_KEYS_PER_STEP = 32
# Programs to keep in flight: an H100 has 132 multiprocessors, each running several programs; a decode step of
# few sequences at long context measured fastest split to ~500-2000 programs.
_TARGET_PROGRAMS = 1024


def launch_shape(tokens: int, kv_heads: int, block_size: int, max_blocks: int, blocks_per_step: int | None = None,
                 splits: int | None = None, interpret: bool = False) -> tuple[int, int]:
    """(blocks_per_step, splits): how many cache blocks one loop step loads (at least 16 keys, a tile of
    Triton's dot), and into how many parts each token's blocks are split (flash-decoding: few tokens with long
    contexts get enough programs to fill the device; a step of many tokens already does). Interpret mode runs
    the programs one after another, so there more splits only cost time: two keep the fold exercised."""
    if blocks_per_step is None:
        blocks_per_step = _KEYS_PER_STEP // block_size
    blocks_per_step = max(blocks_per_step, _MIN_TILE // block_size, 1)
    steps = -(-max_blocks // blocks_per_step)  # loop steps of one token's whole row
    if splits is None:
        splits = 2 if interpret else -(-_TARGET_PROGRAMS // max(tokens * kv_heads, 1))
    return blocks_per_step, max(1, min(splits, steps))


def _kernel(seq_ref, pos_ref, until_ref, tables_ref, q_ref, k_ref, v_ref, *out_refs, scale, softcap, window,
            blocks_per_step, splits):
    from jax.experimental import pallas as pl

    t, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    num_blocks, block_size = k_ref.shape[0], k_ref.shape[1]
    max_blocks = tables_ref.shape[1] - blocks_per_step  # the table arrives padded by one step
    seq, pos, until = seq_ref[t], pos_ref[t], until_ref[t]  # keys [start, until]: until >= pos (an image's end)
    real = seq >= 0
    row = jnp.maximum(seq, 0)
    start = jnp.maximum(pos - window + 1, 0) if window else 0
    first = start // block_size
    last = jnp.where(real & (pos >= 0), jnp.minimum(until // block_size + 1, max_blocks), first)
    # this program's share of the token's blocks: whole loop steps, the last share possibly short or empty
    per_split = pl.cdiv(pl.cdiv(jnp.maximum(last - first, 0), blocks_per_step), splits) * blocks_per_step
    lo = first + s * per_split
    hi = jnp.minimum(lo + per_split, last)
    keys = blocks_per_step * block_size
    exact = jax.lax.Precision.HIGHEST  # f32 tiles: IEEE products, not TF32
    q = q_ref[...]  # (G, D): the token's query heads of this kv head, padded to a tile
    head = (slice(None), h) if k_ref.ndim == 4 else ()  # the whole cache, or kv head h's view of it

    def body(i, carry):
        acc, m, total = carry
        j = lo + i * blocks_per_step
        ids = jnp.clip(tables_ref[row, pl.ds(j, blocks_per_step)], 0, num_blocks - 1)
        k = k_ref[(ids, *head)].reshape(keys, -1)  # (B*BS, D)
        v = v_ref[(ids, *head)].reshape(keys, -1)
        k_pos = j * block_size + jnp.arange(keys)
        visible = (k_pos <= until) & (k_pos < hi * block_size)  # hi: a position past its row reads no padding
        if window:
            visible &= pos - k_pos < window
        qk, kk = (q, k) if q.dtype == k.dtype else (q.astype(jnp.float32), k.astype(jnp.float32))
        sc = jax.lax.dot_general(qk, kk, (((1,), (1,)), ((), ())), precision=exact,
                                 preferred_element_type=jnp.float32) * scale  # (G, B*BS)
        if softcap:
            sc = jnp.tanh(sc / softcap) * softcap
        sc = jnp.where(visible[None, :], sc, jnp.finfo(jnp.float32).min)
        m_next = jnp.maximum(m, jnp.max(sc, axis=-1))
        p = jnp.where(visible[None, :], jnp.exp(sc - m_next[:, None]), 0.0)
        correction = jnp.exp(m - m_next)
        v = jnp.where(visible[:, None], v.astype(jnp.float32), 0.0)  # an unwritten slot may hold NaN: 0 x NaN is NaN
        pv = jax.lax.dot_general(p, v, (((1,), (0,)), ((), ())), precision=exact, preferred_element_type=jnp.float32)
        return acc * correction[:, None] + pv, m_next, total * correction + jnp.sum(p, axis=-1)

    g, d = q.shape
    init = (jnp.zeros((g, d), jnp.float32), jnp.full((g,), jnp.finfo(jnp.float32).min, jnp.float32),
            jnp.zeros((g,), jnp.float32))
    acc, m, total = jax.lax.fori_loop(0, pl.cdiv(jnp.maximum(hi - lo, 0), blocks_per_step), body, init)
    if splits == 1:
        (o_ref,) = out_refs
        o_ref[...] = _normalize(acc, total).astype(o_ref.dtype)
    else:  # partial results, combined outside the kernel
        acc_ref, m_ref, total_ref = out_refs
        acc_ref[...], m_ref[...], total_ref[...] = acc, m, total


def _normalize(acc, total):
    """The softmax-weighted sum acc / total; zero for a query that saw no key (padding)."""
    return jnp.where(total[..., None] > 0, acc / jnp.maximum(total, 1e-30)[..., None], 0.0)


def _combine(acc, m, total):
    """Folds the splits' partial softmaxes (axis 2) into one: each rescaled to the common maximum."""
    top = jnp.max(m, axis=2, keepdims=True)
    w = jnp.exp(m - top)  # an empty split: m is the float minimum, its weight 0 (or 1 with total 0, if all are)
    return _normalize(jnp.sum(w[..., None] * acc, axis=2), jnp.sum(w * total, axis=2))


@functools.partial(jax.jit, static_argnames=("scale", "softcap", "window", "interpret", "blocks_per_step", "splits"))
def paged_attention_pallas(q, k_cache, v_cache, block_tables, token_seq, token_pos, token_until=None, *, scale: float,
                           softcap: float | None = None, window: int | None = None, interpret: bool = False,
                           blocks_per_step: int | None = None, splits: int | None = None):
    """The op's forward as a Pallas kernel; arguments as `paged_attention`'s (checked there).
    blocks_per_step and splits override `launch_shape`'s choice (benchmarks/device_check.py sweeps them)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pl_triton

    t, heads, d = q.shape
    num_blocks, block_size, kv, _ = k_cache.shape
    group = heads // kv
    token_until = token_pos if token_until is None else token_until
    padded = max(_next_pow2(group), _MIN_TILE)
    step, splits = launch_shape(t, kv, block_size, block_tables.shape[1], blocks_per_step, splits, interpret)
    qg = q.reshape(t, kv, group, d)
    if padded != group:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, padded - group), (0, 0)))
    tables = jnp.pad(block_tables, ((0, 0), (0, step)))  # a step starting at the row's last block reads past it
    whole = pl.BlockSpec()  # no blocking: the kernel indexes the whole array
    # On the device each program sees kv head j's view of the cache (the layout the device check timed); the
    # interpreter would copy that view for every program, so there the kernel indexes the head itself.
    cache = whole if interpret else pl.BlockSpec((num_blocks, block_size, None, d), lambda i, j, s: (0, 0, j, 0))
    query_rows = pl.BlockSpec((None, None, padded, d), lambda i, j, s: (i, j, 0, 0))  # a (token, kv head)'s group
    if splits == 1:
        out_shape = [jax.ShapeDtypeStruct(qg.shape, q.dtype)]
        out_specs = [query_rows]
    else:
        f32 = jnp.float32
        out_shape = [jax.ShapeDtypeStruct((t, kv, splits, padded, d), f32),
                     jax.ShapeDtypeStruct((t, kv, splits, padded), f32), jax.ShapeDtypeStruct((t, kv, splits, padded), f32)]
        rows = pl.BlockSpec((None, None, None, padded, d), lambda i, j, s: (i, j, s, 0, 0))
        scalar = pl.BlockSpec((None, None, None, padded), lambda i, j, s: (i, j, s, 0))
        out_specs = [rows, scalar, scalar]
    out = pl.pallas_call(
        functools.partial(_kernel, scale=scale, softcap=softcap, window=window, blocks_per_step=step, splits=splits),
        out_shape=out_shape,
        grid=(t, kv, splits),
        in_specs=[whole, whole, whole, whole, query_rows, cache, cache],
        out_specs=out_specs,
        interpret=interpret,
        compiler_params=pl_triton.CompilerParams(num_warps=4, num_stages=2),  # Triton, not Mosaic GPU
        name="tunix_rt_paged_attention",
    )(token_seq, token_pos, token_until, tables, qg, k_cache, v_cache)
    out = out[0] if splits == 1 else _combine(*out).astype(q.dtype)
    return out[:, :, :group].reshape(t, heads, d)
