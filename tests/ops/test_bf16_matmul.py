"""bf16_matmul vs its reference (XLA's bf16 dot with f32 sums), on both kernels (the FFI op and XLA's
dot under the op's own custom_vjp): hypothesis shapes (K odd, past one 512-deep slab, M and N past one
work block, empty dimensions), w plain or transposed, forward and backward, both output dtypes, every
ISA tier, argument errors and the dot_general hook of nnx.Linear and the decoder's tied head."""

from __future__ import annotations

import functools
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.isa_tiers import TIERS, expected_tier, run_tiers
from tunix_rt.models.decoder import Embed
from tunix_rt.ops import _ffi
from tunix_rt.ops.bf16_matmul import bf16_dot_general, bf16_matmul, bf16_matmul_reference, default_kernel

pytestmark = [pytest.mark.skipif(not _ffi.has_cpu_target("tunix_rt_bf16_matmul"),
                                 reason="tunix_rt._ext is not built: no FFI op to test"),
              pytest.mark.usefixtures("fast_compiles")]
BF16 = jnp.bfloat16


def _f32(a):
    return np.asarray(jnp.asarray(a, jnp.float32))


def _tol(k):
    # f32 sums of exact bf16 products, in another order; a bf16 output adds one rounding (2^-8 relative)
    return dict(rtol=1e-2, atol=1e-2 * np.sqrt(max(k, 1)))


@st.composite
def cases(draw):
    lead = draw(st.sampled_from([(), (0,), (3,), (2, 5), (197,)]))
    k = draw(st.sampled_from([1, 2, 7, 64, 257, 300, 1030, 1101]))
    n = draw(st.sampled_from([1, 5, 31, 33, 260]))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    transpose_w = draw(st.booleans())
    x = jnp.asarray(rng.standard_normal((*lead, k)), BF16)
    w = jnp.asarray(rng.standard_normal((n, k) if transpose_w else (k, n)), BF16)
    return x, w, draw(st.sampled_from([jnp.float32, BF16])), transpose_w


@functools.partial(jax.jit, static_argnames=("fn", "out_dtype", "transpose_w"))
def _product_and_grads(x, w, probe, *, fn, out_dtype, transpose_w):
    """fn's product and the gradients of sum(product * probe) over (x, w), as one program per example."""
    loss = lambda a, b: jnp.sum((fn(a, b, out_dtype=out_dtype, transpose_w=transpose_w) * probe).astype(jnp.float32))
    return fn(x, w, out_dtype=out_dtype, transpose_w=transpose_w), jax.grad(loss, argnums=(0, 1))(x, w)


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["ffi", "xla"])
@settings(max_examples=40)
@given(case=cases())
def test_matches_reference_forward_and_backward(kernel, case):
    x, w, out_dtype, transpose_w = case
    opts = dict(out_dtype=out_dtype, transpose_w=transpose_w)
    out_shape = (*x.shape[:-1], w.shape[0] if transpose_w else w.shape[1])
    probe = jnp.asarray(np.random.default_rng(1).standard_normal(out_shape), out_dtype)
    y, g = _product_and_grads(x, w, probe, fn=functools.partial(bf16_matmul, kernel=kernel), **opts)
    ref, gr = _product_and_grads(x, w, probe, fn=bf16_matmul_reference, **opts)
    assert y.shape == ref.shape and y.dtype == jnp.dtype(out_dtype)
    np.testing.assert_allclose(_f32(y), _f32(ref), **_tol(x.shape[-1]))
    assert g[1].shape == w.shape
    # The op rounds dy to bf16 before its products (the reference keeps it f32 through a mixed dot) and
    # both round the gradient to bf16: each is within 2^-9 of sum |dy| |operand|, so 2^-7 of it bounds
    # their difference, plus f32 summation noise.
    dy, xm = np.abs(_f32(probe)).reshape(-1, y.shape[-1]), np.abs(_f32(x)).reshape(-1, x.shape[-1])
    wm = np.abs(_f32(w)).T if transpose_w else np.abs(_f32(w))
    scale_dx = (dy @ wm.T).reshape(x.shape)
    scale_dw = (dy.T @ xm) if transpose_w else (xm.T @ dy)
    for a, b, scale in zip(g, gr, (scale_dx, scale_dw)):
        assert a.dtype == b.dtype == BF16
        assert np.all(np.abs(_f32(a) - _f32(b)) <= 2.0**-7 * scale + 1e-5), np.abs(_f32(a) - _f32(b)).max()


