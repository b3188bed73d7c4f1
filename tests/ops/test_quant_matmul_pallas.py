"""The Pallas quantized-matmul kernel (the CUDA path) against the reference, in interpret mode on CPU.

Interpret mode runs the kernel's own program: its grid and K splits, the row padding, the nibble split of
4-bit blocks, the per-group scales and mins, a stack's layer. The products are compared with a float64
oracle over the exactly dequantized weight: f32 x to K ulps of |x| @ |w| (summation order), bf16 x also to
the bf16 rounding of the weight tile the kernel multiplies and of the output. The Triton lowering is
checked by lowering for CUDA (no GPU needed); compiling and running it needs one (benchmarks/device_check.py).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.ops.conftest import kernels
from tunix_rt.ops import _ffi
from tunix_rt.ops.quant import FORMATS, QuantizedTensor, dequantize_reference, quant_matmul, quant_matmul_reference
from tunix_rt.ops.quant_matmul_pallas import TARGET_PROGRAMS, quant_matmul_pallas, supported, tiles

pytestmark = pytest.mark.usefixtures("fast_compiles")  # interpret-mode programs are large, compiled once per example

F32, BF16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)
FMT_GROUPS = [(f, g) for f in FORMATS for g in FORMATS[f].groups]


def random_weight(rng, fmt: str, group: int, k: int, n: int, layers: int = 0) -> QuantizedTensor:
    """Arbitrary buffers (every code, q8's -128 included; negative scales and mins), `layers` > 0: a stack."""
    f = FORMATS[fmt]
    lead = (layers,) if layers else ()
    qs = rng.integers(0, 256, (*lead, n, k * f.bits // 8)).astype(np.uint8)
    qs = qs.view(np.int8) if f.bits == 8 else qs
    scales = (rng.standard_normal((*lead, n, k // group)) * 0.1).astype(f.scale_dtype)
    mins = jnp.asarray((rng.standard_normal((*lead, n, k // group)) * 0.1).astype(np.float16)) if f.has_min else None
    return QuantizedTensor(jnp.asarray(qs), jnp.asarray(scales), mins, fmt, (k, n), group)


def run_kernel(x, qt: QuantizedTensor):
    return quant_matmul_pallas(x, qt.qs, qt.scales, qt.mins, qt.layer, fmt=qt.fmt, k=qt.shape[0], n=qt.shape[1],
                               group=qt.group, interpret=True)


def check(x, qt: QuantizedTensor):
    out = run_kernel(x, qt)
    assert out.shape == (x.shape[0], qt.shape[1]) and out.dtype == x.dtype
    w = np.asarray(dequantize_reference(qt)).astype(np.float64)
    x64 = np.asarray(x.astype(jnp.float32)).astype(np.float64)
    exact = x64 @ w
    magnitude = np.abs(x64) @ np.abs(w)
    bound = 2.0**-24 * qt.shape[0] * magnitude + 1e-30
    if x.dtype == BF16:  # the weight tile in bf16, then the output rounded to bf16
        bound += 2.0**-9 * magnitude
        bound += 2.0**-8 * (np.abs(exact) + bound)
    err = np.abs(np.asarray(out.astype(jnp.float32)).astype(np.float64) - exact)
    assert np.all(err <= bound), f"worst error / bound {np.max(err / bound):.3g}"
    ref = np.asarray(quant_matmul_reference(x, qt).astype(jnp.float32))
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), ref, rtol=0, atol=2 * float(bound.max()))


@pytest.mark.slow
@settings(max_examples=30, deadline=None)
@given(fmt_group=st.sampled_from(FMT_GROUPS), k_groups=st.integers(1, 24), n=st.sampled_from([16, 48, 64, 80, 192]),
       m=st.integers(1, 70), layers=st.integers(0, 3), dtype=st.sampled_from([F32, BF16]),
       x_scale=st.sampled_from([1e-3, 1.0, 1e3]), seed=st.integers(0, 2**32 - 1))
def test_matches_the_oracle(fmt_group, k_groups, n, m, layers, dtype, x_scale, seed):
    """Random formats, groups, K (one group to many K tiles and splits), N, rows (GEMV to several row
    tiles, padded), stacks of layers and input scales."""
    fmt, group = fmt_group
    rng = np.random.default_rng(seed)
    k = group * k_groups
    qt = random_weight(rng, fmt, group, k, n, layers)
    if layers:
        qt = dataclasses.replace(qt, layer=jnp.int32(rng.integers(0, layers)))
    x = jnp.asarray(rng.standard_normal((m, k)) * x_scale, dtype)
    check(x, qt)


@pytest.mark.parametrize("fmt,group", FMT_GROUPS)
@pytest.mark.parametrize("m", [1, 16, 33])
def test_every_format_and_group(fmt, group, m):
    rng = np.random.default_rng(m * 7 + group)
    qt = random_weight(rng, fmt, group, 512, 96)
    check(jnp.asarray(rng.standard_normal((m, 512)), jnp.float32), qt)
    check(jnp.asarray(rng.standard_normal((m, 512)), jnp.bfloat16), qt)


@pytest.mark.parametrize("k,n", [(576, 1536), (1536, 576), (2048, 8192)])
def test_real_model_shapes(k, n):
    """SmolLM2-135M's MLP (576 <-> 1536: K tiles of 64 and 256) and a Llama-1B up projection, one decode row."""
    rng = np.random.default_rng(k + n)
    qt = random_weight(rng, "q4_1", 32, k, n)
    check(jnp.asarray(rng.standard_normal((1, k)), jnp.float32), qt)


def test_a_stack_reads_its_layer_and_takes_one_outside_it_as_the_reference_does():
    """A device kernel cannot raise: a layer outside the stack is taken as the reference's dynamic index takes
    it (a negative one counts from the end, then it is clamped; the CPU op raises)."""
    rng = np.random.default_rng(3)
    qt = random_weight(rng, "q4_0", 32, 128, 32, layers=3)
    x = jnp.asarray(rng.standard_normal((2, 128)), jnp.float32)
    for layer in range(3):
        check(x, dataclasses.replace(qt, layer=jnp.int32(layer)))
    for outside, inside in ((7, 2), (-1, 2), (-3, 0), (-4, 0), (-10, 0)):
        np.testing.assert_array_equal(run_kernel(x, dataclasses.replace(qt, layer=jnp.int32(outside))),
                                      run_kernel(x, dataclasses.replace(qt, layer=jnp.int32(inside))))
        check(x, dataclasses.replace(qt, layer=jnp.int32(outside)))  # against the reference at the same index


def test_no_rows_and_non_finite_rows():
    rng = np.random.default_rng(5)
    qt = random_weight(rng, "q8_0", 32, 64, 16)
    assert run_kernel(jnp.zeros((0, 64), jnp.float32), qt).shape == (0, 16)
    x = np.asarray(rng.standard_normal((3, 64)), np.float32)
    x[1, 5] = np.nan
    out = np.asarray(run_kernel(jnp.asarray(x), qt))
    assert np.isnan(out[1]).all() and np.isfinite(out[[0, 2]]).all(), "a NaN stays in its own row"


def test_tiles_split_k_until_the_launch_is_wide_enough():
    bm, bn, bk, splits = tiles(1, 2048, 576)  # a decode row: 9 column tiles, 8 K tiles
    assert (bm, bn, bk, splits) == (16, 64, 256, 8)
    bm, bn, bk, splits = tiles(512, 2048, 8192)  # a prefill chunk: programs enough without a split
    assert (bm, bn, splits) == (64, 64, 1) and (512 // bm) * (8192 // bn) > TARGET_PROGRAMS
    for m, k, n in [(1, 576, 192), (70, 96, 48), (3, 32, 16), (1, 4096, 128256)]:
        bm, bn, bk, splits = tiles(m, k, n)
        assert n % bn == 0 and k % bk == 0 and (k // bk) % splits == 0 and bm >= 16 and bn >= 16 and bk >= 32
    assert supported(48, BF16) and not supported(40, BF16)
    assert not supported(48, F32), "f32 x keeps the reference on CUDA (device_check measured the kernel slower)"


def _traced(mode: str, n: int = 32, dtype=BF16):
    qt = random_weight(np.random.default_rng(1), "q4_1", 32, 64, n)
    with kernels(mode):
        return str(jax.make_jaxpr(functools.partial(quant_matmul, qt=qt))(jnp.zeros((2, 64), dtype)))


def test_kernel_modes_pick_the_path():
    assert "pallas_call" in _traced("interpret")
    assert "pallas_call" not in _traced("interpret", n=24)  # N not a multiple of 16: the reference
    assert "pallas_call" not in _traced("interpret", dtype=F32)  # f32 x: the reference
    assert "pallas_call" not in _traced("reference") and "ffi_call" not in _traced("reference")
    if _ffi.cpu_targets():
        assert "ffi_call" in _traced("native")


def test_gradient_is_the_reference_gradient():
    """The kernel has no derivative of its own: x's gradient goes through the dequantized weight."""
    rng = np.random.default_rng(11)
    qt = random_weight(rng, "q4_1", 32, 64, 32)
    x = jnp.asarray(rng.standard_normal((3, 64)), jnp.bfloat16)
    ct = jnp.asarray(rng.standard_normal((3, 32)), jnp.bfloat16)
    with kernels("interpret"):
        assert "pallas_call" in str(jax.make_jaxpr(jax.grad(lambda a: jnp.sum(quant_matmul(a, qt) * ct)))(x))
        got = jax.grad(lambda a: jnp.sum(quant_matmul(a, qt) * ct))(x)
    want = jax.grad(lambda a: jnp.sum(quant_matmul_reference(a, qt) * ct))(x)
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))


@pytest.mark.parametrize("fmt,group,dtype", [("q8_0", 32, F32), ("q4_1", 32, BF16), ("int4", 128, F32),
                                             ("q4_0", 32, BF16), ("int8", 64, BF16)])
def test_lowers_to_triton_for_cuda(fmt, group, dtype):
    """The kernel lowers through Pallas's Triton path (not Mosaic GPU) for CUDA, a stack's layer included."""
    rng = np.random.default_rng(2)
    qt = random_weight(rng, fmt, group, 1024, 128, layers=2)
    fn = jax.jit(functools.partial(quant_matmul_pallas, fmt=fmt, k=1024, n=128, group=group))
    text = fn.trace(jnp.zeros((3, 1024), dtype), qt.qs, qt.scales, qt.mins, jnp.int32(1)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "xla.gpu.triton" in text and "tunix_rt_quant_matmul" in text
