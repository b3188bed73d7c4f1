"""bf16 matmul with f32 accumulation, for bf16-compute training on CPU.

`bf16_matmul(x, w)` = x @ w for bf16 x (..., K) and w (K, N) (or w (N, K) with `transpose_w`),
summed in f32 and returned in `out_dtype`. Its custom_vjp takes both backward products through the
same kernel (dx = dy @ w^T, dw = x^T @ dy, bf16 operands), so a training step's three matmuls per
linear layer run on it. Two kernels compute the products:
  "ffi"  tunix-rt's XLA FFI op (AVX-512 BF16's vdpbf16ps where the CPU has it, the shared f32 GEMM
         otherwise);
  "xla"  XLA's dot of the bf16 operands with an f32 result, which XLA:CPU runs on AMX tiles where
         the CPU has them (about 7x the FFI op there). Plain autodiff of a bf16 dot would not get
         there: XLA widens a bf16-result dot, and a mixed f32 x bf16 one, to f32 first.
`default_kernel()` picks "xla" on CPUs with AMX-BF16, "ffi" elsewhere. `bf16_dot_general(kernel)`
is a drop-in `dot_general` for nnx.Linear and the decoder's tied embedding head: the trainer
installs it when compute_dtype is bfloat16. The pure-JAX `bf16_matmul_reference` (same signature)
is XLA's dot with an f32 result under plain autodiff.

`lora_matmul(x, w, a, b, scaling=s)` = x @ w + s (x @ a) @ b, a LoRA layer over a bf16 base, as one product:
the low-rank path rides in the base product's f32 sums as r more k (the FFI op's plus form,
`[x | s x a] @ [w ; b]`, and `[dy | s dy b^T] @ [w^T ; a^T]` for dx), rounded once. Two bf16 products
and their add write two (M, N) arrays and add them through f32 converts (XLA:CPU has no bf16
arithmetic): the fused form made the default model's bf16 LoRA step 5-6 % faster. On the "xla" kernel
it is two f32-result dots and one add, rounded once. The thin products (x @ a, dy @ b^T and the
adapters' gradients) stay on XLA's dot. `lora_matmul_reference` is the same function under plain
autodiff of XLA's dots.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from tunix_rt.ops._ffi import cpu_features, has_cpu_target, platform_dispatch, require_array
from tunix_rt.ops.matmul import check_product_shapes, linear_product

_TARGET = "tunix_rt_bf16_matmul"
_PLUS_TARGET = "tunix_rt_bf16_matmul_plus"
_BF16 = jnp.dtype(jnp.bfloat16)
_OUT_DTYPES = (jnp.dtype(jnp.float32), _BF16)
KERNELS = ("ffi", "xla")


def default_kernel() -> str:
    """"xla" where XLA's bf16 dots run on AMX tiles (measured faster there), else tunix-rt's FFI op."""
    return "xla" if cpu_features().get("amx_bf16") else "ffi"


def _check_kernel(kernel, op="bf16_matmul") -> None:
    if kernel not in KERNELS:
        raise ValueError(f"{op}: kernel must be one of {KERNELS}, got {kernel!r}")


def _check_bf16(op, **arrays) -> None:
    for name, arr in arrays.items():
        if jnp.dtype(require_array(op, name, arr).dtype) != _BF16:
            raise ValueError(f"{op}: {name} must be bfloat16, got {jnp.dtype(arr.dtype)}")


def _check(x, w, out_dtype, transpose_w, kernel, op="bf16_matmul") -> None:
    _check_bf16(op, x=x, w=w)
    check_product_shapes(op, x, w, transpose_w)
    if jnp.dtype(out_dtype) not in _OUT_DTYPES:
        raise ValueError(f"{op}: out_dtype must be float32 or bfloat16, got {out_dtype}")
    _check_kernel(kernel, op)


def bf16_matmul_reference(x, w, *, out_dtype=jnp.bfloat16, transpose_w=False, kernel="ffi"):
    """XLA's dot of the bf16 operands with an f32 result, cast to out_dtype (`kernel` is ignored)."""
    _check(x, w, out_dtype, transpose_w, kernel)
    return jnp.matmul(x, w.T if transpose_w else w, preferred_element_type=jnp.float32).astype(out_dtype)


