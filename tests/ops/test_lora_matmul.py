"""lora_matmul (x @ w + s (x @ a) @ b as one bf16 product, the adapter in the base's f32 sums) vs its
reference under plain autodiff, on both kernels: hypothesis shapes (K odd and past one slab, ranks
from 1 to past a slab, M and N past one work block, empty dimensions), forward and backward, both
output dtypes; exact integer cases against numpy; every ISA tier; argument errors; and the LoRA layer
taking it in bf16 (and not where the adapter cannot ride in the base's sums)."""

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
from tunix_rt.models.decoder import Linear
from tunix_rt.models.lora import LoRALinear
from tunix_rt.ops import _ffi
from tunix_rt.ops.bf16_matmul import bf16_dot_general, lora_matmul, lora_matmul_reference

pytestmark = [pytest.mark.skipif(not _ffi.has_cpu_target("tunix_rt_bf16_matmul_plus"),
                                 reason="tunix_rt._ext is not built: no FFI op to test"),
              pytest.mark.usefixtures("fast_compiles")]
BF16 = jnp.bfloat16


def _f32(a):
    return np.asarray(jnp.asarray(a, jnp.float32))


def _assert_close_gradients(got, want, x, w, a, b, dy, scaling):
    """Each side rounds dy, s dy @ b^T and its results to bf16 at its own points, each within 2^-9 of the
    matching sum of magnitudes: 2^-5 of those sums bounds the difference of the two gradients."""
    dy = np.abs(_f32(dy)).reshape(-1, w.shape[1])
    xm, wm, am, bm = (np.abs(_f32(t)) for t in (x, w, a, b))
    xm = xm.reshape(-1, x.shape[-1])
    dyb = dy @ bm.T * scaling
    scales = ((dy @ wm.T + dyb @ am.T).reshape(x.shape), xm.T @ dy, xm.T @ dyb, (xm @ am * scaling).T @ dy)
    for name, g, r, scale in zip("xwab", got, want, scales):
        assert g.shape == r.shape, name
        assert np.all(np.abs(_f32(g) - _f32(r)) <= 2.0**-5 * scale + 1e-5), (name, np.abs(_f32(g) - _f32(r)).max())


@st.composite
def cases(draw):
    lead = draw(st.sampled_from([(), (0,), (3,), (2, 5), (197,)]))
    k = draw(st.sampled_from([1, 2, 7, 64, 301, 1030]))
    n = draw(st.sampled_from([1, 5, 33, 260]))
    r = draw(st.sampled_from([1, 3, 8, 16, 530]))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    x, w, a, b = (jnp.asarray(rng.standard_normal(shape), BF16) for shape in ((*lead, k), (k, n), (k, r), (r, n)))
    return x, w, a, b, draw(st.sampled_from([0.5, 2.0])), draw(st.sampled_from([jnp.float32, BF16]))


@functools.partial(jax.jit, static_argnames=("fn", "scaling", "out_dtype"))
def _product_and_grads(x, w, a, b, probe, *, fn, scaling, out_dtype):
    """fn's product and the gradients of sum(product * probe) over (x, w, a, b), as one program per example."""
    def loss(*args):
        return jnp.sum((fn(*args, scaling=scaling, out_dtype=out_dtype) * probe).astype(jnp.float32))
    return fn(x, w, a, b, scaling=scaling, out_dtype=out_dtype), jax.grad(loss, argnums=(0, 1, 2, 3))(x, w, a, b)


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["ffi", "xla"])
@settings(max_examples=30)
@given(case=cases())
def test_matches_reference_forward_and_backward(kernel, case):
    x, w, a, b, scaling, out_dtype = case
    probe = jnp.asarray(np.random.default_rng(1).standard_normal((*x.shape[:-1], w.shape[1])), out_dtype)
    opts = dict(scaling=scaling, out_dtype=out_dtype)
    y, g = _product_and_grads(x, w, a, b, probe, fn=functools.partial(lora_matmul, kernel=kernel), **opts)
    ref, gr = _product_and_grads(x, w, a, b, probe, fn=lora_matmul_reference, **opts)
    assert y.shape == ref.shape and y.dtype == jnp.dtype(out_dtype)
    assert all(t.dtype == BF16 for t in g)
    # Both round s x @ a to bf16 and sum the rest in f32, in another order; a bf16 result adds one rounding.
    scale_y = np.abs(_f32(x)) @ np.abs(_f32(w)) + np.abs(_f32(x)) @ np.abs(_f32(a)) * scaling @ np.abs(_f32(b))
    bound = 2.0**-7 if out_dtype == BF16 else 1e-5
    assert np.all(np.abs(_f32(y) - _f32(ref)) <= bound * scale_y + 1e-5)
    _assert_close_gradients(g, gr, x, w, a, b, probe, scaling)


