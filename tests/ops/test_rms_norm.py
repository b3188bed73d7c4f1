"""Tests for the fused RMSNorm XLA FFI op (tunix_rt.ops.rms_norm) against its pure-JAX reference.

The FFI op and `rms_norm_reference` share one formula and evaluation order: rstd from mean(x^2) in
f32, then y = (x * rstd) * (offset + w). Only the reduction order and rsqrt implementation differ,
so f32 forward results agree per element to ~1e-5 relative and bf16 results to about one bf16 ulp.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.isa_tiers import TIERS, expected_tier, hardware_tier, run_tiers
from tunix_rt.ops import _ffi, rms_norm, rms_norm_reference

FWD_TARGET = "tunix_rt_rms_norm_fwd"
BWD_TARGET = "tunix_rt_rms_norm_bwd"
F32, BF16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)
DTYPE_PAIRS = [(F32, F32), (BF16, BF16), (F32, BF16), (BF16, F32)]  # (x dtype, w dtype)

pytestmark = [pytest.mark.skipif(not _ffi.has_cpu_target(FWD_TARGET), reason="tunix_rt._ext is not built: no FFI op to test"),
              pytest.mark.usefixtures("fast_compiles")]



# ----------------------------------------------------------------------------------------------
# helpers


@functools.partial(jax.jit, static_argnames=("eps", "offset"))
def _fwd_pair(x, w, *, eps, offset):
    return (
        rms_norm(x, w, eps=eps, offset=offset),
        rms_norm_reference(x, w, eps=eps, offset=offset),
    )


def _vjp(fn, x, w, dy, eps, offset):
    y, pull = jax.vjp(lambda x, w: fn(x, w, eps=eps, offset=offset), x, w)
    dx, dw = pull(dy)
    return y, dx, dw


@functools.partial(jax.jit, static_argnames=("eps", "offset"))
def _vjp_pair(x, w, dy, *, eps, offset):
    return _vjp(rms_norm, x, w, dy, eps, offset), _vjp(rms_norm_reference, x, w, dy, eps, offset)


def _f32(a) -> np.ndarray:
    return np.asarray(jnp.asarray(a).astype(jnp.float32))


def _fwd_tol(dtype):
    # Per element: y = (x * rstd) * g with g computed identically, so only rstd's few-ulp
    # difference (f32) or one bf16 rounding step shows. atol only covers flushed denormals.
    return dict(rtol=1e-5, atol=1e-35) if jnp.dtype(dtype) == F32 else dict(rtol=1e-2, atol=1e-35)


def assert_fwd_close(actual, expected):
    assert actual.shape == expected.shape
    assert actual.dtype == expected.dtype
    np.testing.assert_allclose(_f32(actual), _f32(expected), **_fwd_tol(expected.dtype))


def assert_grad_close(actual, expected, *, rowwise: bool = False, scale=None):
    """Gradients have cancellations (dx = r*dy*g - c*x, dw sums signed terms over rows): tolerate
    an absolute error relative to the size of the terms (`scale`, broadcastable to the gradient),
    by default estimated as each row's (rowwise) or the whole array's largest expected value."""
    assert actual.shape == expected.shape
    assert actual.dtype == expected.dtype
    a, e = _f32(actual), _f32(expected)
    if e.size == 0:
        return
    if jnp.dtype(expected.dtype) == F32:
        rtol, scale_frac = 1e-4, 1e-5
    else:
        rtol, scale_frac = 1.6e-2, 4e-3
    if scale is None:
        absmax = np.abs(e)
        scale = absmax.max(axis=-1, keepdims=True) if rowwise else absmax.max()
    np.testing.assert_array_less(np.abs(a - e), rtol * np.abs(e) + scale_frac * np.asarray(scale) + 1e-30)


def _grad_scales(x, w, dy, eps, offset):
    """Sizes of the terms the gradients are made of: per row max|r*dy*g| + max|c*x| for dx, and
    sum over rows of |r*dy*x| for dw (float64, from the inputs)."""
    x, w, dy = (np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64) for a in (x, w, dy))
    d = x.shape[-1]
    g = offset + w
    r = 1.0 / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    c = np.abs(dy * g * x).sum(-1, keepdims=True) * r**3 / d
    dx_scale = np.abs(r * dy * g).max(-1, keepdims=True) + (c * np.abs(x)).max(-1, keepdims=True)
    dw_scale = np.abs(r * dy * x).reshape(-1, d).sum(0)
    return dx_scale, dw_scale


def _oracle64(x, w, dy, eps, offset):
    """Float64 numpy forward and analytic backward, from the (rounded) inputs."""
    x, w, dy = (np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64) for a in (x, w, dy))
    d = x.shape[-1]
    g = offset + w
    r = 1.0 / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    y = x * r * g
    c = (dy * g * x).sum(-1, keepdims=True) * r**3 / d
    dx = r * dy * g - c * x
    dw = (r * dy * x).reshape(-1, d).sum(0)
    return y, dx, dw


# ----------------------------------------------------------------------------------------------
# data: shapes and (adversarial) values

ROW_KINDS = ("normal", "huge", "tiny", "zero", "const")
INTERESTING_D = [1, 2, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257, 300]


@st.composite
def shapes(draw, max_rank=4, max_lead=5):
    rank = draw(st.integers(1, max_rank))
    lead = draw(st.lists(st.integers(0, max_lead), min_size=rank - 1, max_size=rank - 1))
    d = draw(st.one_of(st.sampled_from(INTERESTING_D), st.integers(1, 300)))
    return (*lead, d)


def make_x(rng: np.random.Generator, shape, kind: str) -> np.ndarray:
    """Rows of one kind, or (kind="mixed") each row of a random kind.

    "huge" rows stay within 1e18 in magnitude, so sum(x^2) over D <= 300 stays below the f32
    maximum (both implementations would overflow to rstd = 0 alike, but not necessarily at the
    same boundary). "tiny" rows (1e-30) make mean(x^2) underflow to 0, so rstd = 1/sqrt(eps).
    """
    d = shape[-1]
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    kinds = rng.choice(ROW_KINDS, size=rows) if kind == "mixed" else np.full(rows, kind)
    out = np.empty((rows, d), np.float32)
    for i, k in enumerate(kinds):
        if k == "normal":
            out[i] = rng.standard_normal(d) * 10.0 ** rng.uniform(-3, 3)
        elif k == "huge":
            out[i] = rng.uniform(-1.0, 1.0, d) * 1e18
        elif k == "tiny":
            out[i] = rng.standard_normal(d) * 1e-30
        elif k == "zero":
            out[i] = 0.0
        else:  # constant row
            out[i] = rng.choice([1.0, -2.5, 1e18, -1e-30, 3e-7, 7.0])
    return out.reshape(shape)


def make_w(rng: np.random.Generator, d: int, offset: float) -> np.ndarray:
    if offset:  # Gemma-style w stores (scale - 1): small values, some exactly -offset (zero gain)
        w = rng.standard_normal(d) * 0.1
    else:
        w = rng.standard_normal(d) * 10.0 ** rng.uniform(-2, 1)
    w[rng.random(d) < 0.05] = -offset
    return w.astype(np.float32)


EPS = st.one_of(st.sampled_from([1e-6, 1e-5, 1e-12, 1e-2, 1.0]), st.floats(1e-10, 1.0))
OFFSET = st.sampled_from([0.0, 1.0])


# ----------------------------------------------------------------------------------------------
# forward


@pytest.mark.slow
@settings(max_examples=60)
@given(
    shape=shapes(),
    kind=st.sampled_from(ROW_KINDS + ("mixed", "mixed")),
    dtypes=st.sampled_from(DTYPE_PAIRS),
    eps=EPS,
    offset=OFFSET,
    seed=st.integers(0, 2**32 - 1),
)
def test_forward_matches_reference(shape, kind, dtypes, eps, offset, seed):
    rng = np.random.default_rng(seed)
    xdt, wdt = dtypes
    x = jnp.asarray(make_x(rng, shape, kind), xdt)
    w = jnp.asarray(make_w(rng, shape[-1], offset), wdt)
    y, y_ref = _fwd_pair(x, w, eps=eps, offset=offset)
    assert y.dtype == xdt
    assert_fwd_close(y, y_ref)
    if xdt == F32 and wdt == F32 and kind in ("normal", "zero", "const", "huge"):
        # Independent check that both are right, not just equal.
        y64 = _oracle64(x, w, x, eps, offset)[0]
        np.testing.assert_allclose(_f32(y), y64, rtol=2e-5, atol=1e-30)


@pytest.mark.parametrize("xdt,wdt", DTYPE_PAIRS)
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_forward_eager_not_jitted(xdt, wdt, offset):
    rng = np.random.default_rng(1)
    x = jnp.asarray(make_x(rng, (3, 4, 67), "mixed"), xdt)
    w = jnp.asarray(make_w(rng, 67, offset), wdt)
    assert_fwd_close(rms_norm(x, w, eps=1e-5, offset=offset), rms_norm_reference(x, w, eps=1e-5, offset=offset))


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 8), (2, 0, 5), (0, 0, 3)])
def test_empty_shapes(shape):
    x = jnp.zeros(shape, jnp.float32)
    w = jnp.ones(shape[-1:], jnp.float32)
    y, dx, dw = _vjp(rms_norm, x, w, jnp.ones_like(x), 1e-6, 0.0)
    assert y.shape == dx.shape == shape
    np.testing.assert_array_equal(np.asarray(dw), np.zeros(shape[-1:], np.float32))


def test_special_rows_exact_values():
    """Zero rows give 0; constant rows give sign(c) * g (up to rounding); a 1e-30 row has rstd=1/sqrt(eps)."""
    d = 37
    w = jnp.asarray(np.linspace(-2, 2, d), jnp.float32)
    x = jnp.stack([jnp.zeros(d), jnp.full(d, -3.0), jnp.full(d, 1e18), jnp.full(d, 1e-30)]).astype(jnp.float32)
    y = np.asarray(rms_norm(x, w, eps=1e-6))
    np.testing.assert_array_equal(y[0], np.zeros(d, np.float32))
    np.testing.assert_allclose(y[1], -np.asarray(w), rtol=1e-6)
    np.testing.assert_allclose(y[2], np.asarray(w), rtol=1e-6)
    np.testing.assert_allclose(y[3], 1e-30 * 1e3 * np.asarray(w), rtol=1e-5)
    assert np.isfinite(y).all()


# ----------------------------------------------------------------------------------------------
# gradients


@pytest.mark.slow
@settings(max_examples=35)
@given(
    shape=shapes(max_rank=3, max_lead=6),
    kind=st.sampled_from(("normal", "normal", "mixed_safe")),
    dtypes=st.sampled_from(DTYPE_PAIRS),
    eps=st.sampled_from([1e-6, 1e-5, 1e-2]),
    offset=OFFSET,
    seed=st.integers(0, 2**32 - 1),
)
def test_gradients_match_reference(shape, kind, dtypes, eps, offset, seed):
    rng = np.random.default_rng(seed)
    xdt, wdt = dtypes
    if kind == "mixed_safe":  # zero / constant / tiny rows; huge rows have their own test below
        xs = make_x(rng, shape, "mixed")
        xs[np.abs(xs) > 1e6] = 1.0
    else:
        xs = make_x(rng, shape, "normal")
    x = jnp.asarray(xs, xdt)
    w = jnp.asarray(make_w(rng, shape[-1], offset), wdt)
    dy = jnp.asarray(rng.standard_normal(shape), xdt)
    (y, dx, dw), (y_r, dx_r, dw_r) = _vjp_pair(x, w, dy, eps=eps, offset=offset)
    assert dx.dtype == xdt and dw.dtype == wdt
    assert_fwd_close(y, y_r)
    dx_scale, dw_scale = _grad_scales(x, w, dy, eps, offset)
    assert_grad_close(dx, dx_r, scale=dx_scale)
    assert_grad_close(dw, dw_r, scale=dw_scale)


@pytest.mark.parametrize("xdt,wdt", DTYPE_PAIRS)
def test_jax_grad_of_scalar_loss(xdt, wdt):
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((5, 3, 100)), xdt)
    w = jnp.asarray(rng.standard_normal(100), wdt)
    t = jnp.asarray(rng.standard_normal((5, 3, 100)), jnp.float32)

    def loss(fn):
        return lambda x, w: jnp.sum(fn(x, w, eps=1e-5, offset=1.0).astype(jnp.float32) * t)

    gx, gw = jax.jit(jax.grad(loss(rms_norm), argnums=(0, 1)))(x, w)
    rx, rw = jax.jit(jax.grad(loss(rms_norm_reference), argnums=(0, 1)))(x, w)
    assert_grad_close(gx, rx, rowwise=True)
    assert_grad_close(gw, rw, rowwise=False)


@pytest.mark.parametrize("scale", [1e3, 1e10, 1e15, 1e18])
def test_ffi_gradient_at_large_magnitudes_matches_f64(scale):
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.uniform(-1, 1, (4, 40)) * scale, jnp.float32)
    w = jnp.asarray(rng.standard_normal(40), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((4, 40)), jnp.float32)
    y, dx, dw = jax.jit(lambda x, w, dy: _vjp(rms_norm, x, w, dy, 1e-6, 0.0))(x, w, dy)
    y64, dx64, dw64 = _oracle64(x, w, dy, 1e-6, 0.0)
    np.testing.assert_allclose(_f32(y), y64, rtol=1e-5)
    np.testing.assert_allclose(_f32(dx), dx64, rtol=1e-4, atol=1e-5 * np.abs(dx64).max())
    np.testing.assert_allclose(_f32(dw), dw64, rtol=1e-4, atol=1e-5 * np.abs(dw64).max())


def test_reference_gradient_at_large_magnitudes_matches_f64():
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.uniform(-1, 1, (4, 40)) * 1e15, jnp.float32)
    w = jnp.asarray(rng.standard_normal(40), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((4, 40)), jnp.float32)
    _, dx, _ = jax.jit(lambda x, w, dy: _vjp(rms_norm_reference, x, w, dy, 1e-6, 0.0))(x, w, dy)
    dx64 = _oracle64(x, w, dy, 1e-6, 0.0)[1]
    np.testing.assert_allclose(_f32(dx), dx64, rtol=1e-4, atol=1e-5 * np.abs(dx64).max())


# ----------------------------------------------------------------------------------------------
# vmap / jit


def _both(fn_builder, *args, jit=True):
    """fn_builder(op) for the FFI op and the reference; one jit (one compile) for both by default."""
    both = lambda *a: (fn_builder(rms_norm)(*a), fn_builder(rms_norm_reference)(*a))
    return jax.jit(both)(*args) if jit else both(*args)


def _norm(fn, eps=1e-5, offset=1.0):
    return lambda x, w: fn(x, w, eps=eps, offset=offset)


VMAP_CASES = {
    # name: (x shape, w shape, builder)
    "x_batched": ((4, 3, 37), (37,), lambda f: jax.vmap(_norm(f), in_axes=(0, None))),
    "x_batched_axis1": ((3, 4, 37), (37,), lambda f: jax.vmap(_norm(f), in_axes=(1, None), out_axes=1)),
    "both_batched": ((4, 3, 37), (4, 37), lambda f: jax.vmap(_norm(f))),
    "both_batched_rank1_x": ((4, 37), (4, 37), lambda f: jax.vmap(_norm(f))),
    "both_batched_w_axis1": ((4, 3, 37), (37, 4), lambda f: jax.vmap(_norm(f), in_axes=(0, 1))),
    "w_batched_x_unbatched": ((3, 5, 37), (4, 37), lambda f: jax.vmap(_norm(f), in_axes=(None, 0))),
    "w_batched_x_empty_rows": ((4, 0, 37), (4, 37), lambda f: jax.vmap(_norm(f))),
    "nested_x_inner_w_outer": (
        (2, 3, 5, 19),
        (3, 19),
        lambda f: jax.vmap(jax.vmap(_norm(f), in_axes=(0, None)), in_axes=(1, 0)),
    ),
    "nested_both_both": ((2, 3, 5, 19), (2, 3, 19), lambda f: jax.vmap(jax.vmap(_norm(f)))),
    "nested_w_inner_only": (
        (5, 19),
        (2, 3, 19),
        lambda f: jax.vmap(jax.vmap(_norm(f), in_axes=(None, 0)), in_axes=(None, 0)),
    ),
    "vmap_of_jit": ((4, 3, 37), (4, 37), lambda f: jax.vmap(jax.jit(_norm(f)))),
}
EAGER_VMAP_CASES = ("x_batched", "both_batched", "w_batched_x_unbatched", "nested_both_both")


@pytest.mark.slow
@pytest.mark.parametrize("xdt,wdt", [(F32, F32), (BF16, BF16)])
@pytest.mark.parametrize("case", list(VMAP_CASES))
def test_vmap_forward_jit(case, xdt, wdt):
    xs, ws, builder = VMAP_CASES[case]
    rng = np.random.default_rng(zlib.crc32(case.encode()))
    x = jnp.asarray(rng.standard_normal(xs), xdt)
    w = jnp.asarray(rng.standard_normal(ws) * 0.3, wdt)
    y, y_ref = _both(builder, x, w)
    assert_fwd_close(y, y_ref)


@pytest.mark.parametrize("case", EAGER_VMAP_CASES)
def test_vmap_forward_eager(case):
    xs, ws, builder = VMAP_CASES[case]
    rng = np.random.default_rng(zlib.crc32(case.encode()))
    x = jnp.asarray(rng.standard_normal(xs), jnp.float32)
    w = jnp.asarray(rng.standard_normal(ws) * 0.3, jnp.bfloat16)
    y, y_ref = _both(builder, x, w, jit=False)
    assert_fwd_close(y, y_ref)


def _vmap_grad(batch_w: bool, *, nested: bool = False):
    def build(fn):
        def per_example(x, w, t):
            loss = lambda x, w: jnp.sum(_norm(fn)(x, w).astype(jnp.float32) * t)
            return jax.grad(loss, argnums=(0, 1))(x, w)

        g = jax.vmap(per_example, in_axes=(0, 0 if batch_w else None, 0))
        if nested:
            g = jax.vmap(g, in_axes=(0, 0 if batch_w else None, 0))
        return g

    return build


@pytest.mark.slow
@pytest.mark.parametrize("xdt,wdt", [(F32, F32), (BF16, BF16), (F32, BF16)])
@pytest.mark.parametrize(
    "batch_w,jit,nested,x_shape",
    [
        (False, True, False, (4, 3, 37)),
        (True, True, False, (4, 3, 37)),
        (True, False, False, (4, 37)),
        (True, True, True, (2, 3, 5, 19)),
        (False, True, True, (2, 3, 5, 19)),
        (True, True, False, (3, 0, 8)),
    ],
)
def test_vmap_of_grad(batch_w, jit, nested, x_shape, xdt, wdt):
    rng = np.random.default_rng(11)
    d = x_shape[-1]
    bdims = x_shape[: 2 if nested else 1]
    x = jnp.asarray(rng.standard_normal(x_shape), xdt)
    w = jnp.asarray(rng.standard_normal((*bdims, d) if batch_w else (d,)) * 0.3, wdt)
    t = jnp.asarray(rng.standard_normal(x_shape), jnp.float32)
    builder = _vmap_grad(batch_w, nested=nested)
    (gx, gw), (rx, rw) = _both(builder, x, w, t, jit=jit)
    assert gw.shape == (*bdims, d)  # per-example dw even when w itself is unbatched
    assert_grad_close(gx, rx, rowwise=True)
    assert_grad_close(gw, rw, rowwise=True)


def test_vmap_batched_w_matches_loop():
    """Batched w: each example must use its own weight row (not e.g. always row 0)."""
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((3, 4, 24)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((3, 24)), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((3, 4, 24)), jnp.float32)
    f = lambda x, w, dy: _vjp(rms_norm, x, w, dy, 1e-6, 0.0)
    y, dx, dw = jax.jit(jax.vmap(f))(x, w, dy)
    for b in range(3):
        yb, dxb, dwb = f(x[b], w[b], dy[b])
        np.testing.assert_allclose(np.asarray(y[b]), np.asarray(yb), rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(np.asarray(dx[b]), np.asarray(dxb), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(dw[b]), np.asarray(dwb), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# it really is the FFI op


def test_lowered_hlo_uses_ffi_custom_calls():
    x = jnp.ones((2, 3, 64), jnp.float32)
    w = jnp.ones((64,), jnp.bfloat16)
    fwd_hlo = jax.jit(rms_norm).lower(x, w).as_text()
    assert FWD_TARGET in fwd_hlo
    assert BWD_TARGET not in fwd_hlo
    vjp_hlo = jax.jit(lambda x, w: _vjp(rms_norm, x, w, x, 1e-6, 0.0)).lower(x, w).as_text()
    assert FWD_TARGET in vjp_hlo and BWD_TARGET in vjp_hlo
    # jax.grad does not need y, so only the backward call survives dead-code elimination.
    grad_hlo = jax.jit(jax.grad(lambda x, w: rms_norm(x, w).sum(), argnums=(0, 1))).lower(x, w).as_text()
    assert BWD_TARGET in grad_hlo
    vmap_hlo = jax.jit(jax.vmap(rms_norm, in_axes=(None, 0))).lower(x, jnp.ones((4, 64))).as_text()
    assert FWD_TARGET in vmap_hlo
    ref_hlo = jax.jit(rms_norm_reference).lower(x, w).as_text()
    assert FWD_TARGET not in ref_hlo


def test_cpu_targets_registered():
    targets = _ffi.cpu_targets()
    assert {FWD_TARGET, BWD_TARGET} <= set(targets)
    assert _ffi.has_cpu_target(FWD_TARGET) and _ffi.has_cpu_target(BWD_TARGET)
    assert _ffi.isa_level() in ("scalar", "avx2", "avxvnni", "avx512")


# ----------------------------------------------------------------------------------------------
# argument validation


@pytest.mark.parametrize("fn", [rms_norm, rms_norm_reference], ids=["ffi", "reference"])
@pytest.mark.parametrize(
    "name,make",
    [
        ("x", lambda: (np.ones((2, 8), np.float16), jnp.ones(8))),
        ("x", lambda: (jnp.ones((2, 8), jnp.float16), jnp.ones(8))),
        ("x", lambda: (jnp.ones((2, 8), jnp.int32), jnp.ones(8))),
        ("x", lambda: (np.ones((2, 8), np.float64), jnp.ones(8))),
        ("x", lambda: ([[1.0] * 8], jnp.ones(8))),
        ("x", lambda: (1.5, jnp.ones(1))),
        ("x", lambda: (jnp.float32(1.5), jnp.ones(1))),
        ("x", lambda: (jnp.ones((), jnp.float32), jnp.ones(1))),
        ("w", lambda: (jnp.ones((2, 8)), jnp.ones(8, jnp.float16))),
        ("w", lambda: (jnp.ones((2, 8)), jnp.ones(8, jnp.int32))),
        ("w", lambda: (jnp.ones((2, 8)), [1.0] * 8)),
        ("w", lambda: (jnp.ones((2, 8)), jnp.ones(7))),
        ("w", lambda: (jnp.ones((2, 8)), jnp.ones(9))),
        ("w", lambda: (jnp.ones((2, 8)), jnp.ones((1, 8)))),
        ("w", lambda: (jnp.ones((2, 8)), jnp.ones((2, 8)))),
        ("w", lambda: (jnp.ones((2, 8)), jnp.ones(()))),
    ],
)
def test_bad_arrays_raise_value_error_naming_argument(fn, name, make):
    x, w = make()
    with pytest.raises(ValueError, match=f"rms_norm: {name} "):
        fn(x, w)
    if isinstance(x, jax.Array) and isinstance(w, jax.Array):  # also when traced under jit
        with pytest.raises(ValueError, match=f"rms_norm: {name} "):
            jax.jit(fn)(x, w)


@pytest.mark.parametrize("fn", [rms_norm, rms_norm_reference], ids=["ffi", "reference"])
@pytest.mark.parametrize("eps", [0.0, -1e-6, -1.0, float("nan"), float("inf"), "1e-6", None])
def test_bad_eps_raises_value_error(fn, eps):
    with pytest.raises(ValueError, match="rms_norm: eps "):
        fn(jnp.ones((2, 8)), jnp.ones(8), eps=eps)


def test_eps_that_underflows_in_f32_is_rejected_or_harmless():
    x, w = jnp.zeros((1, 8), jnp.float32), jnp.ones(8, jnp.float32)
    try:
        y = rms_norm(x, w, eps=1e-50)
    except ValueError:
        return
    assert np.isfinite(np.asarray(y)).all()


# ----------------------------------------------------------------------------------------------
# multi-threaded split: correctness and run-to-run determinism


@pytest.mark.parametrize(
    "shape,dtype,batched_w",
    [
        ((4096, 1024), F32, False),
        ((4099, 1000), BF16, False),  # uneven chunk boundaries, bf16 buffers
        ((3, 1365, 1024), F32, True),  # vmap'd w: chunk boundaries fall inside weight groups
    ],
)
def test_parallel_split_matches_reference_and_is_deterministic(shape, dtype, batched_w):
    rng = np.random.default_rng(99)
    d = shape[-1]
    x = jnp.asarray(rng.standard_normal(shape), dtype)
    dy = jnp.asarray(rng.standard_normal(shape), dtype)
    w = jnp.asarray(rng.standard_normal((shape[0], d) if batched_w else (d,)) * 0.5, dtype)

    def make(fn):
        f = lambda x, w, dy: _vjp(fn, x, w, dy, 1e-6, 1.0)
        return jax.jit(jax.vmap(f) if batched_w else f)

    ffi = make(rms_norm)
    y1, dx1, dw1 = ffi(x, w, dy)
    y2, dx2, dw2 = ffi(x, w, dy)
    for a, b in ((y1, y2), (dx1, dx2), (dw1, dw2)):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    y_r, dx_r, dw_r = make(rms_norm_reference)(x, w, dy)
    assert_fwd_close(y1, y_r)
    if batched_w:
        assert_grad_close(dx1, dx_r, rowwise=True)
        assert_grad_close(dw1, dw_r, rowwise=True)
    else:
        dx_scale, dw_scale = _grad_scales(x, w, dy, 1e-6, 1.0)
        assert_grad_close(dx1, dx_r, scale=dx_scale.reshape(*shape[:-1], 1))
        assert_grad_close(dw1, dw_r, scale=dw_scale)


# ----------------------------------------------------------------------------------------------
# every ISA tier (TUNIX_RT_ISA caps the tier; it is read once per process, so use subprocesses)

_TIER_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np, jax, jax.numpy as jnp
    from tunix_rt.ops import _ffi, rms_norm, rms_norm_reference

    EPS = 1e-6
    # D values around the 8/16-lane vector widths exercise every tail path.
    DIMS = (1, 8, 15, 16, 17, 33, 300)
    CASES = [(d, dt, off) for d in DIMS for dt, off in ((jnp.float32, 0.0), (jnp.bfloat16, 1.0))]

    def vjp(fn, x, w, dy, offset):
        y, pull = jax.vjp(lambda x, w: fn(x, w, eps=EPS, offset=offset), x, w)
        return (y, *pull(dy))

    rng = np.random.default_rng(0)
    inputs = []
    for d, dt, off in CASES:
        inputs.append(tuple(jnp.asarray(a, dt) for a in (
            rng.standard_normal((2, 7, d)), rng.standard_normal(d) * 0.5, rng.standard_normal((2, 7, d)))))

    @jax.jit  # one compile for every case
    def run(inputs):
        return [(vjp(rms_norm, *i, off), vjp(rms_norm_reference, *i, off)) for i, (_, _, off) in zip(inputs, CASES)]

    worst, outs = {}, {}
    for (d, dt, off), (x, w, dy), (got, ref) in zip(CASES, inputs, run(inputs)):
        x64, w64, dy64 = (np.asarray(a, np.float64) for a in (x, w, dy))
        r = 1 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + EPS)
        scales = {  # sizes of the terms each output is made of (dx and dw cancel)
            "y": np.abs(x64 * r * (off + w64)).max(),
            "dx": np.abs(r * dy64 * (off + w64)).max(),
            "dw": np.abs(r * dy64 * x64).reshape(-1, d).sum(0).max(),
        }
        for name, a, b in zip(("y", "dx", "dw"), got, ref):
            err = float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))) / scales[name])
            key = f"{name}_{jnp.dtype(dt).name}"
            worst[key] = max(worst.get(key, 0.0), err)
            if dt is jnp.float32 and off == 0.0:
                outs[f"{name}_{d}"] = np.asarray(a)
    np.savez(sys.argv[1], **outs)
    print(json.dumps({"isa": _ffi.isa_level(), "worst": worst}))
    """
)



