"""The Pallas grouped-matmul kernels (MoE's CUDA path) against the reference, jax.lax.ragged_dot, in interpret
mode on CPU: the work-item list over (group, row tile), the masked stores of tiles two groups share, the dw
walk over each group's rows, empty groups and rows no group owns. The Triton lowering is checked by lowering
for CUDA here; compiling and running it needs a GPU (benchmarks/device_check.py's moe part)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.ops.conftest import kernels, trainer_steps
from tests.ops.test_moe import _gmm_and_grads, _np
from tunix_rt.ops import moe
from tunix_rt.ops.grouped_matmul_pallas import grouped_matmul_pallas, supported

pytestmark = pytest.mark.usefixtures("fast_compiles")  # interpret-mode programs are large, compiled once per example

_pallas = functools.partial(grouped_matmul_pallas, interpret=True)


def check(x, w, sizes, transpose_w):
    n = w.shape[1] if transpose_w else w.shape[2]
    probe = jnp.asarray(np.random.default_rng(2).standard_normal((x.shape[0], n)), x.dtype)
    y, g = _gmm_and_grads(x, w, sizes, probe, fn=_pallas, transpose_w=transpose_w)
    yr, gr = _gmm_and_grads(x, w, sizes, probe, fn=moe.grouped_matmul_reference, transpose_w=transpose_w)
    bf16 = x.dtype == jnp.bfloat16
    scale = np.sqrt(max(x.shape[1], x.shape[0]))
    tol = dict(rtol=1e-2, atol=2e-2 * scale) if bf16 else dict(rtol=2e-5, atol=2e-5 * scale)
    assert y.dtype == x.dtype and y.shape == yr.shape
    np.testing.assert_allclose(_np(y), _np(yr), **tol)
    np.testing.assert_array_equal(_np(y)[int(np.maximum(_np(sizes), 0).sum()):], 0.0)  # rows no group owns
    for name, a, b in zip(("dx", "dw"), g, gr):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        np.testing.assert_allclose(_np(a), _np(b), **{**tol, "atol": tol["atol"] * 3}, err_msg=name)


@st.composite
def cases(draw):
    """Groups of 0 to 150 rows (inside one 64-row tile, straddling tiles, spanning several), empty groups
    and an empty tail, K and N multiples of 16."""
    e = draw(st.integers(1, 6))
    k = draw(st.sampled_from([16, 48, 64, 96]))
    n = draw(st.sampled_from([16, 32, 80, 128, 144]))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    sizes = rng.integers(0, draw(st.sampled_from([3, 40, 150])), e).astype(np.int32)
    sizes[rng.random(e) < 0.3] = 0
    m = max(int(sizes.sum()) + draw(st.integers(0, 70)), 1)
    transpose_w = draw(st.booleans())
    dtype = draw(st.sampled_from([jnp.float32, jnp.bfloat16]))
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = jnp.asarray(rng.standard_normal((e, n, k) if transpose_w else (e, k, n)), dtype)
    return x, w, jnp.asarray(sizes), transpose_w


@pytest.mark.slow
@settings(max_examples=30, deadline=None)
@given(case=cases())
def test_matches_ragged_dot_forward_and_backward(case):
    check(*case)


@pytest.mark.parametrize("transpose_w", [False, True])
def test_groups_straddling_and_spanning_tiles(transpose_w):
    """A group of one row, a group crossing a tile edge, one spanning three tiles, empty groups between."""
    rng = np.random.default_rng(3)
    sizes = jnp.asarray([1, 0, 70, 0, 150, 5], jnp.int32)
    x = jnp.asarray(rng.standard_normal((240, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((6, 48, 64) if transpose_w else (6, 64, 48)), jnp.float32)
    check(x, w, sizes, transpose_w)


def test_bad_group_sizes_are_clamped_not_read_or_written_out_of_bounds():
    """The device kernel cannot raise (the CPU op does): a negative size is an empty group and rows past x's
    are dropped, so the product is that of the clamped sizes."""
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((20, 16)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((3, 16, 16)), jnp.float32)
    got = _pallas(x, w, jnp.asarray([12, -4, 30], jnp.int32))
    want = moe.grouped_matmul_reference(x, w, jnp.asarray([12, 0, 8], jnp.int32))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sizes", [[12, -4, 30], [2**31 - 1, 1, 5], [2**30, 2**30, 2**30], [0, 0, 0], [20, 0, 0],
                                   [1, 1, 1]])
def test_work_items_stay_inside_the_arrays(sizes):
    """What a device kernel would read or write, for any sizes (interpret mode clamps slices, so it cannot show
    an out-of-bounds access): groups inside x's rows, every item's tile inside the padded rows, every dw read
    inside the rows plus one tile of padding."""
    from tunix_rt.ops.grouped_matmul_pallas import _TM, _bounds, _items

    rows = 20
    row_tiles = -(-rows // _TM)
    group, tile, starts, ends = (np.asarray(a) for a in _items(jnp.asarray(sizes, jnp.int32), rows, row_tiles))
    assert np.all((0 <= starts) & (starts <= ends) & (ends <= rows))
    np.testing.assert_array_equal(np.stack(_bounds(jnp.asarray(sizes, jnp.int32), rows)), np.stack([starts, ends]))
    valid = group >= 0
    assert np.all((0 <= tile[valid]) & (tile[valid] < row_tiles)) and np.all(group[valid] < len(sizes))
    for g in range(len(sizes)):  # every row of a group is covered by exactly its items' tiles
        covered = sorted({r for t in tile[group == g] for r in range(t * _TM, (t + 1) * _TM)} & set(range(starts[g], ends[g])))
        assert covered == list(range(starts[g], ends[g]))
        steps = -(-(ends[g] - starts[g]) // _TM)
        assert starts[g] + steps * _TM <= rows + _TM  # dw's last read


def test_supported_shapes():
    assert supported(jnp.zeros((4, 64)), jnp.zeros((2, 64, 48)), False)
    assert supported(jnp.zeros((4, 64)), jnp.zeros((2, 48, 64)), True)
    assert not supported(jnp.zeros((4, 64)), jnp.zeros((2, 64, 24)), False)  # N: the reference
    assert not supported(jnp.zeros((4, 40)), jnp.zeros((2, 40, 48)), False)  # K: the reference
    assert not supported(jnp.zeros((4, 64)), jnp.zeros((0, 64, 48)), False)  # no experts


def _program(mode: str, n: int = 32) -> str:
    x, w, sizes = jnp.zeros((8, 16)), jnp.zeros((2, 16, n)), jnp.asarray([3, 5], jnp.int32)
    with kernels(mode):
        loss = lambda x, w: jnp.sum(moe.grouped_matmul(x, w, sizes))  # noqa: E731
        return str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, w))


def test_kernel_modes_pick_the_path():
    program = _program("interpret")
    for name in ("tunix_rt_grouped_matmul", "tunix_rt_grouped_matmul_dw"):
        assert name in program
    assert program.count("pallas_call") == 3  # forward, dx, dw
    assert "pallas_call" not in _program("interpret", n=24)  # N not a multiple of 16: the reference
    assert "pallas_call" not in _program("reference")


@pytest.mark.parametrize("transpose_w,dtype", [(False, jnp.bfloat16), (True, jnp.float32)])
def test_lowers_to_triton_for_cuda(transpose_w, dtype):
    """Forward, dx and dw lower through Pallas's Triton path for CUDA; no GPU is needed for that."""
    x = jax.ShapeDtypeStruct((1000, 2048), dtype)
    w = jax.ShapeDtypeStruct((128, 768, 2048) if transpose_w else (128, 2048, 768), dtype)
    sizes = jax.ShapeDtypeStruct((128,), jnp.int32)
    dy = jax.ShapeDtypeStruct((1000, 768), dtype)

    def step(x, w, sizes, dy):
        y, vjp = jax.vjp(lambda x, w: grouped_matmul_pallas(x, w, sizes, transpose_w=transpose_w), x, w)
        return y, vjp(dy)[:2]

    text = jax.jit(step).trace(x, w, sizes, dy).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 3 and "tunix_rt_grouped_matmul_dw" in text


def test_a_moe_training_step_through_the_kernels_trains_as_the_reference(tmp_path):
    """SFT steps of a tiny MoE decoder (expert widths multiples of 16) with the kernels in interpret mode against
    the reference path: the same losses and gradient norms, and the step runs the kernels."""
    from tests.train.test_moe_training import _moe_model

    (kernel_program, kernel), (reference_program, reference) = (
        trainer_steps(mode, tmp_path, _moe_model()) for mode in ("interpret", "reference"))
    assert "pallas_call" in kernel_program and "pallas_call" not in reference_program
    assert "tunix_rt_grouped_matmul_dw" in kernel_program
    for a, b in zip(kernel, reference):
        np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-5)
        np.testing.assert_allclose(a["grad_norm"], b["grad_norm"], rtol=1e-4)