@pytest.mark.parametrize("kernel", ["ffi", "xla"])
@pytest.mark.parametrize("k, r, scaling", [(300, 8, 1.0), (301, 3, 2.0), (1030, 16, 1.0), (64, 530, 2.0),
                                           (301, 530, 1.0)])
def test_exact_on_ternary_operands(kernel, k, r, scaling):
    """Ternary operands (sparse adapters) with s a power of two make every sum an integer that bf16 holds
    exactly (checked), so the forward product and every gradient must equal numpy's whatever the kernel's order:
    K even (x read in place) and odd (packed), r even, odd and past one slab, M over many row tiles."""
    rng = np.random.default_rng(k + r)
    x, w, dy = (rng.integers(-1, 2, shape).astype(np.float32) for shape in ((97, k), (k, 70), (97, 70)))
    density = 0.1 if r <= 16 else 0.02
    a, b = ((rng.integers(-1, 2, shape) * (rng.random(shape) < density)).astype(np.float32)
            for shape in ((k, r), (r, 70)))
    us, dyb = scaling * (x @ a), scaling * (dy @ b.T)
    want = (x @ w + us @ b, dy @ w.T + dyb @ a.T, x.T @ dy, x.T @ dyb, us.T @ dy)
    assert all(np.abs(v).max() <= 256 for v in (us, dyb, *want[1:]))  # integers exact in bf16
    y, vjp = jax.vjp(lambda *t: lora_matmul(*t, scaling=scaling, out_dtype=jnp.float32, kernel=kernel),
                     *(jnp.asarray(t, BF16) for t in (x, w, a, b)))
    np.testing.assert_array_equal(np.asarray(y), want[0])
    for got, expected in zip(vjp(jnp.asarray(dy)), want[1:]):
        np.testing.assert_array_equal(_f32(got), expected)


def test_non_finite_values_stay_in_their_row_and_column():
    """An inf in x's last row reaches only that row (through both products); a NaN in b's last column
    only that column."""
    rng = np.random.default_rng(3)
    x, w, a, b = (rng.integers(-3, 4, shape).astype(np.float32) for shape in ((40, 301), (301, 40), (301, 8), (8, 40)))
    x[-1, -1], b[-1, -1] = np.inf, np.nan
    y = _f32(lora_matmul(*(jnp.asarray(t, BF16) for t in (x, w, a, b)), scaling=1.0, out_dtype=jnp.float32))
    assert not np.isfinite(y[-1]).any() and np.isnan(y[:, -1]).all()
    with np.errstate(invalid="ignore"):
        want = x @ w + (x @ a) @ b
    np.testing.assert_array_equal(y[:-1, :-1], want[:-1, :-1])


def _ones(*shape, dtype=BF16):
    return jnp.ones(shape, dtype)


