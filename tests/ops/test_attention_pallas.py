"""The Pallas training-attention kernels (the CUDA path) against the reference, in interpret mode on CPU.

Interpret mode runs the kernels' own programs: their grids, tile skipping, in-tile masks from positions and
segments, online softmax and the FlashAttention-2 backward. The reference runs in f32 on the same inputs
(test_attention's tolerances, which the CPU op meets). The Triton lowering itself is checked by lowering for
CUDA here (no GPU needed to lower); compiling and running it needs a GPU (benchmarks/device_check.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.ops.conftest import kernels, trainer_steps
from tests.ops.test_attention import (
    _close,
    _f32,
    _forward_and_vjp,
    _magnitudes,
    assert_unseen_queries_average_every_value,
    packed_row,
)
from tunix_rt.ops import attention, attention_reference
from tunix_rt.ops.attention_pallas import attention_pallas, supported, tile_size

pytestmark = pytest.mark.usefixtures("fast_compiles")  # interpret-mode programs are large, compiled once per example

_pallas = functools.partial(attention_pallas, interpret=True)


def _case(rng, b, t, kv, group, d, kind, dtype, magnitude=1.0):
    rows = [packed_row(rng, t, kind) for _ in range(b)]
    positions = jnp.asarray(np.stack([r[0] for r in rows]))
    segments = None if kind == "causal" else jnp.asarray(np.stack([r[1] for r in rows]))
    q = jnp.asarray(rng.standard_normal((b, t, kv * group, d)) * magnitude, dtype)
    k, v = (jnp.asarray(rng.standard_normal((b, t, kv, d)), dtype) for _ in range(2))
    dout = jnp.asarray(rng.standard_normal((b, t, kv * group, d)), dtype)
    return (q, k, v), positions, segments, dout


def check(arrays, positions, segments, dout, tile=None, **opts):
    q, k, v = arrays
    fn = functools.partial(_pallas, tile=tile)
    y, grads = _forward_and_vjp(q, k, v, positions, segments, dout, fn=fn, **opts)
    y_ref, grads_ref = _forward_and_vjp(*map(_f32, arrays), positions, segments, _f32(dout), fn=attention_reference,
                                        **opts)
    assert y.shape == q.shape and y.dtype == q.dtype
    _close(y, y_ref, q.dtype, "out")
    for name, g, g_ref, x, size in zip("qkv", grads, grads_ref, arrays, _magnitudes(q, k, v, dout, opts["scale"])):
        assert g.shape == x.shape and g.dtype == x.dtype
        _close(g, g_ref, q.dtype, f"d{name}", 1e-2 * size)


@st.composite
def cases(draw):
    """test_attention's packed rows (plain causal with left padding, packed, shared-prefix and grouped
    completions, trailing padding) at lengths around the kernels' tiles, on power-of-two head dims."""
    d = draw(st.sampled_from([16, 32, 64]))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    case = _case(rng, draw(st.integers(1, 2)), draw(st.sampled_from([1, 2, 15, 16, 17, 63, 64, 65, 100, 150])),
                 draw(st.integers(1, 3)), draw(st.sampled_from([1, 2, 3])), d,
                 draw(st.sampled_from(["causal", "packed", "shared", "grouped"])),
                 draw(st.sampled_from([jnp.float32, jnp.bfloat16])), draw(st.sampled_from([1.0, 30.0])))
    opts = dict(scale=float(d) ** -0.5, window=draw(st.sampled_from([None, 1, 5, 40])),
                softcap=draw(st.sampled_from([None, 20.0])))
    return case, opts


@pytest.mark.slow
@settings(max_examples=30, deadline=None)
@given(case_opts=cases())
def test_matches_reference_forward_and_backward(case_opts):
    case, opts = case_opts
    check(*case, **opts)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_head_dims_and_gqa_ratios(d, group, dtype):
    rng = np.random.default_rng(d + group)
    check(*_case(rng, 1, 40, 2, group, d, "grouped", dtype), scale=d**-0.5, window=17 if group == 4 else None,
          softcap=30.0 if group == 8 else None)


def test_queries_that_see_nothing_average_every_value():
    """Rows of padding alone, answered as the reference and the CPU op answer them (the wrapper's part)."""
    assert_unseen_queries_average_every_value(_pallas, 16)


def test_a_row_mixing_seen_and_unseen_queries():
    """Left padding beside real tokens: the padding queries take the mean, the real ones their softmax."""
    check(*_case(np.random.default_rng(3), 2, 50, 2, 2, 16, "causal", jnp.float32), scale=0.25, window=None,
          softcap=None)


