"""Training attention: the position/segment mask (packed groups behind a shared prefix), and the FFI
op against its dense reference on hypothesis-drawn packed rows (GQA, windows, soft-capping, padding
queries that see nothing, scores far from zero), forward and backward, on every ISA tier."""

from __future__ import annotations

import functools
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.isa_tiers import TIERS, expected_tier, run_tiers
from tunix_rt.ops import _ffi
from tunix_rt.ops.attention import attention, attention_mask, attention_reference, prefix_segment

pytestmark = pytest.mark.usefixtures("fast_compiles")  # small programs, compiled once per example

needs_ffi = pytest.mark.skipif(not _ffi.has_cpu_target("tunix_rt_attention_fwd"),
                               reason="tunix_rt._ext is not built: no FFI op to test")


def test_segments_and_shared_prefix():
    # prompt (2 tokens, segment -1) | completion 1 (2 tokens) | completion 2 (1 token) | padding
    positions = jnp.array([[0, 1, 2, 3, 2, -1]])
    segments = jnp.array([[-1, -1, 1, 1, 2, 0]])
    mask = np.asarray(attention_mask(positions, positions, None, segments))[0].astype(int)
    np.testing.assert_array_equal(mask, [
        [1, 0, 0, 0, 0, 0],  # the prompt sees itself, causally
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],  # completion 1 sees the prompt and itself
        [1, 1, 1, 1, 0, 0],
        [1, 1, 0, 0, 1, 0],  # completion 2 sees the prompt and itself, never completion 1
        [0, 0, 0, 0, 0, 0],  # padding sees nothing
    ])


def test_groups_see_only_their_own_prefix():
    # group 0: prompt (-1) | chosen (1) | rejected (2); group 1: prompt (-2) | chosen (65537) | rejected (65538)
    positions = jnp.array([[0, 1, 1, 0, 1, 1]])
    segments = jnp.array([[-1, 1, 2, -2, 65537, 65538]])
    mask = np.asarray(attention_mask(positions, positions, None, segments))[0].astype(int)
    np.testing.assert_array_equal(mask, [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],  # rejected sees its prompt, never chosen
        [0, 0, 0, 1, 0, 0],  # the second prompt never sees the first group
        [0, 0, 0, 1, 1, 0],  # nor do its completions: only their own prompt
        [0, 0, 0, 1, 0, 1],
    ])
    assert int(prefix_segment(jnp.int32(65538))) == -2 and int(prefix_segment(jnp.int32(7))) == -1


def test_positive_segments_stay_apart():
    positions = jnp.array([[0, 1, 0, 1]])
    segments = jnp.array([[1, 1, 2, 2]])
    mask = np.asarray(attention_mask(positions, positions, None, segments))[0].astype(int)
    np.testing.assert_array_equal(mask, [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]])


# ----------------------------------------------------------------------------------------------
# the FFI op against its reference