@pytest.mark.parametrize("call, pattern", [
    (lambda: lora_matmul(_ones(2, 3, dtype=jnp.float32), _ones(3, 4), _ones(3, 2), _ones(2, 4), scaling=1.0),
     "x must be bfloat16"),
    (lambda: lora_matmul(_ones(2, 3), _ones(3, 4), _ones(3, 2, dtype=jnp.float32), _ones(2, 4), scaling=1.0),
     "a must be bfloat16"),
    (lambda: lora_matmul(_ones(2, 3), _ones(4, 4), _ones(3, 2), _ones(2, 4), scaling=1.0),
     r"x's last dimension \(3\) does not match"),
    (lambda: lora_matmul(_ones(2, 3), _ones(3, 4), _ones(4, 2), _ones(2, 4), scaling=1.0),
     r"need a \(K, r\) and b \(r, N\) for w \(K, N\) = \(3, 4\), got a \(4, 2\)"),
    (lambda: lora_matmul(_ones(2, 3), _ones(3, 4), _ones(3, 2), _ones(3, 4), scaling=1.0),
     r"need a .* got a \(3, 2\) and b \(3, 4\)"),
    (lambda: lora_matmul(_ones(2, 3), _ones(3, 4), _ones(3, 2), _ones(2, 5), scaling=1.0),
     r"need a .* got a \(3, 2\) and b \(2, 5\)"),
    (lambda: lora_matmul(_ones(2, 3), _ones(3, 4), _ones(3, 2), _ones(2, 4), scaling=float("nan")),
     "scaling must be a finite number"),
    (lambda: lora_matmul(_ones(2, 3), _ones(3, 4), _ones(3, 2), _ones(2, 4), scaling=1.0, out_dtype=jnp.int8),
     "out_dtype must be"),
    (lambda: lora_matmul(_ones(2, 3), _ones(3, 4), _ones(3, 2), _ones(2, 4), scaling=1.0, kernel="amx"),
     "kernel must be one of"),
])
def test_argument_errors(call, pattern):
    with pytest.raises(ValueError, match=f"lora_matmul: {pattern}"):
        call()


def _lora_layer(kernel, dropout=0.0):
    base = Linear(48, 40, dtype=BF16, rngs=nnx.Rngs(0), dot_general=bf16_dot_general(kernel))
    layer = LoRALinear(base, rank=4, alpha=8.0, dropout=dropout, rngs=nnx.Rngs(1))
    layer.lora_b.set_value(jax.random.normal(jax.random.key(2), layer.lora_b.shape) * 0.1)
    return layer


def _lowered(layer, x):
    graphdef, state = nnx.split(layer)
    return jax.jit(lambda s, x: nnx.merge(graphdef, s)(x)).lower(state, x).as_text()


@pytest.mark.parametrize("kernel", ["ffi", "xla"])
def test_lora_layer_fuses_its_adapter_in_bf16(kernel):
    layer = _lora_layer(kernel)
    x = jnp.asarray(np.random.default_rng(4).standard_normal((2, 7, 48)), BF16)
    hlo = _lowered(layer, x)
    assert ("@tunix_rt_bf16_matmul_plus(" in hlo) == (kernel == "ffi") and "@tunix_rt_bf16_matmul(" not in hlo
    base = layer.base
    want = (_f32(x) @ _f32(base.kernel[...].astype(BF16)) + _f32(base.bias[...].astype(BF16))
            + _f32(x) @ _f32(layer.lora_a[...].astype(BF16)) @ _f32(layer.lora_b[...].astype(BF16)) * layer.scaling)
    np.testing.assert_allclose(_f32(layer(x)), want, rtol=2e-2, atol=5e-2)


def test_lora_layer_keeps_the_separate_adapter_where_it_cannot_fuse():
    """Dropout feeds the adapter another input than the base, the engine's row-invariant path and an f32 result
    asked of the base have their own products, and f32 compute runs XLA's dot: no fused op."""
    x = jnp.asarray(np.random.default_rng(4).standard_normal((3, 48)), BF16)
    assert "@tunix_rt_bf16_matmul_plus(" in _lowered(_lora_layer("ffi"), x)
    assert "tunix_rt_bf16_matmul_plus" not in _lowered(_lora_layer("ffi", dropout=0.1), x)
    invariant = _lora_layer("ffi")
    invariant.invariant = True
    assert "tunix_rt_bf16_matmul_plus" not in _lowered(invariant, x)
    f32_out = _lora_layer("ffi")
    f32_out.base.preferred_element_type = jnp.float32
    assert "tunix_rt_bf16_matmul_plus" not in _lowered(f32_out, x) and f32_out(x).dtype == jnp.float32
    f32 = LoRALinear(Linear(48, 40, rngs=nnx.Rngs(0), dot_general=bf16_dot_general("ffi")), rank=4, alpha=8.0,
                     dropout=0.0, rngs=nnx.Rngs(1))
    assert "tunix_rt_bf16_matmul_plus" not in _lowered(f32, x.astype(jnp.float32))


