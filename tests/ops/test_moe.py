"""MoE routing ops vs their pure-JAX references: router top-k, permute, unpermute, grouped matmul,
forward and backward, on hypothesis inputs (ties, -inf logits, empty experts, every token on one
expert), plus bad-index FFI errors, argument checks and the auxiliary losses."""

from __future__ import annotations

import functools
import re
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.isa_tiers import TIERS, expected_tier, hardware_tier, run_tiers
from tunix_rt.ops import _ffi, moe

pytestmark = [pytest.mark.skipif(not _ffi.has_cpu_target("tunix_rt_grouped_matmul"),
                                 reason="tunix_rt._ext is not built: no FFI op to test"),
              pytest.mark.usefixtures("fast_compiles")]
FFI_ERROR = (jax.errors.JaxRuntimeError, ValueError)


def _np(a):
    return np.asarray(jnp.asarray(a).astype(jnp.float32) if jnp.asarray(a).dtype == jnp.bfloat16 else a)


# ---- router top-k ------------------------------------------------------------------------------


@st.composite
def route_cases(draw):
    groups = draw(st.sampled_from([1, 1, 2, 4]))
    e = groups * draw(st.integers(1, 6))
    t = draw(st.integers(0, 24))
    kind = draw(st.sampled_from(["normal", "ties", "neg_inf", "large"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    if kind == "ties":  # few distinct values: top-k must break ties by the lower expert id
        logits = rng.integers(-2, 2, (t, e)).astype(np.float32)
    elif kind == "large":
        logits = (rng.standard_normal((t, e)) * 60).astype(np.float32)
    else:
        logits = rng.standard_normal((t, e)).astype(np.float32)
    if kind == "neg_inf" and e > 1:  # masked experts, never all of a row
        mask = rng.random((t, e)) < 0.4
        mask[:, 0] = False
        logits[mask] = -np.inf
    topk_groups = draw(st.integers(1, groups))
    k = draw(st.integers(1, topk_groups * (e // groups) if groups > 1 else e))
    kw = dict(scoring=draw(st.sampled_from(moe.SCORINGS)), renormalize=draw(st.booleans()), n_groups=groups,
              topk_groups=topk_groups, group_top=draw(st.integers(1, min(2, e // groups))),
              scale=draw(st.sampled_from([1.0, 2.5])))
    if draw(st.booleans()):
        kw["bias"] = jnp.asarray(rng.standard_normal(e).astype(np.float32))
    return logits, k, kw


@functools.partial(jax.jit, static_argnames=("fn", "k", "scoring", "renormalize", "n_groups", "topk_groups",
                                             "group_top", "scale"))
def _route_and_grad(logits, bias, probe, *, fn, k, **kw):
    """fn's (weights, ids) and the gradient of sum(weights * probe) over the logits, as one program."""
    route = lambda x: fn(x, k, bias=bias, **kw)
    return route(logits), jax.grad(lambda x: jnp.sum(route(x)[0] * probe))(logits)


@pytest.mark.slow
@settings(max_examples=60)
@given(case=route_cases())
def test_router_topk_matches_reference(case):
    logits, k, kw = case
    lg = jnp.asarray(logits)
    probe = jnp.asarray(np.random.default_rng(1).standard_normal((logits.shape[0], k)).astype(np.float32))
    kw = dict(kw)
    bias = kw.pop("bias", None)
    (w, ids), g = _route_and_grad(lg, bias, probe, fn=moe.router_topk, k=k, **kw)
    (wr, idr), gr = _route_and_grad(lg, bias, probe, fn=moe.router_topk_reference, k=k, **kw)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(idr))
    np.testing.assert_allclose(np.asarray(w), np.asarray(wr), rtol=2e-6, atol=1e-7)
    if logits.size and np.isfinite(logits).all():
        np.testing.assert_allclose(np.asarray(g), np.asarray(gr), rtol=1e-5, atol=1e-6)


def test_router_topk_leading_dims_bf16_and_jit():
    lg = jnp.asarray(np.random.default_rng(0).standard_normal((2, 5, 8)), jnp.bfloat16)
    w, ids = jax.jit(lambda x: moe.router_topk(x, 2, renormalize=True))(lg)
    wr, idr = moe.router_topk_reference(lg, 2, renormalize=True)
    assert w.shape == ids.shape == (2, 5, 2) and w.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(idr))
    np.testing.assert_allclose(np.asarray(w.sum(-1)), 1.0, rtol=1e-6)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_router_rejects_nan_and_pos_inf_logits(bad):
    lg = np.zeros((3, 4), np.float32)
    lg[1, 2] = bad
    with pytest.raises(FFI_ERROR, match=re.escape("router logits[1, 2]")):
        jax.block_until_ready(moe.router_topk(jnp.asarray(lg), 2))


def test_router_rejects_an_all_neg_inf_row_under_softmax():
    lg = np.zeros((2, 4), np.float32)
    lg[1] = -np.inf
    with pytest.raises(FFI_ERROR, match="row 1 is all -inf"):
        jax.block_until_ready(moe.router_topk(jnp.asarray(lg), 1))


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(k=0), "k must be a positive integer"),
    (dict(k=9), r"k \(9\) exceeds"),
    (dict(scoring="relu"), "scoring must be one of"),
    (dict(n_groups=3), r"n_groups \(3\) must divide"),
    (dict(n_groups=2, topk_groups=3), "need topk_groups <= n_groups"),
    (dict(n_groups=4, topk_groups=1, k=3), r"k \(3\) exceeds the experts of the 1 kept groups"),
    (dict(bias=jnp.zeros(3)), r"bias must have shape \(8,\)"),
    (dict(scale=float("nan")), "scale must be a finite number"),
])
def test_router_argument_errors(kwargs, pattern):
    kwargs = {"k": 2, **kwargs}
    k = kwargs.pop("k")
    for fn in (moe.router_topk, moe.router_topk_reference):
        with pytest.raises(ValueError, match=f"router_topk: {pattern}"):
            fn(jnp.zeros((4, 8)), k, **kwargs)


# ---- permute / unpermute -----------------------------------------------------------------------


@st.composite
def permute_cases(draw):
    t = draw(st.integers(0, 30))
    k = draw(st.integers(1, 4))
    e = draw(st.integers(1, 10))
    h = draw(st.sampled_from([1, 7, 33]))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    pattern = draw(st.sampled_from(["random", "one_expert", "few_experts"]))
    if pattern == "one_expert":  # every token's every choice on one expert (duplicates allowed)
        ids = np.full((t, k), draw(st.integers(0, e - 1)), np.int32)
    elif pattern == "few_experts":  # most experts get no token
        ids = rng.choice(np.array([0, e - 1]), (t, k)).astype(np.int32)
    else:
        ids = rng.integers(0, e, (t, k)).astype(np.int32)
    dtype = draw(st.sampled_from([jnp.float32, jnp.bfloat16]))
    x = jnp.asarray(rng.standard_normal((t, h)), dtype)
    w = jnp.asarray(rng.standard_normal((t, k)).astype(np.float32))
    return x, jnp.asarray(ids), e, w


_IMPLS = {"op": (moe.permute, moe.unpermute), "reference": (moe.permute_reference, moe.unpermute_reference)}


@functools.partial(jax.jit, static_argnames=("e", "impl"))
def _permute_round_trip(x, ids, w, *, e, impl):
    """permute's outputs, unpermute of them, and the gradients of a loss through both, as one program."""
    permute_fn, unpermute_fn = _IMPLS[impl]

    def f(x, w):
        xs, row_of, _ = permute_fn(x, ids, e)
        return jnp.sum(jnp.sin(unpermute_fn(xs * 1.5, row_of, w).astype(jnp.float32)))

    permuted = permute_fn(x, ids, e)
    return permuted, unpermute_fn(permuted[0], permuted[1], w), jax.grad(f, argnums=(0, 1))(x, w)


@pytest.mark.slow
@settings(max_examples=40)
@given(case=permute_cases())
def test_permute_and_unpermute_match_reference(case):
    x, ids, e, w = case
    got, out, grads = _permute_round_trip(x, ids, w, e=e, impl="op")
    ref, out_ref, grads_ref = _permute_round_trip(x, ids, w, e=e, impl="reference")
    for a, b in zip(got, ref):
        np.testing.assert_array_equal(_np(a), _np(b))
    xs, row_of, sizes = got
    t, k = ids.shape
    assert int(sizes.sum()) == t * k
    np.testing.assert_array_equal(np.sort(np.asarray(row_of).reshape(-1)), np.arange(t * k))  # one row each
    tol = 1e-6 if x.dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(_np(out), _np(out_ref), rtol=tol, atol=tol)
    for g, gr in zip(grads, grads_ref):
        np.testing.assert_allclose(_np(g), _np(gr), rtol=tol * 10, atol=tol * 10)


def test_permute_is_stable_within_each_expert():
    ids = jnp.asarray([[2, 0], [0, 2], [0, 1]], jnp.int32)
    x = jnp.arange(3, dtype=jnp.float32)[:, None] + 1.0
    xs, row_of, sizes = moe.permute(x, ids, 3)
    np.testing.assert_array_equal(np.asarray(sizes), [3, 1, 2])
    np.testing.assert_array_equal(np.asarray(row_of), [[4, 0], [1, 5], [2, 3]])  # tokens keep their order
    np.testing.assert_array_equal(np.asarray(xs[:, 0]), [1, 2, 3, 3, 1, 2])


def test_permute_rejects_expert_ids_out_of_range():
    x = jnp.ones((3, 4))
    for bad in (4, -1):
        ids = jnp.asarray([[0, 1], [2, bad], [3, 0]], jnp.int32)
        with pytest.raises(FFI_ERROR, match=re.escape(f"expert_ids[1, 1] = {bad} is outside [0, 4)")):
            jax.block_until_ready(moe.permute(x, ids, 4))


def test_unpermute_rejects_bad_rows():
    ys, w = jnp.ones((4, 3)), jnp.ones((2, 2))
    with pytest.raises(FFI_ERROR, match=re.escape("row_of[1, 0] = 4 is outside [-1, 4)")):
        jax.block_until_ready(moe.unpermute(ys, jnp.asarray([[0, 1], [4, 2]], jnp.int32), w))
    dup = jnp.asarray([[0, 1], [1, 2]], jnp.int32)  # the forward sum is defined; its gradient is not
    with pytest.raises(FFI_ERROR, match=re.escape("row_of[1, 0] = 1 repeats a row")):
        jax.block_until_ready(jax.grad(lambda y: moe.unpermute(y, dup, w).sum())(ys))


@pytest.mark.parametrize("call, pattern", [
    (lambda: moe.permute(jnp.ones((3, 4), jnp.int32), jnp.zeros((3, 2), jnp.int32), 4), "permute: x must be float32"),
    (lambda: moe.permute(jnp.ones((3, 4)), jnp.zeros((2, 2), jnp.int32), 4), r"permute: expert_ids must be int32 \(3, k\)"),
    (lambda: moe.permute(jnp.ones((3, 4)), jnp.zeros((3, 2), jnp.int32), 0), "permute: num_experts must be a positive"),
    (lambda: moe.unpermute(jnp.ones((4, 3)), jnp.zeros((2, 2), jnp.int32), jnp.ones((2, 3))), "unpermute: weights must be"),
    (lambda: moe.unpermute(jnp.ones((4, 3)), jnp.zeros((2, 2)), jnp.ones((2, 2))), "unpermute: row_of must be int32"),
])
def test_permute_argument_errors(call, pattern):
    with pytest.raises(ValueError, match=pattern):
        call()


# ---- grouped matmul ----------------------------------------------------------------------------


@st.composite
def gmm_cases(draw):
    e = draw(st.integers(1, 6))
    k = draw(st.sampled_from([1, 5, 16, 37]))
    n = draw(st.sampled_from([1, 3, 17, 40]))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    pattern = draw(st.sampled_from(["random", "one_group", "empty_tail"]))
    if pattern == "one_group":
        sizes = np.zeros(e, np.int32)
        sizes[draw(st.integers(0, e - 1))] = draw(st.integers(0, 20))
    else:
        sizes = rng.integers(0, 9, e).astype(np.int32)
        sizes[rng.random(e) < 0.3] = 0
    m = int(sizes.sum()) + (draw(st.integers(1, 5)) if pattern == "empty_tail" else 0)
    transpose_w = draw(st.booleans())
    dtype = draw(st.sampled_from([jnp.float32, jnp.bfloat16]))
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = jnp.asarray(rng.standard_normal((e, n, k) if transpose_w else (e, k, n)), dtype)
    return x, w, jnp.asarray(sizes), transpose_w


@functools.partial(jax.jit, static_argnames=("fn", "transpose_w"))
def _gmm_and_grads(x, w, sizes, probe, *, fn, transpose_w):
    """fn's product and the gradients of sum(product * probe) over (x, w), as one program."""
    loss = lambda a, b: jnp.sum((fn(a, b, sizes, transpose_w=transpose_w) * probe).astype(jnp.float32))
    return fn(x, w, sizes, transpose_w=transpose_w), jax.grad(loss, argnums=(0, 1))(x, w)


def _gmm_check(x, w, sizes, transpose_w):
    n = w.shape[1] if transpose_w else w.shape[2]
    probe = jnp.asarray(np.random.default_rng(2).standard_normal((x.shape[0], n)), x.dtype)
    y, g = _gmm_and_grads(x, w, sizes, probe, fn=moe.grouped_matmul, transpose_w=transpose_w)
    yr, gr = _gmm_and_grads(x, w, sizes, probe, fn=moe.grouped_matmul_reference, transpose_w=transpose_w)
    bf16 = x.dtype == jnp.bfloat16
    scale = np.sqrt(x.shape[1])
    tol = dict(rtol=1e-2, atol=2e-2 * scale) if bf16 else dict(rtol=2e-5, atol=2e-5 * scale)
    assert y.dtype == x.dtype and y.shape == yr.shape
    np.testing.assert_allclose(_np(y), _np(yr), **tol)
    np.testing.assert_array_equal(_np(y)[int(sizes.sum()):], 0.0)
    for a, b in zip(g, gr):
        assert a.dtype == b.dtype
        np.testing.assert_allclose(_np(a), _np(b), **{**tol, "atol": tol["atol"] * 3})


@pytest.mark.slow
@settings(max_examples=40)
@given(case=gmm_cases())
def test_grouped_matmul_matches_ragged_dot(case):
    _gmm_check(*case)


@pytest.mark.parametrize("transpose_w", [False, True])
def test_grouped_matmul_large_panels(transpose_w):
    """Sizes past one packed block (K > 256, N > 256, a group > 192 rows) and groups of 1-2 rows
    (the unpacked path)."""
    rng = np.random.default_rng(3)
    sizes = jnp.asarray([1, 0, 230, 2, 40], jnp.int32)
    k, n = 300, 270
    x = jnp.asarray(rng.standard_normal((280, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((5, n, k) if transpose_w else (5, k, n)), jnp.float32)
    _gmm_check(x, w, sizes, transpose_w)


def test_grouped_matmul_jit_equals_eager():
    rng = np.random.default_rng(4)
    x, w = jnp.asarray(rng.standard_normal((12, 8)), jnp.float32), jnp.asarray(rng.standard_normal((3, 8, 5)), jnp.float32)
    sizes = jnp.asarray([4, 0, 7], jnp.int32)
    np.testing.assert_array_equal(np.asarray(jax.jit(moe.grouped_matmul)(x, w, sizes)),
                                  np.asarray(moe.grouped_matmul(x, w, sizes)))


@pytest.mark.parametrize("sizes, pattern", [
    ([2, -1, 1], re.escape("group_sizes[1] = -1 is negative")),
    ([3, 3, 1], "group_sizes sum past the 6 rows of x"),
])
def test_grouped_matmul_rejects_bad_group_sizes(sizes, pattern):
    x, w = jnp.ones((6, 4)), jnp.ones((3, 4, 2))
    with pytest.raises(FFI_ERROR, match=pattern):
        jax.block_until_ready(moe.grouped_matmul(x, w, jnp.asarray(sizes, jnp.int32)))


@pytest.mark.parametrize("call, pattern", [
    (lambda: moe.grouped_matmul(jnp.ones((4, 3)), jnp.ones((2, 4, 5)), jnp.ones(2, jnp.int32)), r"w's K axis \(4\)"),
    (lambda: moe.grouped_matmul(jnp.ones((4, 3)), jnp.ones((2, 3, 5), jnp.bfloat16), jnp.ones(2, jnp.int32)),
     r"w must be \(experts, K, N\) of x's dtype"),
    (lambda: moe.grouped_matmul(jnp.ones((4, 3)), jnp.ones((2, 3, 5)), jnp.ones(3, jnp.int32)),
     r"group_sizes must be int32 \(2,\)"),
    (lambda: moe.grouped_matmul(jnp.ones(4), jnp.ones((2, 3, 5)), jnp.ones(2, jnp.int32)),
     "x must be float32 or bfloat16 \\(rows, K\\)"),
])
def test_grouped_matmul_argument_errors(call, pattern):
    with pytest.raises(ValueError, match=f"grouped_matmul: {pattern}"):
        call()


_TIER_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np, jax, jax.numpy as jnp
    from tunix_rt.ops import _ffi, moe

    rng = np.random.default_rng(5)
    sizes = jnp.asarray([1, 0, 9, 2, 31], jnp.int32)
    x = jnp.asarray(rng.standard_normal((45, 37)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((5, 37, 41)), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((45, 41)), jnp.float32)
    y, vjp = jax.vjp(lambda a, b: moe.grouped_matmul(a, b, sizes), x, w)
    dx, dw = vjp(dy)
    solo = moe.grouped_matmul(x[12:14], w, jnp.asarray([0, 0, 0, 0, 2], jnp.int32))  # group 4's first rows alone
    np.savez(sys.argv[1], y=np.asarray(y), dx=np.asarray(dx), dw=np.asarray(dw), solo=np.asarray(solo))
    print(json.dumps({"isa": _ffi.isa_level()}))
    """
)


@pytest.fixture(scope="module")
def tier_runs(tmp_path_factory):
    return run_tiers(TIERS, _TIER_SCRIPT, tmp_path_factory.mktemp("moe_isa"))


@pytest.mark.parametrize("tier", TIERS)
def test_grouped_matmul_every_isa_tier_matches_ragged_dot(tier_runs, tier):
    report, res = tier_runs[tier]
    assert report["isa"] == expected_tier(tier)
    rng = np.random.default_rng(5)
    sizes = jnp.asarray([1, 0, 9, 2, 31], jnp.int32)
    x = jnp.asarray(rng.standard_normal((45, 37)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((5, 37, 41)), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((45, 41)), jnp.float32)
    y, vjp = jax.vjp(lambda a, b: moe.grouped_matmul_reference(a, b, sizes), x, w)
    for name, ref in zip(("y", "dx", "dw"), (y, *vjp(dy))):
        np.testing.assert_allclose(res[name], np.asarray(ref), rtol=2e-5, atol=1e-4, err_msg=f"{tier} {name}")
    # a row's product does not depend on how many rows its expert got (decode batches stay invariant)
    np.testing.assert_array_equal(res["solo"], res["y"][12:14])


@pytest.mark.skipif(hardware_tier() == "scalar", reason="needs a SIMD tier to compare with scalar")
def test_isa_cap_changes_the_gemm_kernels(tier_runs):
    assert not np.array_equal(tier_runs["scalar"][1]["y"], tier_runs["avx2"][1]["y"])


# ---- auxiliary losses --------------------------------------------------------------------------


def _np_softmax(x):
    z = np.exp(x - x.max(-1, keepdims=True))
    return z / z.sum(-1, keepdims=True)


def test_load_balancing_loss_matches_numpy():
    rng = np.random.default_rng(6)
    t, e, k = 50, 8, 2
    logits = rng.standard_normal((t, e)).astype(np.float32)
    mask = (rng.random(t) < 0.7).astype(np.float32)
    ids = np.argsort(-logits, axis=-1)[:, :k].astype(np.int32)
    probs = _np_softmax(logits.astype(np.float64))
    onehot = np.eye(e)[ids]  # (t, k, e)
    m = mask[:, None, None]
    fraction = (onehot * m).sum(0) / mask.sum()
    mean_prob = (probs * mask[:, None]).sum(0) / mask.sum()
    want = e * np.sum(fraction * mean_prob[None])
    got = moe.load_balancing_loss(jnp.asarray(logits), jnp.asarray(ids), e, jnp.asarray(mask))
    np.testing.assert_allclose(float(got), want, rtol=1e-5)
    uniform = moe.load_balancing_loss(jnp.zeros((e, e)), jnp.arange(e, dtype=jnp.int32)[:, None], e)
    np.testing.assert_allclose(float(uniform), 1.0, rtol=1e-6)


def test_router_z_loss_matches_numpy():
    rng = np.random.default_rng(7)
    logits = rng.standard_normal((3, 5, 8)).astype(np.float32) * 4
    lse = np.log(np.exp(logits.astype(np.float64)).sum(-1))
    np.testing.assert_allclose(float(moe.router_z_loss(jnp.asarray(logits))), np.mean(lse**2), rtol=1e-5)
    mask = np.zeros((3, 5), np.float32)
    mask[0] = 1
    np.testing.assert_allclose(float(moe.router_z_loss(jnp.asarray(logits), jnp.asarray(mask))), np.mean(lse[0] ** 2),
                               rtol=1e-5)


def test_ops_under_vmap_equal_a_loop():
    rng = np.random.default_rng(8)
    x = jnp.asarray(rng.standard_normal((3, 10, 6)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, 4, (3, 10, 2)), jnp.int32)
    w = jnp.asarray(rng.standard_normal((4, 6, 5)), jnp.float32)

    def layer(x, ids):
        rows, row_of, sizes = moe.permute(x, ids, 4)
        return moe.unpermute(moe.grouped_matmul(rows, w, sizes), row_of, jnp.ones(ids.shape))

    batched = jax.vmap(layer)(x, ids)
    for b in range(3):
        np.testing.assert_allclose(np.asarray(batched[b]), np.asarray(layer(x[b], ids[b])), rtol=1e-6, atol=1e-6)
