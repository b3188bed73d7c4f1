"""Gradient checkpointing that saves memory on XLA:CPU as well.

jax.checkpoint keeps the recomputation apart from the forward pass with an optimization barrier, and
XLA:CPU expands that barrier away before it schedules: the recomputed forward is hoisted next to the
original, every activation stays alive, and the step only gets slower (measured on a 30-layer MLP of
2048 tokens: temp memory 1291 -> 1287 MB, time +8%). Here the backward recomputes a layer from its
saved inputs offset by a zero taken from the incoming cotangent, so the recomputation cannot start
before the backward reaches the layer (1291 -> 201 MB, time +2%, gradients bit-identical).
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero


def recompute_in_backward(f: Callable, state, x: jax.Array, consts: tuple = ()):
    """f(state, x, *consts) -> y, keeping only `state`, `x` and `consts` for the backward, which runs
    f again. Cotangents are formed for the state leaves and x being differentiated only (a LoRA
    layer's frozen kernels get no weight gradient); `consts` are never differentiated."""
    leaves, treedef = jax.tree.flatten(state)
    return _remat(lambda leaves, x, *consts: f(treedef.unflatten(leaves), x, *consts), leaves, x, consts)


def tie(tree, to: jax.Array):
    """`tree`'s float leaves offset by a zero XLA cannot fold away (min(|v|, 0) of one element of `to`):
    whatever is computed from them waits for `to`. XLA:CPU schedules work that depends on parameters
    only (a bf16 cast of a layer's f32 weights) at the start of the step, so every layer's copy would be
    alive at once. A non-finite element makes the result NaN, which it would be anyway downstream."""
    zero = jnp.minimum(jnp.abs(to.reshape(-1)[0]), 0)
    return jax.tree.map(lambda v: v + zero.astype(v.dtype) if jnp.issubdtype(v.dtype, jnp.floating) else v, tree)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _remat(f, leaves, x, consts):
    return f(leaves, x, *consts)


def _value(p):
    return p.value if isinstance(p, CustomVJPPrimal) else p


def _fwd(f, leaves, x, consts):
    values = [_value(p) for p in leaves]
    # Which leaves are differentiated, as arrays and Nones (residuals must be arrays): None where not.
    perturbed = [v if p.perturbed else None for p, v in zip(leaves, values)]
    x_value = _value(x)
    const_values = jax.tree.map(_value, consts, is_leaf=lambda p: isinstance(p, CustomVJPPrimal))
    return f(values, x_value, *const_values), (values, perturbed, x_value, const_values)


def _bwd(f, res, ct):
    values, perturbed, x, consts = res
    if isinstance(ct, SymbolicZero):
        return [None] * len(values), None, jax.tree.map(lambda _: None, consts)
    which = [i for i, v in enumerate(perturbed) if v is not None]

    def g(diff, x):
        full = list(values)
        for i, v in zip(which, diff):
            full[i] = v
        return f(full, x, *consts)

    # x tied to the cotangent: the recomputation waits until the layer above has produced its gradient.
    _, vjp = jax.vjp(g, [values[i] for i in which], tie(x, ct))
    d_diff, dx = vjp(ct)
    d_leaves = [None] * len(values)
    for i, d in zip(which, d_diff):
        d_leaves[i] = d
    return d_leaves, dx, jax.tree.map(lambda _: None, consts)


_remat.defvjp(_fwd, _bwd, symbolic_zeros=True)