_TIER_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np, jax, jax.numpy as jnp
    from tunix_rt.ops import _ffi
    from tunix_rt.ops.bf16_matmul import lora_matmul

    rng = np.random.default_rng(4)
    x, w, a, b = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in ((45, 301), (301, 70), (301, 5), (5, 70)))
    dy = jnp.asarray(rng.standard_normal((45, 70)), jnp.float32)
    y, vjp = jax.vjp(lambda *t: lora_matmul(*t, scaling=2.0, out_dtype=jnp.float32), x, w, a, b)
    grads = vjp(dy)
    np.savez(sys.argv[1], y=np.asarray(y), **{"d" + n: np.asarray(g, np.float32) for n, g in zip("xwab", grads)})
    print(json.dumps({"isa": _ffi.isa_level()}))
    """
)


@pytest.fixture(scope="module")
def tier_runs(tmp_path_factory):
    return run_tiers(TIERS, _TIER_SCRIPT, tmp_path_factory.mktemp("lora_isa"))


@pytest.mark.parametrize("tier", TIERS)
def test_every_isa_tier_matches_reference(tier_runs, tier):
    report, res = tier_runs[tier]
    assert report["isa"] == expected_tier(tier)
    rng = np.random.default_rng(4)
    x, w, a, b = (jnp.asarray(rng.standard_normal(s), BF16) for s in ((45, 301), (301, 70), (301, 5), (5, 70)))
    dy = jnp.asarray(rng.standard_normal((45, 70)), jnp.float32)
    y, vjp = jax.vjp(lambda *t: lora_matmul_reference(*t, scaling=2.0, out_dtype=jnp.float32), x, w, a, b)
    np.testing.assert_allclose(res["y"], np.asarray(y), rtol=1e-4, atol=1e-3)
    _assert_close_gradients([res["d" + name] for name in "xwab"], vjp(dy), x, w, a, b, dy, 2.0)


def _plus_call(a, b, u, v, *, transpose_b=False, transpose_v=False):
    out = jax.ShapeDtypeStruct((a.shape[0], b.shape[-2] if transpose_b else b.shape[-1]), a.dtype)
    return jax.ffi.ffi_call("tunix_rt_bf16_matmul_plus", out)(a, b, u, v, transpose_a=False, transpose_b=transpose_b,
                                                              transpose_v=transpose_v)


@pytest.mark.parametrize("transpose_b, transpose_v", [(False, False), (True, True)])
def test_plus_handler_on_f32_operands(transpose_b, transpose_v):
    """The handler's f32 route (the shared f32 GEMM, both products): integers make the sums exact."""
    rng = np.random.default_rng(6)
    a, b, u, v = (rng.integers(-4, 5, s).astype(np.float32) for s in ((13, 37), (37, 21), (13, 5), (5, 21)))
    y = _plus_call(jnp.asarray(a), jnp.asarray(b.T if transpose_b else b), jnp.asarray(u),
                   jnp.asarray(v.T if transpose_v else v), transpose_b=transpose_b, transpose_v=transpose_v)
    np.testing.assert_array_equal(np.asarray(y), a @ b + u @ v)


@pytest.mark.parametrize("shapes, message", [
    (((4, 6), (2, 6, 5), (4, 3), (3, 5)), "b, u and v must be 2-D"),
    (((4, 6), (6, 5), (4, 3), (2, 5)), r"u \(M, R\) and v \(R, N\) do not agree"),
    (((4, 6), (6, 5), (3, 3), (3, 5)), r"u \(M, R\) and v \(R, N\) do not agree"),
])
def test_plus_handler_rejects_bad_operands(shapes, message):
    a, b, u, v = (jnp.ones(s, jnp.float32) for s in shapes)
    with pytest.raises(jax.errors.JaxRuntimeError, match=f"bf16_matmul_plus: {message}"):
        jax.block_until_ready(_plus_call(a, b, u, v))
    with pytest.raises(jax.errors.JaxRuntimeError, match="bf16_matmul_plus: u and v must have a's element type"):
        jax.block_until_ready(_plus_call(jnp.ones((4, 6)), jnp.ones((6, 5)), jnp.ones((4, 3), BF16),
                                         jnp.ones((3, 5), BF16)))
