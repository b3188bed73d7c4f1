"""Tests for the weight-only quantization FFI ops (tunix_rt.ops.quant) and their pure-JAX references.

What must hold, and how tightly:
* quantize/dequantize of the GGUF formats (q8_0, q4_0, q4_1) reproduce gguf.quants bit for bit:
  packed bytes (f16 scales/mins, int8 codes, nibble order) and dequantized values, for the FFI op
  and for the reference, on adversarial blocks (ties, zeros, constants, 1e30 / 1e-30, f16-subnormal
  scales, exact .5 rounding points) and bf16 inputs. int8/int4 have no GGUF twin: FFI == reference.
* quant_matmul, up to int8_rows rows (4 by default; None: every row), quantizes x to int8 per
  32-block, so it only approximates
  x @ dequantize(qt): the per-element error is bounded by sum_b (amax_b(x) / 254) * sum_{i in b}
  |w_i| (half an activation step times the weights) plus float rounding; the relative Frobenius
  error is ~0.5%. More rows, or exact=True, multiply by exact dequantized panels: f32 rounding only.
  Up to 4 rows take GEMV kernels; more the VNNI int8 GEMM where the CPU has it, else 4-row GEMV
  tiles. Every int8 row equals the same row computed alone, bit for bit, whichever route; exact
  products with invariant=True too (the engine's batch invariance).
* Its gradient wrt x is exact: dy @ dequantize(qt).T, the same as through the reference.
* The references stay bit exact under jit, where XLA contracts multiply-adds into FMAs and turns
  divisions by constants into multiplications.
"""

from __future__ import annotations

import dataclasses
import functools
import textwrap

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.isa_tiers import ALL_TIERS, expected_tier, hardware_tier, has_avx_vnni, run_tiers
from tunix_rt.ops import (
    FORMATS,
    QuantizedTensor,
    _ffi,
    dequantize,
    dequantize_reference,
    quant_matmul,
    quant_matmul_reference,
    quantize,
    quantize_reference,
)
from tunix_rt.ops.quant import GEMV_ROWS, lane_scales, with_lane_scales

QUANTIZE_TARGET, DEQUANTIZE_TARGET, MATMUL_TARGET = "tunix_rt_quantize", "tunix_rt_dequantize", "tunix_rt_quant_matmul"
F32, BF16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)
GGUF_FMTS = ("q8_0", "q4_0", "q4_1")
ALL_FMTS = ("q8_0", "q4_0", "q4_1", "int8", "int4")
# (fmt, group) for every legal combination
FMT_GROUPS = [(f, g) for f in ALL_FMTS for g in FORMATS[f].groups]

pytestmark = pytest.mark.skipif(
    not all(_ffi.has_cpu_target(t) for t in (QUANTIZE_TARGET, DEQUANTIZE_TARGET, MATMUL_TARGET)),
    reason="tunix_rt._ext is not built: no FFI op to test",
)



# ----------------------------------------------------------------------------------------------
# helpers

# The references under jit: fusion is where FMA contraction or reassociation could break bit
# parity, so this is the stricter of the two ways to run them (eager runs in the fixed tests).
_quantize_ref_jit = jax.jit(quantize_reference, static_argnums=(1, 2))
_dequantize_ref_jit = jax.jit(dequantize_reference, static_argnums=(1,))
_quant_matmul_ref_jit = jax.jit(quant_matmul_reference)


def _np(a) -> np.ndarray:
    return np.asarray(a)


def _f32(a) -> np.ndarray:
    return np.asarray(jnp.asarray(a).astype(jnp.float32))


def assert_bits_equal(actual, expected, what=""):
    """Same dtype, shape and bit pattern; NaNs only need to sit at the same places (their payload
    and sign depend on which instruction made them)."""
    a, e = np.asarray(actual), np.asarray(expected)
    assert a.shape == e.shape, (what, a.shape, e.shape)
    assert a.dtype == e.dtype, (what, a.dtype, e.dtype)
    if a.dtype.kind == "f" or a.dtype == np.dtype(jnp.bfloat16):
        a32, e32 = a.astype(np.float32), e.astype(np.float32)
        nan_a, nan_e = np.isnan(a32), np.isnan(e32)
        np.testing.assert_array_equal(nan_a, nan_e, err_msg=f"{what}: NaN positions differ")
        uint = {2: np.uint16, 4: np.uint32}[a.dtype.itemsize]
        ab, eb = a.view(uint)[~nan_a], e.view(uint)[~nan_e]
        if not np.array_equal(ab, eb):
            bad = np.flatnonzero(ab != eb)[:8]
            raise AssertionError(
                f"{what}: {np.count_nonzero(ab != eb)} elements differ, e.g. at {bad}: "
                f"{a[~nan_a][bad]} vs {e[~nan_e][bad]}"
            )
    else:
        np.testing.assert_array_equal(a, e, err_msg=what)


def assert_qt_equal(actual: QuantizedTensor, expected: QuantizedTensor, what=""):
    assert (actual.fmt, actual.shape, actual.group) == (expected.fmt, expected.shape, expected.group)
    for name in ("qs", "scales", "mins"):
        a, e = getattr(actual, name), getattr(expected, name)
        if a is None or e is None:  # mins: None for formats without them
            assert a is None and e is None, (what, name)
        else:
            assert_bits_equal(a, e, f"{what} {name}")