def test_supported_shapes_and_tiles():
    def bf16(d, dtype=jnp.bfloat16):
        x = jnp.zeros((1, 8, 2, d), dtype)
        return x, x, x

    assert supported(*bf16(64)) and supported(*bf16(16)) and supported(*bf16(256))
    assert not supported(*bf16(64, jnp.float32))  # f32: XLA's reference (measured faster on the device)
    q, k, _ = bf16(64)
    assert not supported(q, k, k.astype(jnp.float32)) and not supported(q.astype(jnp.float32), k, k)
    assert not supported(*bf16(72))  # not a power of two: the reference runs instead
    assert not supported(*bf16(8))  # under Triton's 16-wide tile
    assert not supported(*bf16(512))  # past the largest head dim measured on a device
    assert [tile_size(t) for t in (1, 16, 17, 33, 64, 65, 4096)] == [16, 16, 32, 64, 64, 64, 64]
    assert tile_size(4096, tile=128) == 128
    with pytest.raises(ValueError, match="tile must be a power of two"):
        tile_size(64, tile=24)


@pytest.mark.parametrize("tile", [16, 32, 128])
def test_any_tile_gives_the_same_attention(tile):
    """A tile longer than the row, or several per row: the same answer (the device check sweeps tiles)."""
    check(*_case(np.random.default_rng(tile), 1, 70, 1, 2, 16, "packed", jnp.float32), scale=0.25, window=9,
          softcap=None, tile=tile)


def _program(mode: str, d: int = 16, dtype=jnp.bfloat16) -> str:
    q = jnp.zeros((1, 8, 2, d), dtype)
    positions = jnp.arange(8, dtype=jnp.int32)[None]
    with kernels(mode):
        loss = lambda q: jnp.sum(attention(q, q, q, positions, scale=0.1).astype(jnp.float32))  # noqa: E731
        return str(jax.make_jaxpr(jax.grad(loss))(q))


def test_kernel_modes_pick_the_path():
    program = _program("interpret")
    assert program.count("pallas_call") == 3  # forward, dk/dv, dq
    assert "pallas_call" not in _program("interpret", d=24)  # unsupported head_dim: the reference
    assert "pallas_call" not in _program("interpret", dtype=jnp.float32)  # f32: the reference
    assert "pallas_call" not in _program("reference")


@pytest.mark.parametrize("d,group,dtype,segments", [(64, 3, jnp.bfloat16, True), (128, 4, jnp.float32, False),
                                                    (256, 8, jnp.bfloat16, True)])
def test_lowers_to_triton_for_cuda(d, group, dtype, segments):
    """Forward and backward lower through Pallas's Triton path for CUDA; no GPU is needed for that."""
    q = jax.ShapeDtypeStruct((2, 100, 2 * group, d), dtype)
    k = jax.ShapeDtypeStruct((2, 100, 2, d), dtype)
    ids = jax.ShapeDtypeStruct((2, 100), jnp.int32)

    def step(q, k, v, positions, segment_ids, dout):
        fn = lambda q, k, v: attention_pallas(q, k, v, positions, segment_ids if segments else None,  # noqa: E731
                                              scale=0.1, window=40, softcap=30.0)
        y, vjp = jax.vjp(fn, q, k, v)
        return y, vjp(dout)

    text = jax.jit(step).trace(q, k, k, ids, ids, q).lower(lowering_platforms=("cuda",)).as_text()
    for name in ("tunix_rt_attention_fwd", "tunix_rt_attention_dkv", "tunix_rt_attention_dq"):
        assert name in text
    assert text.count("xla.gpu.triton") == 3


def test_a_bf16_training_step_through_the_kernels_trains_as_the_reference(tmp_path):
    """bf16 SFT steps of a tiny decoder with the kernels (interpret mode) against the reference path: the same
    losses and gradient norms up to bf16 rounding, and the step's program runs the three kernels."""
    from tests.train import sharded_worker as W

    config = dict(compute_dtype="bfloat16", bf16_matmul="xla")
    (kernel_program, kernel), (reference_program, reference) = (
        trainer_steps(mode, tmp_path, W.new_model(), **config) for mode in ("interpret", "reference"))
    assert "pallas_call" in kernel_program and "pallas_call" not in reference_program
    for name in ("tunix_rt_attention_fwd", "tunix_rt_attention_dkv", "tunix_rt_attention_dq"):  # the last two:
        assert name in kernel_program  # Pallas's alone (the CPU op's backward is tunix_rt_attention_bwd)
    for a, b in zip(kernel, reference):
        np.testing.assert_allclose(a["loss"], b["loss"], rtol=2e-2)
        np.testing.assert_allclose(a["grad_norm"], b["grad_norm"], rtol=5e-2)
