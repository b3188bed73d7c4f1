"""QuantizedTensor as a pytree: jit arguments, sharding over N on a device mesh, Orbax round trips."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tunix_rt.ops import QuantizedTensor, dequantize, quantize


def _qt(fmt="q4_1", k=128, n=64):
    w = jnp.asarray(np.random.default_rng(0).standard_normal((k, n)), jnp.float32)
    return quantize(w, fmt)


def test_flatten_keeps_format_static():
    qt = _qt()
    leaves, treedef = jax.tree.flatten(qt)
    assert len(leaves) == 3
    back = jax.tree.unflatten(treedef, leaves)
    assert (back.fmt, back.shape, back.group) == ("q4_1", (128, 64), 32)
    doubled = jax.jit(lambda q: dequantize(q) * 2)(qt)
    np.testing.assert_array_equal(np.asarray(doubled), np.asarray(dequantize(qt)) * 2)


def test_orbax_round_trip(tmp_path):
    import orbax.checkpoint as ocp

    qt = _qt("q4_0")
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "qt", {"w": qt})
    with ocp.StandardCheckpointer() as ckpt:
        restored = ckpt.restore(tmp_path / "qt", {"w": jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), qt)})
    got = restored["w"]
    assert isinstance(got, QuantizedTensor) and got.fmt == "q4_0"
    for a, b in zip(jax.tree.leaves(qt), jax.tree.leaves(got)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


_SHARDED = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from tunix_rt.ops import quantize, quant_matmul
    assert len(jax.devices()) == 8
    mesh = Mesh(np.array(jax.devices()).reshape(8), ("tp",))
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((256, 128)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((6, 256)), jnp.float32)
    for fmt in ("q8_0", "q4_1", "int4"):
        qt = quantize(w, fmt)
        want = np.asarray(quant_matmul(x, qt))
        sharded = jax.device_put(qt, NamedSharding(mesh, P("tp", None)))  # output features split 8 ways
        assert sharded.qs.sharding.spec == P("tp", None)
        got = np.asarray(jax.jit(quant_matmul)(x, sharded))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    print("ok")
""")


@pytest.mark.parallel
def test_sharded_over_output_features():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", _SHARDED], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
