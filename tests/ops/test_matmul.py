"""The row-invariant matmul (tunix_rt.ops.matmul) against XLA's dot, and its batch invariance.

What must hold: f32 and bf16 products equal x @ w up to f32 summation order (bf16: plus one rounding of
the result); every row is bit-equal to the same row computed alone, whatever M, K, N and layout of w
(the engine's batch invariance rests on it); gradients are the reference's; nnx.Linear and the tied
embedding head reach it through invariant_dot_general; bad inputs are ValueErrors naming the argument.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from tunix_rt.models.decoder import Embed
from tunix_rt.ops._ffi import has_cpu_target
from tunix_rt.ops.matmul import invariant_dot_general, matmul, matmul_reference

pytestmark = pytest.mark.skipif(not has_cpu_target("tunix_rt_bf16_matmul"), reason="needs the compiled extension")


def _bound(x, w):
    """K ulps of |x| @ |w|: any summation order of an f32 dot product stays within it."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    return x @ w, 2.0**-24 * x.shape[1] * (np.abs(x) @ np.abs(w)) + 1e-30


@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 20), k=st.integers(1, 600), n=st.integers(1, 70), transpose_w=st.booleans(),
       bf16=st.booleans(), scale=st.sampled_from([1e-3, 1.0, 1e4]), seed=st.integers(0, 2**16))
def test_rows_equal_each_row_alone(m, k, n, transpose_w, bf16, scale, seed):
    rng = np.random.default_rng(seed)
    dtype = jnp.bfloat16 if bf16 else jnp.float32
    x = jnp.asarray(rng.standard_normal((m, k)) * scale, dtype)
    w = jnp.asarray(rng.standard_normal((n, k) if transpose_w else (k, n)), dtype)
    y = np.asarray(matmul(x, w, transpose_w=transpose_w).astype(jnp.float32))
    for i in range(m):
        np.testing.assert_array_equal(y[i], np.asarray(matmul(x[i], w, transpose_w=transpose_w).astype(jnp.float32)))
    ref, bound = _bound(np.asarray(x.astype(jnp.float32)), np.asarray((w.T if transpose_w else w).astype(jnp.float32)))
    if bf16:
        bound = bound + 2.0**-8 * (np.abs(ref) + bound)
    assert np.all(np.abs(y - ref) <= bound)


def test_leading_dims_dtype_and_gradient():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 3, 40)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((40, 9)), jnp.float32)
    y = matmul(x, w)
    assert y.shape == (2, 3, 9) and y.dtype == jnp.float32
    np.testing.assert_allclose(y, matmul_reference(x, w), rtol=1e-5, atol=1e-5)
    assert jax.jit(matmul)(x, w).shape == y.shape

    def loss(f):
        return lambda x, w: (f(x, w) ** 2).sum()

    for got, want in zip(jax.grad(loss(matmul), (0, 1))(x, w), jax.grad(loss(matmul_reference), (0, 1))(x, w)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_linear_and_tied_head_reach_it():
    """nnx.Linear and the decoder's tied embedding head, with invariant_dot_general installed, compute through
    the FFI op (a custom call in the program) and give the same numbers as calling it directly."""
    rng = np.random.default_rng(1)
    linear = nnx.Linear(24, 10, rngs=nnx.Rngs(0))
    embed = Embed(11, 24, rngs=nnx.Rngs(1))
    x = jnp.asarray(rng.standard_normal((5, 24)), jnp.float32)
    for module in (linear, embed):
        module.dot_general = invariant_dot_general
    np.testing.assert_array_equal(linear(x), matmul(x, linear.kernel[...]) + linear.bias[...])
    np.testing.assert_array_equal(embed.attend(x), matmul(x, embed.embedding[...], transpose_w=True))
    assert "tunix_rt_bf16_matmul" in jax.jit(lambda x: linear(x)).lower(x).as_text()
    # a product it does not cover (mixed dtypes) goes to XLA's dot unchanged
    mixed = invariant_dot_general(x, jnp.ones((24, 3), jnp.bfloat16), (((1,), (0,)), ((), ())))
    np.testing.assert_allclose(mixed, x @ jnp.ones((24, 3)), rtol=1e-2)


@pytest.mark.parametrize("fn", [matmul, matmul_reference])
def test_bad_inputs_name_the_argument(fn):
    x = jnp.ones((2, 8), jnp.float32)
    with pytest.raises(ValueError, match="matmul: x must be float32 or bfloat16"):
        fn(x.astype(jnp.int32), jnp.ones((8, 3)))
    with pytest.raises(ValueError, match="matmul: w must be an array"):
        fn(x, [[1.0]])
    with pytest.raises(ValueError, match="one dtype"):
        fn(x, jnp.ones((8, 3), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"x's last dimension \(8\) does not match w's K \(5\)"):
        fn(x, jnp.ones((5, 3)))
    with pytest.raises(ValueError, match="need x"):
        fn(x, jnp.ones((8,)))
