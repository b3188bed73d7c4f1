"""bf16 matmul with f32 accumulation as an XLA FFI op, for bf16-compute training on CPU.

`bf16_matmul(x, w)` = x @ w for bf16 x (..., K) and w (K, N), summed in f32 (AVX-512 BF16's
vdpbf16ps where the CPU has it, the shared f32 GEMM otherwise) and returned in `out_dtype`. Its
custom_vjp takes both backward products through the same op (dx = dy @ w^T, dw = x^T @ dy), so a
training step's three matmuls per linear layer all run on it. `linear_dot_general` is a drop-in
`dot_general` for nnx.Linear: the trainer installs it in every Linear when compute_dtype is bfloat16.
The pure-JAX `bf16_matmul_reference` (same signature) is XLA's dot with an f32 result.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from tunix_rt.ops._ffi import has_cpu_target, platform_dispatch, require_array

_TARGET = "tunix_rt_bf16_matmul"
_BF16 = jnp.dtype(jnp.bfloat16)
_OUT_DTYPES = (jnp.dtype(jnp.float32), _BF16)


def _check(x, w, out_dtype) -> None:
    for name, arr in (("x", x), ("w", w)):
        if jnp.dtype(require_array("bf16_matmul", name, arr).dtype) != _BF16:
            raise ValueError(f"bf16_matmul: {name} must be bfloat16, got {jnp.dtype(arr.dtype)}")
    if x.ndim < 1 or w.ndim != 2:
        raise ValueError(f"bf16_matmul: need x (..., K) and w (K, N), got x {x.shape} and w {w.shape}")
    if x.shape[-1] != w.shape[0]:
        raise ValueError(f"bf16_matmul: x's last dimension ({x.shape[-1]}) does not match w's K ({w.shape[0]})")
    if jnp.dtype(out_dtype) not in _OUT_DTYPES:
        raise ValueError(f"bf16_matmul: out_dtype must be float32 or bfloat16, got {out_dtype}")


def bf16_matmul_reference(x, w, *, out_dtype=jnp.bfloat16):
    """XLA's dot of the bf16 operands with an f32 result, cast to out_dtype."""
    _check(x, w, out_dtype)
    return jnp.matmul(x, w, preferred_element_type=jnp.float32).astype(out_dtype)


def _call(a, b, out_dtype, transpose_a=False, transpose_b=False):
    """op(a) @ op(b) for 2-D bf16 a, b."""
    m = a.shape[1] if transpose_a else a.shape[0]
    n = b.shape[0] if transpose_b else b.shape[1]
    call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct((m, n), out_dtype), vmap_method="sequential")
    return call(a, b, transpose_a=transpose_a, transpose_b=transpose_b)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _matmul2d(x, w, out_dtype):
    return _call(x, w, out_dtype)


def _fwd(x, w, out_dtype):
    return _call(x, w, out_dtype), (x, w)


def _bwd(out_dtype, residuals, dy):
    x, w = residuals
    dy = dy.astype(_BF16)
    return _call(dy, w, _BF16, transpose_b=True), _call(x, dy, _BF16, transpose_a=True)


_matmul2d.defvjp(_fwd, _bwd)


def bf16_matmul(x, w, *, out_dtype=jnp.bfloat16):
    """x (..., K) @ w (K, N), bf16 operands, f32 sums, result in out_dtype; differentiable in x and w
    (gradients in bf16, as a bf16 dot's are)."""
    _check(x, w, out_dtype)
    out_dtype = jnp.dtype(out_dtype)
    lead = x.shape[:-1]

    def compiled(x, w):
        return _matmul2d(x.reshape(-1, x.shape[-1]), w, out_dtype).reshape(*lead, w.shape[1])

    return platform_dispatch(_TARGET, compiled,
                             lambda x, w: bf16_matmul_reference(x, w, out_dtype=out_dtype), x, w)


def linear_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs):
    """jax.lax.dot_general, with nnx.Linear's bf16 product (last axis of lhs with the first of a 2-D
    rhs) sent to bf16_matmul. Anything else, including sharded outputs, goes to XLA unchanged."""
    standard = dimension_numbers == (((lhs.ndim - 1,), (0,)), ((), ())) and rhs.ndim == 2
    if (standard and lhs.dtype == _BF16 and rhs.dtype == _BF16 and kwargs.get("out_sharding") is None
            and has_cpu_target(_TARGET)):
        out = preferred_element_type if preferred_element_type is not None else _BF16
        if jnp.dtype(out) in _OUT_DTYPES:
            return bf16_matmul(lhs, rhs, out_dtype=out)
    return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                               preferred_element_type=preferred_element_type, **kwargs)

