"""The decoder's KV caches. Each implements the three calls the decoder makes per forward pass:
`begin(positions)`, `attend(layer, q, k, v, positions, ...)` per layer, and `end(num_tokens)`.

DenseKVCache is the reference generator's per-sequence cache: slots are written in order at one
shared index for the whole batch (prompts are left-padded), and each slot keeps the absolute
position of its token, -1 while empty, which is all attention needs to build its mask.
PagedKVCache is the engine's: the block pools of every layer plus the step's slot mapping and block
tables, served by the write_kv / paged_attention FFI ops.

Both hold every layer's buffers in one array and `attend` takes the layer's index traced (the decoder scans
its layers). The paged pools are one pool of every layer's blocks, layer after layer (KVLayout): the ops
index it with the layer's block and slot indices offset, in place. (A pool stacked on a leading layer axis
and reshaped for the ops would be copied whole by XLA at every layer of the scan.) Layers fall in KV groups
by attention type (full; a sliding window of W): each group has its own block tables and as many blocks per
layer as it needs, so a sliding-window layer holds only the blocks its window reaches (engine/
kv_cache_manager.py frees the rest).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from tunix_rt.ops._ffi import zero_cotangent
from tunix_rt.ops.attention import attention, attention_mask, dot_product_attention
from tunix_rt.ops.paged_attention import paged_attention, write_kv


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseKVCache:
    k: jax.Array  # (layers, B, S, KV, D)
    v: jax.Array
    positions: jax.Array  # (B, S) int32, -1 = empty
    index: jax.Array  # () int32: the next slot to write

    @classmethod
    def create(cls, num_layers: int, batch: int, max_len: int, num_kv_heads: int, head_dim: int, dtype) -> "DenseKVCache":
        shape = (num_layers, batch, max_len, num_kv_heads, head_dim)
        return cls(
            k=jnp.zeros(shape, dtype),
            v=jnp.zeros(shape, dtype),
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

    def attend(self, layer, q, k, v, positions, *, window, scale, softcap,
               attend_until=None) -> tuple["DenseKVCache", jax.Array]:
        """Store this step's k/v (B, T, KV, D) for `layer`, then attend q (B, T, H, D) over the layer's cache
        (`attend_until`: see ops.attention.attention_mask)."""
        start = (layer, 0, self.index, 0, 0)
        all_k = jax.lax.dynamic_update_slice(self.k, k.astype(self.k.dtype)[None], start)
        all_v = jax.lax.dynamic_update_slice(self.v, v.astype(self.v.dtype)[None], start)
        mask = attention_mask(positions, self.positions, window, attend_until=attend_until)
        read = lambda a: jax.lax.dynamic_index_in_dim(a, layer, keepdims=False)
        out = dot_product_attention(q, read(all_k), read(all_v), mask, scale=scale, softcap=softcap)
        return dataclasses.replace(self, k=all_k, v=all_v), out

    def end(self, num_tokens: int) -> "DenseKVCache":
        return dataclasses.replace(self, index=self.index + num_tokens)


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """Where each layer's blocks sit in the engine's pools. `windows[g]`: KV group g's sliding window (None: full
    attention); `layer_group[l]`: layer l's group; `blocks[g]`: blocks per layer of group g. Layer l's block b
    is the pools' block bases[l] + b."""

    windows: tuple[int | None, ...]
    layer_group: tuple[int, ...]
    blocks: tuple[int, ...]

    @classmethod
    def of(cls, config, num_blocks: int, window_blocks: Callable[[int], int] | None = None) -> "KVLayout":
        """One group per attention type of `config`'s layers, a full group with `num_blocks` per layer and a
        window W's with window_blocks(W), when `window_blocks` is given; else one group of `num_blocks`."""
        windows = tuple(dict.fromkeys(config.window(layer) for layer in range(config.num_layers)))
        if window_blocks is None or windows == (None,):
            return cls((None,), (0,) * config.num_layers, (num_blocks,))
        windows = tuple(sorted(windows, key=lambda w: (w is not None, w or 0)))  # the full group first, if any
        layer_group = tuple(windows.index(config.window(layer)) for layer in range(config.num_layers))
        return cls(windows, layer_group, tuple(num_blocks if w is None else window_blocks(w) for w in windows))

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def bases(self) -> tuple[int, ...]:
        out, at = [], 0
        for g in self.layer_group:
            out.append(at)
            at += self.blocks[g]
        return tuple(out)

    @property
    def total_blocks(self) -> int:
        return sum(self.blocks[g] for g in self.layer_group)

    def group_layers(self, g: int) -> int:
        return self.layer_group.count(g)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    """One engine step's view of the block pools: tokens arrive packed as a (1, T) batch.

    k, v (layout.total_blocks, block_size, KV, D): every layer's blocks (KVLayout). slots (G, T): where each
    token's k/v goes in a layer of KV group g (-1 = padding); token_seq (T,): the row of block_tables
    (G, S, max_blocks) each token belongs to (-1 = padding); both index one layer's blocks. The pools are updated
    in place by write_kv when the engine's jitted step donates them.
    """

    k: jax.Array
    v: jax.Array
    slots: jax.Array
    token_seq: jax.Array
    block_tables: jax.Array
    layout: KVLayout = dataclasses.field(metadata=dict(static=True))

    def begin(self, positions: jax.Array) -> "PagedKVCache":
        return self

    def attend(self, layer, q, k, v, positions, *, window, scale, softcap,
               attend_until=None) -> tuple["PagedKVCache", jax.Array]:
        """`attend_until` (1, T): the last position each token sees (an image's tokens: its end); None: its own."""
        _check_packed("PagedKVCache", q)
        layout = self.layout
        if layout.num_groups == 1:
            group, base = 0, jnp.asarray(layer, jnp.int32) * layout.blocks[0]
        else:
            group = jnp.asarray(layout.layer_group, jnp.int32)[layer]
            base = jnp.asarray(layout.bases, jnp.int32)[layer]
        all_k, all_v, out = _write_and_attend(q[0], k[0], v[0], positions[0].astype(jnp.int32), self.k, self.v, base,
                                              self.slots[group], self.token_seq, self.block_tables[group], None, None,
                                              window, scale, softcap,
                                              None if attend_until is None else attend_until[0].astype(jnp.int32))
        return dataclasses.replace(self, k=all_k, v=all_v), out[None]

    def end(self, num_tokens: int) -> "PagedKVCache":
        return self


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ExactPagedLayout:
    """The RL trainer's exact on-policy mode (train/rl_trainer.paged_hidden): packed training rows laid out as
    the engine's block pool, so each layer's forward is the engine's paged attention (its numbers) and its
    gradient the training attention's over the packed rows (ops/attention.py), whose backward keeps no
    per-query copies of the keys, as paged_attention's reference backward does.

    slots / token_seq / block_tables as PagedKVCache's; copy_src / copy_slots (C,) write token copy_src[i]'s
    k/v a second time, at copy_slots[i] (-1 = none), as the layout gives a group's completions, each a
    sequence sharing the prompt, their own copy of the prompt's last, partly filled block; segment_ids (R, L)
    are the packed rows'. Every layer writes a fresh pool of `num_blocks` blocks: nothing outlives the step.
    """

    slots: jax.Array
    token_seq: jax.Array
    block_tables: jax.Array
    copy_src: jax.Array
    copy_slots: jax.Array
    segment_ids: jax.Array
    num_blocks: int = dataclasses.field(metadata=dict(static=True))
    block_size: int = dataclasses.field(metadata=dict(static=True))
    dtype: Any = dataclasses.field(metadata=dict(static=True))

    def begin(self, positions: jax.Array) -> "ExactPagedLayout":
        return self

    def attend(self, layer, q, k, v, positions, *, window, scale, softcap,
               attend_until=None) -> tuple["ExactPagedLayout", jax.Array]:
        if attend_until is not None:
            raise ValueError("exact_on_policy training does not run images (their tokens' two-way attention) yet")
        _check_packed("ExactPagedLayout", q)
        pool = jnp.zeros((self.num_blocks, self.block_size, *k.shape[2:]), self.dtype)
        layout = (self.slots, self.token_seq, self.block_tables, self.copy_src, self.copy_slots, self.segment_ids)
        out = _exact(q[0], k[0], v[0], positions[0].astype(jnp.int32), (pool, pool), layout, window, scale, softcap)
        return self, out[None]

    def end(self, num_tokens: int) -> "ExactPagedLayout":
        return self