@pytest.fixture(scope="module")
def tier_runs(tmp_path_factory):
    return run_tiers(TIERS, _TIER_SCRIPT, tmp_path_factory.mktemp("isa"))


@pytest.mark.slow
@pytest.mark.parametrize("tier", TIERS)
def test_isa_tier_matches_reference(tier_runs, tier):
    report, _ = tier_runs[tier]
    assert report["isa"] == expected_tier(tier)
    for key, err in report["worst"].items():
        limit = 1e-5 if key.endswith("float32") else 1.6e-2
        assert err <= limit, (tier, key, err, report)


def test_isa_tiers_agree_with_each_other(tier_runs):
    _, base = tier_runs["scalar"]
    for tier in ("avx2", "avx512"):
        _, other = tier_runs[tier]
        for key, a in base.items():
            atol = 1e-5 * np.abs(a).max() if key.startswith("y") else 1e-4 * np.abs(a).max()
            np.testing.assert_allclose(other[key], a, rtol=1e-4, atol=atol, err_msg=f"{tier} {key}")


@pytest.mark.skipif(hardware_tier() == "scalar", reason="needs a SIMD tier to differ from scalar")
def test_isa_cap_changes_the_kernels(tier_runs):
    """The cap must select different kernels, not only a different name: the scalar and SIMD
    reductions sum in different orders, so some f32 output bits differ on D=300 rows."""
    _, scalar = tier_runs["scalar"]
    _, simd = tier_runs["avx2"]  # the lowest SIMD tier every SIMD host runs
    assert any(not np.array_equal(scalar[k], simd[k]) for k in scalar)


_REREAD_SCRIPT = textwrap.dedent(
    """
    import os, jax.numpy as jnp
    from tunix_rt.ops import _ffi, rms_norm
    rms_norm(jnp.ones((4, 64)), jnp.ones(64)).block_until_ready()  # kernels chosen now
    before = _ffi.isa_level()
    os.environ["TUNIX_RT_ISA"] = "scalar"
    print(before, _ffi.isa_level())
    """
)


@pytest.mark.skipif(hardware_tier() == "scalar", reason="needs a SIMD tier to differ from scalar")
def test_isa_level_is_fixed_per_process():
    env = {k: v for k, v in os.environ.items() if k != "TUNIX_RT_ISA"}
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run([sys.executable, "-c", _REREAD_SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    before, after = proc.stdout.split()
    assert before == after == hardware_tier()
