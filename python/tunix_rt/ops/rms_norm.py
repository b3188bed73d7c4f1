"""Fused RMSNorm: y = x * rsqrt(mean(x^2) + eps) * (offset + w), as an XLA FFI op.

`offset` is 0 for Llama/Qwen and 1 for Gemma, which stores its scale as (w - 1). Math runs in f32
whatever the input dtype, as HF does; y has x's dtype. The pure-JAX `rms_norm_reference` has the
same signature: tests compare the two, and it runs on platforms without a compiled handler.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from tunix_rt.ops._ffi import platform_dispatch, require_array

_FWD = "tunix_rt_rms_norm_fwd"
_BWD = "tunix_rt_rms_norm_bwd"
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def _check(x, w, eps: float, offset: float) -> None:
    for name, arr in (("x", x), ("w", w)):
        if jnp.dtype(require_array("rms_norm", name, arr).dtype) not in _DTYPES:
            raise ValueError(f"rms_norm: {name} must be float32 or bfloat16, got {jnp.dtype(arr.dtype)}")
    if x.ndim < 1:
        raise ValueError("rms_norm: x must have at least one dimension (..., D), got a scalar")
    if w.shape != (x.shape[-1],):
        raise ValueError(f"rms_norm: w must have shape ({x.shape[-1]},) to match x's last dimension, got {w.shape}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float, np.floating, np.integer)):
        raise ValueError(f"rms_norm: eps must be a number, got {type(eps).__name__}")
    eps32 = np.float32(eps) if math.isfinite(eps) and abs(eps) < 3e38 else np.float32(np.inf)
    if not (np.isfinite(eps32) and eps32 > 0):
        raise ValueError(f"rms_norm: eps must be positive and finite in float32, got {eps!r}")
    if isinstance(offset, bool) or not isinstance(offset, (int, float, np.floating, np.integer)) or not math.isfinite(offset):
        raise ValueError(f"rms_norm: offset must be a finite number, got {offset!r}")


def rms_norm_reference(x: jax.Array, w: jax.Array, *, eps: float = 1e-6, offset: float = 0.0) -> jax.Array:
    """Pure-JAX RMSNorm with the FFI op's semantics."""
    _check(x, w, eps, offset)
    xf = x.astype(jnp.float32)
    # Rows are pre-divided by max(1, max|x|) (a constant to autodiff) and eps by its square: the same
    # value, but mean(x^2) and rsqrt's derivative stay in f32 range for huge activations.
    scale = jax.lax.stop_gradient(jnp.maximum(jnp.max(jnp.abs(xf), axis=-1, keepdims=True), 1.0))
    xs = xf / scale
    rstd = jax.lax.rsqrt(jnp.mean(xs * xs, axis=-1, keepdims=True) + eps / (scale * scale))
    return (xs * rstd * (offset + w.astype(jnp.float32))).astype(x.dtype)


def _ffi_fwd(x, w, eps, offset):
    call = jax.ffi.ffi_call(_FWD, jax.ShapeDtypeStruct(x.shape, x.dtype), vmap_method="broadcast_all")
    return call(x, w, eps=np.float32(eps), offset=np.float32(offset))


def _ffi_bwd(x, w, dy, eps, offset):
    out = (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(w.shape, w.dtype))
    call = jax.ffi.ffi_call(_BWD, out, vmap_method="broadcast_all")
    return call(x, w, dy, eps=np.float32(eps), offset=np.float32(offset))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _rms_norm_ffi(x, w, eps, offset):
    return _ffi_fwd(x, w, eps, offset)


def _vjp_fwd(x, w, eps, offset):
    return _ffi_fwd(x, w, eps, offset), (x, w)


def _vjp_bwd(eps, offset, residuals, dy):
    x, w = residuals
    return _ffi_bwd(x, w, dy.astype(x.dtype), eps, offset)


_rms_norm_ffi.defvjp(_vjp_fwd, _vjp_bwd)


def rms_norm(x: jax.Array, w: jax.Array, *, eps: float = 1e-6, offset: float = 0.0) -> jax.Array:
    """RMSNorm over the last axis of x (f32 or bf16), differentiable in x and w."""
    _check(x, w, eps, offset)
    eps, offset = float(eps), float(offset)
    return platform_dispatch(
        _FWD,
        lambda x, w: _rms_norm_ffi(x, w, eps, offset),
        lambda x, w: rms_norm_reference(x, w, eps=eps, offset=offset),
        x,
        w,
    )
