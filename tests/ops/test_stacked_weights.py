"""Stacked weights: quant_matmul with a QuantizedTensor's `layer` and matmul's `layer=`, which read one layer of
a stack (every weight array on a leading layer axis) in place.

What must hold: layer i of a stack gives the same bits as the unstacked layer i, for every quant format, x dtype
and route (int8 GEMV and GEMM, exact, exact row-invariant), with and without lane scales, in jit with a traced
layer and in a scan over layers; the compiled ops stay within the unstacked tests' bounds of the references;
a layer outside the stack is an FFI error at run time (never a read past the buffer) and the op works after
it; inconsistent stacks are ValueErrors naming the argument; gradients are the unstacked layer's. A scan over
a stacked quant_matmul compiles to no dynamic-slice of the weight: the copy per layer the stack exists to avoid.
"""

from __future__ import annotations

import dataclasses
import re
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.isa_tiers import TIERS, expected_tier, run_tiers
from tests.ops.test_quant import exact_matmul_bound, matmul_error_bound
from tunix_rt.ops import FORMATS, _ffi, dequantize, dequantize_reference, quant_matmul, quant_matmul_reference, quantize
from tunix_rt.ops.matmul import matmul, matmul_reference
from tunix_rt.ops.quant import lane_scales, with_lane_scales

pytestmark = pytest.mark.skipif(
    not all(_ffi.has_cpu_target(t) for t in ("tunix_rt_quant_matmul", "tunix_rt_bf16_matmul")),
    reason="tunix_rt._ext is not built: no FFI op to test",
)

ALL_FMTS = ("q8_0", "q4_0", "q4_1", "int8", "int4")
F32, BF16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)
S = 3
# (name, rows of x, quant_matmul's route settings): the int8 GEMV, the int8 GEMM, exact panels, exact column dots
ROUTES = [
    ("int8 gemv", 3, {}),
    ("int8 gemm", 7, dict(int8_rows=None)),
    ("exact", 7, dict(exact=True)),
    ("invariant", 5, dict(exact=True, invariant=True)),
]
# jax raises a handler's INVALID_ARGUMENT as JaxRuntimeError on a first call, as ValueError from its fast path after
FFI_ERROR = (jax.errors.JaxRuntimeError, ValueError)


def _f32(a) -> np.ndarray:
    return np.asarray(jnp.asarray(a).astype(jnp.float32))


def _stack(trees):
    return jax.tree.map(lambda *a: jnp.stack(a), *trees)


def _layers(fmt, k, n, seed, group=None, lanes=False):
    """S quantized (K, N) weights and their stack."""
    rng = np.random.default_rng(seed)
    qts = [quantize(jnp.asarray(rng.standard_normal((k, n)) * rng.uniform(0.1, 2), jnp.float32), fmt, group)
           for _ in range(S)]
    if lanes:
        qts = [with_lane_scales(q) for q in qts]
    return qts, _stack(qts)


def _at(stack, layer):
    return dataclasses.replace(stack, layer=layer)


def _scan_layers(mm, x, stack, **kw):
    """mm(x, layer i) for every i, in one jitted scan over a traced layer index: (S, M, N)."""
    def run(x, stack):
        return jax.lax.scan(lambda c, i: (c, mm(x, _at(stack, i), **kw)), None, jnp.arange(S, dtype=jnp.int32))[1]
    return jax.jit(run)(x, stack)


def _expect_layer_error(fn, op, layer):
    with pytest.raises(FFI_ERROR, match=r"^INVALID_ARGUMENT: .*" + re.escape(f"{op}: layer = {layer} is outside "
                                                                               f"the stack's [0, {S})")):
        jax.block_until_ready(fn())


