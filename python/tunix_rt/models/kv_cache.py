"""The decoder's KV caches. Each implements the three calls the decoder makes per forward pass:
`begin(positions)`, `attend(layer, q, k, v, positions, ...)` per layer, and `end(num_tokens)`.

DenseKVCache is the reference generator's per-sequence cache: slots are written in order at one
shared index for the whole batch (prompts are left-padded), and each slot keeps the absolute
position of its token, -1 while empty, which is all attention needs to build its mask.
PagedKVCache is the engine's: per-layer block pools plus the step's slot mapping and block tables,
served by the write_kv / paged_attention FFI ops.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from tunix_rt.ops._ffi import zero_cotangent
from tunix_rt.ops.attention import attention, attention_mask, dot_product_attention
from tunix_rt.ops.paged_attention import paged_attention, write_kv


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseKVCache:
    k: tuple[jax.Array, ...]  # per layer (B, S, KV, D): separate buffers keep updates cheap to compile
    v: tuple[jax.Array, ...]
    positions: jax.Array  # (B, S) int32, -1 = empty
    index: jax.Array  # () int32: the next slot to write

    @classmethod
    def create(cls, num_layers: int, batch: int, max_len: int, num_kv_heads: int, head_dim: int, dtype) -> "DenseKVCache":
        shape = (batch, max_len, num_kv_heads, head_dim)
        return cls(
            k=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
            v=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
            positions=jnp.full((batch, max_len), -1, jnp.int32),
            index=jnp.zeros((), jnp.int32),
        )

    @property
    def max_len(self) -> int:
        return self.positions.shape[1]

    def begin(self, positions: jax.Array) -> "DenseKVCache":
        """Record the positions of the T tokens about to be written at `index`."""
        new = jax.lax.dynamic_update_slice(self.positions, positions.astype(jnp.int32), (0, self.index))
        return dataclasses.replace(self, positions=new)

    def attend(self, layer: int, q, k, v, positions, *, window, scale, softcap) -> tuple["DenseKVCache", jax.Array]:
        """Store this step's k/v (B, T, KV, D) for `layer`, then attend q (B, T, H, D) over the layer's cache."""
        start = (0, self.index, 0, 0)
        layer_k = jax.lax.dynamic_update_slice(self.k[layer], k.astype(self.k[layer].dtype), start)
        layer_v = jax.lax.dynamic_update_slice(self.v[layer], v.astype(self.v[layer].dtype), start)
        mask = attention_mask(positions, self.positions, window)
        out = dot_product_attention(q, layer_k, layer_v, mask, scale=scale, softcap=softcap)
        cache = dataclasses.replace(self, k=_replace(self.k, layer, layer_k), v=_replace(self.v, layer, layer_v))
        return cache, out

    def end(self, num_tokens: int) -> "DenseKVCache":
        return dataclasses.replace(self, index=self.index + num_tokens)


def _replace(buffers: tuple, i: int, new) -> tuple:
    return buffers[:i] + (new,) + buffers[i + 1:]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    """One engine step's view of the block pools: tokens arrive packed as a (1, T) batch.

    slots (T,): where each token's k/v goes (-1 = padding); token_seq (T,): the row of
    block_tables (S, max_blocks) each token belongs to (-1 = padding). The pools are updated in
    place by write_kv when the engine's jitted step donates them.

    The RL trainer's exact mode (train/rl_trainer.paged_hidden) gives the last three fields: copy_src /
    copy_slots (C,) write token copy_src[i]'s k/v a second time, at copy_slots[i] (-1 = none), as it lays a
    group's completions out as sequences sharing the prompt, each holding its own copy of the prompt's last,
    partly filled block; segment_ids (R, L) are the packed rows'. Its forward is the engine's paged attention
    (its numbers); its gradient the training attention's over the packed rows (ops/attention.py), whose
    backward keeps no per-query copies of the keys, as paged_attention's reference backward does.
    """

    k: tuple[jax.Array, ...]  # per layer (num_blocks, block_size, KV, D)
    v: tuple[jax.Array, ...]
    slots: jax.Array
    token_seq: jax.Array
    block_tables: jax.Array
    copy_src: jax.Array | None = None
    copy_slots: jax.Array | None = None
    segment_ids: jax.Array | None = None

    def begin(self, positions: jax.Array) -> "PagedKVCache":
        return self

    def attend(self, layer: int, q, k, v, positions, *, window, scale, softcap) -> tuple["PagedKVCache", jax.Array]:
        if q.shape[0] != 1:
            raise ValueError(f"PagedKVCache takes a step's tokens packed as one row (1, T), got batch {q.shape[0]}")
        if self.segment_ids is not None:  # the trainer's exact mode
            out = _exact_attention(q[0], k[0], v[0], positions[0].astype(jnp.int32), self, layer, window, scale,
                                   softcap)
            return self, out[None]
        layer_k, layer_v, out = _write_and_attend(q[0], k[0], v[0], positions[0].astype(jnp.int32), self.k[layer],
                                                  self.v[layer], self.slots, self.token_seq, self.block_tables,
                                                  None, None, window, scale, softcap)
        cache = dataclasses.replace(self, k=_replace(self.k, layer, layer_k), v=_replace(self.v, layer, layer_v))
        return cache, out[None]

    def end(self, num_tokens: int) -> "PagedKVCache":
        return self


def _write_and_attend(q, k, v, positions, pool_k, pool_v, slots, token_seq, tables, copy_src, copy_slots, window,
                      scale, softcap):
    """The engine's arithmetic: k/v written into the layer's pools (and the copies, if any), then
    paged_attention; returns the updated pools and the attention output."""
    pool_k, pool_v = write_kv(pool_k, pool_v, k.astype(pool_k.dtype), v.astype(pool_v.dtype), slots)
    if copy_src is not None:
        pool_k, pool_v = write_kv(pool_k, pool_v, k[copy_src].astype(pool_k.dtype), v[copy_src].astype(pool_v.dtype),
                                  copy_slots)
    out = paged_attention(q, pool_k, pool_v, tables, token_seq, positions, scale=scale, softcap=softcap, window=window)
    return pool_k, pool_v, out


def _paged(q, k, v, positions, pools, layout, window, scale, softcap):
    """The exact mode's forward: the engine's arithmetic over the trainer's paged layout."""
    slots, token_seq, tables, copy_src, copy_slots, _ = layout
    return _write_and_attend(q, k, v, positions, *pools, slots, token_seq, tables, copy_src, copy_slots, window, scale,
                             softcap)[2]


