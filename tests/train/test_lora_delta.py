"""LoRA's adapter product under its hand-written backward equals plain autodiff, in f32 and bf16."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tunix_rt.models.lora import lora_delta


@pytest.mark.slow
@pytest.mark.parametrize("dtype, rtol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("m, k, r, n", [(1, 1, 1, 1), (37, 24, 4, 40), (64, 16, 8, 3)])
def test_lora_delta_matches_autodiff(dtype, rtol, m, k, r, n):
    keys = jax.random.split(jax.random.PRNGKey(m * 1000 + n), 4)
    x, a, b, dy = (jax.random.normal(key, shape).astype(dtype)
                   for key, shape in zip(keys, ((m, k), (k, r), (r, n), (m, n))))
    plain = lambda x, a, b: ((x @ a) @ b) * 2.5
    value, vjp = jax.vjp(lambda x, a, b: lora_delta(x, a, b, 2.5), x, a, b)
    value_ref, vjp_ref = jax.vjp(plain, *(t.astype(jnp.float32) for t in (x, a, b)))
    for got, want in zip((value, *vjp(dy)), (value_ref, *vjp_ref(dy.astype(jnp.float32)))):
        assert got.dtype == dtype and got.shape == want.shape
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        assert np.abs(got - want).max() <= rtol * max(np.abs(want).max(), 1e-6)