# ----------------------------------------------------------------------------------------------
# quant_matmul


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("fmt", ALL_FMTS)
def test_quant_layer_equals_the_unstacked_layer(fmt, dtype):
    """Every layer, route and lanes setting: eager, jit with a traced layer and a scan give the unstacked
    layer's bits; the reference too; the compiled op within the unstacked bounds of the reference."""
    k, n = 96, 40
    rng = np.random.default_rng(1)
    for lanes in (False, True):
        qts, stack = _layers(fmt, k, n, seed=2, lanes=lanes)
        assert stack.lanes is None or stack.lanes.shape[0] == S
        for name, m, kw in ROUTES:
            x = jnp.asarray(rng.standard_normal((m, k)), dtype)
            jitted = jax.jit(lambda x, q, kw=kw: quant_matmul(x, q, **kw))
            scanned = _scan_layers(quant_matmul, x, stack, **kw)
            for i, qt in enumerate(qts):
                want = _f32(quant_matmul(x, qt, **kw))
                what = f"{name} lanes={lanes} layer {i}"
                np.testing.assert_array_equal(_f32(quant_matmul(x, _at(stack, i), **kw)), want, err_msg=what)
                np.testing.assert_array_equal(_f32(jitted(x, _at(stack, jnp.int32(i)))), want, err_msg=what)
                np.testing.assert_array_equal(_f32(scanned[i]), want, err_msg=what)
                ref = _f32(quant_matmul_reference(x, _at(stack, jnp.int32(i)), **kw))
                np.testing.assert_array_equal(ref, _f32(quant_matmul_reference(x, qt, **kw)), err_msg=what)
                bound = exact_matmul_bound if kw.get("exact") else matmul_error_bound
                ref64, tol = bound(_f32(x), qt, dtype)
                assert np.all(np.abs(want.astype(np.float64) - ref64) <= tol), what


@settings(max_examples=25, deadline=None)
@given(fmt_group=st.sampled_from([(f, g) for f in ALL_FMTS for g in FORMATS[f].groups]), blocks=st.integers(1, 6),
       n=st.integers(1, 40), m=st.integers(1, 9), lead=st.booleans(), seed=st.integers(0, 2**16))
def test_quant_layer_any_shape(fmt_group, blocks, n, m, lead, seed):
    """Any K (group multiples), N (partial 16-column tiles), M and leading dimensions of x: a traced layer of the
    stack is the unstacked layer, bit for bit, on the default route and with int8 for every row."""
    fmt, group = fmt_group
    k = blocks * group
    qts, stack = _layers(fmt, k, n, seed, group, lanes=bool(seed % 2))
    x = jnp.asarray(np.random.default_rng(seed).standard_normal((2, m, k) if lead else (m, k)), jnp.float32)
    for kw in ({}, dict(int8_rows=None)):
        f = jax.jit(lambda x, q, kw=kw: quant_matmul(x, q, **kw))
        for i in range(S):
            np.testing.assert_array_equal(_f32(f(x, _at(stack, jnp.int32(i)))), _f32(quant_matmul(x, qts[i], **kw)))


@pytest.mark.parametrize("fmt", ALL_FMTS)
def test_quant_layer_outside_the_stack_is_an_error(fmt):
    _, stack = _layers(fmt, 64, 20, seed=3, lanes=fmt == "q4_1")
    x = jnp.ones((2, 64), jnp.float32)
    f = jax.jit(lambda x, q: quant_matmul(x, q))
    scan = jax.jit(lambda x, q, layers: jax.lax.scan(lambda c, i: (c, quant_matmul(x, _at(q, i))), None, layers)[1])
    for layer in (-1, S, 2**31 - 1, -(2**31)):
        _expect_layer_error(lambda: f(x, _at(stack, jnp.int32(layer))), "quant_matmul", layer)
        _expect_layer_error(lambda: quant_matmul(x, _at(stack, layer)), "quant_matmul", layer)
        _expect_layer_error(lambda: scan(x, stack, jnp.asarray([0, layer, 1], jnp.int32)), "quant_matmul", layer)
    # the same program runs on after the errors
    np.testing.assert_array_equal(_f32(f(x, _at(stack, jnp.int32(S - 1)))),
                                  _f32(quant_matmul(x, jax.tree.map(lambda a: a[S - 1], stack))))