def _check_packed(name: str, q) -> None:
    if q.shape[0] != 1:
        raise ValueError(f"{name} takes a step's tokens packed as one row (1, T), got batch {q.shape[0]}")


def _offset(index, by):
    """Block or slot indices of one layer's pool as indices into the pool of all layers (-1, none, stays)."""
    return jnp.where(index >= 0, index + by, index)


def _write_and_attend(q, k, v, positions, pool_k, pool_v, base, slots, token_seq, tables, copy_src,
                      copy_slots, window, scale, softcap, until=None):
    """The engine's arithmetic: k/v written into one layer's blocks of the pools (and the copies, if any), then
    paged_attention; returns the updated pools and the attention output. The layer's block b is the pools'
    block base + b."""
    block_size = pool_k.shape[1]
    base = jnp.asarray(base, jnp.int32)
    pool_k, pool_v = write_kv(pool_k, pool_v, k.astype(pool_k.dtype), v.astype(pool_v.dtype),
                              _offset(slots, base * block_size))
    if copy_src is not None:
        pool_k, pool_v = write_kv(pool_k, pool_v, k[copy_src].astype(pool_k.dtype), v[copy_src].astype(pool_v.dtype),
                                  _offset(copy_slots, base * block_size))
    out = paged_attention(q, pool_k, pool_v, _offset(tables, base), token_seq, positions, until, scale=scale,
                          softcap=softcap, window=window)
    return pool_k, pool_v, out


def _paged(q, k, v, positions, pools, layout, window, scale, softcap):
    """The exact mode's forward: the engine's arithmetic over the trainer's paged layout."""
    slots, token_seq, tables, copy_src, copy_slots, _ = layout
    return _write_and_attend(q, k, v, positions, *pools, 0, slots, token_seq, tables, copy_src, copy_slots, window,
                             scale, softcap)[2]


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