@pytest.mark.parametrize("kernel", ["ffi", "xla"])
def test_exact_on_small_integers(kernel):
    """Integers below 2^8 are exact in bf16 and their sums exact in f32: any order gives one answer."""
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.integers(-8, 8, (13, 301)), BF16)
    w = jnp.asarray(rng.integers(-8, 8, (301, 70)), BF16)
    want = np.asarray(x, np.float32) @ np.asarray(w, np.float32)
    np.testing.assert_array_equal(np.asarray(bf16_matmul(x, w, out_dtype=jnp.float32, kernel=kernel)), want)
    np.testing.assert_array_equal(np.asarray(jax.jit(bf16_matmul, static_argnames=("out_dtype", "kernel"))(
        x, w, out_dtype=jnp.float32, kernel=kernel)), want)
    np.testing.assert_array_equal(np.asarray(bf16_matmul(x, w.T, out_dtype=jnp.float32, transpose_w=True,
                                                         kernel=kernel)), want)


@pytest.mark.parametrize("k", [1030, 1101])
@pytest.mark.parametrize("transpose_w", [False, True])
def test_exact_products_in_every_layout(transpose_w, k):
    """Ternary operands make every sum an integer that f32 (forward) and bf16 (gradients, |sum| <= 256)
    hold exactly, so the forward product and both backward products (A transposed, B transposed) must
    equal numpy's whatever the kernel's order: K even (A read in place) and odd (A packed), over two
    slabs, M over many row tiles."""
    rng = np.random.default_rng(k)
    x = jnp.asarray(rng.integers(-1, 2, (197, k)), BF16)
    w_kn = rng.integers(-1, 2, (k, 70)).astype(np.float32)
    w = jnp.asarray(w_kn.T if transpose_w else w_kn, BF16)
    dy = rng.integers(-1, 2, (197, 70)).astype(np.float32)
    y, vjp = jax.vjp(lambda a, b: bf16_matmul(a, b, out_dtype=jnp.float32, transpose_w=transpose_w), x, w)
    np.testing.assert_array_equal(np.asarray(y), _f32(x) @ w_kn)
    dx, dw = vjp(jnp.asarray(dy))
    np.testing.assert_array_equal(_f32(dx), dy @ w_kn.T)
    np.testing.assert_array_equal(_f32(dw), (dy.T @ _f32(x)) if transpose_w else (_f32(x).T @ dy))


@pytest.mark.parametrize("k", [300, 301])
@pytest.mark.parametrize("transpose_w", [False, True])
def test_non_finite_values_stay_in_their_row_and_column(transpose_w, k):
    """An inf in x's last row and in w's last column (at the last k, where odd K pads the final pair)
    reaches only that row and that column; NaN survives the rounding to a bf16 output."""
    rng = np.random.default_rng(3)
    x = np.asarray(rng.integers(-4, 5, (40, k)), np.float32)
    w_kn = np.asarray(rng.integers(-4, 5, (k, 40)), np.float32)
    x[-1, -1], w_kn[-1, -1] = np.inf, np.inf
    w = w_kn.T if transpose_w else w_kn
    for out_dtype in (jnp.float32, BF16):
        y = _f32(bf16_matmul(jnp.asarray(x, BF16), jnp.asarray(w, BF16), out_dtype=out_dtype,
                             transpose_w=transpose_w))
        with np.errstate(invalid="ignore"):
            want = _f32(jnp.asarray(x @ w_kn, out_dtype))  # integers exact in f32, rounded once to out_dtype
        np.testing.assert_array_equal(y[:-1, :-1], want[:-1, :-1])
        assert not np.isfinite(y[-1]).any() and not np.isfinite(y[:, -1]).any()
        np.testing.assert_array_equal(np.isnan(y), np.isnan(want))


@pytest.mark.parametrize("call, pattern", [
    (lambda: bf16_matmul(jnp.ones((2, 3), jnp.float32), jnp.ones((3, 4), BF16)), "x must be bfloat16"),
    (lambda: bf16_matmul(jnp.ones((2, 3), BF16), jnp.ones((4, 4), BF16)), r"x's last dimension \(3\) does not match"),
    (lambda: bf16_matmul(jnp.ones((2, 3), BF16), jnp.ones((3,), BF16)), r"need x \(..., K\) and w \(K, N\)"),
    (lambda: bf16_matmul(jnp.ones((2, 3), BF16), jnp.ones((3, 4), BF16), out_dtype=jnp.int32), "out_dtype must be"),
    (lambda: bf16_matmul(jnp.ones((2, 3), BF16), jnp.ones((3, 4), BF16), transpose_w=True),
     r"x's last dimension \(3\) does not match w's K \(4\)"),
    (lambda: bf16_matmul(jnp.ones((2, 3), BF16), jnp.ones((3, 4), BF16), kernel="amx"), "kernel must be one of"),
    (lambda: bf16_dot_general("amx"), "kernel must be one of"),
])
def test_argument_errors(call, pattern):
    with pytest.raises(ValueError, match=f"bf16_matmul: {pattern}"):
        call()