def test_quant_handler_checks_the_stack():
    """Called directly, the handler refuses buffers whose stacks disagree (an FFI error, not a read past them)."""
    qts, stack = _layers("q4_1", 64, 20, seed=4)
    x = jnp.ones((1, 64), jnp.float32)
    call = jax.ffi.ffi_call("tunix_rt_quant_matmul", jax.ShapeDtypeStruct((1, 20), jnp.float32))
    kw = dict(fmt=np.int32(FORMATS["q4_1"].id), group=np.int64(32), route=np.int32(0))
    no_lanes = jnp.zeros((0, 0, 0), jnp.float16)
    lanes = lane_scales(qts[0])
    for label, args, match in (
        ("scales of 2", (stack.qs, stack.scales[:2], stack.mins, no_lanes), "scales"),
        ("unstacked mins", (stack.qs, stack.scales, stack.mins[0], no_lanes), "mins"),
        ("unstacked lanes", (stack.qs, stack.scales, stack.mins, lanes), "lanes"),
        ("stacked scales of one weight", (qts[0].qs, stack.scales, stack.mins, no_lanes), "scales"),
    ):
        with pytest.raises(FFI_ERROR, match=match):
            jax.block_until_ready(call(x, *args, np.int32(0), **kw))
    with pytest.raises(FFI_ERROR, match=re.escape("layer = 1 is outside the stack's [0, 1)")):
        jax.block_until_ready(call(x, qts[0].qs, qts[0].scales, qts[0].mins, no_lanes, np.int32(1), **kw))


@pytest.mark.parametrize("fn", [quant_matmul, quant_matmul_reference, "dequantize", "dequantize_reference"])
def test_inconsistent_stacks_name_the_argument(fn):
    qts, stack = _layers("q4_1", 64, 20, seed=5, lanes=True)
    stack = _at(stack, 0)
    x = jnp.ones((2, 64), jnp.float32)
    call = {"dequantize": lambda q: dequantize(q), "dequantize_reference": lambda q: dequantize_reference(q)}.get(
        fn, lambda q: fn(x, q))
    one = qts[0]
    for label, qt, name in (
        ("scales of 2", dataclasses.replace(stack, scales=stack.scales[:2]), "qt.scales"),
        ("mins unstacked", dataclasses.replace(stack, mins=one.mins), "qt.mins"),
        ("lanes unstacked", dataclasses.replace(stack, lanes=one.lanes), "qt.lanes"),
        ("an unstacked weight", dataclasses.replace(one, layer=0), "qt.qs"),
        ("layer of shape (1,)", dataclasses.replace(stack, layer=jnp.zeros((1,), jnp.int32)), "qt.layer"),
        ("float layer", dataclasses.replace(stack, layer=jnp.float32(0)), "qt.layer"),
        ("bool layer", dataclasses.replace(stack, layer=True), "qt.layer"),
        ("layer None", dataclasses.replace(stack, layer=None), "set qt.layer"),  # a stack is one weight by its layer
    ):
        with pytest.raises(ValueError, match=re.escape(name)):
            call(qt)
    with pytest.raises(ValueError, match=re.escape("qt.scales must be float16[3, 20, 2] for q4_1 (64, 20) in a stack "
                                                  "of 3, got float16[2, 20, 2]")):
        call(dataclasses.replace(stack, scales=stack.scales[:2]))