def _product(a, b, out_dtype, transpose_a, transpose_b, kernel):
    """op(a) @ op(b) for 2-D bf16 a, b, summed in f32."""
    if kernel == "xla":
        dims = (((0,) if transpose_a else (1,), (1,) if transpose_b else (0,)), ((), ()))
        return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32).astype(out_dtype)
    m = a.shape[1] if transpose_a else a.shape[0]
    n = b.shape[0] if transpose_b else b.shape[1]
    call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct((m, n), out_dtype), vmap_method="sequential")
    return call(a, b, np.int32(0), transpose_a=transpose_a, transpose_b=transpose_b)  # layer 0: b is no stack


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _matmul2d(x, w, out_dtype, transpose_w, kernel):
    return _product(x, w, out_dtype, False, transpose_w, kernel)


def _fwd(x, w, out_dtype, transpose_w, kernel):
    return _product(x, w, out_dtype, False, transpose_w, kernel), (x, w)


def _bwd(out_dtype, transpose_w, kernel, residuals, dy):
    x, w = residuals
    dy = dy.astype(_BF16)
    dx = _product(dy, w, _BF16, False, not transpose_w, kernel)
    dw = _product(dy, x, _BF16, True, False, kernel) if transpose_w else _product(x, dy, _BF16, True, False, kernel)
    return dx, dw


_matmul2d.defvjp(_fwd, _bwd)


def bf16_matmul(x, w, *, out_dtype=jnp.bfloat16, transpose_w=False, kernel="ffi"):
    """x (..., K) @ w (K, N) (w (N, K) transposed with `transpose_w`), bf16 operands, f32 sums, result in
    out_dtype; differentiable in x and w (gradients in bf16, as a bf16 dot's are)."""
    _check(x, w, out_dtype, transpose_w, kernel)
    out_dtype = jnp.dtype(out_dtype)
    lead = x.shape[:-1]
    n = w.shape[0] if transpose_w else w.shape[1]

    def compiled(x, w):
        return _matmul2d(x.reshape(-1, x.shape[-1]), w, out_dtype, transpose_w, kernel).reshape(*lead, n)

    if kernel == "xla":
        return compiled(x, w)
    return platform_dispatch(_TARGET, compiled,
                             lambda x, w: bf16_matmul_reference(x, w, out_dtype=out_dtype, transpose_w=transpose_w),
                             x, w)


@functools.cache
def bf16_dot_general(kernel: str = "ffi"):
    """jax.lax.dot_general, with linear layers' bf16 products (ops.matmul.linear_product) sent to
    bf16_matmul's `kernel`. Anything else, including sharded outputs, goes to XLA unchanged. Cached: one
    function per kernel, so the modules holding it keep one graph definition."""
    _check_kernel(kernel)

    def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs):
        transpose_w = linear_product(lhs, rhs, dimension_numbers, kwargs)
        if (transpose_w is not None and lhs.dtype == _BF16 and rhs.dtype == _BF16
                and (kernel == "xla" or has_cpu_target(_TARGET))):
            out = preferred_element_type if preferred_element_type is not None else _BF16
            if jnp.dtype(out) in _OUT_DTYPES:
                return bf16_matmul(lhs, rhs, out_dtype=out, transpose_w=transpose_w, kernel=kernel)
        return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                                   preferred_element_type=preferred_element_type, **kwargs)

    dot_general.bf16_kernel = kernel  # what LoRALinear fuses its adapter into (lora_matmul)
    return dot_general


def _check_lora(x, w, a, b, scaling, out_dtype, kernel) -> None:
    _check(x, w, out_dtype, False, kernel, op="lora_matmul")
    _check_bf16("lora_matmul", a=a, b=b)
    k, n = w.shape
    if a.ndim != 2 or b.ndim != 2 or a.shape[0] != k or b.shape != (a.shape[1], n):
        raise ValueError(f"lora_matmul: need a (K, r) and b (r, N) for w (K, N) = {w.shape}, got a {a.shape} and "
                         f"b {b.shape}")
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not np.isfinite(scaling):
        raise ValueError(f"lora_matmul: scaling must be a finite number, got {scaling!r}")


