"""Row-invariant matmul: x @ w whose every row is summed in one order, however many rows share the call.

XLA:CPU's dot picks its blocking by shape, so a row's float sums change with the number of rows beside it:
a request's logits in the engine would depend on its neighbours. `matmul(x, w)` runs tunix-rt's FFI GEMM
(csrc/bf16_matmul.cc): each output is one multiply-add chain per K slab whose depth depends on K alone,
for f32 operands (f32 result) and bf16 ones (f32 sums, bf16 result). `invariant_dot_general` is a
drop-in `dot_general` for nnx.Linear and the tied embedding head that sends their products there; the
engine installs it (models/batch_invariant.py). Gradients go through XLA's dot: the engine never
differentiates, and a trainer that does needs the forward's numbers, not the backward's.

`matmul(x, w, layer=i)` takes w as a stack of layers' weights on a leading axis and multiplies by layer i,
which the FFI op reads in place: a scanned decoder's slice of a stacked weight would be a copy per layer.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from tunix_rt.ops._ffi import has_cpu_target, platform_dispatch, require_array, zero_cotangent

_TARGET = "tunix_rt_bf16_matmul"
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def _check(x, w, transpose_w, layer) -> None:
    for name, arr in (("x", x), ("w", w)):
        if jnp.dtype(require_array("matmul", name, arr).dtype) not in _DTYPES:
            raise ValueError(f"matmul: {name} must be float32 or bfloat16, got {jnp.dtype(arr.dtype)}")
    if jnp.dtype(x.dtype) != jnp.dtype(w.dtype):
        raise ValueError(f"matmul: x and w must have one dtype, got {jnp.dtype(x.dtype)} and {jnp.dtype(w.dtype)}")
    if layer is not None:
        check_layer("matmul", "layer", layer)
        if w.ndim != 3:
            raise ValueError(f"matmul: with a layer, w must be a stack (S, K, N) (or (S, N, K) with transpose_w), "
                             f"got {w.shape}")
        w = jax.ShapeDtypeStruct(w.shape[1:], w.dtype)
    check_product_shapes("matmul", x, w, transpose_w)


def check_layer(op: str, name: str, layer) -> None:
    """A ValueError naming `op` and `name` unless `layer` is an integer scalar (a Python int or an integer array
    of shape ()), the index of a layer in a stacked weight."""
    if isinstance(layer, int) and not isinstance(layer, bool):
        return
    if hasattr(layer, "shape") and hasattr(layer, "dtype"):
        if tuple(layer.shape) == () and jnp.issubdtype(layer.dtype, jnp.integer):
            return
        raise ValueError(f"{op}: {name} must be an integer scalar, got {jnp.dtype(layer.dtype)}{list(layer.shape)}")
    raise ValueError(f"{op}: {name} must be an integer scalar, got {type(layer).__name__}")


def check_product_shapes(op: str, x, w, transpose_w: bool) -> None:
    """x (..., K) against w (K, N), or (N, K) with transpose_w: a ValueError naming `op` otherwise."""
    if x.ndim < 1 or w.ndim != 2:
        raise ValueError(f"{op}: need x (..., K) and w (K, N), got x {x.shape} and w {w.shape}")
    k = w.shape[1] if transpose_w else w.shape[0]
    if x.shape[-1] != k:
        raise ValueError(f"{op}: x's last dimension ({x.shape[-1]}) does not match w's K ({k})")


def matmul_reference(x, w, *, transpose_w=False, layer=None):
    """XLA's dot with f32 sums, in x's dtype (with `layer`, of x and the sliced layer)."""
    _check(x, w, transpose_w, layer)
    if layer is not None:
        w = jax.lax.dynamic_index_in_dim(w, layer, 0, keepdims=False)
    return jnp.matmul(x, w.T if transpose_w else w, preferred_element_type=jnp.float32,
                      precision=jax.lax.Precision.HIGHEST).astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _matmul2d(x, w, layer, transpose_w):
    call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct((x.shape[0], w.shape[-2] if transpose_w else w.shape[-1]),
                                                          x.dtype), vmap_method="sequential")
    return call(x, w, np.int32(0) if layer is None else layer, transpose_a=False, transpose_b=transpose_w)


def _fwd(x, w, layer, transpose_w):
    return _matmul2d(x, w, layer, transpose_w), (x, w, layer)


def _bwd(transpose_w, residuals, dy):
    """The reference's gradients: for a stack, dw is the layer's, placed in zeros for the others."""
    x, w, layer = residuals
    dx, dw = jax.vjp(lambda x, w: matmul_reference(x, w, transpose_w=transpose_w, layer=layer), x, w)[1](dy)
    return dx, dw, zero_cotangent(layer)


_matmul2d.defvjp(_fwd, _bwd)


def matmul(x, w, *, transpose_w=False, layer=None):
    """x (..., K) @ w (K, N) (w (N, K) with `transpose_w`), x and w both f32 or both bf16, f32 sums, in x's
    dtype; each row's sums in one order whatever the other rows. With `layer` (an integer scalar), w is a stack
    (S, K, N) (or (S, N, K)) and the product is with w[layer], read in place; a layer outside [0, S) is an
    error when the op runs."""
    _check(x, w, transpose_w, layer)
    lead = x.shape[:-1]
    n = w.shape[-2] if transpose_w else w.shape[-1]
    layer = None if layer is None else jnp.asarray(layer, jnp.int32)

    def compiled(x, w, layer):
        return _matmul2d(x.reshape(-1, x.shape[-1]), w, layer, transpose_w).reshape(*lead, n)

    def reference(x, w, layer):
        return matmul_reference(x, w, transpose_w=transpose_w, layer=layer)

    return platform_dispatch(_TARGET, compiled, reference, x, w, layer)


def linear_product(lhs, rhs, dimension_numbers, kwargs) -> bool | None:
    """Whether a dot_general is a linear layer's product, x (..., K) with a 2-D weight: False for nnx.Linear's
    (K, N) weight, True for a tied embedding head's (N, K) one, None for any other product or a sharded
    output (the dot_general overrides leave those to XLA)."""
    contract, batch = dimension_numbers
    if batch != ((), ()) or rhs.ndim != 2 or kwargs.get("out_sharding") is not None:
        return None
    if contract == ((lhs.ndim - 1,), (0,)):
        return False
    return True if contract == ((lhs.ndim - 1,), (1,)) else None


def invariant_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs):
    """jax.lax.dot_general, with linear layers' products (`linear_product`) sent to `matmul` when both
    operands share a float dtype and the output keeps it. Anything else goes to XLA unchanged."""
    transpose_w = linear_product(lhs, rhs, dimension_numbers, kwargs)
    out = jnp.dtype(preferred_element_type if preferred_element_type is not None else lhs.dtype)
    if (transpose_w is not None and jnp.dtype(lhs.dtype) in _DTYPES and lhs.dtype == rhs.dtype
            and out == jnp.dtype(lhs.dtype) and has_cpu_target(_TARGET)):
        return matmul(lhs, rhs, transpose_w=transpose_w)
    return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                               preferred_element_type=preferred_element_type, **kwargs)