@pytest.mark.parametrize("fmt", ALL_FMTS)
def test_quant_stack_dequantize_lanes_and_gradient(fmt):
    """dequantize and lane_scales of a stack are the layer's; d/dx through a stacked call is the unstacked
    layer's, the stack's cotangents zeros of its shapes (float0 for codes and the layer index)."""
    qts, stack = _layers(fmt, 64, 24, seed=6)
    np.testing.assert_array_equal(np.asarray(lane_scales(_at(stack, 0))), np.stack([lane_scales(q) for q in qts]))
    laned = with_lane_scales(_at(stack, 0))
    assert laned.lanes.shape == (S, *lane_scales(qts[0]).shape) and laned.layer == 0
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((5, 64)), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((5, 24)), jnp.float32)
    for i, qt in enumerate(qts):
        at = _at(stack, jnp.int32(i))
        for deq in (dequantize, dequantize_reference, jax.jit(dequantize)):
            np.testing.assert_array_equal(np.asarray(deq(at)), np.asarray(dequantize(qt)))
        y, pull = jax.vjp(quant_matmul, x, at)
        dx, dqt = pull(dy)
        np.testing.assert_array_equal(np.asarray(y), np.asarray(quant_matmul(x, qt)))
        np.testing.assert_array_equal(np.asarray(dx), np.asarray(jax.vjp(quant_matmul, x, qt)[1](dy)[0]))
        assert dqt.qs.dtype == jax.dtypes.float0 and dqt.qs.shape == stack.qs.shape
        assert dqt.layer.dtype == jax.dtypes.float0 and dqt.layer.shape == ()
        assert dqt.scales.shape == stack.scales.shape and not np.any(_f32(dqt.scales))
        g = jax.jit(jax.grad(lambda x, q: jnp.sum(quant_matmul(x, q) * dy)))(x, at)
        np.testing.assert_array_equal(np.asarray(g), np.asarray(dx))


def _weight_slices(hlo: str) -> list[str]:
    """The compiled program's dynamic-slices of anything but an s32 index vector (a scan's own xs)."""
    return [line for line in hlo.splitlines()
            if "dynamic-slice(" in line and not re.search(r"= s32\[\d*\]\S* dynamic-slice\(", line)]


def test_scanned_stack_compiles_to_no_weight_slice():
    """A scan over a stacked weight's layers compiles to FFI calls on the whole stack, no dynamic-slice of it; the
    same scan slicing the stack itself (what the decoder would do without `layer`) does slice it."""
    _, stack = _layers("q4_1", 128, 128, seed=8, lanes=True)
    w = jnp.asarray(np.random.default_rng(9).standard_normal((S, 128, 128)), jnp.float32)
    x = jnp.ones((1, 128), jnp.float32)
    layers = jnp.arange(S, dtype=jnp.int32)

    def chain(mm):
        return lambda x, weights: jax.lax.scan(lambda h, i: (mm(h, weights, i), None), x, layers)[0]

    programs = {
        "quant_matmul": chain(lambda h, q, i: quant_matmul(h, _at(q, i))),
        "matmul": chain(lambda h, w, i: matmul(h, w, layer=i)),
        "matmul transposed": chain(lambda h, w, i: matmul(h, w, transpose_w=True, layer=i)),
    }
    for name, f in programs.items():
        hlo = jax.jit(f).lower(x, stack if name == "quant_matmul" else w).compile().as_text()
        assert "custom-call" in hlo, name
        assert not _weight_slices(hlo), (name, _weight_slices(hlo))
    sliced = chain(lambda h, q, i: quant_matmul(h, jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, False),
                                                                q)))
    assert _weight_slices(jax.jit(sliced).lower(x, stack).compile().as_text())


# ----------------------------------------------------------------------------------------------
# matmul


@settings(max_examples=30, deadline=None)
@given(m=st.integers(1, 12), k=st.integers(1, 300), n=st.integers(1, 70), transpose_w=st.booleans(),
       bf16=st.booleans(), seed=st.integers(0, 2**16))