def test_linear_hook_sends_bf16_linears_to_the_op_and_leaves_the_rest():
    layer = nnx.Linear(24, 10, dtype=BF16, rngs=nnx.Rngs(0), dot_general=bf16_dot_general("ffi"))
    x = jnp.asarray(np.random.default_rng(3).standard_normal((4, 24)), jnp.float32)
    assert "tunix_rt_bf16_matmul" in jax.jit(layer.__call__).lower(x).as_text()
    plain = nnx.Linear(24, 10, dtype=BF16, rngs=nnx.Rngs(0))
    np.testing.assert_allclose(_f32(layer(x)), _f32(plain(x)), rtol=1e-2, atol=2e-2)
    f32_layer = nnx.Linear(24, 10, rngs=nnx.Rngs(0), dot_general=bf16_dot_general("ffi"))
    assert "tunix_rt_bf16_matmul" not in jax.jit(f32_layer.__call__).lower(x).as_text()
    assert bf16_dot_general("xla") is bf16_dot_general("xla")  # one function: one graph definition


@pytest.mark.parametrize("kernel", ["ffi", "xla"])
def test_tied_head_hook(kernel):
    """The decoder's Embed.attend (x @ table^T) goes through the hook, on the kernel's custom_vjp."""
    head = Embed(50, 24, dtype=BF16, rngs=nnx.Rngs(0))
    plain = head.attend
    h = jnp.asarray(np.random.default_rng(5).standard_normal((3, 24)), BF16)
    want = plain(h)
    head.dot_general = bf16_dot_general(kernel)
    np.testing.assert_allclose(_f32(head.attend(h)), _f32(want), rtol=1e-2, atol=2e-2)
    hlo = jax.jit(lambda h: head.attend(h)).lower(h).as_text()
    if kernel == "ffi":
        assert "tunix_rt_bf16_matmul" in hlo
    else:  # bf16 operands into a dot with an f32 result (XLA widens a bf16-result dot to f32 first)
        assert "tunix_rt_bf16_matmul" not in hlo and "bf16>) -> tensor<3x50xf32>" in hlo
    grad = jax.grad(lambda h: jnp.sum(head.attend(h).astype(jnp.float32)))(h)
    assert grad.dtype == BF16 and grad.shape == h.shape


def test_default_kernel_follows_amx():
    assert default_kernel() == ("xla" if _ffi.cpu_features().get("amx_bf16") else "ffi")


_TIER_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np, jax, jax.numpy as jnp
    from tunix_rt.ops import _ffi
    from tunix_rt.ops.bf16_matmul import bf16_matmul

    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((45, 301)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((301, 70)), jnp.bfloat16)
    dy = jnp.asarray(rng.standard_normal((45, 70)), jnp.float32)
    y, vjp = jax.vjp(lambda a, b: bf16_matmul(a, b, out_dtype=jnp.float32), x, w)
    dx, dw = vjp(dy)
    np.savez(sys.argv[1], y=np.asarray(y), dx=np.asarray(dx, np.float32), dw=np.asarray(dw, np.float32))
    print(json.dumps({"isa": _ffi.isa_level()}))
    """
)


@pytest.fixture(scope="module")
def tier_runs(tmp_path_factory):
    return run_tiers(TIERS, _TIER_SCRIPT, tmp_path_factory.mktemp("bf16_isa"))


@pytest.mark.parametrize("tier", TIERS)
def test_every_isa_tier_matches_reference(tier_runs, tier):
    report, res = tier_runs[tier]
    assert report["isa"] == expected_tier(tier)
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((45, 301)), BF16)
    w = jnp.asarray(rng.standard_normal((301, 70)), BF16)
    dy = jnp.asarray(rng.standard_normal((45, 70)), jnp.float32)
    y, vjp = jax.vjp(lambda a, b: bf16_matmul_reference(a, b, out_dtype=jnp.float32), x, w)
    np.testing.assert_allclose(res["y"], np.asarray(y), rtol=1e-5, atol=1e-4)
    for name, ref, k in zip(("dx", "dw"), vjp(dy), (70, 45)):
        np.testing.assert_allclose(res[name], _f32(ref), **_tol(k), err_msg=f"{tier} {name}")