def _packed(q, k, v, positions, segment_ids, window, scale, softcap):
    """The same attention over the packed training rows (R, L): the training kernel, for the gradient."""
    rows, length = segment_ids.shape
    shape = lambda a: a.reshape(rows, length, *a.shape[1:])
    out = attention(shape(q), shape(k), shape(v), positions.reshape(rows, length), segment_ids, scale=scale,
                    window=window, softcap=softcap)
    return out.reshape(q.shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _exact(q, k, v, positions, pools, layout, window, scale, softcap):
    return _paged(q, k, v, positions, pools, layout, window, scale, softcap)


def _exact_fwd(q, k, v, positions, pools, layout, window, scale, softcap):
    return _paged(q, k, v, positions, pools, layout, window, scale, softcap), (q, k, v, positions, pools, layout)


def _exact_bwd(window, scale, softcap, residuals, g):
    q, k, v, positions, pools, layout = residuals
    _, vjp = jax.vjp(lambda q, k, v: _packed(q, k, v, positions, layout[-1], window, scale, softcap), q, k, v)
    return (*vjp(g), zero_cotangent(positions), jax.tree.map(zero_cotangent, pools),
            jax.tree.map(zero_cotangent, layout))


_exact.defvjp(_exact_fwd, _exact_bwd)


def _exact_attention(q, k, v, positions, cache: PagedKVCache, layer: int, window, scale, softcap):
    layout = (cache.slots, cache.token_seq, cache.block_tables, cache.copy_src, cache.copy_slots, cache.segment_ids)
    return _exact(q, k, v, positions, (cache.k[layer], cache.v[layer]), layout, window, scale, softcap)