def test_matmul_layer_equals_the_unstacked_layer(m, k, n, transpose_w, bf16, seed):
    """matmul(x, w, layer=i) is matmul(x, w[i]) bit for bit, eager, in jit with a traced layer and in a scan;
    matmul_reference(layer=i) is matmul_reference(x, w[i])."""
    rng = np.random.default_rng(seed)
    dtype = jnp.bfloat16 if bf16 else jnp.float32
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = jnp.asarray(rng.standard_normal((S, n, k) if transpose_w else (S, k, n)), dtype)
    f = jax.jit(lambda x, w, i: matmul(x, w, transpose_w=transpose_w, layer=i))
    scanned = jax.jit(lambda x, w: jax.lax.scan(lambda c, i: (c, matmul(x, w, transpose_w=transpose_w, layer=i)), None,
                                                jnp.arange(S))[1])(x, w)
    for i in range(S):
        want = _f32(matmul(x, w[i], transpose_w=transpose_w))
        np.testing.assert_array_equal(_f32(matmul(x, w, transpose_w=transpose_w, layer=i)), want)
        np.testing.assert_array_equal(_f32(f(x, w, jnp.int32(i))), want)
        np.testing.assert_array_equal(_f32(scanned[i]), want)
        np.testing.assert_array_equal(_f32(matmul_reference(x, w, transpose_w=transpose_w, layer=jnp.int32(i))),
                                      _f32(matmul_reference(x, w[i], transpose_w=transpose_w)))


@pytest.mark.parametrize("transpose_w", [False, True])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_matmul_layer_outside_the_stack_is_an_error(dtype, transpose_w):
    x = jnp.ones((2, 16), dtype)
    w = jnp.ones((S, 16, 16), dtype)
    f = jax.jit(lambda x, w, i: matmul(x, w, transpose_w=transpose_w, layer=i))
    for layer in (-1, S, 2**31 - 1):
        _expect_layer_error(lambda: f(x, w, jnp.int32(layer)), "bf16_matmul", layer)
        _expect_layer_error(lambda: matmul(x, w, transpose_w=transpose_w, layer=layer), "bf16_matmul", layer)
    np.testing.assert_array_equal(_f32(f(x, w, jnp.int32(S - 1))), _f32(matmul(x, w[S - 1], transpose_w=transpose_w)))


