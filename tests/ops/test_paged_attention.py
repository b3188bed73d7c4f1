"""Tests for the paged KV cache ops (tunix_rt.ops.write_kv / paged_attention) and their references.

The compiled attention runs an online softmax block by block in f32; the reference gathers each
token's whole block-table row and masks by position. Both evaluate the same scores, so f32 outputs
agree to ~1e-5 relative (plus a little absolute slack for the dot products' summation order), bf16
outputs to about one bf16 ulp. Independent float64 NumPy and dense-JAX formulations check that the
reference itself is right: position p of sequence s lives at slot block_tables[s, p // bs] * bs +
p % bs, and query head j reads kv head j // (heads / kv_heads), as in HF's repeat_kv.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.isa_tiers import expected_tier, hardware_tier, run_tiers
from tunix_rt.ops import _ffi, paged_attention, paged_attention_reference, write_kv, write_kv_reference
from tunix_rt.ops.paged_attention import empty_kv_cache, empty_kv_cache_reference

WRITE_TARGET, ATTEND_TARGET = "tunix_rt_write_kv", "tunix_rt_paged_attention"
F32, BF16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)
DTYPE_PAIRS = [(F32, F32), (BF16, BF16), (F32, BF16), (BF16, F32)]  # (q dtype, cache dtype)
I32_MIN, I32_MAX = -(2**31), 2**31 - 1

pytestmark = pytest.mark.skipif(
    not (_ffi.has_cpu_target(WRITE_TARGET) and _ffi.has_cpu_target(ATTEND_TARGET)),
    reason="tunix_rt._ext is not built: no FFI op to test",
)



# ----------------------------------------------------------------------------------------------
# helpers


def _f32(a) -> np.ndarray:
    return np.asarray(jnp.asarray(a).astype(jnp.float32))


def _i32(a) -> np.ndarray:
    return np.asarray(a, np.int32)


_ATTN_STATIC = ("scale", "softcap", "window")


@functools.partial(jax.jit, static_argnames=_ATTN_STATIC)
def _attn_pair(q, kc, vc, bt, ts, tp, *, scale, softcap, window):
    kw = dict(scale=scale, softcap=softcap, window=window)
    return paged_attention(q, kc, vc, bt, ts, tp, **kw), paged_attention_reference(q, kc, vc, bt, ts, tp, **kw)


_attn_jit = jax.jit(paged_attention, static_argnames=_ATTN_STATIC)
_attn_ref_jit = jax.jit(paged_attention_reference, static_argnames=_ATTN_STATIC)


@jax.jit
def _write_pair(kc, vc, k, v, slots):
    return write_kv(kc, vc, k, v, slots), write_kv_reference(kc, vc, k, v, slots)


def dense_oracle(q, kc, vc, bt, ts, tp, tu=None, *, scale, softcap=None, window=None) -> np.ndarray:
    """float64 NumPy: for each real token, gather its visible keys (positions [start, until], until = the
    token's own position unless `tu` says) position by position through the block table, repeat kv heads
    (repeat_kv) and take an ordinary softmax. Padding rows are zero."""
    q, kc, vc = (np.asarray(_f32(a), np.float64) for a in (q, kc, vc))
    bt, ts, tp = (np.asarray(a, np.int64) for a in (bt, ts, tp))
    tu = tp if tu is None else np.asarray(tu, np.int64)
    nb, bs, kv, d = kc.shape
    g = q.shape[1] // kv
    kflat, vflat = kc.reshape(nb * bs, kv, d), vc.reshape(nb * bs, kv, d)
    out = np.zeros(q.shape, np.float64)
    for t in range(q.shape[0]):
        s, p = ts[t], tp[t]
        if s < 0:
            continue
        start = max(0, p - window + 1) if window else 0
        positions = np.arange(start, tu[t] + 1)
        slots = bt[s, positions // bs] * bs + positions % bs
        keys = np.repeat(kflat[slots], g, axis=1)  # (L, H, D): kv head j // g for query head j
        values = np.repeat(vflat[slots], g, axis=1)
        scores = np.einsum("hd,lhd->hl", q[t], keys) * scale
        if softcap:
            scores = np.tanh(scores / softcap) * softcap
        w = np.exp(scores - scores.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        out[t] = np.einsum("hl,lhd->hd", w, values)
    return out


def _fwd_tol(q_dtype, cache_dtype, vmax: float, scale: float, d: int):
    """rtol per element, atol for outputs that are sums with cancellation: a score error of e (from
    the dot products' different summation order, growing with scale * sqrt(d) for N(0, 1) data)
    perturbs the softmax weights by ~e relative, i.e. the output by ~e * max|v|."""
    if q_dtype == F32 and cache_dtype == F32:  # measured worst: about a quarter of this
        return dict(rtol=1e-5, atol=(3e-6 + 2e-7 * scale * np.sqrt(d)) * vmax)
    return dict(rtol=1e-2, atol=1e-3 * vmax)  # one bf16 ulp (2^-8..2^-7) of the f32 result


# ----------------------------------------------------------------------------------------------
# random paged steps


@dataclasses.dataclass
class Case:
    q: np.ndarray  # (T, H, D) f32
    kc: np.ndarray  # (NB, BS, KV, D) f32
    vc: np.ndarray
    bt: np.ndarray  # (S, MB) int32
    ts: np.ndarray  # (T,) int32
    tp: np.ndarray  # (T,) int32
    scale: float
    softcap: float | None
    window: int | None

    def arrays(self, q_dtype=F32, cache_dtype=F32):
        return (jnp.asarray(self.q, q_dtype), jnp.asarray(self.kc, cache_dtype), jnp.asarray(self.vc, cache_dtype),
                jnp.asarray(self.bt), jnp.asarray(self.ts), jnp.asarray(self.tp))

    @property
    def kw(self):
        return dict(scale=self.scale, softcap=self.softcap, window=self.window)


def build_case(rng: np.random.Generator, *, bs, d, kv, group, nseq, max_blocks, tables="shared", mode="mixed",
               n_pad=0, pad_pos="zero", garbage=False, shuffle=True, scale=None, softcap=None, window=None,
               max_chunk=None) -> Case:
    """A step of decode (one token per sequence) and/or chunked-prefill tokens (consecutive positions
    ending at the sequence's context length), packed with padding tokens, over random block tables.

    tables: "disjoint" (one permutation of the pool split between sequences), "shared" (each row a
    random permutation of the pool: blocks shared between sequences) or "random" (ids with repeats).
    garbage: table entries that no token reads (past each sequence's last position) hold invalid ids.
    """
    if tables == "disjoint":
        num_blocks = nseq * max_blocks + int(rng.integers(0, 3))
        bt = rng.permutation(num_blocks)[: nseq * max_blocks].reshape(nseq, max_blocks)
    elif tables == "shared":
        num_blocks = max_blocks + int(rng.integers(0, 4))
        bt = np.stack([rng.permutation(num_blocks)[:max_blocks] for _ in range(nseq)])
    else:
        num_blocks = int(rng.integers(1, max_blocks + 3))
        bt = rng.integers(0, num_blocks, (nseq, max_blocks))
    bt = bt.astype(np.int64)
    cap = max_blocks * bs
    seqs, pos, ctx = [], [], np.zeros(nseq, np.int64)
    for s in range(nseq):
        if nseq > 1 and rng.random() < 0.2:
            continue  # a sequence with no token in this step
        length = int(rng.integers(1, cap + 1))
        m = mode if mode != "mixed" else rng.choice(["decode", "prefill"])
        chunk = 1 if m == "decode" else int(rng.integers(1, min(length, max_chunk or length) + 1))
        seqs += [s] * chunk
        pos += list(range(length - chunk, length))
        ctx[s] = length
    if garbage:
        for s in range(nseq):
            used = (ctx[s] - 1) // bs + 1 if ctx[s] else 0
            bt[s, used:] = rng.choice([-1, num_blocks, num_blocks + 7, I32_MAX, I32_MIN], size=max_blocks - used)
    order = rng.permutation(len(seqs)) if shuffle else np.arange(len(seqs))
    seqs, pos = [seqs[i] for i in order], [pos[i] for i in order]
    for _ in range(n_pad):
        at = int(rng.integers(0, len(seqs) + 1))
        p = 0 if pad_pos == "zero" else int(rng.choice([0, 3, cap, cap + 100, -1, -5, I32_MAX, I32_MIN]))
        seqs.insert(at, -1)
        pos.insert(at, p)
    if not seqs:  # an empty step (T = 0) is covered by test_empty_step
        seqs, pos = [-1], [0]
    t, h = len(seqs), kv * group
    if scale is None:
        scale = d**-0.5
    return Case(
        q=rng.standard_normal((t, h, d)).astype(np.float32),
        kc=rng.standard_normal((num_blocks, bs, kv, d)).astype(np.float32),
        vc=rng.standard_normal((num_blocks, bs, kv, d)).astype(np.float32),
        bt=_i32(bt), ts=_i32(seqs), tp=_i32(pos), scale=float(scale), softcap=softcap, window=window,
    )


INTERESTING_D = [1, 2, 7, 8, 9, 15, 16, 17, 24, 31, 32, 33, 64, 65, 72]


@st.composite
def attention_cases(draw, dtype_pairs=tuple(DTYPE_PAIRS)):
    d = draw(st.one_of(st.sampled_from(INTERESTING_D), st.integers(1, 72)))
    params = dict(
        bs=draw(st.integers(1, 16)),
        d=d,
        kv=draw(st.integers(1, 4)),
        group=draw(st.integers(1, 4)),  # 1: MHA; kv=1 and group>1: MQA
        nseq=draw(st.integers(1, 4)),
        max_blocks=draw(st.integers(1, 5)),
        tables=draw(st.sampled_from(["disjoint", "shared", "random"])),
        mode=draw(st.sampled_from(["decode", "prefill", "mixed"])),
        n_pad=draw(st.integers(0, 3)),
        pad_pos=draw(st.sampled_from(["zero", "any"])),
        garbage=draw(st.booleans()),
        shuffle=draw(st.booleans()),
        scale=draw(st.one_of(st.just(d**-0.5), st.sampled_from([0.0, 1.0, 0.05, 2.0]), st.floats(0.01, 2.0))),
        softcap=draw(st.one_of(st.none(), st.sampled_from([1.0, 5.0, 30.0]), st.floats(0.5, 60.0))),
        window=draw(st.one_of(st.none(), st.just(1), st.integers(1, 90), st.just(10**6))),
    )
    seed = draw(st.integers(0, 2**32 - 1))
    dtypes = draw(st.sampled_from(dtype_pairs))
    return build_case(np.random.default_rng(seed), **params), dtypes


# ----------------------------------------------------------------------------------------------
# forward vs the reference and an independent float64 oracle


def check_forward(case: Case, q_dtype, cache_dtype):
    args = case.arrays(q_dtype, cache_dtype)
    out, ref = _attn_pair(*args, **case.kw)
    assert out.shape == ref.shape == case.q.shape
    assert out.dtype == ref.dtype == q_dtype
    pad = case.ts < 0
    assert np.all(_f32(out)[pad] == 0.0), "padding tokens must give zero output"
    vmax = float(np.abs(_f32(args[2])).max()) if case.vc.size else 1.0
    tol = _fwd_tol(q_dtype, cache_dtype, vmax, case.scale, case.q.shape[-1])
    np.testing.assert_allclose(_f32(out), _f32(ref), **tol, err_msg="ffi vs reference")
    oracle = dense_oracle(*args, **case.kw)
    loose = dict(rtol=1e-4, atol=tol["atol"] * 2) if tol["rtol"] < 1e-3 else tol
    np.testing.assert_allclose(_f32(out), oracle, **loose, err_msg="ffi vs float64 oracle")
    np.testing.assert_allclose(_f32(ref), oracle, **loose, err_msg="reference vs float64 oracle")
    return out


@pytest.mark.slow
@settings(max_examples=32)
@given(case_dtypes=attention_cases())
def test_forward_matches_reference_and_oracle(case_dtypes):
    case, (q_dtype, cache_dtype) = case_dtypes
    check_forward(case, q_dtype, cache_dtype)


@pytest.mark.parametrize("window,softcap", [(None, None), (1, 0.5), (2, 50.0), (5, None), (1000, 0.5)])
def test_window_and_softcap(window, softcap):
    """Every window/softcap combination on one fixed GQA step with prefill chunks crossing blocks."""
    rng = np.random.default_rng(3)
    case = build_case(rng, bs=3, d=20, kv=2, group=2, nseq=3, max_blocks=6, mode="prefill", n_pad=2,
                      scale=0.7, softcap=softcap, window=window)
    check_forward(case, F32, F32)


def test_window_one_is_the_token_own_value():
    """window=1: each token sees only its own position, so the output is its own V row (any scale)."""
    rng = np.random.default_rng(4)
    case = build_case(rng, bs=4, d=12, kv=2, group=3, nseq=2, max_blocks=4, mode="prefill", scale=5.0, window=1)
    out = _f32(_attn_jit(*case.arrays(), **case.kw))
    nb, bs, kv, d = case.kc.shape
    slots = case.bt[case.ts, case.tp // bs] * bs + case.tp % bs
    want = np.repeat(case.vc.reshape(nb * bs, kv, d)[slots], 3, axis=1)
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)


def test_zero_scale_is_the_mean_of_visible_values():
    rng = np.random.default_rng(5)
    case = build_case(rng, bs=5, d=9, kv=1, group=4, nseq=4, max_blocks=3, mode="decode", n_pad=1, scale=0.0)
    out = _f32(_attn_jit(*case.arrays(), **case.kw))
    nb, bs, kv, d = case.kc.shape
    assert np.count_nonzero(case.ts >= 0) >= 2
    for t in np.flatnonzero(case.ts >= 0):
        positions = np.arange(case.tp[t] + 1)
        slots = case.bt[case.ts[t], positions // bs] * bs + positions % bs
        want = case.vc.reshape(nb * bs, kv, d)[slots].mean(0)  # (1, D), shared by the 4 query heads (MQA)
        np.testing.assert_allclose(out[t], np.broadcast_to(want, (4, d)), rtol=1e-5, atol=1e-6)


def _poisoned(case: Case) -> Case:
    """`case` with every slot no token of it reads set to NaN (keys) and inf (values): what a reused block's slots
    past a sequence's last position, blocks its table does not reach, or a pool never written (empty_kv_cache) may
    hold."""
    nb, bs, kv, d = case.kc.shape
    read = np.zeros(nb * bs, bool)
    for t in np.flatnonzero(case.ts >= 0):
        positions = np.arange(case.tp[t] + 1)
        read[case.bt[case.ts[t], positions // bs] * bs + positions % bs] = True
    assert not read.all()
    return dataclasses.replace(case, kc=np.where(read.reshape(nb, bs)[..., None, None], case.kc, np.nan),
                               vc=np.where(read.reshape(nb, bs)[..., None, None], case.vc, np.inf))


@pytest.mark.parametrize("cache_dtype", [F32, BF16])
@pytest.mark.parametrize(("mode", "window", "softcap"), [("decode", None, None), ("mixed", None, 5.0),
                                                         ("mixed", 3, None)])
def test_stale_nan_in_unwritten_slots_is_never_read(mode, window, softcap, cache_dtype):
    """Neither the kernel nor the reference lets an unwritten slot into a row: decode and prefill runs, windows,
    softcap, f32 and bf16 caches (whose rows the kernel converts a run's span at a time) give the same bits as with
    those slots clean."""
    case = build_case(np.random.default_rng(7), bs=4, d=8, kv=2, group=2, nseq=3, max_blocks=4, tables="disjoint",
                      mode=mode, n_pad=1, scale=0.5, window=window, softcap=softcap)
    poisoned = _poisoned(case)
    for fn in (_attn_jit, _attn_ref_jit):
        want = _f32(fn(*case.arrays(F32, cache_dtype), **case.kw))
        np.testing.assert_array_equal(_f32(fn(*poisoned.arrays(F32, cache_dtype), **poisoned.kw)), want)


def test_stale_nan_in_unwritten_slots_leaves_gradients_clean():
    """The backward (the reference's vjp, for every path) masks unread keys as well as values: 0 x NaN would
    otherwise reach q's gradient."""
    case = build_case(np.random.default_rng(8), bs=4, d=8, kv=2, group=2, nseq=3, max_blocks=4, tables="disjoint",
                      mode="mixed", n_pad=1, scale=0.5, softcap=5.0)
    grads = []
    for c in (case, _poisoned(case)):
        q, kc, vc, *rest = c.arrays()
        grads.append(jax.grad(lambda q, kc=kc, vc=vc, rest=rest: jnp.sum(paged_attention(q, kc, vc, *rest, **c.kw)))(q))
    assert np.isfinite(np.asarray(grads[1])).all()
    np.testing.assert_array_equal(np.asarray(grads[1]), np.asarray(grads[0]))


def _small_cache_case():
    return build_case(np.random.default_rng(6), bs=4, d=8, kv=2, group=2, nseq=2, max_blocks=2)


def test_all_padding_step_and_empty_write():
    case = _small_cache_case()
    _, kc, vc, bt, _, _ = case.arrays()
    pad = jnp.full((3,), -1, jnp.int32)
    out = _attn_jit(jnp.ones((3, 4, 8)), kc, vc, bt, pad, jnp.asarray([0, I32_MAX, I32_MIN], jnp.int32), scale=1.0)
    np.testing.assert_array_equal(np.asarray(out), np.zeros((3, 4, 8), np.float32))
    k0, s0 = jnp.zeros((0, 2, 8), jnp.float32), jnp.zeros((0,), jnp.int32)
    (new_k, new_v), (ref_k, ref_v) = _write_pair(kc, vc, k0, k0, s0)
    for a in (new_k, ref_k):
        np.testing.assert_array_equal(np.asarray(a), case.kc)
    for a in (new_v, ref_v):
        np.testing.assert_array_equal(np.asarray(a), case.vc)


def _empty_step(fn, jit):
    case = _small_cache_case()
    _, kc, vc, bt, _, _ = case.arrays()
    empty = jnp.zeros((0,), jnp.int32)
    f = functools.partial(fn, scale=1.0, window=3)
    out = (jax.jit(f) if jit else f)(jnp.zeros((0, 4, 8), jnp.float32), kc, vc, bt, empty, empty)
    assert out.shape == (0, 4, 8) and out.dtype == F32


@pytest.mark.parametrize("fn,jit", [
    pytest.param(paged_attention, False, id="ffi-eager"),
    pytest.param(paged_attention, True, id="ffi-jit"),
    pytest.param(paged_attention_reference, False, id="reference-eager"),
    pytest.param(paged_attention_reference, True, id="reference-jit"),
])
def test_empty_step(fn, jit):
    _empty_step(fn, jit)


def test_eager_call_matches_jitted():
    rng = np.random.default_rng(8)
    case = build_case(rng, bs=4, d=17, kv=2, group=2, nseq=3, max_blocks=3, n_pad=1, softcap=10.0, window=6)
    eager = paged_attention(*case.arrays(), **case.kw)
    np.testing.assert_array_equal(np.asarray(eager), np.asarray(_attn_jit(*case.arrays(), **case.kw)))
    np.testing.assert_allclose(np.asarray(eager), dense_oracle(*case.arrays(), **case.kw), rtol=1e-4, atol=1e-5)


@settings(max_examples=20)
@given(seed=st.integers(0, 2**32 - 1), window=st.one_of(st.none(), st.integers(1, 12)),
       softcap=st.one_of(st.none(), st.just(5.0)), bs=st.integers(1, 8), group=st.integers(1, 4))
def test_token_until_extends_what_a_token_sees(seed, window, softcap, bs, group):
    """token_until (an image's tokens see up to its end): keys [pos - window + 1, until], the window counted from
    the token's own position; the op, its reference and the Pallas kernel (interpreted) against the oracle."""
    from tunix_rt.ops.paged_attention_pallas import paged_attention_pallas

    rng = np.random.default_rng(seed)
    case = build_case(rng, bs=bs, d=8, kv=2, group=group, nseq=3, max_blocks=4, n_pad=1, softcap=softcap,
                      window=window)
    cap = case.bt.shape[1] * bs
    until = np.where(case.ts >= 0, case.tp + (rng.random(case.tp.shape) * (cap - case.tp)).astype(np.int32),
                     case.tp).astype(np.int32)
    assert np.all(until >= case.tp) and np.all(until[case.ts >= 0] < cap)
    args = (*case.arrays(), jnp.asarray(until))
    want = dense_oracle(*args, **case.kw)
    tol = dict(rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(_attn_jit(*args, **case.kw)), want, **tol)
    np.testing.assert_allclose(np.asarray(_attn_ref_jit(*args, **case.kw)), want, **tol)
    if bs & (bs - 1) == 0:  # the kernel's block sizes
        pallas = jax.jit(functools.partial(paged_attention_pallas, interpret=True, **case.kw))
        np.testing.assert_allclose(np.asarray(pallas(*args)), want, **tol)


def test_token_until_before_the_position_raises():
    case = build_case(np.random.default_rng(4), bs=4, d=8, kv=1, group=1, nseq=2, max_blocks=3)
    until = case.tp.copy()
    real = int(np.flatnonzero(case.ts >= 0)[0])
    until[real] = case.tp[real] - 1
    _expect_ffi_error(lambda: _attn_jit(*case.arrays(), jnp.asarray(until), **case.kw), f"token_until[{real}]")
    until[real] = case.bt.shape[1] * 4
    _expect_ffi_error(lambda: _attn_jit(*case.arrays(), jnp.asarray(until), **case.kw), f"token_until[{real}]")


# ----------------------------------------------------------------------------------------------
# end to end: write a prompt into scattered blocks, attend, compare with dense causal attention


def dense_causal_numpy(q, k, v, *, scale, softcap=None, window=None) -> np.ndarray:
    """Ordinary attention over one whole sequence: q (L, H, D), k/v (L, KV, D), float64."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    g = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)  # HF repeat_kv
    scores = np.einsum("qhd,khd->hqk", q, k) * scale
    if softcap:
        scores = np.tanh(scores / softcap) * softcap
    i, j = np.arange(len(q))[:, None], np.arange(len(q))[None, :]
    mask = j <= i
    if window:
        mask &= i - j < window
    scores = np.where(mask, scores, -np.inf)
    w = np.exp(scores - scores.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", w, v)


@functools.partial(jax.jit, static_argnames=_ATTN_STATIC, donate_argnums=(0, 1))
def _engine_step(kc, vc, q, k, v, slots, bt, ts, tp, *, scale, softcap, window):
    kc, vc = write_kv(kc, vc, k, v, slots)
    return kc, vc, paged_attention(q, kc, vc, bt, ts, tp, scale=scale, softcap=softcap, window=window)


@pytest.mark.parametrize(
    "kv,group,softcap,window,dtype",
    [
        (2, 1, None, None, F32),  # MHA
        (2, 3, None, None, F32),  # GQA
        (1, 4, None, None, F32),  # MQA
        (2, 2, 20.0, 5, F32),  # softcap and sliding window
        (2, 2, None, 1000, F32),  # window longer than any context
        (2, 2, None, None, BF16),
    ],
)
def test_end_to_end_chunked_prefill_then_decode_matches_dense(kv, group, softcap, window, dtype):
    rng = np.random.default_rng(10 + kv + group)
    bs, d, max_blocks, step_tokens = 4, 24, 8, 24
    h = kv * group
    lengths = [19, 7, 25]  # prompts; then 4 decode steps each
    total = [n + 4 for n in lengths]
    nseq = len(lengths)
    num_blocks = nseq * max_blocks + 5
    bt = _i32(rng.permutation(num_blocks)[: nseq * max_blocks].reshape(nseq, max_blocks))
    qs = [rng.standard_normal((n, h, d)).astype(np.float32) for n in total]
    ks = [rng.standard_normal((n, kv, d)).astype(np.float32) for n in total]
    vs = [rng.standard_normal((n, kv, d)).astype(np.float32) for n in total]
    if dtype == BF16:  # the oracle sees the rounded values
        qs, ks, vs = ([_f32(jnp.asarray(a, BF16)) for a in arrs] for arrs in (qs, ks, vs))
    scale = d**-0.5
    want = [dense_causal_numpy(q, k, v, scale=scale, softcap=softcap, window=window) for q, k, v in zip(qs, ks, vs)]

    # steps: (seq, first position, count); prefill split in chunks, then one-token decode steps
    steps = [
        [(0, 0, 10), (1, 0, 7), (2, 0, 5)],
        [(0, 10, 9), (2, 5, 12)],
        [(2, 17, 8)],
    ] + [[(s, n + i, 1) for s, n in enumerate(lengths)] for i in range(4)]
    # the cache starts as garbage: anything read that was not written shows
    kc = jnp.asarray(rng.standard_normal((num_blocks, bs, kv, d)) * 100, dtype)
    vc = jnp.asarray(rng.standard_normal((num_blocks, bs, kv, d)) * 100, dtype)
    for step in steps:
        ts, tp, slots = [], [], []
        q, k, v = (np.zeros((step_tokens, n, d), np.float32) for n in (h, kv, kv))
        for s, start, count in step:
            for p in range(start, start + count):
                i = len(ts)
                ts.append(s)
                tp.append(p)
                slots.append(bt[s, p // bs] * bs + p % bs)
                q[i], k[i], v[i] = qs[s][p], ks[s][p], vs[s][p]
        real = len(ts)
        pad = step_tokens - real
        ts, tp, slots = _i32(ts + [-1] * pad), _i32(tp + [0] * pad), _i32(slots + [-1] * pad)
        kc, vc, out = _engine_step(kc, vc, jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
                                   jnp.asarray(slots), jnp.asarray(bt), jnp.asarray(ts), jnp.asarray(tp),
                                   scale=scale, softcap=softcap, window=window)
        out = _f32(out)
        assert np.all(out[real:] == 0.0)
        expected = np.stack([want[s][p] for s, p in zip(ts[:real], tp[:real])])
        tol = dict(rtol=1e-5, atol=2e-6) if dtype == F32 else dict(rtol=1e-2, atol=4e-3)
        np.testing.assert_allclose(out[:real], expected, **tol, err_msg=f"step {step}")
    # every written row sits in its block, bit for bit
    kflat = _f32(kc).reshape(-1, kv, d)
    for s, n in enumerate(total):
        p = np.arange(n)
        np.testing.assert_array_equal(kflat[bt[s, p // bs] * bs + p % bs], ks[s])


# ----------------------------------------------------------------------------------------------
# write_kv


@st.composite
def write_cases(draw):
    nb, bs = draw(st.integers(1, 6)), draw(st.integers(1, 16))
    kv, d = draw(st.integers(1, 4)), draw(st.one_of(st.sampled_from(INTERESTING_D), st.integers(1, 72)))
    n_slots = nb * bs
    t = draw(st.integers(0, n_slots + 3))
    seed = draw(st.integers(0, 2**32 - 1))
    dtype = draw(st.sampled_from([F32, BF16]))
    rng = np.random.default_rng(seed)
    # distinct slots (a step never writes one slot twice), some tokens skipped with -1
    slots = rng.permutation(n_slots)[: min(t, n_slots)]
    slots = np.concatenate([slots, np.full(t - len(slots), -1)])
    slots[rng.random(t) < 0.25] = -1
    slots = _i32(rng.permutation(slots))
    kc, vc = (rng.standard_normal((nb, bs, kv, d)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((t, kv, d)).astype(np.float32) for _ in range(2))
    return kc, vc, k, v, slots, dtype


def _write_numpy(cache, rows, slots):
    flat = cache.reshape(-1, *cache.shape[2:]).copy()
    for t, s in enumerate(slots):
        if s >= 0:
            flat[s] = rows[t]
    return flat.reshape(cache.shape)


@settings(max_examples=15)
@given(case=write_cases())
def test_write_kv_matches_reference(case):
    kc, vc, k, v, slots, dtype = case
    args = [jnp.asarray(a, dtype) for a in (kc, vc, k, v)] + [jnp.asarray(slots)]
    (ok, ov), (rk, rv) = _write_pair(*args)
    for got, ref, cache, rows in ((ok, rk, kc, k), (ov, rv, vc, v)):
        assert got.dtype == dtype and got.shape == cache.shape
        want = _write_numpy(_f32(jnp.asarray(cache, dtype)), _f32(jnp.asarray(rows, dtype)), slots)
        np.testing.assert_array_equal(_f32(got), want)
        np.testing.assert_array_equal(_f32(ref), want)
    # not donated: the inputs are unchanged
    np.testing.assert_array_equal(_f32(args[0]), _f32(jnp.asarray(kc, dtype)))
    np.testing.assert_array_equal(_f32(args[1]), _f32(jnp.asarray(vc, dtype)))


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_write_kv_donated_updates_in_place(dtype):
    rng = np.random.default_rng(12)
    nb, bs, kv, d = 5, 4, 2, 12
    step = jax.jit(write_kv, donate_argnums=(0, 1))
    kc_np = rng.standard_normal((nb, bs, kv, d)).astype(np.float32)
    vc_np = rng.standard_normal((nb, bs, kv, d)).astype(np.float32)
    # computed buffers: a jnp.asarray of an f32 numpy array may share the numpy memory (not donatable)
    kc, vc = jnp.asarray(kc_np, dtype) * 1, jnp.asarray(vc_np, dtype) * 1
    want_k, want_v = np.array(_f32(kc)), np.array(_f32(vc))  # copies: a live numpy view blocks donation
    for i in range(4):  # a decode loop: the same buffers, donated over and over
        slots = _i32(rng.permutation(nb * bs)[:3])
        slots[1] = -1
        k = jnp.asarray(rng.standard_normal((3, kv, d)), dtype)
        v = jnp.asarray(rng.standard_normal((3, kv, d)), dtype)
        ptr = kc.unsafe_buffer_pointer(), vc.unsafe_buffer_pointer()
        new_k, new_v = step(kc, vc, k, v, jnp.asarray(slots))
        assert kc.is_deleted() and vc.is_deleted(), "donated caches must be consumed"
        assert (new_k.unsafe_buffer_pointer(), new_v.unsafe_buffer_pointer()) == ptr, "no copy: aliased in place"
        want_k, want_v = _write_numpy(want_k, _f32(k), slots), _write_numpy(want_v, _f32(v), slots)
        np.testing.assert_array_equal(np.array(_f32(new_k)), want_k, err_msg=f"iteration {i}")
        np.testing.assert_array_equal(np.array(_f32(new_v)), want_v, err_msg=f"iteration {i}")
        kc, vc = new_k, new_v


def test_write_kv_eager_leaves_inputs_alone():
    rng = np.random.default_rng(13)
    kc_np = rng.standard_normal((3, 2, 1, 5)).astype(np.float32)
    kc, vc = jnp.asarray(kc_np), jnp.asarray(kc_np * 2)
    k = jnp.ones((2, 1, 5), jnp.float32)
    new_k, new_v = write_kv(kc, vc, k, -k, jnp.asarray([5, 0], jnp.int32))
    np.testing.assert_array_equal(np.asarray(kc), kc_np)
    np.testing.assert_array_equal(np.asarray(vc), kc_np * 2)
    assert not kc.is_deleted()
    np.testing.assert_array_equal(np.asarray(new_k).reshape(6, 5)[[5, 0]], np.ones((2, 5)))
    np.testing.assert_array_equal(np.asarray(new_v).reshape(6, 5)[[5, 0]], -np.ones((2, 5)))


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_empty_kv_cache_gives_two_pools_that_write_and_attend_like_zeroed_ones(dtype):
    shape = (4, 2, 1, 8)
    k0, v0 = empty_kv_cache(shape, dtype)
    assert k0.shape == v0.shape == shape and k0.dtype == v0.dtype == dtype
    assert k0.unsafe_buffer_pointer() != v0.unsafe_buffer_pointer()
    rk, rv = empty_kv_cache_reference(shape, dtype)
    assert not np.asarray(rk.astype(jnp.float32)).any() and not np.asarray(rv.astype(jnp.float32)).any()
    rng = np.random.default_rng(3)
    k = jnp.asarray(rng.standard_normal((3, 1, 8)), dtype)
    v = jnp.asarray(rng.standard_normal((3, 1, 8)), dtype)
    q = jnp.asarray(rng.standard_normal((3, 2, 8)), dtype)
    slots, tables = jnp.asarray([0, 1, 2], jnp.int32), jnp.asarray([[0, 1]], jnp.int32)
    seq, pos = jnp.zeros(3, jnp.int32), jnp.arange(3, dtype=jnp.int32)
    outs = [paged_attention(q, *write_kv(kc, vc, k, v, slots), tables, seq, pos, scale=0.3)
            for kc, vc in [(k0, v0), (rk, rv)]]
    np.testing.assert_array_equal(np.asarray(outs[0].astype(jnp.float32)), np.asarray(outs[1].astype(jnp.float32)))


@pytest.mark.parametrize(("shape", "dtype", "names"), [
    ((4, 2, 1), F32, "shape"), ((4, 0, 1, 8), F32, "shape"), ((4, 2.0, 1, 8), F32, "shape"),
    ((4, True, 1, 8), F32, "shape"), ("4218", F32, "shape"), ((4, 2, 1, 8), jnp.int32, "dtype"),
    ((4, 2, 1, 8), "not a dtype", "dtype"),
])
@pytest.mark.parametrize("fn", [empty_kv_cache, empty_kv_cache_reference])
def test_empty_kv_cache_rejects_bad_shapes_and_dtypes(fn, shape, dtype, names):
    with pytest.raises(ValueError, match=f"empty_kv_cache: {names}"):
        fn(shape, dtype)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads anonymous resident memory from /proc/self/status")
@pytest.mark.skipif(not _ffi.has_cpu_target("tunix_rt_empty_kv"), reason="the extension has no tunix_rt_empty_kv")
def test_empty_kv_cache_leaves_the_pools_pages_untouched():
    """An engine's pool (1 GiB by default) costs resident memory only as its pages are written: 2 x 128 MiB of
    pools add far less than that to the process's anonymous resident memory (the zeroing reference adds all)."""
    def anonymous_resident_bytes():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) << 10 for line in f if line.startswith("RssAnon:"))

    shape = (2048, 16, 8, 128)
    jax.block_until_ready(empty_kv_cache(shape, F32))  # the program compiled and run once, its pools freed
    before = anonymous_resident_bytes()
    k, v = jax.block_until_ready(empty_kv_cache(shape, F32))
    grown = anonymous_resident_bytes() - before
    assert grown < 64 << 20, f"resident memory grew by {grown >> 20} MiB for 2 x {k.nbytes >> 20} MiB of pools"


@pytest.mark.parametrize("flag", [jax.debug_nans, jax.debug_infs])
def test_empty_kv_cache_is_zeros_under_debug_nans_and_infs(flag):
    """Those modes check every output, and reused memory may hold NaN bits: the pools are zeros there."""
    def program_text():
        return jax.jit(lambda: empty_kv_cache((4, 2, 1, 8), F32)).lower().as_text()

    assert "tunix_rt_empty_kv" in program_text()
    with flag(True):
        assert "tunix_rt_empty_kv" not in program_text()
        k, v = empty_kv_cache((4, 2, 1, 8), F32)
    assert not np.asarray(k).any() and not np.asarray(v).any()


# ----------------------------------------------------------------------------------------------
# gradients


def dense_jax_attention(case: Case):
    """Attention over the same step written densely in JAX, independent of both implementations:
    visible slots per token computed in NumPy, keys gathered, kv heads repeated, jax.nn.softmax."""
    nb, bs, kv, d = case.kc.shape
    g = case.q.shape[1] // kv
    rows, real = [], case.ts >= 0
    for t in range(len(case.ts)):
        if not real[t]:
            rows.append(np.zeros(1, np.int64))  # a dummy key: the output is zeroed below
            continue
        p = int(case.tp[t])
        start = max(0, p - case.window + 1) if case.window else 0
        positions = np.arange(start, p + 1)
        rows.append(case.bt[case.ts[t], positions // bs].astype(np.int64) * bs + positions % bs)
    width = max([len(r) for r in rows] + [1])
    idx = np.zeros((len(rows), width), np.int64)
    mask = np.zeros((len(rows), width), bool)
    for t, r in enumerate(rows):
        idx[t, : len(r)], mask[t, : len(r)] = r, True

    def attend(q, kc, vc):
        keys = jnp.repeat(kc.reshape(nb * bs, kv, d)[idx], g, axis=2)  # (T, L, H, D)
        values = jnp.repeat(vc.reshape(nb * bs, kv, d)[idx], g, axis=2)
        scores = jnp.einsum("thd,tlhd->thl", q, keys, precision="highest") * case.scale
        if case.softcap:
            scores = jnp.tanh(scores / case.softcap) * case.softcap
        probs = jax.nn.softmax(jnp.where(mask[:, None, :], scores, -jnp.inf), axis=-1)
        out = jnp.einsum("thl,tlhd->thd", probs, values, precision="highest")
        return jnp.where(real[:, None, None], out, 0.0)

    return attend


def assert_grad_close(actual, expected, what, *, rtol=3e-5, frac=5e-6, atol=0.0):
    """|error| <= rtol * |expected| + frac * max|expected| + atol (sums over tokens cancel); measured
    worst f32 error: a fifth of this."""
    a, e = _f32(actual), _f32(expected)
    assert a.shape == e.shape, what
    scale = np.abs(e).max() if e.size else 0.0
    np.testing.assert_array_less(np.abs(a - e), rtol * np.abs(e) + frac * scale + atol + 1e-30, err_msg=what)


def rounding_floor(case, ct, other) -> float:
    """dq_i = scale * sum_j p_ij (dp_ij - D_i) k_j, with dp_ij = ct_i . v_j and D_i = sum_j p_ij dp_ij, can cancel
    to ~0 (a query that sees one key has dq = 0 exactly), and so can dk_j = scale * sum_i p_ij (dp_ij - D_i) q_i;
    both sides then return rounding noise, of size eps * scale * max|dp| * max|k| for dq (max|q| for dk;
    hypothesis found a dq of 5e-9 computed as 1.2e-6, and an all-zero dk computed as 5e-15), not relative to
    the gradient. `other` is the operand the gradient multiplies: the keys for dq, the queries for dk."""
    dp = np.linalg.norm(_f32(ct), axis=-1).max() * np.linalg.norm(_f32(case.vc), axis=-1).max()
    return 64 * np.finfo(np.float32).eps * case.scale * dp * np.abs(_f32(other)).max()


@pytest.mark.slow
@settings(max_examples=6)
@given(case_dtypes=attention_cases(dtype_pairs=((F32, F32),)), seed=st.integers(0, 2**32 - 1))
def test_gradients_match_dense_jax(case_dtypes, seed):
    case, _ = case_dtypes
    ct = jnp.asarray(np.random.default_rng(seed).standard_normal(case.q.shape), jnp.float32)
    q, kc, vc = case.arrays()[:3]
    rest = case.arrays()[3:]
    loss_ffi = lambda q, kc, vc: jnp.sum(paged_attention(q, kc, vc, *rest, **case.kw) * ct)
    dense = dense_jax_attention(case)
    loss_dense = lambda q, kc, vc: jnp.sum(dense(q, kc, vc) * ct)
    got = jax.jit(jax.grad(loss_ffi, argnums=(0, 1, 2)))(q, kc, vc)
    want = jax.jit(jax.grad(loss_dense, argnums=(0, 1, 2)))(q, kc, vc)
    for name, a, e in zip(("dq", "dk_cache", "dv_cache"), got, want):
        assert a.dtype == F32, name
        floor = {"dq": rounding_floor(case, ct, case.kc), "dk_cache": rounding_floor(case, ct, case.q)}.get(name, 0.0)
        assert_grad_close(a, e, name, atol=floor)
    # blocks no token reads get no gradient
    read = np.zeros(case.kc.shape[0] * case.kc.shape[1], bool)
    nb, bs = case.kc.shape[:2]
    for t in np.flatnonzero(case.ts >= 0):
        p = int(case.tp[t])
        positions = np.arange(max(0, p - case.window + 1) if case.window else 0, p + 1)
        read[case.bt[case.ts[t], positions // bs].astype(np.int64) * bs + positions % bs] = True
    for name, a in (("dk_cache", got[1]), ("dv_cache", got[2])):
        assert np.all(_f32(a).reshape(nb * bs, -1)[~read] == 0.0), f"{name} on unread slots"


def test_gradients_bf16():
    rng = np.random.default_rng(14)
    case = build_case(rng, bs=4, d=16, kv=2, group=2, nseq=3, max_blocks=4, n_pad=1, softcap=20.0, window=7)
    q, kc, vc = case.arrays(BF16, BF16)[:3]
    rest = case.arrays()[3:]
    ct = jnp.asarray(rng.standard_normal(case.q.shape), BF16)
    loss_ffi = lambda q, kc, vc: jnp.sum(paged_attention(q, kc, vc, *rest, **case.kw).astype(jnp.float32) * ct)
    dense = dense_jax_attention(case)
    loss_dense = lambda q, kc, vc: jnp.sum(dense(*(a.astype(jnp.float32) for a in (q, kc, vc))) * ct)
    got = jax.jit(jax.grad(loss_ffi, argnums=(0, 1, 2)))(q, kc, vc)
    want = jax.jit(jax.grad(loss_dense, argnums=(0, 1, 2)))(q, kc, vc)
    for name, a, e in zip(("dq", "dk_cache", "dv_cache"), got, want):
        assert a.dtype == BF16, name
        assert_grad_close(a, e, name, rtol=3e-2, frac=2e-2)


def test_write_kv_gradients():
    rng = np.random.default_rng(15)
    nb, bs, kv, d, t = 4, 3, 2, 5, 6
    kc, vc = (jnp.asarray(rng.standard_normal((nb, bs, kv, d)), jnp.float32) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((t, kv, d)), jnp.float32) for _ in range(2))
    slots = _i32([7, -1, 0, 11, -1, 4])
    gk, gv = (rng.standard_normal((nb, bs, kv, d)).astype(np.float32) for _ in range(2))

    def loss(kc, vc, k, v):
        nk, nv = write_kv(kc, vc, k, v, jnp.asarray(slots))
        return jnp.sum(nk * gk) + jnp.sum(nv * gv)

    dkc, dvc, dk, dv = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(kc, vc, k, v)
    written = np.zeros(nb * bs, bool)
    written[slots[slots >= 0]] = True
    for name, dcache, dnew, g in (("k", dkc, dk, gk), ("v", dvc, dv, gv)):
        flat = g.reshape(nb * bs, kv, d)
        want_new = np.where((slots >= 0)[:, None, None], flat[np.maximum(slots, 0)], 0.0)
        np.testing.assert_array_equal(np.asarray(dnew), want_new, err_msg=f"d{name}")
        want_cache = np.where(written[:, None, None], 0.0, flat).reshape(g.shape)  # overwritten rows: no gradient
        np.testing.assert_array_equal(np.asarray(dcache), want_cache, err_msg=f"d{name}_cache")


def test_gradient_through_write_then_attend():
    """A training-style step: grads wrt the new K/V flow through write_kv into paged_attention and
    match dense causal attention over the same tokens."""
    rng = np.random.default_rng(16)
    bs, kv, g, d, n = 4, 2, 2, 8, 11
    nb = 6
    bt = _i32(rng.permutation(nb)[:3][None])
    slots = _i32([bt[0, p // bs] * bs + p % bs for p in range(n)])
    q = jnp.asarray(rng.standard_normal((n, kv * g, d)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((n, kv, d)), jnp.float32) for _ in range(2))
    kc = vc = jnp.zeros((nb, bs, kv, d), jnp.float32)
    ct = jnp.asarray(rng.standard_normal((n, kv * g, d)), jnp.float32)
    ts, tp = jnp.zeros(n, jnp.int32), jnp.arange(n, dtype=jnp.int32)

    def paged(q, k, v):
        nk, nv = write_kv(kc, vc, k, v, jnp.asarray(slots))
        return jnp.sum(paged_attention(q, nk, nv, jnp.asarray(bt), ts, tp, scale=0.4) * ct)

    def dense(q, k, v):
        s = jnp.einsum("qhd,khd->hqk", q, jnp.repeat(k, g, axis=1), precision="highest") * 0.4
        s = jnp.where(jnp.tril(jnp.ones((n, n), bool)), s, -jnp.inf)
        o = jnp.einsum("hqk,khd->qhd", jax.nn.softmax(s, -1), jnp.repeat(v, g, axis=1), precision="highest")
        return jnp.sum(o * ct)

    got = jax.jit(jax.grad(paged, argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.grad(dense, argnums=(0, 1, 2)))(q, k, v)
    for name, a, e in zip(("dq", "dk", "dv"), got, want):
        assert_grad_close(a, e, name)


# ----------------------------------------------------------------------------------------------
# bounds: data-dependent ids are checked in the compiled op (an error, never a wild read)


def _bounds_base():
    """2 sequences, 3-wide tables of 4-slot blocks (positions < 12), 6 blocks; tokens of seq 0 at
    positions 0..4 (prefill) and seq 1 at position 11 (the last valid one)."""
    rng = np.random.default_rng(20)
    return dict(
        q=rng.standard_normal((7, 4, 8)).astype(np.float32),
        kc=rng.standard_normal((6, 4, 2, 8)).astype(np.float32),
        vc=rng.standard_normal((6, 4, 2, 8)).astype(np.float32),
        bt=_i32([[4, 0, 2], [1, 5, 3]]),
        ts=_i32([0, 0, 0, 0, 0, 1, -1]),
        tp=_i32([0, 1, 2, 3, 4, 11, 0]),
    )


def _attn_args(a):
    return tuple(jnp.asarray(a[k]) for k in ("q", "kc", "vc", "bt", "ts", "tp"))


ATTN_BOUNDS = [
    # (label, field, index, value, name in the message)
    ("block negative", "bt", (0, 1), -1, "block_tables["),
    ("block min int", "bt", (1, 2), I32_MIN, "block_tables["),
    ("block == num_blocks", "bt", (1, 0), 6, "block_tables["),
    ("block max int", "bt", (0, 0), I32_MAX, "block_tables["),
    ("seq == num_seqs", "ts", (2,), 2, "token_seq["),
    ("seq max int", "ts", (5,), I32_MAX, "token_seq["),
    ("seq -2", "ts", (0,), -2, "token_seq["),
    ("seq min int", "ts", (3,), I32_MIN, "token_seq["),
    ("pos == width * block", "tp", (5,), 12, "token_pos["),
    ("pos max int", "tp", (5,), I32_MAX, "token_pos["),
    ("pos -1", "tp", (0,), -1, "token_pos["),
    ("pos min int", "tp", (2,), I32_MIN, "token_pos["),
]


def _expect_ffi_error(fn, name):
    # jax raises the handler's INVALID_ARGUMENT as JaxRuntimeError on the first (compiling) call and
    # as ValueError from its C++ fast path on later calls: either, with the handler's message
    with pytest.raises((jax.errors.JaxRuntimeError, ValueError), match=r"^INVALID_ARGUMENT: .*" + re.escape(name)):
        jax.block_until_ready(fn())


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("label,field,index,value,name", ATTN_BOUNDS, ids=[c[0] for c in ATTN_BOUNDS])
def test_paged_attention_bad_ids_raise(label, field, index, value, name, window):
    a = _bounds_base()
    a[field][index] = value
    if field == "bt" and index[0] == 1:  # seq 1's token reads the bad block (also with the window)
        a["tp"][5] = index[1] * 4 + 3
    _expect_ffi_error(lambda: _attn_jit(*_attn_args(a), scale=0.5, window=window), name)


def test_paged_attention_valid_base_and_recovery_after_error():
    a = _bounds_base()
    good = _attn_args(a)
    ref = _attn_ref_jit(*good, scale=0.5)
    np.testing.assert_allclose(np.asarray(_attn_jit(*good, scale=0.5)), np.asarray(ref), rtol=1e-5, atol=1e-6)
    a["bt"][0, 0] = 99
    _expect_ffi_error(lambda: _attn_jit(*_attn_args(a), scale=0.5), "block_tables[0, 0] = 99")
    np.testing.assert_allclose(np.asarray(_attn_jit(*good, scale=0.5)), np.asarray(ref), rtol=1e-5, atol=1e-6)


def test_unread_table_entries_may_hold_anything():
    """Blocks past a token's position (and, with a window, before its window) are never read:
    invalid ids there are not an error and do not change the result."""
    a = _bounds_base()
    want = _attn_ref_jit(*_attn_args(a), scale=0.5)
    # seq 0's tokens reach position 4 (block 1): block 2 of its row is unread
    for bad in (-1, 6, I32_MAX, I32_MIN):
        a["bt"][0, 2] = bad
        got = _attn_jit(*_attn_args(a), scale=0.5)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    # window 4 at position 11 reads positions 8..11 only: blocks 0 and 1 of seq 1 are unread
    b = _bounds_base()
    b["ts"][:5] = -1
    want = _attn_ref_jit(*_attn_args(b), scale=0.5, window=4)
    b["bt"][1, :2] = [-1, I32_MAX]
    got = _attn_jit(*_attn_args(b), scale=0.5, window=4)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    # padding tokens read nothing: their seq is -1 and their position can be anything
    b["tp"][6] = I32_MIN
    b["tp"][:5] = [I32_MAX, -1, 12, 0, 5]
    got = _attn_jit(*_attn_args(b), scale=0.5, window=4)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_bad_id_in_a_multithreaded_step_raises():
    """A large step is split over the thread pool: an error from any chunk must surface."""
    rng = np.random.default_rng(21)
    case = build_case(rng, bs=16, d=64, kv=2, group=4, nseq=4, max_blocks=16, tables="disjoint", mode="prefill")
    assert len(case.ts) > 40
    mid = len(case.ts) // 2
    for field, value, name in (("tp", 16 * 16, "token_pos["), ("ts", 4, "token_seq["), ("tp", -3, "token_pos[")):
        arrays = dataclasses.replace(case, **{field: getattr(case, field).copy()})
        getattr(arrays, field)[mid] = value
        _expect_ffi_error(lambda: _attn_jit(*arrays.arrays(), **case.kw), name)
    bt = case.bt.copy()
    s = case.ts[mid]
    bt[s, case.tp[mid] // 16] = 10**6
    bad = dataclasses.replace(case, bt=bt)
    _expect_ffi_error(lambda: _attn_jit(*bad.arrays(), **case.kw), "block_tables[")


@pytest.mark.parametrize("value", [24, 25, I32_MAX, -2, I32_MIN])
def test_write_kv_bad_slot_raises(value):
    kc = jnp.zeros((6, 4, 2, 8), jnp.float32)
    k = jnp.ones((3, 2, 8), jnp.float32)
    slots = _i32([3, 23, 0])
    slots[1] = value
    f = jax.jit(write_kv)
    _expect_ffi_error(lambda: f(kc, kc, k, k, jnp.asarray(slots)), "slots[1]")
    donated = jax.jit(write_kv, donate_argnums=(0, 1))
    _expect_ffi_error(lambda: donated(jnp.zeros_like(kc), jnp.zeros_like(kc), k, k, jnp.asarray(slots)), "slots[1]")
    # the edges are fine
    out, _ = f(kc, kc, k, k, jnp.asarray(_i32([-1, 23, 0])))
    assert float(np.asarray(out).reshape(24, 16)[23].sum()) == 16.0


# ----------------------------------------------------------------------------------------------
# Python-side validation: ValueError naming the argument, before anything runs


def _attn_good():
    return dict(
        q=jnp.ones((3, 4, 8), jnp.float32),
        k_cache=jnp.ones((5, 4, 2, 8), jnp.float32),
        v_cache=jnp.ones((5, 4, 2, 8), jnp.float32),
        block_tables=jnp.zeros((2, 3), jnp.int32),
        token_seq=jnp.zeros((3,), jnp.int32),
        token_pos=jnp.zeros((3,), jnp.int32),
    )


ATTN_BAD = [
    ("q", dict(q=jnp.ones((3, 32), jnp.float32))),
    ("q", dict(q=jnp.ones((1, 3, 4, 8), jnp.float32))),
    ("q", dict(q=jnp.ones((3, 4, 8), jnp.float16))),
    ("q", dict(q=jnp.ones((3, 4, 8), jnp.int32))),
    ("q", dict(q=np.ones((3, 4, 8), np.float64))),
    ("q", dict(q=[[[1.0] * 8] * 4] * 3)),
    ("q", dict(q=jnp.ones((3, 4, 9), jnp.float32))),  # head_dim
    ("q", dict(q=jnp.ones((3, 3, 8), jnp.float32))),  # heads not a multiple of kv heads
    ("q", dict(q=jnp.ones((3, 0, 8), jnp.float32))),
    ("k_cache", dict(k_cache=jnp.ones((5, 4, 16), jnp.float32), v_cache=jnp.ones((5, 4, 16), jnp.float32))),
    ("k_cache", dict(k_cache=jnp.ones((5, 4, 2, 8), jnp.float16), v_cache=jnp.ones((5, 4, 2, 8), jnp.float16))),
    ("k_cache", dict(k_cache=jnp.ones((5, 4, 2, 8), jnp.int32), v_cache=jnp.ones((5, 4, 2, 8), jnp.int32))),
    ("k_cache", dict(k_cache=None)),
    ("v_cache", dict(v_cache=jnp.ones((5, 4, 2, 9), jnp.float32))),
    ("v_cache", dict(v_cache=jnp.ones((6, 4, 2, 8), jnp.float32))),
    ("v_cache", dict(v_cache=jnp.ones((5, 4, 2, 8), jnp.bfloat16))),
    ("v_cache", dict(v_cache=jnp.ones((5, 4, 16), jnp.float32))),
    ("block_tables", dict(block_tables=jnp.zeros((6,), jnp.int32))),
    ("block_tables", dict(block_tables=jnp.zeros((1, 2, 3), jnp.int32))),
    ("block_tables", dict(block_tables=np.zeros((2, 3), np.int64))),
    ("block_tables", dict(block_tables=jnp.zeros((2, 3), jnp.float32))),
    ("block_tables", dict(block_tables=jnp.zeros((2, 3), jnp.uint32))),
    ("token_seq", dict(token_seq=jnp.zeros((4,), jnp.int32))),
    ("token_seq", dict(token_seq=jnp.zeros((3, 1), jnp.int32))),
    ("token_seq", dict(token_seq=np.zeros((3,), np.int64))),
    ("token_seq", dict(token_seq=jnp.zeros((3,), jnp.float32))),
    ("token_pos", dict(token_pos=jnp.zeros((2,), jnp.int32))),
    ("token_pos", dict(token_pos=jnp.zeros((), jnp.int32))),
    ("token_pos", dict(token_pos=jnp.zeros((3,), jnp.int16))),
]

SCALAR_BAD = [
    ("scale", dict(scale=float("nan"))),
    ("scale", dict(scale=float("inf"))),
    ("scale", dict(scale="0.5")),
    ("scale", dict(scale=None)),
    ("softcap", dict(softcap=0.0)),
    ("softcap", dict(softcap=-5.0)),
    ("softcap", dict(softcap=float("nan"))),
    ("softcap", dict(softcap=float("inf"))),
    ("softcap", dict(softcap="30")),
    ("window", dict(window=0)),
    ("window", dict(window=-3)),
    ("window", dict(window=2.5)),
    ("window", dict(window="4")),
    ("window", dict(window=True)),
]

ATTN_FNS = pytest.mark.parametrize("fn", [paged_attention, paged_attention_reference], ids=["ffi", "reference"])


@ATTN_FNS
@pytest.mark.parametrize("name,change", ATTN_BAD, ids=[f"{n}{i}" for i, (n, _) in enumerate(ATTN_BAD)])
def test_paged_attention_bad_arrays_raise_value_error(fn, name, change):
    args = {**_attn_good(), **change}
    pattern = rf"paged_attention: {name}\b"
    with pytest.raises(ValueError, match=pattern):
        fn(*args.values(), scale=1.0)
    if all(isinstance(a, jax.Array) for a in args.values()):  # also while tracing under jit
        with pytest.raises(ValueError, match=pattern):
            jax.jit(functools.partial(fn, scale=1.0))(*args.values())


@ATTN_FNS
@pytest.mark.parametrize("name,change", SCALAR_BAD, ids=[f"{n}{i}" for i, (n, _) in enumerate(SCALAR_BAD)])
def test_paged_attention_bad_scalars_raise_value_error(fn, name, change):
    kw = {"scale": 1.0, **change}
    with pytest.raises(ValueError, match=rf"paged_attention: {name}\b"):
        fn(*_attn_good().values(), **kw)


@ATTN_FNS
def test_paged_attention_good_arguments_accepted(fn):
    out = jax.jit(functools.partial(fn, scale=1, softcap=30, window=4))(*_attn_good().values())
    assert out.shape == (3, 4, 8) and out.dtype == F32


@pytest.mark.parametrize("fn", [paged_attention, paged_attention_reference, write_kv, write_kv_reference],
                         ids=["ffi", "reference", "write_kv", "write_kv_reference"])
@pytest.mark.parametrize("v_cache", [[[[[1.0] * 8] * 2] * 4] * 5, None], ids=["list", "None"])
def test_v_cache_not_an_array(fn, v_cache):
    if fn in (write_kv, write_kv_reference):
        op, args, kw = "write_kv", {**_write_good(), "v_cache": v_cache}, {}
    else:
        op, args, kw = "paged_attention", {**_attn_good(), "v_cache": v_cache}, {"scale": 1.0}
    with pytest.raises(ValueError, match=rf"{op}: v_cache\b"):
        fn(*args.values(), **kw)


def _write_good():
    return dict(
        k_cache=jnp.zeros((5, 4, 2, 8), jnp.float32),
        v_cache=jnp.zeros((5, 4, 2, 8), jnp.float32),
        k=jnp.ones((3, 2, 8), jnp.float32),
        v=jnp.ones((3, 2, 8), jnp.float32),
        slots=jnp.zeros((3,), jnp.int32),
    )


WRITE_BAD = [
    ("k_cache", dict(k_cache=jnp.zeros((5, 4, 16), jnp.float32), v_cache=jnp.zeros((5, 4, 16), jnp.float32))),
    ("k_cache", dict(k_cache=jnp.zeros((5, 4, 2, 8), jnp.float16), v_cache=jnp.zeros((5, 4, 2, 8), jnp.float16))),
    ("k_cache", dict(k_cache="cache")),
    ("v_cache", dict(v_cache=jnp.zeros((5, 4, 2, 7), jnp.float32))),
    ("v_cache", dict(v_cache=jnp.zeros((5, 4, 2, 8), jnp.bfloat16))),
    ("k", dict(k=jnp.ones((3, 16), jnp.float32))),
    ("k", dict(k=jnp.ones((3, 2, 8), jnp.bfloat16))),  # not the cache's dtype
    ("k", dict(k=jnp.ones((3, 1, 8), jnp.float32))),  # kv heads
    ("k", dict(k=jnp.ones((3, 2, 9), jnp.float32))),  # head_dim
    ("k", dict(k=np.ones((3, 2, 8), np.float64))),
    ("v", dict(v=jnp.ones((4, 2, 8), jnp.float32))),
    ("v", dict(v=jnp.ones((3, 2, 8), jnp.bfloat16))),
    ("v", dict(v=jnp.ones((3, 16), jnp.float32))),
    ("v", dict(v=None)),
    ("slots", dict(slots=jnp.zeros((4,), jnp.int32))),
    ("slots", dict(slots=jnp.zeros((3, 1), jnp.int32))),
    ("slots", dict(slots=np.zeros((3,), np.int64))),
    ("slots", dict(slots=jnp.zeros((3,), jnp.float32))),
    ("slots", dict(slots=[0, 1, 2])),
]


@pytest.mark.parametrize("fn", [write_kv, write_kv_reference], ids=["ffi", "reference"])
@pytest.mark.parametrize("name,change", WRITE_BAD, ids=[f"{n}{i}" for i, (n, _) in enumerate(WRITE_BAD)])
def test_write_kv_bad_arrays_raise_value_error(fn, name, change):
    args = {**_write_good(), **change}
    pattern = rf"write_kv: {name}\b"
    with pytest.raises(ValueError, match=pattern):
        fn(*args.values())
    if all(isinstance(a, jax.Array) for a in args.values()):
        with pytest.raises(ValueError, match=pattern):
            jax.jit(fn)(*args.values())


# ----------------------------------------------------------------------------------------------
# it really is the FFI op


def test_lowered_hlo_uses_ffi_custom_calls():
    a = _bounds_base()
    args = _attn_args(a)
    assert ATTEND_TARGET in jax.jit(functools.partial(paged_attention, scale=1.0)).lower(*args).as_text()
    assert ATTEND_TARGET not in jax.jit(functools.partial(paged_attention_reference, scale=1.0)).lower(*args).as_text()
    k = jnp.ones((2, 2, 8), jnp.float32)
    assert WRITE_TARGET in jax.jit(write_kv).lower(args[1], args[2], k, k, jnp.zeros(2, jnp.int32)).as_text()


# ----------------------------------------------------------------------------------------------
# multi-threaded split: bitwise determinism, and independent of how the step is packed


def test_large_step_deterministic_and_matches_reference():
    rng = np.random.default_rng(30)
    make = lambda: build_case(rng, bs=16, d=64, kv=2, group=4, nseq=8, max_blocks=16, tables="disjoint",
                              mode="prefill", n_pad=5, shuffle=True, softcap=30.0)
    case = make()
    while np.count_nonzero(case.ts >= 0) < 300:  # several hundred tokens: many chunks of work
        case = make()
    args = case.arrays()
    first = np.asarray(_attn_jit(*args, **case.kw))
    for _ in range(2):
        again = np.asarray(_attn_jit(*args, **case.kw))
        np.testing.assert_array_equal(first.view(np.uint32), again.view(np.uint32))
    ref = np.asarray(_attn_ref_jit(*args, **case.kw))
    np.testing.assert_allclose(first, ref, **_fwd_tol(F32, F32, float(np.abs(case.vc).max()), case.scale, 64))
    # each token's output does not depend on the rest of the step (or on the thread split)
    picks = np.asarray([0, 1, len(case.ts) // 2, len(case.ts) - 1])
    single = np.asarray(_attn_jit(args[0][picks], *args[1:4], args[4][picks], args[5][picks], **case.kw))
    np.testing.assert_array_equal(single.view(np.uint32), first[picks].view(np.uint32))
    # bf16 as well
    bargs = case.arrays(BF16, BF16)
    b1, b2 = (np.asarray(_attn_jit(*bargs, **case.kw)).view(np.uint16) for _ in range(2))
    np.testing.assert_array_equal(b1, b2)


@pytest.mark.parametrize("window", [None, 21])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_a_token_gives_the_same_bits_alone_as_in_its_chunk(window, dtype):
    """A prefill chunk's tokens walk their sequence's blocks together (one run per kv head): each token's output
    is bit for bit the one it gets alone, whatever run, run length or thread split it fell in."""
    rng = np.random.default_rng(31)
    case = build_case(rng, bs=16, d=64, kv=2, group=3, nseq=3, max_blocks=12, tables="disjoint", mode="prefill",
                      shuffle=False, window=window, softcap=20.0)
    while np.count_nonzero(case.ts >= 0) < 40:
        case = build_case(rng, bs=16, d=64, kv=2, group=3, nseq=3, max_blocks=12, tables="disjoint",
                          mode="prefill", shuffle=False, window=window, softcap=20.0)
    args = case.arrays(dtype, dtype)
    whole = np.asarray(_attn_jit(*args, **case.kw).astype(jnp.float32))
    for t in range(len(case.ts)):
        alone = _attn_jit(args[0][t:t + 1], *args[1:4], args[4][t:t + 1], args[5][t:t + 1], **case.kw)
        np.testing.assert_array_equal(np.asarray(alone.astype(jnp.float32))[0], whole[t], err_msg=f"token {t}")


@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 7])
@pytest.mark.parametrize("d", [37, 64])
def test_a_query_head_gets_the_same_bits_whatever_heads_share_its_kv_head(group, d):
    """The SIMD kernels score up to three query heads of a kv head per pass over its keys: a head's output is
    bit for bit the one it gets with a kv head of its own (the cache repeated per query head, group 1)."""
    rng = np.random.default_rng(group * 100 + d)
    case = build_case(rng, bs=5, d=d, kv=2, group=group, nseq=3, max_blocks=8, mode="mixed", softcap=15.0)
    q, kc, vc, *rest = case.arrays(jnp.float32, jnp.float32)
    grouped = np.asarray(_attn_jit(q, kc, vc, *rest, **case.kw))
    own = np.asarray(_attn_jit(q, jnp.repeat(kc, group, axis=2), jnp.repeat(vc, group, axis=2), *rest, **case.kw))
    np.testing.assert_array_equal(grouped, own)


# ----------------------------------------------------------------------------------------------
# every ISA tier (TUNIX_RT_ISA is read once per process: subprocesses)

_TIER_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np, jax, jax.numpy as jnp
    from tunix_rt.ops import _ffi, paged_attention, write_kv

    data = dict(np.load(sys.argv[1]))
    configs = json.loads(sys.argv[2])
    out = {}
    kc, vc = jnp.asarray(data["kc"]), jnp.asarray(data["vc"])
    kc, vc = write_kv(kc, vc, jnp.asarray(data["k"]), jnp.asarray(data["v"]), jnp.asarray(data["slots"]))
    out["kc"], out["vc"] = np.asarray(kc), np.asarray(vc)
    for i, (dtype, kw) in enumerate(configs):
        dt = jnp.dtype(dtype)
        o = paged_attention(jnp.asarray(data["q"], dt), kc.astype(dt), vc.astype(dt), jnp.asarray(data["bt"]),
                            jnp.asarray(data["ts"]), jnp.asarray(data["tp"]), **kw)
        out[f"out{i}"] = np.asarray(o.astype(jnp.float32))
    np.savez(sys.argv[3], **out)
    print(json.dumps({"isa": _ffi.isa_level()}))
    """
)

_TIERS = ("scalar", "avx2")
_TIER_CONFIGS = [
    ("float32", dict(scale=0.3)),
    ("float32", dict(scale=0.3, softcap=10.0, window=9)),
    ("bfloat16", dict(scale=0.3, window=40)),
]


def _tier_case():
    # head_dim 37: the 16-wide, 8-wide and scalar tails of every vector loop
    rng = np.random.default_rng(40)
    case = build_case(rng, bs=5, d=37, kv=2, group=3, nseq=4, max_blocks=8, tables="shared", mode="mixed", n_pad=2)
    nb, bs, kv, d = case.kc.shape
    t = 6
    slots = _i32(rng.permutation(nb * bs)[:t])
    slots[2] = -1
    k, v = (rng.standard_normal((t, kv, d)).astype(np.float32) for _ in range(2))
    return case, k, v, slots


@pytest.fixture(scope="module")
def tier_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("paged_isa")
    case, k, v, slots = _tier_case()
    data = tmp / "data.npz"
    np.savez(data, q=case.q, kc=case.kc, vc=case.vc, bt=case.bt, ts=case.ts, tp=case.tp, k=k, v=v, slots=slots)
    return run_tiers(_TIERS, _TIER_SCRIPT, tmp, [str(data), json.dumps(_TIER_CONFIGS)])


@pytest.mark.parametrize("tier", _TIERS)
def test_isa_tier_matches_reference(tier_runs, tier):
    report, res = tier_runs[tier]
    assert report["isa"] == expected_tier(tier)
    case, k, v, slots = _tier_case()
    kc, vc = jax.jit(write_kv_reference)(jnp.asarray(case.kc), jnp.asarray(case.vc), jnp.asarray(k),
                                         jnp.asarray(v), jnp.asarray(slots))
    np.testing.assert_array_equal(res["kc"], np.asarray(kc))
    np.testing.assert_array_equal(res["vc"], np.asarray(vc))
    for i, (dtype, kw) in enumerate(_TIER_CONFIGS):
        dt = jnp.dtype(dtype)
        ref = _attn_ref_jit(jnp.asarray(case.q, dt), kc.astype(dt), vc.astype(dt), jnp.asarray(case.bt),
                            jnp.asarray(case.ts), jnp.asarray(case.tp), **{"softcap": None, "window": None, **kw})
        tol = _fwd_tol(dt, dt, float(np.abs(_f32(vc.astype(dt))).max()), kw["scale"], 37)
        np.testing.assert_allclose(res[f"out{i}"], _f32(ref), **tol, err_msg=f"{tier} config {i}")


@pytest.mark.skipif(hardware_tier() == "scalar", reason="needs a SIMD tier to compare with scalar")
def test_isa_cap_changes_the_kernels(tier_runs):
    """The cap selects different kernels, not only a different name: AVX2's fused multiply-adds and
    16-lane dot order round differently from the scalar loops, so some f32 output bits differ."""
    _, scalar = tier_runs["scalar"]
    _, simd = tier_runs["avx2"]
    assert any(not np.array_equal(simd[f"out{i}"], scalar[f"out{i}"]) for i in range(2))