def packed_row(rng, t: int, kind: str) -> tuple[np.ndarray, np.ndarray | None]:
    """(positions, segment_ids) of one row: a plain causal row with left padding, or packed
    examples (some behind a shared prefix, segment < 0; "grouped": several prefixes, each with its
    completions) with trailing padding (position -1)."""
    if kind == "causal":
        pad = int(rng.integers(0, t))
        return np.concatenate([np.full(pad, -1), np.arange(t - pad)]).astype(np.int32), None
    if kind == "grouped":
        pos, seg, group = [], [], 0
        while len(pos) < t:
            p = int(rng.integers(1, t // 2 + 2))
            pos, seg = pos + list(range(p)), seg + [-(group + 1)] * p
            for c in range(1, int(rng.integers(1, 4))):
                n = int(rng.integers(1, t // 2 + 2))
                pos, seg = pos + list(range(p, p + n)), seg + [(group << 16) + c] * n
            group += 1
        pos, seg = np.array(pos[:t], np.int32), np.array(seg[:t], np.int32)
        return pos, seg
    pos, seg = [], []
    while len(pos) < t:
        n = int(rng.integers(1, t + 1))
        if kind == "shared" and not pos:  # a prompt, then completions continuing its positions
            pos += list(range(n))
            seg += [-1] * n
            continue
        start = len([s for s in seg if s < 0]) if kind == "shared" else 0
        pos += list(range(start, start + n))
        seg += [max(seg, default=0) + 1] * n
    pos, seg = np.array(pos[:t], np.int32), np.array(seg[:t], np.int32)
    pad = int(rng.integers(0, 4))
    if pad:
        pos[-pad:], seg[-pad:] = -1, 0
    return pos, seg


@st.composite
def cases(draw):
    b = draw(st.integers(1, 2))
    t = draw(st.sampled_from([1, 2, 31, 33, 64, 65, 100, 150]))
    kv = draw(st.integers(1, 3))
    heads = kv * draw(st.integers(1, 3))
    d = draw(st.sampled_from([1, 8, 16, 64]))
    kind = draw(st.sampled_from(["causal", "packed", "shared", "grouped"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    rows = [packed_row(rng, t, kind) for _ in range(b)]
    positions = np.stack([r[0] for r in rows])
    segments = None if kind == "causal" else np.stack([r[1] for r in rows])
    magnitude = draw(st.sampled_from([1.0, 30.0]))  # 30: scores in the hundreds, one key dominating
    dtype = draw(st.sampled_from([jnp.float32, jnp.bfloat16]))
    arrays = [jnp.asarray(rng.standard_normal(shape) * m, dtype)
              for shape, m in (((b, t, heads, d), magnitude), ((b, t, kv, d), 1.0), ((b, t, kv, d), 1.0))]
    opts = dict(scale=float(d) ** -0.5, window=draw(st.sampled_from([None, 1, 5, 40])),
                softcap=draw(st.sampled_from([None, 20.0])))
    dout = jnp.asarray(rng.standard_normal((b, t, heads, d)), dtype)
    return arrays, jnp.asarray(positions), None if segments is None else jnp.asarray(segments), opts, dout


def _f32(a):
    return np.asarray(jnp.asarray(a, jnp.float32))


def _close(a, b, dtype, name, magnitude=0.0):
    """Max error within tol of the larger of the reference's max and `magnitude`, the size of the terms
    that cancel in it (a softmax gradient is p (dp - sum p dp): where one key takes all the mass the
    difference is rounding noise on terms of |dO| |v|, times |q| or |k| for dk and dq)."""
    a, b = _f32(a), _f32(b)
    tol = 1e-4 if dtype == jnp.float32 else 1e-2  # bf16: the op's inputs and outputs rounded, its math f32
    err = np.abs(a - b).max() / max(np.abs(b).max(), magnitude, 1e-3) if a.size else 0.0
    assert err <= tol, (name, err)


def _magnitudes(q, k, v, dout, scale):
    m = lambda x: float(np.abs(_f32(x)).max()) if x.size else 0.0
    return (scale * m(dout) * m(v) * m(k), scale * m(dout) * m(v) * m(q), m(dout))


@functools.partial(jax.jit, static_argnames=("fn", "scale", "window", "softcap"))
def _forward_and_vjp(q, k, v, positions, segments, dout, *, fn, scale, window, softcap):
    """The output and (dq, dk, dv) of `fn`, as one program: an example compiles once, not once per op."""
    y, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, positions, segments, scale=scale, window=window, softcap=softcap),
                     q, k, v)
    return y, vjp(dout)


@pytest.mark.slow
@needs_ffi
@settings(max_examples=60)
@given(case=cases())
def test_matches_reference_forward_and_backward(case):
    """Against the reference in f32 on the same inputs: a bf16 reference would round its
    probabilities and sums, and differ from the op's f32 math by more than the op's own error."""
    (q, k, v), positions, segments, opts, dout = case
    y, grads = _forward_and_vjp(q, k, v, positions, segments, dout, fn=attention, **opts)
    y_ref, grads_ref = _forward_and_vjp(*map(_f32, (q, k, v)), positions, segments, _f32(dout),
                                        fn=attention_reference, **opts)
    assert y.shape == q.shape and y.dtype == q.dtype
    _close(y, y_ref, q.dtype, "out")
    for name, g, g_ref, x, size in zip("qkv", grads, grads_ref, (q, k, v), _magnitudes(q, k, v, dout, opts["scale"])):
        assert g.shape == x.shape and g.dtype == x.dtype
        _close(g, g_ref, q.dtype, f"d{name}", 1e-2 * size)


def assert_unseen_queries_average_every_value(fn, d: int) -> None:
    """Every position -1: the reference's softmax over equal scores is uniform over all T keys, its
    gradient reaches v alone. `fn` has attention's signature."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, 70, 2, d)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((1, 70, 1, d)), jnp.float32) for _ in range(2))
    positions = jnp.full((1, 70), -1, jnp.int32)
    y, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, positions, scale=0.3), q, k, v)
    np.testing.assert_allclose(np.asarray(y), np.broadcast_to(np.asarray(v).mean(1, keepdims=True), y.shape),
                               rtol=1e-5, atol=1e-6)
    dq, dk, dv = vjp(jnp.ones_like(y))
    assert not np.any(np.asarray(dq)) and not np.any(np.asarray(dk))
    # each of the 70 queries of both heads (sharing the one kv head) gives every value 1/70 of its dO
    np.testing.assert_allclose(np.asarray(dv), 2.0, rtol=1e-5)


@needs_ffi
def test_queries_that_see_nothing_average_every_value():
    assert_unseen_queries_average_every_value(attention, 8)


@needs_ffi
def test_vmap_and_jit_equal_a_loop():
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((3, 1, 40, 2, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((3, 1, 40, 1, 8)), jnp.float32) for _ in range(2))
    positions = jnp.broadcast_to(jnp.arange(40, dtype=jnp.int32), (3, 1, 40))
    f = lambda q, k, v, p: attention(q, k, v, p, scale=0.25, window=9)
    batched = jax.jit(jax.vmap(f))(q, k, v, positions)
    for i in range(3):
        np.testing.assert_allclose(np.asarray(batched[i]), np.asarray(f(q[i], k[i], v[i], positions[i])), rtol=1e-6)


@needs_ffi
def test_training_forward_lowers_to_the_op():
    q = jnp.zeros((1, 8, 2, 4), jnp.bfloat16)
    hlo = jax.jit(lambda q: attention(q, q[:, :, :1], q[:, :, :1], jnp.zeros((1, 8), jnp.int32), scale=1.0)).lower(q)
    assert "tunix_rt_attention_fwd" in hlo.as_text()


_GOOD = dict(q=jnp.zeros((1, 4, 2, 8)), k=jnp.zeros((1, 4, 1, 8)), v=jnp.zeros((1, 4, 1, 8)),
             positions=jnp.zeros((1, 4), jnp.int32))


@pytest.mark.parametrize("fn", [attention, attention_reference])
@pytest.mark.parametrize("change, pattern", [
    (dict(q=jnp.zeros((1, 4, 2, 8), jnp.int32)), "q must be float32 or bfloat16"),
    (dict(k=jnp.zeros((1, 4, 3, 8))), "k and v must match"),
    (dict(q=jnp.zeros((1, 4, 3, 8)), k=jnp.zeros((1, 4, 2, 8)), v=jnp.zeros((1, 4, 2, 8))), "k must be .* KV dividing"),
    (dict(q=jnp.zeros((4, 2, 8))), r"q must be \(B, T, heads, head_dim\)"),
    (dict(positions=jnp.zeros((1, 5), jnp.int32)), r"positions must be integer \(B, T\)"),
    (dict(positions=jnp.zeros((1, 4))), r"positions must be integer"),
    (dict(segment_ids=jnp.zeros((2, 4), jnp.int32)), "segment_ids must be integer"),
    (dict(window=0), "window must be a positive integer"),
    (dict(softcap=-1.0), "softcap must be positive"),
    (dict(scale=float("nan")), "scale must be finite"),
])
def test_argument_errors(fn, change, pattern):
    args = {**_GOOD, "scale": 1.0, **change}
    with pytest.raises(ValueError, match=f"attention: {pattern}"):
        fn(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("positions"), **args)


_TIER_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np, jax, jax.numpy as jnp
    from tunix_rt.ops import _ffi
    from tunix_rt.ops.attention import attention

    rng = np.random.default_rng(5)
    q = rng.standard_normal((2, 150, 6, 16)).astype(np.float32) * 3
    k, v = (rng.standard_normal((2, 150, 2, 16)).astype(np.float32) for _ in range(2))
    positions = np.r_[np.arange(20), 20 + np.arange(130) % 65].astype(np.int32)[None].repeat(2, 0)
    segments = np.r_[-np.ones(20), 1 + np.arange(130) // 65].astype(np.int32)[None].repeat(2, 0)
    # row 1: grouped prefixes at the int32 extremes: group 32767's prefix (-32768) seen by its two completions
    # and by INT32_MAX (group 32767 too); an INT32_MIN prefix no positive segment sees
    top, lo, hi = (32767 << 16), np.iinfo(np.int32).min, np.iinfo(np.int32).max
    positions[1] = np.r_[np.arange(20), 20 + np.arange(65), 20 + np.arange(45), np.arange(10), 20 + np.arange(10)]
    segments[1] = np.r_[[-32768] * 20, [top + 1] * 65, [top + 2] * 45, [lo] * 10, [hi] * 10]
    dout = rng.standard_normal(q.shape).astype(np.float32)
    out = dict(q=q, k=k, v=v, positions=positions, segments=segments, dout=dout)
    q_nan = q.copy()
    q_nan[0, 30, 0, 3] = np.nan
    for name, opts, qi in (("plain", {}, q), ("window", dict(window=17), q), ("softcap", dict(softcap=4.0), q),
                           ("nan", {}, q_nan)):
        y, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, positions, segments, scale=0.25, **opts), qi, k, v)
        out.update({f"{name}_y": np.asarray(y), **{f"{name}_d{n}": np.asarray(g) for n, g in zip("qkv", vjp(dout))}})
    np.savez(sys.argv[1], **out)
    print(json.dumps({"isa": _ffi.isa_level()}))
    """
)


@pytest.fixture(scope="module")
def tier_runs(tmp_path_factory):
    return run_tiers(TIERS, _TIER_SCRIPT, tmp_path_factory.mktemp("attention_isa"))


@pytest.mark.slow
@needs_ffi
@pytest.mark.parametrize("tier", TIERS)
def test_every_isa_tier_matches_reference(tier_runs, tier):
    """Every tier against the reference, and a NaN in one query reaching that query's output and
    gradient as it does the reference's (the vector exp must not clamp it away)."""
    report, res = tier_runs[tier]
    assert report["isa"] == expected_tier(tier)
    q, k, v, positions, segments, dout = (jnp.asarray(res[n]) for n in ("q", "k", "v", "positions", "segments", "dout"))
    for name, opts in (("plain", {}), ("window", dict(window=17)), ("softcap", dict(softcap=4.0))):
        y, vjp = jax.vjp(lambda q, k, v: attention_reference(q, k, v, positions, segments, scale=0.25, **opts), q, k, v)
        _close(res[f"{name}_y"], y, jnp.float32, f"{tier} {name} out")
        for n, g, size in zip("qkv", vjp(dout), _magnitudes(q, k, v, dout, 0.25)):
            _close(res[f"{name}_d{n}"], g, jnp.float32, f"{tier} {name} d{n}", 1e-2 * size)
    y_ref = attention_reference(q.at[0, 30, 0, 3].set(jnp.nan), k, v, positions, segments, scale=0.25)
    np.testing.assert_array_equal(np.isnan(res["nan_y"]), np.isnan(np.asarray(y_ref)))
    assert np.isnan(res["nan_y"][0, 30, 0]).all() and np.isnan(res["nan_dq"][0, 30, 0]).all()