@pytest.mark.parametrize("transpose_w", [False, True])
def test_matmul_layer_gradients_are_the_references(transpose_w):
    """dx is the layer's; dw is the layer's gradient in its slot of the stack, zeros in the others."""
    rng = np.random.default_rng(10)
    x = jnp.asarray(rng.standard_normal((4, 24)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((S, 12, 24) if transpose_w else (S, 24, 12)), jnp.float32)

    def loss(mm, layer):
        return lambda x, w: jnp.sum(mm(x, w, transpose_w=transpose_w, layer=layer) ** 2)

    for i in range(S):
        gx, gw = jax.jit(jax.grad(loss(matmul, i), (0, 1)))(x, w)
        rx, rw = jax.grad(loss(matmul_reference, i), (0, 1))(x, w)
        np.testing.assert_allclose(gx, rx, rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(gw, rw, rtol=1e-5, atol=1e-4)
        assert np.any(np.asarray(gw[i])) and not np.any(np.delete(np.asarray(gw), i, axis=0))


@pytest.mark.parametrize("fn", [matmul, matmul_reference])
def test_matmul_bad_stacks_name_the_argument(fn):
    x = jnp.ones((2, 8), jnp.float32)
    w = jnp.ones((S, 8, 5), jnp.float32)
    for bad, match in (
        (dict(w=w[0], layer=0), r"matmul: with a layer, w must be a stack \(S, K, N\)"),
        (dict(w=w[None], layer=0), r"matmul: with a layer, w must be a stack"),
        (dict(w=w, layer=jnp.zeros((1,), jnp.int32)), r"matmul: layer must be an integer scalar, got int32\[1\]"),
        (dict(w=w, layer=1.0), "matmul: layer must be an integer scalar, got float"),
        (dict(w=w, layer=True), "matmul: layer must be an integer scalar, got bool"),
        (dict(w=w, layer=0, transpose_w=True), r"x's last dimension \(8\) does not match w's K \(5\)"),
        (dict(w=w, layer=None), "need x"),  # a stack without a layer
    ):
        with pytest.raises(ValueError, match=match):
            fn(x, **bad)


def test_bf16_matmul_handler_checks_the_stack():
    """Only the b operand may be a stack; a stacked a is an FFI error."""
    call = jax.ffi.ffi_call("tunix_rt_bf16_matmul", jax.ShapeDtypeStruct((2, 5), jnp.float32))
    with pytest.raises(FFI_ERROR, match="operands must be 2-D"):
        jax.block_until_ready(call(jnp.ones((S, 2, 8)), jnp.ones((8, 5)), np.int32(0), transpose_a=False,
                                   transpose_b=False))
    with pytest.raises(FFI_ERROR, match="operands must be 2-D"):
        jax.block_until_ready(call(jnp.ones((2, 8)), jnp.ones((1, S, 8, 5)), np.int32(0), transpose_a=False,
                                   transpose_b=False))


# ----------------------------------------------------------------------------------------------
# every ISA tier (TUNIX_RT_ISA is read once per process: subprocesses)

_TIER_SCRIPT = textwrap.dedent(
    """
    import dataclasses, json, sys
    import numpy as np, jax, jax.numpy as jnp
    from tunix_rt.ops import _ffi, quantize, quant_matmul
    from tunix_rt.ops.matmul import matmul
    from tunix_rt.ops.quant import with_lane_scales

    out, rng = {}, np.random.default_rng(12)
    x = jnp.asarray(rng.standard_normal((7, 160)), jnp.float32)
    for fmt in ("q8_0", "q4_1", "int4"):
        qts = [with_lane_scales(quantize(jnp.asarray(rng.standard_normal((160, 40)), jnp.float32), fmt)) for _ in range(3)]
        stack = jax.tree.map(lambda *a: jnp.stack(a), *qts)
        for route, m, kw in (("gemv", 3, {}), ("gemm", 7, dict(int8_rows=None)), ("exact", 7, dict(exact=True))):
            f = jax.jit(lambda x, q, kw=kw: quant_matmul(x, q, **kw))
            for i in range(3):
                out[f"{fmt}_{route}_{i}_stacked"] = np.asarray(f(x[:m], dataclasses.replace(stack, layer=jnp.int32(i))))
                out[f"{fmt}_{route}_{i}"] = np.asarray(quant_matmul(x[:m], qts[i], **kw))
    for dtype in (jnp.float32, jnp.bfloat16):  # bf16 below AVX-512 BF16: the layer alone is widened to f32
        for t in (False, True):
            w = jnp.asarray(rng.standard_normal((3, 40, 160) if t else (3, 160, 40)), dtype)
            f = jax.jit(lambda x, w, i, t=t: matmul(x, w, transpose_w=t, layer=i))
            for i in range(3):
                name = f"matmul_{jnp.dtype(dtype).name}_{t}_{i}"
                out[name + "_stacked"] = np.asarray(f(x.astype(dtype), w, jnp.int32(i)).astype(jnp.float32))
                out[name] = np.asarray(matmul(x.astype(dtype), w[i], transpose_w=t).astype(jnp.float32))
    np.savez(sys.argv[1], **out)
    print(json.dumps({"isa": _ffi.isa_level()}))
    """
)


@pytest.fixture(scope="module")
def tier_runs(tmp_path_factory):
    return run_tiers(TIERS, _TIER_SCRIPT, tmp_path_factory.mktemp("stacked_isa"))


@pytest.mark.parametrize("tier", TIERS)
def test_every_isa_tier_reads_the_layer(tier_runs, tier):
    """On every kernel tier a stacked weight's layer gives the unstacked layer's bits."""
    report, res = tier_runs[tier]
    assert report["isa"] == expected_tier(tier)
    stacked = [name for name in res if name.endswith("_stacked")]
    assert len(stacked) == 3 * 3 * 3 + 2 * 2 * 3
    for name in stacked:
        np.testing.assert_array_equal(res[name], res[name.removesuffix("_stacked")], err_msg=f"{tier} {name}")
