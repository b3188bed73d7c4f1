"""A dense per-sequence KV cache: the reference generator's cache (the engine uses paged blocks).

Slots are written in order at one shared index for the whole batch (prompts are left-padded), and
each slot keeps the absolute position of its token, -1 while empty, which is all attention needs
to build its mask.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


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

    def with_positions(self, positions: jax.Array) -> "DenseKVCache":
        """Record the positions of the T tokens about to be written at `index`."""
        new = jax.lax.dynamic_update_slice(self.positions, positions.astype(jnp.int32), (0, self.index))
        return dataclasses.replace(self, positions=new)

    def write(self, layer: int, k: jax.Array, v: jax.Array) -> tuple["DenseKVCache", jax.Array, jax.Array]:
        """Store this step's k/v (B, T, KV, D) for `layer`; return the cache and the layer's full k/v."""
        start = (0, self.index, 0, 0)
        layer_k = jax.lax.dynamic_update_slice(self.k[layer], k.astype(self.k[layer].dtype), start)
        layer_v = jax.lax.dynamic_update_slice(self.v[layer], v.astype(self.v[layer].dtype), start)
        new_k = self.k[:layer] + (layer_k,) + self.k[layer + 1:]
        new_v = self.v[:layer] + (layer_v,) + self.v[layer + 1:]
        return dataclasses.replace(self, k=new_k, v=new_v), layer_k, layer_v

    def advance(self, steps: int) -> "DenseKVCache":
        return dataclasses.replace(self, index=self.index + steps)
