"""Many LoRA adapters in one model, picked per token: the engine's multi-adapter layers (S-LoRA / Punica's idea).

Each targeted projection holds `slots` adapters of rank up to `rank` side by side: A (in, slots * rank) and
B (slots * rank, out), with each adapter's scaling folded into its B and smaller ranks zero-padded. A step's
tokens carry the slot of their request's adapter (-1: the base model alone). The layer computes
u = x @ A for every slot at once, zeroes the columns of the slots a row does not use, and adds u @ B:
each row gets exactly its own adapter's product (the other slots contribute exact zeros, so a row's numbers
depend neither on its neighbours' adapters nor on what the other slots hold), and a base row gets exactly
the base layer's output. When no row of a step uses an adapter, both products are skipped at run time.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from tunix_rt.models.decoder import Decoder
from tunix_rt.models.lora import ALL_TARGETS, lora_targets, stack_shape
from tunix_rt.ops.matmul import matmul


class AdapterSlots(nnx.Variable):
    """The stacked adapter weights of a multi-adapter layer: written by the engine, never trained."""


class MultiLoRALinear(nnx.Module):
    """Over a layer-stacked base, the slots are stacked alike: A (..., in, slots * rank), B (..., slots * rank, out)."""

    def __init__(self, base: nnx.Module, *, slots: int, rank: int):
        din, dout = base.kernel.get_value().shape[-2:]  # a float array or a QuantizedTensor, both (..., in, out)
        lead = stack_shape(base)
        self.base = base
        self.slots, self.rank = slots, rank
        self.lora_a = AdapterSlots(jnp.zeros((*lead, din, slots * rank), jnp.float32))
        self.lora_b = AdapterSlots(jnp.zeros((*lead, slots * rank, dout), jnp.float32))  # scaling folded in
        self.ids: jax.Array | None = None  # (tokens,) slot per row, -1 = none: set for each traced step
        self.invariant = False  # the engine's row-invariant products (models/batch_invariant.py)

    def __call__(self, x: jax.Array) -> jax.Array:
        y = self.base(x)
        if self.ids is None:
            return y
        flat = x.reshape(-1, x.shape[-1])
        ids = self.ids
        if ids.shape != (flat.shape[0],):
            raise ValueError(f"MultiLoRALinear: ids must have one slot per row ({flat.shape[0]},), got {ids.shape}")
        dot = matmul if self.invariant else (lambda a, b: a @ b)
        a, b = self.lora_a[...].astype(x.dtype), self.lora_b[...].astype(x.dtype)

        def delta():
            u = dot(flat, a)
            own = jnp.arange(self.slots * self.rank) // self.rank == ids[:, None]  # the row's slot's columns
            # behind a barrier: the masked product must not fuse into an FMA with the add, whatever the fusion
            return jax.lax.optimization_barrier(dot(jnp.where(own, u, jnp.zeros_like(u)), b))

        d = jax.lax.cond(jnp.any(ids >= 0), delta, lambda: jnp.zeros((flat.shape[0], b.shape[1]), x.dtype))
        d = jnp.where((ids >= 0)[:, None], d, jnp.zeros_like(d))  # a base row is the base layer, whatever B holds
        return y + d.reshape(*x.shape[:-1], -1).astype(y.dtype)


def with_adapter_slots(model: Decoder, *, slots: int, rank: int) -> Decoder:
    """A copy of `model` (weights shared, not copied) whose every LoRA-targetable projection is a
    MultiLoRALinear of `slots` adapters of rank up to `rank`, all empty."""
    if slots < 1 or rank < 1:
        raise ValueError(f"adapter slots and rank must be positive, got {slots} and {rank}")
    model = nnx.clone(model)
    for owner, name in lora_targets(model, ALL_TARGETS):
        setattr(owner, name, MultiLoRALinear(getattr(owner, name), slots=slots, rank=rank))
    return model


def set_adapter_ids(model: nnx.Module, ids: jax.Array | None) -> None:
    """Give every multi-adapter layer the step's per-row slots (inside the traced step)."""
    for _, module in nnx.iter_modules(model):
        if isinstance(module, MultiLoRALinear):
            module.ids = None if ids is None else nnx.data(ids)