def lora_matmul_reference(x, w, a, b, *, scaling, out_dtype=jnp.bfloat16, kernel="ffi"):
    """x @ w + (s x @ a, rounded to bf16) @ b under plain autodiff of XLA's dots, f32 sums (`kernel` is ignored)."""
    _check_lora(x, w, a, b, scaling, out_dtype, kernel)
    us = (jnp.matmul(x, a, preferred_element_type=jnp.float32) * scaling).astype(_BF16)
    return (jnp.matmul(x, w, preferred_element_type=jnp.float32)
            + jnp.matmul(us, b, preferred_element_type=jnp.float32)).astype(out_dtype)


def _thin(a, b, scaling, contract_b):
    """s a @ b (b transposed with contract_b = 1) for a thin b, f32 sums, rounded to bf16: the rank-r factor."""
    dims = (((1,), (contract_b,)), ((), ()))
    return (jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32) * scaling).astype(_BF16)


def _plus(a, b, u, v, out_dtype, transpose_b, transpose_v, kernel):
    """a @ op(b) + u @ op(v), bf16 operands, summed in f32 and rounded once to out_dtype."""
    if kernel == "xla":
        f32 = jnp.float32
        return (_product(a, b, f32, False, transpose_b, kernel) + _product(u, v, f32, False, transpose_v, kernel)
                ).astype(out_dtype)
    n = b.shape[0] if transpose_b else b.shape[1]
    call = jax.ffi.ffi_call(_PLUS_TARGET, jax.ShapeDtypeStruct((a.shape[0], n), out_dtype), vmap_method="sequential")
    return call(a, b, u, v, transpose_a=False, transpose_b=transpose_b, transpose_v=transpose_v)


def _lora_fwd(x, w, a, b, scaling, out_dtype, kernel):
    us = _thin(x, a, scaling, 0)
    return _plus(x, w, us, b, out_dtype, False, False, kernel), (x, w, a, b, us)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _lora2d(x, w, a, b, scaling, out_dtype, kernel):
    return _lora_fwd(x, w, a, b, scaling, out_dtype, kernel)[0]


def _lora_bwd(scaling, out_dtype, kernel, residuals, dy):
    x, w, a, b, us = residuals
    dy = dy.astype(_BF16)
    dyb = _thin(dy, b, scaling, 1)  # s dy @ b^T, (M, r)
    dx = _plus(dy, w, dyb, a, _BF16, True, True, kernel)  # dy @ w^T + dyb @ a^T
    dw = _product(x, dy, _BF16, True, False, kernel)  # dead where w is frozen (LoRA): XLA drops it
    # The adapters' gradients are made rank-major, reading x and dy in their own layout, and da is transposed
    # after its rounding: XLA folds a transpose of the dot itself into a (K, r) dot several times slower.
    da = jax.lax.dot_general(dyb, x, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32).astype(_BF16).T
    db = jax.lax.dot_general(us, dy, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32).astype(_BF16)
    return dx, dw, da, db


_lora2d.defvjp(_lora_fwd, _lora_bwd)


def lora_matmul(x, w, a, b, *, scaling, out_dtype=jnp.bfloat16, kernel="ffi"):
    """x (..., K) @ w (K, N) + scaling * (x @ a (K, r)) @ b (r, N), bf16 operands, f32 sums, one rounding to
    out_dtype; differentiable in x, w, a and b (gradients in bf16)."""
    _check_lora(x, w, a, b, scaling, out_dtype, kernel)
    out_dtype = jnp.dtype(out_dtype)
    lead = x.shape[:-1]
    scaling = float(scaling)

    def compiled(x, w, a, b):
        return _lora2d(x.reshape(-1, x.shape[-1]), w, a, b, scaling, out_dtype, kernel).reshape(*lead, w.shape[1])

    if kernel == "xla":
        return compiled(x, w, a, b)
    return platform_dispatch(
        _PLUS_TARGET, compiled,
        lambda x, w, a, b: lora_matmul_reference(x, w, a, b, scaling=scaling, out_dtype=out_dtype), x, w, a, b)