def gguf_quantize(w32: np.ndarray, fmt: str):
    """gguf.quants' bytes for w (K, N) (column n = ggml row n), split into our arrays, and its
    dequantization transposed back to (K, N)."""
    k, n = w32.shape
    qtype = GGMLQuantizationType[FORMATS[fmt].ggml_type]
    with np.errstate(over="ignore", invalid="ignore"):  # f16 scales of 1e30 blocks overflow, as in ggml
        raw = gguf.quants.quantize(np.ascontiguousarray(w32.T), qtype)
    blocks = raw.reshape(n, k // 32, -1)
    d = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16).reshape(n, k // 32)
    if fmt == "q4_1":
        m = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16).reshape(n, k // 32)
        qs = blocks[..., 4:]
    else:
        m = None  # QuantizedTensor.mins for formats without mins
        qs = blocks[..., 2:]
    qs = np.ascontiguousarray(qs).reshape(n, -1)
    if fmt == "q8_0":
        qs = qs.view(np.int8)
    with np.errstate(invalid="ignore", over="ignore"):
        deq = gguf.quants.dequantize(raw, qtype).reshape(n, k).T
    return (qs, d, m), np.ascontiguousarray(deq)


# ----------------------------------------------------------------------------------------------
# data: adversarial 32-blocks

BLOCK_KINDS = (
    "normal",  # N(0, s^2) with a random scale s
    "zeros",
    "single",  # one non-zero
    "tie",  # |max| reached twice with opposite signs: ggml picks the first index
    "const",
    "huge",  # ~1e30: the f16 scale overflows to inf (and dequantization gives inf / NaN)
    "tiny",  # ~1e-30: the f16 scale underflows to 0
    "f16sub",  # scales in f16's subnormal range
    "halfgrid",  # x * (1/d) lands exactly on .5 rounding points
    "outlier",  # small values and one large one
    "signed_zeros",  # -0.0 and 0.0 mixed (q4_1: see test_q4_1_signed_zero_extremes)
    "halfgrid_ulps",  # halfgrid scaled by a non-power of 2: the product's rounding decides codes
)


def make_block(rng: np.random.Generator, kind: str, fmt: str) -> np.ndarray:
    b = np.zeros(32, np.float32)
    if kind == "normal":
        b[:] = rng.standard_normal(32) * 10.0 ** rng.uniform(-3, 3)
    elif kind == "zeros":
        pass
    elif kind == "single":
        b[rng.integers(32)] = rng.choice([-1.0, 1.0]) * 10.0 ** rng.uniform(-6, 6)
    elif kind == "tie":
        v = float(rng.uniform(0.5, 4.0))
        b[:] = rng.uniform(-0.4, 0.4, 32) * v
        i, j = sorted(rng.choice(32, size=2, replace=False))
        s = rng.choice([-1.0, 1.0])
        b[i], b[j] = s * v, -s * v
    elif kind == "const":
        b[:] = rng.choice([1.0, -2.5, 0.1, -7.0, 1e30, -1e-30, 3e-6])
    elif kind == "huge":
        b[:] = rng.uniform(-1.0, 1.0, 32) * 1e30
    elif kind == "tiny":
        b[:] = rng.uniform(-1.0, 1.0, 32) * 1e-30
    elif kind == "f16sub":  # scale = amax / 127 (or / 8, / 15) below 2^-14 ~ 6.1e-5
        b[:] = rng.uniform(-1.0, 1.0, 32) * 10.0 ** rng.uniform(-9, -4.5)
    elif kind == "halfgrid_ulps":
        # halfgrid at a scale that is not a power of 2: x * (1/d) is inexact and within an ulp or
        # two of the .5 points, so the product's own rounding decides the code
        b[:] = make_block(rng, "halfgrid", fmt) * np.float32(rng.uniform(1.0, 2.0))
    elif kind == "halfgrid":
        # Scale 2^e exactly, so codes = value * (1/d) is exact and hits .5 points exactly.
        e = float(2.0 ** rng.integers(-6, 7))
        if FORMATS[fmt].bits == 8:  # d = amax / 127 = e
            b[:] = rng.integers(-254, 255, 32) / 2
            b[rng.integers(32)] = rng.choice([-127.0, 127.0])
            b[:] = np.clip(b, -127, 127)
        elif not FORMATS[fmt].has_min:  # d = max / -8 = -+e
            b[:] = rng.integers(-15, 16, 32) / 2
            b[rng.integers(32)] = rng.choice([-8.0, 8.0])
        else:  # d = (15 - 0) / 15 = e, m = 0 (then shifted by an exact offset)
            b[:] = rng.integers(0, 31, 32) / 2
            b[rng.integers(32)], b[rng.integers(32)] = 0.0, 15.0
            b[:] = np.clip(b, 0, 15) - rng.integers(0, 16)
        b *= e
    elif kind == "outlier":
        b[:] = rng.standard_normal(32) * 1e-3
        b[rng.integers(32)] = rng.choice([-1.0, 1.0]) * rng.uniform(1, 100)
    elif kind == "signed_zeros":
        if fmt != "q4_1":  # gguf.quants' numpy min/max choose a sign of zero unlike ggml's C
            b[rng.random(32) < 0.5] = -0.0
    else:
        raise ValueError(kind)
    return b


def make_weight(rng: np.random.Generator, kinds, k: int, n: int, fmt: str) -> np.ndarray:
    """(K, N) with column n's 32-blocks of kinds[n * K/32 + b] (kinds cycle if short)."""
    nb = k // 32
    cols = np.stack(
        [np.concatenate([make_block(rng, kinds[(c * nb + b) % len(kinds)], fmt) for b in range(nb)]) for c in range(n)]
    )
    return np.ascontiguousarray(cols.T)


def _w_in(w32: np.ndarray, dtype) -> tuple[jax.Array, np.ndarray]:
    """The jnp input of `dtype` and the f32 numpy array of its exact values."""
    w = jnp.asarray(w32, dtype)
    return w, _f32(w)


@st.composite
def weight_cases(draw, fmts=GGUF_FMTS, ks=(32, 64, 96, 128, 256), ns=(1, 2, 5, 8)):
    fmt = draw(st.sampled_from(fmts))
    group = draw(st.sampled_from(FORMATS[fmt].groups))
    k = draw(st.sampled_from([k for k in ks if k % group == 0]))
    n = draw(st.sampled_from(ns))
    kinds = draw(st.lists(st.sampled_from(BLOCK_KINDS), min_size=1, max_size=k // 32 * n))
    seed = draw(st.integers(0, 2**32 - 1))
    dtype = draw(st.sampled_from([F32, BF16]))
    return fmt, group, k, n, kinds, seed, dtype


# ----------------------------------------------------------------------------------------------
# 1. bitwise parity with gguf.quants


def check_gguf_parity(w, w32, fmt, *, eager_reference=False):
    (g_qs, g_d, g_m), g_deq = gguf_quantize(w32, fmt)
    qt = quantize(w, fmt)
    ref_q = quantize_reference if eager_reference else _quantize_ref_jit
    ref_dq = dequantize_reference if eager_reference else _dequantize_ref_jit
    qt_ref = ref_q(w, fmt) if eager_reference else ref_q(w, fmt, None)
    for name, got in (("ffi", qt), ("reference", qt_ref)):
        assert_bits_equal(got.qs, g_qs, f"{fmt} {name} qs vs gguf")
        assert_bits_equal(got.scales, g_d, f"{fmt} {name} scales vs gguf")
        if g_m is None:
            assert got.mins is None, f"{fmt} {name} mins"
        else:
            assert_bits_equal(got.mins, g_m, f"{fmt} {name} mins vs gguf")
    assert_bits_equal(dequantize(qt), g_deq, f"{fmt} ffi dequantize vs gguf")
    assert_bits_equal(ref_dq(qt_ref) if eager_reference else ref_dq(qt_ref, F32), g_deq, f"{fmt} reference dequantize vs gguf")


@pytest.mark.slow
@settings(max_examples=25)
@given(case=weight_cases())
def test_gguf_parity_hypothesis(case):
    fmt, _, k, n, kinds, seed, dtype = case
    w, w32 = _w_in(make_weight(np.random.default_rng(seed), kinds, k, n, fmt), dtype)
    check_gguf_parity(w, w32, fmt)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("fmt", GGUF_FMTS)
def test_gguf_parity_every_block_kind(fmt, dtype):
    """Each column holds every block kind (a few draws each), references run eagerly."""
    rng = np.random.default_rng(1234)
    kinds = [k for k in BLOCK_KINDS for _ in range(3)]
    w, w32 = _w_in(make_weight(rng, kinds, 32 * len(kinds), 3, fmt), dtype)
    check_gguf_parity(w, w32, fmt, eager_reference=True)


def _handmade_blocks() -> np.ndarray:
    """(32, C): columns that pin down the documented tie-breaking and rounding rules."""
    cols = []
    ramp = np.linspace(-0.5, 0.5, 32, dtype=np.float32)
    for i, j in ((0, 31), (31, 0), (3, 4), (17, 16), (15, 16)):
        for s in (1.0, -1.0):  # |max| at i and j with opposite signs; the first index wins
            b = ramp.copy()
            b[i], b[j] = s * 2.0, -s * 2.0
            cols.append(b)
    b = ramp.copy()
    b[5] = b[9] = 3.0  # equal values (same sign) tie
    cols.append(b)
    cols.append(np.full(32, 0.0, np.float32))
    cols.append(np.full(32, -0.0, np.float32))
    b = np.zeros(32, np.float32)
    b[7] = -1e-30
    cols.append(b)
    b = np.zeros(32, np.float32)
    b[0] = 6.5e4  # amax / 127 in f16's normal range, codes +-127
    cols.append(b)
    cols.append(np.full(32, 65504.0 * 8, np.float32))  # q4_0: d = -65504, exactly f16 max
    cols.append(np.arange(32, dtype=np.float32) / 2 - 8)  # .5 grid for q4_0 (d = 1)
    cols.append(np.concatenate([[127.0], np.arange(-15.5, 15.5, 1.0, dtype=np.float32)]))  # q8_0 (d = 1)
    cols.append(np.concatenate([[0.0, 15.0], np.arange(0.5, 15.5, 0.5, dtype=np.float32)]))  # q4_1 (d = 1)
    cols.append(np.float32(2.0**-24) * np.arange(-16, 16, dtype=np.float32))  # f16-subnormal scales
    cols.append(np.float32(1e-4) * np.sin(np.arange(32, dtype=np.float32)))
    return np.stack([np.resize(c, 32).astype(np.float32) for c in cols], axis=1)


@pytest.mark.parametrize("fmt", GGUF_FMTS)
def test_gguf_parity_handmade_blocks(fmt):
    w32 = _handmade_blocks()
    check_gguf_parity(jnp.asarray(w32), w32, fmt, eager_reference=True)
    check_gguf_parity(jnp.asarray(w32), w32, fmt)
    # bf16 inputs of the same columns
    w, wb = _w_in(w32, BF16)
    check_gguf_parity(w, wb, fmt)


@pytest.mark.parametrize("fmt", GGUF_FMTS)
def test_gguf_tie_breaking_picks_first_index(fmt):
    """Spelled out for q4_0 (whose scale takes the max's sign): the first of two +-|max| wins."""
    b = np.zeros((32, 2), np.float32)
    b[[2, 9], 0] = [4.0, -4.0]
    b[[2, 9], 1] = [-4.0, 4.0]
    qt = quantize(jnp.asarray(b), fmt)
    d = _f32(qt.scales)[:, 0]
    if fmt == "q4_0":
        np.testing.assert_array_equal(d, [-0.5, 0.5])
    (_, g_d, _), _ = gguf_quantize(b, fmt)
    assert_bits_equal(qt.scales, g_d)


def _f16_rounding_cases() -> np.ndarray:
    """f32 values at, and one f32 ulp either side of, the midpoints between neighbouring f16
    values (normal, subnormal, near the overflow threshold 65520), and a few exact ones."""
    rng = np.random.default_rng(17)
    h = np.concatenate([
        rng.integers(0, 0x7BFF, 120).astype(np.uint16),  # random finite positive halves
        np.array([0, 1, 2, 3, 0x3FF, 0x400, 0x401, 0x7BFD, 0x7BFE], np.uint16),  # subnormal/normal/max edges
    ]).view(np.float16)
    lo, hi = h.astype(np.float32), np.nextafter(h, np.float16(np.inf)).astype(np.float32)
    mid = (lo + hi) / 2  # exact in f32
    v = np.concatenate([lo, mid, np.nextafter(mid, 0), np.nextafter(mid, np.inf),
                        np.float32([65519.996, 65520.0, 1e-8, 2.0**-25, 3 * 2.0**-25, 2.0**-14 * (1 - 2.0**-12)])])
    assert np.all(np.isfinite(v))
    return np.concatenate([v, -v])


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1"])
def test_f16_scale_rounding(fmt):
    """GGUF scales round f32 -> f16 to nearest even like numpy (ties, subnormals, overflow to inf).
    q4_0's d = max / -8 is exact, so a block [-8 v, 0, ...] has d = v before the f16 rounding;
    q4_1's m = min is stored as is, so a block [v, 2|v|, 2|v|, ...] rounds m = v directly."""
    v = _f16_rounding_cases()
    if fmt == "q4_1":  # a block [-0.0, 0.0, ...]: see test_q4_1_signed_zero_extremes
        v = v[v != 0]
    w32 = np.zeros((32, v.size), np.float32)
    if fmt == "q4_0":
        w32[0] = -8 * v
    else:
        w32[:] = np.abs(v) * 2
        w32[0] = v
    with np.errstate(over="ignore"):  # 65520 and up round to inf
        want = v.astype(np.float16)
    for qt in (quantize(jnp.asarray(w32), fmt), quantize_reference(jnp.asarray(w32), fmt)):
        got = _np(qt.scales if fmt == "q4_0" else qt.mins)[:, 0]
        assert_bits_equal(got, want, fmt)
    check_gguf_parity(jnp.asarray(w32), w32, fmt)


def _ggml_q4_1_min_max(block: np.ndarray) -> tuple[np.float32, np.float32]:
    """quantize_row_q4_1_ref's scan: strict comparisons, so the first of equal extremes stays."""
    lo, hi = np.float32(np.finfo(np.float32).max), np.float32(-np.finfo(np.float32).max)
    for v in block:
        if v < lo:
            lo = v
        if v > hi:
            hi = v
    return lo, hi


def test_q4_1_signed_zero_extremes():
    """In a q4_1 block whose min (or max) is zero, ggml's C keeps the first zero's sign in m (and
    d = (max - min) / 15 can be -0.0). The FFI and the reference follow it bit for bit; gguf.quants'
    numpy min/max picks a sign of its own, so against gguf only the values compare equal."""
    rng = np.random.default_rng(19)
    cols = []
    for i, j in ((0, 5), (5, 0), (3, 31), (31, 3), (16, 15)):
        for base in (np.abs(rng.standard_normal(32)), -np.abs(rng.standard_normal(32)), np.zeros(32)):
            b = base.astype(np.float32)
            b[i], b[j] = -0.0, 0.0
            cols.append(b)
    w32 = np.stack(cols, axis=1)
    qt = quantize(jnp.asarray(w32), "q4_1")
    want = [_ggml_q4_1_min_max(c) for c in cols]
    want_m = np.array([lo for lo, _ in want], np.float32).astype(np.float16)
    want_d = np.array([(hi - lo) / np.float32(15) for lo, hi in want], np.float32).astype(np.float16)
    assert_bits_equal(_np(qt.mins)[:, 0], want_m, "m")
    assert_bits_equal(_np(qt.scales)[:, 0], want_d, "d")
    assert_qt_equal(qt, quantize_reference(jnp.asarray(w32), "q4_1"), "eager reference")
    assert_qt_equal(qt, _quantize_ref_jit(jnp.asarray(w32), "q4_1", None), "jit reference")
    (g_qs, _, _), g_deq = gguf_quantize(w32, "q4_1")
    assert_bits_equal(qt.qs, g_qs, "qs vs gguf")
    np.testing.assert_array_equal(_np(dequantize(qt)), g_deq)  # +-0 compare equal


@pytest.mark.parametrize("fmt", ALL_FMTS)
def test_jit_reference_near_rounding_points(fmt):
    """Codes decided by the last bit of x * (1/d): under jit, XLA fuses the product into the add
    of ggml's trunc(x * id + 8.5) (an FMA, one rounding instead of two) unless the reference
    avoids the add; 64k such values would show a few hundred wrong codes."""
    rng = np.random.default_rng(29)
    w32 = make_weight(rng, ["halfgrid_ulps"], 256, 256, fmt)
    w = jnp.asarray(w32)
    qt = quantize(w, fmt)
    assert_qt_equal(qt, _quantize_ref_jit(w, fmt, None), f"{fmt} jit reference")
    if fmt in GGUF_FMTS:
        (g_qs, g_d, g_m), _ = gguf_quantize(w32, fmt)
        assert_bits_equal(qt.qs, g_qs, f"{fmt} qs vs gguf")


def test_numpy_input_accepted():
    w32 = np.random.default_rng(0).standard_normal((64, 3)).astype(np.float32)
    assert_qt_equal(quantize(w32, "q4_0"), quantize(jnp.asarray(w32), "q4_0"))


# ----------------------------------------------------------------------------------------------
# 1b/2. FFI == reference, packed bytes, for all five formats; int8/int4 error bounds


@settings(max_examples=30)
@given(case=weight_cases(fmts=ALL_FMTS))
def test_ffi_quantize_matches_reference_bytes(case):
    fmt, group, k, n, kinds, seed, dtype = case
    w, _ = _w_in(make_weight(np.random.default_rng(seed), kinds, k, n, fmt), dtype)
    qt = quantize(w, fmt, group)
    assert_qt_equal(qt, _quantize_ref_jit(w, fmt, group), f"{fmt}/{group}")
    assert qt.qs.shape == (n, k * FORMATS[fmt].bits // 8)
    assert qt.scales.shape == (n, k // group)
    assert_bits_equal(dequantize(qt), _dequantize_ref_jit(qt, F32), f"{fmt}/{group} dequantize")


@pytest.mark.parametrize("fmt,group", FMT_GROUPS)
def test_ffi_matches_eager_reference_every_group(fmt, group):
    rng = np.random.default_rng(7)
    kinds = [k for k in BLOCK_KINDS for _ in range(2)]
    w32 = make_weight(rng, kinds, 256, 5, fmt)
    qt = quantize(jnp.asarray(w32), fmt, group)
    qt_ref = quantize_reference(jnp.asarray(w32), fmt, group)
    assert_qt_equal(qt, qt_ref, f"{fmt}/{group}")
    assert (qt.fmt, qt.shape, qt.group) == (fmt, (256, 5), group)
    assert qt.scales.dtype == FORMATS[fmt].scale_dtype
    assert_bits_equal(dequantize(qt), dequantize_reference(qt_ref), f"{fmt}/{group} dequantize")


def test_default_group_is_the_first():
    w = jnp.asarray(np.random.default_rng(0).standard_normal((128, 2)), jnp.float32)
    for fmt in ALL_FMTS:
        assert quantize(w, fmt).group == FORMATS[fmt].groups[0] == 32


@settings(max_examples=25)
@given(
    fmt=st.sampled_from(["int8", "int4"]),
    group=st.sampled_from([32, 64, 128]),
    k_mult=st.integers(1, 2),
    n=st.sampled_from([1, 3, 8]),
    kind=st.sampled_from(["normal", "mixed", "halfgrid", "tie", "huge", "tiny"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_int_formats_error_bound(fmt, group, k_mult, n, kind, seed):
    """int8: q = round(w / d), d = amax / 127, so |w - d q| <= d / 2 (plus the rounding of 1/d).
    int4: code = clip(floor(w / d + 8.5), 0, 15) with d = -(signed max) / 8, so |w - d (code - 8)|
    <= |d| / 2 except where w / d > 7.5 is clipped to code 15, which only the opposite-signed
    extreme reaches (w / d <= 8): there the error is <= |d|."""
    rng = np.random.default_rng(seed)
    k = group * k_mult
    kinds = BLOCK_KINDS if kind == "mixed" else [kind]
    w32 = make_weight(rng, kinds, k, n, fmt)
    w = jnp.asarray(w32)
    qt = quantize(w, fmt, group)
    assert_qt_equal(qt, _quantize_ref_jit(w, fmt, group))
    dq = _np(dequantize(qt))
    d = np.repeat(np.abs(_np(qt.scales)), group, axis=1).T  # (K, N)
    assert np.all(np.isfinite(d)) and np.all(np.isfinite(dq))  # f32 scales: no overflow at 1e30
    err = np.abs(w32.astype(np.float64) - dq)
    slack = 1e-6 * np.abs(w32) + 1e-37
    if fmt == "int8":
        assert np.all(err <= d / 2 + slack), np.max(err - d / 2)
    else:
        codes = _unpacked_codes(qt)
        clipped = (codes == 15) & (err > d / 2 + slack)
        assert np.all(err <= d / 2 + slack + clipped * (d / 2)), np.max(err - d / 2)
        # clipping only happens for values of the opposite sign to the block max, near |max|
        if clipped.any():
            big = np.repeat(np.abs(_np(qt.scales)) * 8, group, axis=1).T
            assert np.all(np.abs(w32[clipped]) >= 0.9375 * big[clipped] * (1 - 1e-6))
    # and the scales are what the formula says
    blocks = w32.T.reshape(n, k // group, group)
    if fmt == "int8":
        np.testing.assert_array_equal(_np(qt.scales), np.abs(blocks).max(-1) / np.float32(127))
    else:
        imax = np.abs(blocks).argmax(-1)[..., None]
        np.testing.assert_array_equal(_np(qt.scales), np.take_along_axis(blocks, imax, -1)[..., 0] / np.float32(-8))


def _unpacked_codes(qt: QuantizedTensor) -> np.ndarray:
    """(K, N) codes from the packed bytes, decoded independently of the library: byte j of each
    32-block holds element j (low nibble) and j + 16 (high nibble)."""
    k, n = qt.shape
    qs = _np(qt.qs)
    if FORMATS[qt.fmt].bits == 8:
        return qs.astype(np.int32).T
    b = qs.reshape(n, k // 32, 16)
    return np.concatenate([b & 0x0F, b >> 4], axis=-1).reshape(n, k).astype(np.int32).T


@pytest.mark.parametrize("fmt", ALL_FMTS)
def test_nibble_layout(fmt):
    """Element j of a 32-block sits in the low nibble of byte j, element j+16 in the high nibble;
    dequantize is d * (code - offset) (+ m) with those codes."""
    # values 0..15 with 0 and 15 in every block: q4_1 codes equal the values (d = 1, m = 0);
    # shifted by -8, the first |max| is -8, so q4_0/int4 have d = 1 and codes = value + 8.
    col = np.concatenate([np.arange(16), np.arange(16)[::-1], (np.arange(32) * 7) % 16]).astype(np.float32)
    if fmt in ("q4_0", "int4"):
        col = col - 8
    w32 = np.stack([col, col[::-1].copy()], axis=1)
    qt = quantize(jnp.asarray(w32), fmt)
    codes = _unpacked_codes(qt)
    if FORMATS[fmt].bits == 4:
        np.testing.assert_array_equal(_f32(qt.scales), 1.0)
        np.testing.assert_array_equal(codes, w32 + (8 if fmt != "q4_1" else 0))
        first = _np(qt.qs)[0, :16]  # block 0 of column 0: elements j (0..15) and j+16 (15..0)
        np.testing.assert_array_equal(first & 0x0F, codes[:16, 0])
        np.testing.assert_array_equal(first >> 4, codes[16:32, 0])
    dq = _np(dequantize(qt))
    d = np.repeat(_f32(qt.scales), 32, axis=1).T
    m = np.repeat(_f32(qt.mins), 32, axis=1).T if fmt == "q4_1" else np.float32(0)
    offset = 8 if FORMATS[fmt].offset8 else 0
    np.testing.assert_array_equal(dq, d * (codes - offset).astype(np.float32) + m)


def _random_qt(rng, fmt, group, k, n) -> QuantizedTensor:
    """Arbitrary buffers, including codes quantize never writes (q8 -128) and negative scales."""
    f = FORMATS[fmt]
    qs = rng.integers(0, 256, (n, k * f.bits // 8)).astype(np.uint8)
    qs = qs.view(np.int8) if f.bits == 8 else qs
    scales = (rng.standard_normal((n, k // group)) * 0.1).astype(f.scale_dtype)
    mins = jnp.asarray((rng.standard_normal((n, k // group)) * 0.1).astype(np.float16)) if f.has_min else None
    return QuantizedTensor(jnp.asarray(qs), jnp.asarray(scales), mins, fmt, (k, n), group)


@pytest.mark.parametrize("fmt,group", FMT_GROUPS)
def test_arbitrary_buffers(fmt, group):
    """dequantize and quant_matmul on buffers that did not come from quantize (e.g. read from a
    GGUF file): FFI dequantize == reference bitwise, the matmul within its error bound."""
    rng = np.random.default_rng(31)
    qt = _random_qt(rng, fmt, group, 256, 24)
    if FORMATS[fmt].bits == 8:
        qs = _np(qt.qs).copy()
        qs[:, :32] = -128  # the most negative code in a whole block: the AVX2 sign trick's edge
        qt = dataclasses.replace(qt, qs=jnp.asarray(qs))
    assert_bits_equal(dequantize(qt), dequantize_reference(qt), f"{fmt}/{group}")
    assert_bits_equal(dequantize(qt, jnp.bfloat16), dequantize_reference(qt, jnp.bfloat16), f"{fmt}/{group} bf16")
    x = rng.standard_normal((7, 256)).astype(np.float32)
    ref, bound = matmul_error_bound(x, qt, F32)
    err = np.abs(_np(quant_matmul(jnp.asarray(x), qt)).astype(np.float64) - ref)
    assert np.all(err <= bound), np.max(err / bound)


def test_parallel_chunks():
    """Shapes large enough for the handlers to split columns across the thread pool."""
    rng = np.random.default_rng(41)
    k, n, m = 256, 600, 16
    w = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    for fmt, group in (("q4_1", 32), ("int8", 128)):
        qt = quantize(w, fmt, group)
        assert_qt_equal(qt, _quantize_ref_jit(w, fmt, group), fmt)
        assert_bits_equal(dequantize(qt), _dequantize_ref_jit(qt, F32), fmt)
        ref, bound = matmul_error_bound(x, qt, F32)
        y = _np(quant_matmul(jnp.asarray(x), qt))
        assert np.all(np.abs(y.astype(np.float64) - ref) <= bound)
        # each column is computed independently of how columns are chunked
        np.testing.assert_array_equal(y[:, 300:301], _np(quant_matmul(jnp.asarray(x), _column(qt, 300))))


def _column(qt: QuantizedTensor, c: int) -> QuantizedTensor:
    mins = None if qt.mins is None else qt.mins[c:c + 1]
    return QuantizedTensor(qt.qs[c:c + 1], qt.scales[c:c + 1], mins, qt.fmt, (qt.shape[0], 1), qt.group)


# ----------------------------------------------------------------------------------------------
# 3. dequantize to bf16


@settings(max_examples=20)
@given(case=weight_cases(fmts=ALL_FMTS))
def test_dequantize_bf16_is_rounded_f32(case):
    fmt, group, k, n, kinds, seed, dtype = case
    w, _ = _w_in(make_weight(np.random.default_rng(seed), kinds, k, n, fmt), dtype)
    qt = quantize(w, fmt, group)
    d32 = dequantize(qt)
    d16 = dequantize(qt, jnp.bfloat16)
    assert d16.dtype == BF16 and d16.shape == (k, n)
    assert_bits_equal(d16, d32.astype(jnp.bfloat16), f"{fmt} bf16 dequantize")
    assert_bits_equal(_dequantize_ref_jit(qt, jnp.bfloat16), d32.astype(jnp.bfloat16), f"{fmt} bf16 reference")


# ----------------------------------------------------------------------------------------------
# 4. quant_matmul vs x @ dequantize(qt)


def matmul_error_bound(x32: np.ndarray, qt: QuantizedTensor, out_dtype, *, exact_x: bool = False):
    """(exact reference in f64, elementwise bound on |quant_matmul - reference| in f64) for x (M, K).

    Small M quantizes x per 32-block to xd * xq with xd = amax / 127 and |x - xd xq| <= xd / 2,
    so |y - x @ w| <= sum_b xd_b / 2 * sum_{i in b} a_i with a_i = |w_i|; for q4_1, whose kernels
    may take sum(x) exactly and the dot on the centred codes (m sum(x) + d sum((q - 8) xq xd)
    + 8 d sum(x)), a_i = max(|w_i|, |d (q_i - 8)|) covers either scheme. The f32 arithmetic (block
    scales times integer dots, corrections that cancel against the codes) adds at most a few ulps
    of sum_i |x_i| (16 |d| + |m|). Large M (exact products of dequantized panels) stays well
    inside. exact_x: every x block quantizes without error (one non-zero), only rounding remains."""
    m_rows, k = x32.shape
    n = qt.shape[1]
    w = _np(dequantize(qt)).astype(np.float64)  # (K, N)
    x = x32.astype(np.float64)
    ref = x @ w
    d = np.repeat(np.abs(_f32(qt.scales)).astype(np.float64), qt.group, axis=1).T
    a = np.abs(w)
    if qt.fmt == "q4_1":
        a = np.maximum(a, d * np.abs(_unpacked_codes(qt) - 8))
    xd = np.abs(x).reshape(m_rows, k // 32, 32).max(-1) / 127  # (M, K/32)
    asum = a.reshape(k // 32, 32, n).sum(1)  # (K/32, N)
    bound = 0.0 if exact_x else 0.5 * (1 + 1e-4) * (xd @ asum)
    mins = np.repeat(np.abs(_f32(qt.mins)).astype(np.float64), qt.group, axis=1).T if qt.fmt == "q4_1" else 0.0
    scale_terms = (127.0 if FORMATS[qt.fmt].bits == 8 else 16.0) * d + mins
    bound += 1e-5 * (np.abs(x) @ scale_terms) + 1e-30
    if jnp.dtype(out_dtype) == BF16:  # both outputs rounded to bf16: half an ulp each
        bound += 2.0**-8 * (np.abs(ref) + bound)
    return ref, bound


def exact_matmul_bound(x32: np.ndarray, qt: QuantizedTensor, out_dtype):
    """(reference in f64, bound) for a product of x with the exact dequantized weights, up to f32
    summation order: K ulps of |x| @ |w| at most (K <= 384 here), plus the bf16 rounding."""
    w = _np(dequantize(qt)).astype(np.float64)
    x = x32.astype(np.float64)
    ref = x @ w
    bound = 2.0**-24 * x.shape[1] * (np.abs(x) @ np.abs(w)) + 1e-30
    if jnp.dtype(out_dtype) == BF16:
        bound += 2.0**-8 * (np.abs(ref) + bound)
    return ref, bound


LEAD_SHAPES = st.one_of(
    st.just(()),  # x of rank 1
    st.tuples(st.integers(0, 9)),  # (M, K): M = 0, GEMV 1..4, tiles of 4 with remainders
    st.tuples(st.integers(1, 3), st.integers(0, 3)),  # (B, M, K)
)


@pytest.mark.slow
@settings(max_examples=30)
@given(
    fmt_group=st.sampled_from(FMT_GROUPS),
    k_mult=st.sampled_from([1, 2, 3]),  # group 32: 1 and 3 blocks, odd counts for paired kernels
    n=st.sampled_from([1, 8, 24, 64]),
    lead=LEAD_SHAPES,
    dtype=st.sampled_from([F32, BF16]),
    x_scale=st.sampled_from([1.0, 1e-3, 1e3]),
    seed=st.integers(0, 2**32 - 1),
)
def test_quant_matmul_matches_reference(fmt_group, k_mult, n, lead, dtype, x_scale, seed):
    fmt, group = fmt_group
    k = group * k_mult
    rng = np.random.default_rng(seed)
    w32 = rng.standard_normal((k, n)).astype(np.float32) * np.float32(rng.uniform(0.01, 2))
    qt = quantize(jnp.asarray(w32), fmt, group)
    x = jnp.asarray(rng.standard_normal((*lead, k)) * x_scale, dtype)
    y = quant_matmul(x, qt)
    y_ref = _quant_matmul_ref_jit(x, qt)
    assert y.shape == (*lead, n) and y.dtype == dtype
    assert y_ref.shape == y.shape and y_ref.dtype == dtype
    x2 = _f32(x).reshape(-1, k)
    ref64, bound = matmul_error_bound(x2, qt, dtype)
    err = np.abs(_f32(y).reshape(-1, n).astype(np.float64) - ref64)
    assert np.all(err <= bound), (np.max(err - bound), fmt, group, lead)
    # the reference itself is x @ dequantize(qt) in f32 (then cast)
    np.testing.assert_allclose(_f32(y_ref).reshape(-1, n), ref64, rtol=1e-2 if dtype == BF16 else 1e-5,
                               atol=1e-5 * float(np.abs(x2).max(initial=0) * np.abs(w32).max() * k))
    if y.size >= 64:  # enough elements for the Frobenius norm to average the rounding noise
        rel = np.linalg.norm(_f32(y) - _f32(y_ref)) / np.linalg.norm(_f32(y_ref))
        assert rel <= 1e-2, rel


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("fmt,group", FMT_GROUPS)
def test_quant_matmul_frobenius_every_m(fmt, group, dtype):
    """M = 0..9 (GEMV rows 1..4, 4-row tiles with every remainder): relative Frobenius error <= 1e-2."""
    k, n = 256, 64
    rng = np.random.default_rng(11)
    qt = quantize(jnp.asarray(rng.standard_normal((k, n)), jnp.float32), fmt, group)
    xs = jnp.asarray(rng.standard_normal((9, k)), dtype)
    y_refs = quant_matmul_reference(xs, qt)  # row by row the same as each prefix's reference
    for m in range(10):
        x = xs[:m]
        y, y_ref = quant_matmul(x, qt), y_refs[:m]
        assert y.shape == (m, n) and y.dtype == dtype
        if m == 0:
            continue
        rel = np.linalg.norm(_f32(y) - _f32(y_ref)) / np.linalg.norm(_f32(y_ref))
        assert rel <= 1e-2, (m, rel)
        # rows are independent of the other rows in the call: the last row equals the same row alone
        # (GEMV rows; past 4 the default route is exact, whose panels depend on M)
        if m <= GEMV_ROWS:
            np.testing.assert_array_equal(_f32(y[m - 1]), _f32(quant_matmul(x[m - 1], qt)))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("fmt,group", FMT_GROUPS)
def test_quant_matmul_int8_rows(fmt, group, dtype):
    """With int8_rows=None every row quantizes x (past 4 rows the VNNI int8 GEMM: 16 rows per vector, so
    17 and 33 leave partial row groups; N = 37 leaves a partial column tile): within the int8 error
    bound, each row bit-equal to the same row alone (the 1-row GEMV), the same under jit; the default
    stays exact."""
    k, n = 256, 37
    rng = np.random.default_rng(17)
    qt = quantize(jnp.asarray(rng.standard_normal((k, n)), jnp.float32), fmt, group)
    xs = jnp.asarray(rng.standard_normal((100, k)), dtype)
    int8 = functools.partial(quant_matmul, int8_rows=None)
    alone = np.stack([_f32(int8(xs[i], qt)) for i in range(100)])
    for m in (5, 17, 33, 100):
        y, jitted = int8(xs[:m], qt), jax.jit(int8)(xs[:m], qt)
        ref64, bound = matmul_error_bound(_f32(xs[:m]), qt, dtype)
        err = np.abs(_f32(y).astype(np.float64) - ref64)
        assert np.all(err <= bound), (m, np.max(err - bound))
        np.testing.assert_array_equal(_f32(y), alone[:m])
        np.testing.assert_array_equal(_f32(jitted), _f32(y))
        # by default the same call is exact
        ref, exact_bound = exact_matmul_bound(_f32(xs[:m]), qt, dtype)
        assert np.all(np.abs(_f32(quant_matmul(xs[:m], qt)).astype(np.float64) - ref) <= exact_bound), m


@settings(max_examples=40, deadline=None)
@given(fmt_group=st.sampled_from(FMT_GROUPS), blocks=st.integers(1, 40), n=st.integers(1, 40),
       m=st.integers(2, 24), scale=st.sampled_from([1e-3, 1.0, 1e3]), seed=st.integers(0, 2**16))
def test_int8_rows_equal_each_row_alone(fmt_group, blocks, n, m, scale, seed):
    """Whatever K (partial 4-block runs, partial 16-block stripes), N (partial 16-column tiles) and M
    (GEMV up to 4 rows, the int8 GEMM past them), every row of an int8 product, and of an exact one with
    invariant=True, is bit-equal to that row computed alone: the batch invariance the engine rests on."""
    fmt, group = fmt_group
    k = -(-blocks * 32 // group) * group
    rng = np.random.default_rng(seed)
    qt = quantize(jnp.asarray(rng.standard_normal((k, n)), jnp.float32), fmt, group)
    x = jnp.asarray(rng.standard_normal((m, k)) * scale, jnp.float32)
    laned = with_lane_scales(qt)
    for kw in (dict(int8_rows=None), dict(exact=True, invariant=True)):
        y = _f32(quant_matmul(x, qt, **kw))
        for i in range(m):
            np.testing.assert_array_equal(y[i], _f32(quant_matmul(x[i:i + 1], qt, **kw))[0], err_msg=f"{kw} row {i}")
            # the weight's column-lane scales change where the GEMV reads its scales, not its numbers
            np.testing.assert_array_equal(y[i], _f32(quant_matmul(x[i:i + 1], laned, **kw))[0], err_msg=f"lanes {i}")
        np.testing.assert_array_equal(y, _f32(quant_matmul(x, laned, **kw)), err_msg=f"{kw} lanes")
    ref64, bound = matmul_error_bound(_f32(x), qt, F32)
    assert np.all(np.abs(_f32(quant_matmul(x, qt, int8_rows=None)).astype(np.float64) - ref64) <= bound)


# Up to GEMV_ROWS rows (int8_rows; None: every row) the op quantizes x to int8; past
# that it multiplies x by exact dequantized weight panels, so its result equals x @ dequantize(qt)
# to f32 rounding.


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("fmt,group", FMT_GROUPS)
def test_quant_matmul_many_rows_is_exact(fmt, group, dtype):
    """M > 4, or > 64 with int8_rows=64 (GEMM over dequantized panels; K = 640 spans
    two 512-deep panels, N = 7 leaves a partial 3-column tile), and exact=True with invariant=True
    (column dots, 4 rows at a time, any M): equal to x @ dequantize(qt) up to f32 summation order;
    the invariant route's rows bit-equal to each row alone."""
    k, n = 640, 7
    rng = np.random.default_rng(13)
    qt = quantize(jnp.asarray(rng.standard_normal((k, n)), jnp.float32), fmt, group)
    for m, rows in ((5, GEMV_ROWS), (6, GEMV_ROWS), (9, GEMV_ROWS), (65, 64), (70, 64)):
        x = jnp.asarray(rng.standard_normal((m, k)), dtype)
        ref, bound = exact_matmul_bound(_f32(x), qt, dtype)
        y = quant_matmul(x, qt, int8_rows=rows)
        err = np.abs(_f32(y).astype(np.float64) - ref)
        assert np.all(err <= bound), (m, np.max(err / bound))
    # exact=True takes the same route for GEMV-sized M (output heads)
    for m in (1, 3, 4):
        x = jnp.asarray(rng.standard_normal((m, k)), dtype)
        ref, bound = exact_matmul_bound(_f32(x), qt, dtype)
        y = quant_matmul(x, qt, exact=True)
        assert y.shape == (m, n) and y.dtype == dtype
        err = np.abs(_f32(y).astype(np.float64) - ref)
        assert np.all(err <= bound), (m, np.max(err / bound))
        np.testing.assert_array_equal(_f32(jax.jit(functools.partial(quant_matmul, exact=True))(x, qt)), _f32(y))
    invariant = functools.partial(quant_matmul, exact=True, invariant=True)
    x = jnp.asarray(rng.standard_normal((70, k)), dtype)
    alone = np.stack([_f32(invariant(x[i], qt)) for i in range(70)])
    ref, bound = exact_matmul_bound(_f32(x), qt, dtype)
    for m in (2, 5, 9, 70):
        y = invariant(x[:m], qt)
        assert np.all(np.abs(_f32(y).astype(np.float64) - ref[:m]) <= bound[:m]), m
        np.testing.assert_array_equal(_f32(y), alone[:m])


@pytest.mark.parametrize("lead", [(0,), (2, 0), (0, 3)])
def test_quant_matmul_empty_m(lead):
    qt = quantize(jnp.ones((64, 5), jnp.float32), "q4_1")
    for dtype in (F32, BF16):
        x = jnp.zeros((*lead, 64), dtype)
        y = quant_matmul(x, qt)
        assert y.shape == (*lead, 5) and y.dtype == dtype
        assert jax.jit(quant_matmul)(x, qt).shape == (*lead, 5)


def test_quant_matmul_special_rows():
    """Zero rows give exact zeros; rows whose blocks hold one non-zero each quantize exactly
    (xq = +-127), so only float rounding separates the result from x @ dequantize(qt)."""
    k, n = 128, 16
    rng = np.random.default_rng(3)
    x = np.zeros((4, k), np.float32)
    x[1, ::32] = [1.0, -2.0, 0.5, 4.0]
    x[2, 5] = 1e-20
    x[3, 40] = 3e20
    for fmt, group in FMT_GROUPS:
        qt = quantize(jnp.asarray(rng.standard_normal((k, n)), jnp.float32), fmt, group)
        y = _np(quant_matmul(jnp.asarray(x), qt)).astype(np.float64)
        np.testing.assert_array_equal(y[0], 0.0)
        ref, bound = matmul_error_bound(x, qt, F32, exact_x=True)
        assert np.all(np.abs(y - ref) <= bound), (fmt, group, np.abs(y - ref) / bound)


@pytest.mark.parametrize("fmt", ALL_FMTS)
def test_quant_matmul_jit_with_qt_argument(fmt):
    rng = np.random.default_rng(5)
    qt = quantize(jnp.asarray(rng.standard_normal((128, 24)), jnp.float32), fmt)
    x = jnp.asarray(rng.standard_normal((2, 3, 128)), jnp.float32)
    leaves, treedef = jax.tree_util.tree_flatten(qt)
    # qs, scales (and mins for q4_1; None otherwise); fmt/shape/group are static
    assert len(leaves) == (3 if fmt == "q4_1" else 2)
    y_jit = jax.jit(quant_matmul)(x, qt)
    np.testing.assert_array_equal(_np(y_jit), _np(quant_matmul(x, qt)))
    # a QuantizedTensor built inside jit (quantize traced) gives the same
    y_in = jax.jit(lambda x, w: quant_matmul(x, quantize(w, fmt)))(x, jnp.asarray(rng.standard_normal((128, 24)), jnp.float32))
    assert y_in.shape == (2, 3, 24)
    # and the same qt as a jit argument through dequantize
    np.testing.assert_array_equal(_np(jax.jit(dequantize)(qt)), _np(dequantize(qt)))


def test_quant_matmul_vmap_over_x():
    rng = np.random.default_rng(6)
    qt = quantize(jnp.asarray(rng.standard_normal((64, 8)), jnp.float32), "q4_0")
    x = jnp.asarray(rng.standard_normal((3, 2, 64)), jnp.float32)
    y = jax.vmap(quant_matmul, in_axes=(0, None))(x, qt)
    # vmap_method="sequential": one (2, K) call per batch element (not one (6, K) call, which
    # would take the GEMM kernel)
    np.testing.assert_array_equal(_np(y), np.stack([_np(quant_matmul(xi, qt)) for xi in x]))


# ----------------------------------------------------------------------------------------------
# 5. gradients


def _loss(mm, qt, c):
    return lambda x: jnp.sum(mm(x, qt).astype(jnp.float32) * c)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("fmt,group", [("q8_0", 32), ("q4_0", 32), ("q4_1", 32), ("int8", 64), ("int4", 128)])
def test_grad_wrt_x_is_exact(fmt, group, dtype):
    rng = np.random.default_rng(21)
    k, n = 128, 24
    qt = quantize(jnp.asarray(rng.standard_normal((k, n)), jnp.float32), fmt, group)
    x = jnp.asarray(rng.standard_normal((2, 3, k)), dtype)
    c = jnp.asarray(rng.standard_normal((2, 3, n)), jnp.float32)
    g = jax.grad(_loss(quant_matmul, qt, c))(x)
    g_ref = jax.grad(_loss(quant_matmul_reference, qt, c))(x)
    assert g.shape == x.shape and g.dtype == dtype
    # analytic: dy @ dequantize(qt).T, dy = c rounded to the output dtype
    dy = _f32(jnp.asarray(c).astype(dtype)).astype(np.float64)
    g64 = dy @ _np(dequantize(qt)).astype(np.float64).T
    if dtype == F32:
        np.testing.assert_allclose(_np(g), _np(g_ref), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(_np(g), g64, rtol=1e-5, atol=1e-5)
    else:
        np.testing.assert_allclose(_f32(g), _f32(g_ref), rtol=2.0**-8, atol=1e-6)
        np.testing.assert_allclose(_f32(g), g64, rtol=2.0**-7, atol=1e-3)
    # also under jit
    np.testing.assert_array_equal(_f32(jax.jit(jax.grad(_loss(quant_matmul, qt, c)))(x)), _f32(g))


def test_vjp_and_frozen_weight_cotangents():
    rng = np.random.default_rng(22)
    for fmt in ALL_FMTS:
        qt = quantize(jnp.asarray(rng.standard_normal((64, 8)), jnp.float32), fmt)
        x = jnp.asarray(rng.standard_normal((5, 64)), jnp.float32)
        dy = jnp.asarray(rng.standard_normal((5, 8)), jnp.float32)
        y, pull = jax.vjp(quant_matmul, x, qt)
        np.testing.assert_array_equal(_np(y), _np(quant_matmul(x, qt)))
        dx, dqt = pull(dy)
        np.testing.assert_allclose(_np(dx), _np(dy) @ _np(dequantize(qt)).T, rtol=1e-5, atol=1e-5)
        assert isinstance(dqt, QuantizedTensor)
        assert (dqt.fmt, dqt.shape, dqt.group) == (qt.fmt, qt.shape, qt.group)
        assert dqt.qs.dtype == jax.dtypes.float0 and dqt.qs.shape == qt.qs.shape
        for name in ("scales", "mins"):
            ct, primal = getattr(dqt, name), getattr(qt, name)
            if primal is None:
                assert ct is None
                continue
            assert ct.shape == primal.shape and ct.dtype == primal.dtype
            assert not np.any(_f32(ct))
        # grad wrt both, with integer leaves allowed
        gx, gqt = jax.grad(lambda x, q: jnp.sum(quant_matmul(x, q) * dy), argnums=(0, 1), allow_int=True)(x, qt)
        np.testing.assert_allclose(_np(gx), _np(dx), rtol=1e-6, atol=1e-6)
        assert not np.any(_f32(gqt.scales))


def test_grad_closed_over_qt_in_training_step():
    """A QLoRA-like step: frozen quantized base + trainable low-rank adapter, jitted value_and_grad."""
    rng = np.random.default_rng(23)
    k, n, r = 128, 16, 4
    qt = quantize(jnp.asarray(rng.standard_normal((k, n)), jnp.float32), "q4_0")
    params = {"a": jnp.asarray(rng.standard_normal((k, r)) * 0.1, jnp.float32), "b": jnp.zeros((r, n), jnp.float32)}
    x = jnp.asarray(rng.standard_normal((6, k)), jnp.float32)
    t = jnp.asarray(rng.standard_normal((6, n)), jnp.float32)

    def loss(p, x, mm):
        h = mm(x, qt) + (x @ p["a"]) @ p["b"]
        return jnp.mean((h - t) ** 2)

    (v, g) = jax.jit(jax.value_and_grad(lambda p, x: loss(p, x, quant_matmul)))(params, x)
    (v_ref, g_ref) = jax.value_and_grad(lambda p, x: loss(p, x, quant_matmul_reference))(params, x)
    np.testing.assert_allclose(float(v), float(v_ref), rtol=2e-2)
    # d/db depends on the forward values through the residual h - t: approximate forward
    np.testing.assert_allclose(_np(g["b"]), _np(g_ref["b"]), rtol=5e-2, atol=5e-2 * float(np.abs(g_ref["b"]).max()))
    gx = jax.grad(lambda x: loss(params, x, quant_matmul))(x)
    assert gx.shape == x.shape and np.all(np.isfinite(_np(gx)))


# ----------------------------------------------------------------------------------------------
# 6. every ISA tier (TUNIX_RT_ISA is read once per process: subprocesses)

_TIER_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np, jax, jax.numpy as jnp
    from tunix_rt.ops import _ffi, quantize, quant_matmul, dequantize

    out = {}
    rng = np.random.default_rng(99)
    w = jnp.asarray(rng.standard_normal((256, 40)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((65, 256)), jnp.float32)
    for fmt, group in (("q8_0", 32), ("q4_0", 32), ("q4_1", 32), ("int8", 64), ("int4", 128)):
        qt = quantize(w, fmt, group)
        out[f"{fmt}_qs"] = np.asarray(qt.qs)
        out[f"{fmt}_scales"] = np.asarray(qt.scales)
        out[f"{fmt}_deq"] = np.asarray(dequantize(qt))
        for m in (1, 2, 3, 4, 5, 11, 17, 33, 64, 65):  # int8 up to 64 rows, exact at 65
            out[f"{fmt}_y{m}"] = np.asarray(quant_matmul(x[:m], qt, int8_rows=64))
        out[f"{fmt}_yexact3"] = np.asarray(quant_matmul(x[:3], qt, exact=True))  # column dots
        out[f"{fmt}_ybf16"] = np.asarray(quant_matmul(x[:33].astype(jnp.bfloat16), qt, int8_rows=64).astype(jnp.float32))
    # K = 39 blocks: the VNNI GEMVs' whole 16-block stripes, a partial one and blocks past it
    wl = jnp.asarray(rng.standard_normal((1248, 24)), jnp.float32)
    xl = jnp.asarray(rng.standard_normal((4, 1248)), jnp.float32)
    for fmt, group in (("q8_0", 32), ("q4_0", 32), ("q4_1", 32), ("int8", 32), ("int4", 32)):
        qt = quantize(wl, fmt, group)
        for m in (1, 2, 3, 4):
            out[f"{fmt}_long_y{m}"] = np.asarray(quant_matmul(xl[:m], qt))
    # 64 rows in one call and each row alone (batch invariance), N even and odd (a last one-column tile), and
    # K = 4096 by N = 1024, whose GEMV chunks span several ~128 KB column blocks
    wo = jnp.asarray(rng.standard_normal((256, 13)), jnp.float32)
    ww = jnp.asarray(rng.standard_normal((4096, 1024)), jnp.float32)
    xw = jnp.asarray(rng.standard_normal((64, 4096)), jnp.float32)
    for fmt, group in (("q8_0", 32), ("q4_0", 32), ("q4_1", 32), ("int8", 64), ("int4", 128)):
        for name, weight, xs in (("even", w, x), ("odd", wo, x), ("wide", ww, xw)):
            if name == "wide" and fmt not in ("q8_0", "q4_1"):
                continue
            qt = quantize(weight, fmt, group)
            for route, kw in (("", dict(int8_rows=None)), ("exact_", dict(exact=True, invariant=True))):
                out[f"{fmt}_{route}{name}_rows64"] = np.asarray(quant_matmul(xs[:64], qt, **kw))
                out[f"{fmt}_{route}{name}_alone"] = np.concatenate(
                    [np.asarray(quant_matmul(xs[i:i + 1], qt, **kw)) for i in range(64)])
    # adversarial activations, every 32-block one case: zeros, one value, halves that round to even
    # (amax 127: scale 1), signed zeros, subnormals, huge values, a block of equal values, a NaN, an infinity
    blocks = [np.zeros(32), np.eye(32)[5] * -3.0, np.r_[127.0, np.arange(31) - 15.5], np.r_[-0.0, np.zeros(31)],
              np.full(32, 1e-40), np.linspace(-3e30, 3e30, 32), np.full(32, -2.5), rng.standard_normal(32),
              np.r_[np.zeros(9), np.nan, np.ones(22)], np.r_[np.ones(31), -np.inf]]
    xa = np.stack([np.concatenate([blocks[(r + j) % len(blocks)] for j in range(8)]) for r in range(64)])
    xa = jnp.asarray(xa, jnp.float32)
    out["adv_nonfinite_rows"] = ~np.isfinite(np.asarray(xa)).all(axis=1)
    wa = jnp.asarray(rng.standard_normal((256, 24)), jnp.float32)
    for fmt, group in (("q8_0", 32), ("q4_0", 32), ("q4_1", 32), ("int8", 64), ("int4", 128)):
        qt = quantize(wa, fmt, group)
        out[f"{fmt}_adv_rows64"] = np.asarray(quant_matmul(xa, qt, int8_rows=None))
        out[f"{fmt}_adv_alone"] = np.concatenate([np.asarray(quant_matmul(xa[i:i + 1], qt, int8_rows=None))
                                                  for i in range(64)])
    # rows made only of tiny blocks, whose scale amax / 127 is subnormal (1 / scale overflows: codes 0 on every
    # tier) or, where the thread flushes subnormals to zero (XLA's CPU threads do), zero
    tiny = np.array([1e-38, -3e-39, 1e-40, 2e-37])
    xt = jnp.asarray(np.stack([np.repeat(np.roll(tiny, r), 64) * np.linspace(0.5, 1, 256) for r in range(64)]),
                     jnp.float32)
    for fmt, group in (("q8_0", 32), ("q4_0", 32), ("q4_1", 32), ("int8", 64), ("int4", 128)):
        qt = quantize(wa, fmt, group)
        out[f"{fmt}_tiny_rows64"] = np.asarray(quant_matmul(xt, qt, int8_rows=None))
        out[f"{fmt}_tiny_alone"] = np.concatenate([np.asarray(quant_matmul(xt[i:i + 1], qt, int8_rows=None))
                                                   for i in range(64)])
    np.savez(sys.argv[1], **out)
    print(json.dumps({"isa": _ffi.isa_level(), "int8_kernels": [_ffi.int8_matmul_kernels(i) for i in range(5)]}))
    """
)


@pytest.fixture(scope="module")
def tier_runs(tmp_path_factory):
    return run_tiers(ALL_TIERS, _TIER_SCRIPT, tmp_path_factory.mktemp("quant_isa"))


@pytest.mark.slow
@pytest.mark.parametrize("tier", ALL_TIERS)
def test_isa_tier_matches_reference(tier_runs, tier):
    report, res = tier_runs[tier]
    assert report["isa"] == expected_tier(tier)
    rng = np.random.default_rng(99)
    w = jnp.asarray(rng.standard_normal((256, 40)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((65, 256)), jnp.float32)
    for fmt, group in (("q8_0", 32), ("q4_0", 32), ("q4_1", 32), ("int8", 64), ("int4", 128)):
        qt_ref = quantize_reference(w, fmt, group)
        assert_bits_equal(res[f"{fmt}_qs"], qt_ref.qs, f"{tier} {fmt} qs")
        assert_bits_equal(res[f"{fmt}_scales"], qt_ref.scales, f"{tier} {fmt} scales")
        assert_bits_equal(res[f"{fmt}_deq"], dequantize_reference(qt_ref), f"{tier} {fmt} dequantize")
        for m in (1, 2, 3, 4, 5, 11, 17, 33, 64, 65):
            y_ref = _np(quant_matmul_reference(x[:m], qt_ref))
            rel = np.linalg.norm(res[f"{fmt}_y{m}"] - y_ref) / np.linalg.norm(y_ref)
            assert rel <= 1e-2, (tier, fmt, m, rel)
            _, bound = matmul_error_bound(_np(x[:m]), qt_ref, F32)
            assert np.all(np.abs(res[f"{fmt}_y{m}"] - y_ref) <= bound), (tier, fmt, m)
        y_ref = _f32(quant_matmul_reference(x[:33].astype(jnp.bfloat16), qt_ref))
        assert np.linalg.norm(res[f"{fmt}_ybf16"] - y_ref) / np.linalg.norm(y_ref) <= 1e-2
        ref, bound = exact_matmul_bound(_np(x[:3]), qt_ref, F32)
        assert np.all(np.abs(res[f"{fmt}_yexact3"] - ref) <= bound), (tier, fmt)
    wl = jnp.asarray(rng.standard_normal((1248, 24)), jnp.float32)
    xl = jnp.asarray(rng.standard_normal((4, 1248)), jnp.float32)
    for fmt in ("q8_0", "q4_0", "q4_1", "int8", "int4"):
        qt_ref = quantize_reference(wl, fmt, 32)
        for m in (1, 2, 3, 4):
            y_ref = _np(quant_matmul_reference(xl[:m], qt_ref))
            _, bound = matmul_error_bound(_np(xl[:m]), qt_ref, F32)
            assert np.all(np.abs(res[f"{fmt}_long_y{m}"] - y_ref) <= bound), (tier, fmt, m)


@pytest.mark.slow
@pytest.mark.parametrize("tier", ALL_TIERS)
def test_isa_tier_rows_equal_each_row_alone(tier_runs, tier):
    """On every tier the int8 products of 64 rows in one call equal each row computed alone, bit for bit: the
    engine's batch invariance (scalar: GEMV row tiles of 4 over column tiles and column blocks; AVX2 and
    AVX-VNNI: the 8-lane int8 GEMM against the AVX2 GEMV; AVX-512 VNNI: its int8 GEMM against its GEMV); so do
    the exact row-invariant products (output heads: columns dequantized once for 64 rows against the column
    dots in registers for one). The odd-N products also meet the int8 error bound."""
    _, res = tier_runs[tier]
    keys = [k for k in res if k.endswith("_rows64")]
    assert len(keys) == 34
    for key in keys:
        assert_bits_equal(res[key], res[key.replace("_rows64", "_alone")], f"{tier} {key}")
    # a row with a NaN or an infinity comes out NaN, as a float product would; the rows beside it are finite
    bad = res["adv_nonfinite_rows"]
    assert 0 < bad.sum() < 64
    for fmt in ("q8_0", "q4_0", "q4_1", "int8", "int4"):
        y = res[f"{fmt}_adv_rows64"]
        assert np.isnan(y[bad]).all() and np.isfinite(y[~bad]).all(), (tier, fmt)
        assert np.isfinite(res[f"{fmt}_tiny_rows64"]).all() and np.abs(res[f"{fmt}_tiny_rows64"]).max() < 1e-30
    rng = np.random.default_rng(99)  # the script's draws, in its order: w, x, wl, xl, wo
    draws = [rng.standard_normal(shape) for shape in ((256, 40), (65, 256), (1248, 24), (4, 1248), (256, 13))]
    x64, wo = draws[1][:64].astype(np.float32), jnp.asarray(draws[4], jnp.float32)
    for fmt, group in (("q8_0", 32), ("q4_0", 32), ("q4_1", 32), ("int8", 64), ("int4", 128)):
        y_ref, bound = matmul_error_bound(x64, quantize_reference(wo, fmt, group), F32)
        assert np.all(np.abs(res[f"{fmt}_odd_rows64"] - y_ref) <= bound), (tier, fmt)


def _is_exact_route(key: str) -> bool:
    return key.endswith(("_y65", "_yexact3")) or "_exact_" in key  # f32 products over dequantized weights


@pytest.mark.skipif(hardware_tier() == "scalar", reason="needs a SIMD tier to compare with scalar")
@pytest.mark.parametrize("tier", ALL_TIERS[1:])
def test_isa_tiers_agree(tier_runs, tier):
    """The int8 route gives the same bits on every tier (the same integer dots, scaled and summed in one
    order: a rollout's logits do not depend on the host's CPU); the exact route's f32 products differ
    only in summation order."""
    _, scalar = tier_runs["scalar"]
    _, simd = tier_runs[tier]
    for key in scalar:
        if key.endswith(("_qs", "_scales", "_deq")) or not _is_exact_route(key):
            assert_bits_equal(simd[key], scalar[key], f"{tier} {key}")
        else:
            rel = np.linalg.norm(simd[key] - scalar[key]) / np.linalg.norm(scalar[key])
            assert rel <= 1e-5, (key, rel)
    # the cap selects different exact-route kernels too: scalar adds in one order, the SIMD tiers in lanes
    assert any(not np.array_equal(simd[k], scalar[k]) for k in scalar if _is_exact_route(k))


def _int8_kernels_expected(tier: str) -> dict[str, str]:
    f = _ffi.cpu_features()
    if tier == "scalar":
        return {"gemv": "scalar", "gemm": "none"}
    if tier == "avx512" and f.get("avx512_vnni"):  # AMD's AVX-512 (Zen 4/5): the 256-bit GEMV is the faster
        return {"gemv": "avx2" if f.get("amd_avx512") else "avx512-vnni", "gemm": "avx512-vnni"}
    return {"gemv": "avx2", "gemm": "avx-vnni" if tier != "avx2" and has_avx_vnni() else "avx2"}


@pytest.mark.parametrize("tier", ALL_TIERS)
def test_isa_cap_selects_the_tiers_int8_kernels(tier_runs, tier):
    """Each cap runs its own tier's int8 kernels (their results are the same bits, so the outputs cannot
    tell): AVX-512 VNNI's GEMV and GEMM, AVX2's GEMV with the AVX-VNNI or AVX2 GEMM, or the scalar GEMV."""
    report, _ = tier_runs[tier]
    want = _int8_kernels_expected(report["isa"])
    assert report["int8_kernels"] == [want] * 5, (tier, report)


# ----------------------------------------------------------------------------------------------
# 7. bad inputs


def _good_qt(fmt="q4_1", k=64, n=4, group=None):
    return quantize(jnp.asarray(np.random.default_rng(0).standard_normal((k, n)), jnp.float32), fmt, group)


QUANTIZERS = pytest.mark.parametrize("qfn", [quantize, quantize_reference], ids=["ffi", "reference"])
DEQUANTIZERS = pytest.mark.parametrize("dqfn", [dequantize, dequantize_reference], ids=["ffi", "reference"])
MATMULS = pytest.mark.parametrize("mm", [quant_matmul, quant_matmul_reference], ids=["ffi", "reference"])


@QUANTIZERS
def test_bad_format_and_group(qfn):
    w = jnp.ones((128, 2), jnp.float32)
    with pytest.raises(ValueError, match="fmt"):
        qfn(w, "q5_0")
    with pytest.raises(ValueError, match="fmt"):
        qfn(w, "Q4_0")
    for fmt, group in (("q4_0", 64), ("q8_0", 16), ("int8", 48), ("int4", 256), ("int8", 0), ("int4", True)):
        with pytest.raises(ValueError, match="group_size"):
            qfn(w, fmt, group)


@QUANTIZERS
def test_bad_weight(qfn):
    with pytest.raises(ValueError, match=r"shape \(K, N\)"):
        qfn(jnp.ones((64,), jnp.float32), "q8_0")
    with pytest.raises(ValueError, match=r"shape \(K, N\)"):
        qfn(jnp.ones((2, 64, 2), jnp.float32), "q8_0")
    for dtype in (jnp.int32, jnp.float16, jnp.float64 if jax.config.jax_enable_x64 else jnp.int8):
        with pytest.raises(ValueError, match="float32 or bfloat16"):
            qfn(jnp.ones((64, 2), dtype), "q8_0")
    with pytest.raises(ValueError, match="must be an array"):
        qfn([[1.0, 2.0]] * 32, "q8_0")
    with pytest.raises(ValueError, match="multiple"):
        qfn(jnp.ones((40, 2), jnp.float32), "q4_0")
    with pytest.raises(ValueError, match="multiple"):
        qfn(jnp.ones((96, 2), jnp.float32), "int4", 64)
    for bad in (np.inf, -np.inf, np.nan):
        w = np.ones((64, 2), np.float32)
        w[37, 1] = bad
        for dtype in (F32, BF16):
            with pytest.raises(ValueError, match="non-finite"):
                qfn(jnp.asarray(w, dtype), "q4_0")


@MATMULS
def test_bad_x(mm):
    qt = _good_qt()
    for dtype in (jnp.float16, jnp.int32):
        with pytest.raises(ValueError, match="x must be float32 or bfloat16"):
            mm(jnp.ones((2, 64), dtype), qt)
    for shape in ((2, 65), (2, 32), (64, 2), ()):
        with pytest.raises(ValueError, match="last dimension must be K=64"):
            mm(jnp.ones(shape, jnp.float32), qt)
    with pytest.raises(ValueError, match="x must be an array"):
        mm([1.0] * 64, qt)


@MATMULS
def test_bad_qt_for_matmul(mm):
    x = jnp.ones((2, 64), jnp.float32)
    with pytest.raises(ValueError, match="QuantizedTensor"):
        mm(x, jnp.ones((64, 4), jnp.float32))
    with pytest.raises(ValueError, match="QuantizedTensor"):
        mm(x, None)


def _bad_qts():
    """(label, QuantizedTensor with an inconsistent field, expected message)."""
    good = {f: _good_qt(f) for f in ("q8_0", "q4_0", "q4_1", "int8", "int4")}
    out = []
    q = good["q4_1"]
    out.append(("qs wide", dataclasses.replace(q, qs=jnp.zeros((4, 64), jnp.uint8)), "qt.qs"))
    out.append(("qs int8 for 4-bit", dataclasses.replace(q, qs=q.qs.astype(jnp.int8)), "qt.qs"))
    out.append(("qs transposed", dataclasses.replace(q, qs=q.qs.T), "qt.qs"))
    out.append(("scales f32 for q4_1", dataclasses.replace(q, scales=q.scales.astype(jnp.float32)), "qt.scales"))
    out.append(("scales shape", dataclasses.replace(q, scales=q.scales[:, :1]), "qt.scales"))
    out.append(("mins missing", dataclasses.replace(q, mins=jnp.zeros((4, 0), jnp.float16)), "qt.mins"))
    out.append(("mins f32", dataclasses.replace(q, mins=q.mins.astype(jnp.float32)), "qt.mins"))
    q8 = good["q8_0"]
    out.append(("q8 qs uint8", dataclasses.replace(q8, qs=q8.qs.astype(jnp.uint8)), "qt.qs"))
    out.append(("q8 qs 1-D", dataclasses.replace(q8, qs=q8.qs.reshape(-1)), "qt.qs"))
    out.append(("q8 mins present", dataclasses.replace(q8, mins=jnp.zeros((4, 2), jnp.float16)), "qt.mins"))
    out.append(("q8 empty mins", dataclasses.replace(q8, mins=jnp.zeros((4, 0), jnp.float16)), "qt.mins"))
    out.append(("q4_1 mins None", dataclasses.replace(q, mins=None), "qt.mins"))
    i8 = good["int8"]
    out.append(("int8 f16 scales", dataclasses.replace(i8, scales=i8.scales.astype(jnp.float16)), "qt.scales"))
    out.append(("int8 group mismatch", dataclasses.replace(i8, group=64), "qt.scales"))
    out.append(("bad fmt", dataclasses.replace(i8, fmt="int3"), "fmt"))
    out.append(("bad group", dataclasses.replace(i8, group=16), "group_size"))
    out.append(("shape K", dataclasses.replace(good["q4_0"], shape=(32, 4)), "qt.qs"))
    # buffers consistent with the (K, N) formulas, but K = 40 is not a whole number of blocks
    out.append(("K not multiple of group", QuantizedTensor(jnp.zeros((4, 20), jnp.uint8), jnp.ones((4, 1), jnp.float16),
                                                           jnp.zeros((4, 0), jnp.float16), "q4_0", (40, 4), 32), "multiple"))
    return out


@pytest.mark.parametrize("fmt,group", [("q4_1", 32), ("q8_0", 32), ("int4", 64)])
def test_lane_scales_layout(fmt, group):
    """lanes[t, g, c] is column 16 t + c's scale of group g (then, for q4_1, its min at c + 16); columns
    past N are zeros."""
    qt = _good_qt(fmt, k=4 * group, n=21, group=group)
    lanes = np.asarray(lane_scales(qt))
    assert lanes.shape == (2, 4, 32 if fmt == "q4_1" else 16) and lanes.dtype == qt.scales.dtype
    scales = np.asarray(qt.scales)
    for col in range(32):
        t, c = divmod(col, 16)
        want = scales[col] if col < 21 else np.zeros(4, scales.dtype)
        np.testing.assert_array_equal(lanes[t, :, c], want, err_msg=f"scales of column {col}")
        if fmt == "q4_1":
            want = np.asarray(qt.mins)[col] if col < 21 else np.zeros(4, np.float16)
            np.testing.assert_array_equal(lanes[t, :, 16 + c], want, err_msg=f"mins of column {col}")
    assert with_lane_scales(qt).lanes is not None and with_lane_scales(with_lane_scales(qt)).lanes.shape == lanes.shape


def test_bad_lanes():
    """Lanes that do not match the weight: a ValueError naming them in Python, an FFI error (not a read past
    the buffer) when the handler is called directly."""
    qt = _good_qt("q4_1", k=64, n=20)
    x = jnp.ones((1, 64), jnp.float32)
    for bad in (lane_scales(qt)[:1], lane_scales(qt)[..., :16], lane_scales(qt).astype(jnp.float32)):
        for mm in (quant_matmul, quant_matmul_reference):
            with pytest.raises(ValueError, match="qt.lanes"):
                mm(x, dataclasses.replace(qt, lanes=bad))
        call = jax.ffi.ffi_call(MATMUL_TARGET, jax.ShapeDtypeStruct((1, 20), jnp.float32))
        with pytest.raises(Exception, match="lanes"):
            jax.block_until_ready(call(x, qt.qs, qt.scales, qt.mins, bad, np.int32(0), fmt=np.int32(FORMATS["q4_1"].id),
                                       group=np.int64(32), route=np.int32(0)))


@pytest.mark.parametrize("label,qt,match", _bad_qts(), ids=lambda v: v if isinstance(v, str) else "")
def test_bad_quantized_tensor(label, qt, match):
    x = jnp.ones((2, qt.shape[0]), jnp.float32)
    for fn in (lambda: dequantize(qt), lambda: dequantize_reference(qt), lambda: quant_matmul(x, qt),
               lambda: quant_matmul_reference(x, qt)):
        with pytest.raises(ValueError, match=match):
            fn()


@DEQUANTIZERS
def test_bad_dequantize_args(dqfn):
    with pytest.raises(ValueError, match="QuantizedTensor"):
        dqfn(jnp.ones((64, 4), jnp.float32))


def test_bad_dequantize_dtype():
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        dequantize(_good_qt(), jnp.float16)


# ----------------------------------------------------------------------------------------------
# 8. the compiled ops are what jit lowers to


def test_lowered_hlo_contains_custom_calls():
    qt = _good_qt("q4_0", k=64, n=8)
    x = jnp.ones((3, 64), jnp.float32)
    assert MATMUL_TARGET in jax.jit(quant_matmul).lower(x, qt).as_text()
    assert QUANTIZE_TARGET in jax.jit(quantize, static_argnums=(1, 2)).lower(jnp.ones((64, 8)), "q4_0", None).as_text()
    assert DEQUANTIZE_TARGET in jax.jit(dequantize).lower(qt).as_text()
    # the backward pass dequantizes with the FFI op (grad alone drops the unused forward call)
    assert DEQUANTIZE_TARGET in jax.jit(jax.grad(lambda x: quant_matmul(x, qt).sum())).lower(x).as_text()
    both = jax.jit(jax.value_and_grad(lambda x: quant_matmul(x, qt).sum())).lower(x).as_text()
    assert MATMUL_TARGET in both and DEQUANTIZE_TARGET in both
    # and the references contain no custom call
    assert "tunix_rt_" not in jax.jit(quant_matmul_reference).lower(x, qt).as_text()


@MATMULS
@pytest.mark.parametrize("rows", [-1, 2.0, "4", True])
def test_bad_int8_rows(mm, rows):
    qt = _good_qt()
    with pytest.raises(ValueError, match="quant_matmul: int8_rows"):
        mm(jnp.ones((2, 64), jnp.float32), qt, int8_rows=rows)


@MATMULS
def test_invariant_needs_a_route_that_ignores_the_row_count(mm):
    """invariant=True with a finite int8_rows would pick int8 or exact by the call's row count."""
    with pytest.raises(ValueError, match="invariant=True needs exact=True or int8_rows=None"):
        mm(jnp.ones((2, 64), jnp.float32), _good_qt(), invariant=True)
    mm(jnp.ones((2, 64), jnp.float32), _good_qt(), invariant=True, int8_rows=None)
    mm(jnp.ones((2, 64), jnp.float32), _good_qt(), invariant=True, exact=True)
