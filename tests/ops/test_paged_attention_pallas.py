"""The Pallas paged-attention kernel (the CUDA path) against the reference, in interpret mode on CPU.

Interpret mode runs the kernel's own program: its grid, block-table walk, window bounds, online softmax
and padding. Both sides compute f32 scores from the same inputs, so they agree to the tolerances the
FFI op meets (test_paged_attention._fwd_tol). The Triton lowering itself is checked by lowering for
CUDA here (no GPU needed to lower); compiling and running it needs a GPU (benchmarks/device_check.py).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.ops.conftest import kernels
from tests.ops.test_paged_attention import BF16, DTYPE_PAIRS, F32, _f32, _fwd_tol, build_case, dense_oracle
from tunix_rt.ops import _ffi, paged_attention, paged_attention_reference
from tunix_rt.ops.paged_attention_pallas import launch_shape, paged_attention_pallas, supported

pytestmark = pytest.mark.usefixtures("fast_compiles")  # interpret-mode programs are large, compiled once per example

_STATIC = ("scale", "softcap", "window")
_pallas = jax.jit(functools.partial(paged_attention_pallas, interpret=True),
                  static_argnames=(*_STATIC, "blocks_per_step", "splits"))
_reference = jax.jit(paged_attention_reference, static_argnames=_STATIC)


def check(case, q_dtype=F32, cache_dtype=F32, **launch):
    """launch: the kernel's blocks_per_step / splits, else its own choice."""
    args = case.arrays(q_dtype, cache_dtype)
    out, ref = _pallas(*args, **case.kw, **launch), _reference(*args, **case.kw)
    assert out.shape == ref.shape and out.dtype == ref.dtype == q_dtype
    assert np.all(_f32(out)[case.ts < 0] == 0.0), "padding tokens must give zero output"
    vmax = float(np.abs(_f32(args[2])).max()) if case.vc.size else 1.0
    tol = _fwd_tol(q_dtype, cache_dtype, vmax, case.scale, case.q.shape[-1])
    np.testing.assert_allclose(_f32(out), _f32(ref), **tol, err_msg="pallas vs reference")
    loose = dict(rtol=1e-4, atol=tol["atol"] * 2) if tol["rtol"] < 1e-3 else tol
    np.testing.assert_allclose(_f32(out), dense_oracle(*args, **case.kw), **loose, err_msg="pallas vs float64 oracle")


@st.composite
def pallas_cases(draw):
    """The op's random steps (decode, chunked prefill, mixed; padding; shared, disjoint and repeated
    tables; invalid ids past each sequence's end) on the power-of-two shapes the kernel takes."""
    d = draw(st.sampled_from([1, 2, 4, 8, 16, 32, 64]))
    params = dict(
        bs=draw(st.sampled_from([1, 2, 4, 8, 16])), d=d, kv=draw(st.integers(1, 3)),
        group=draw(st.sampled_from([1, 2, 3, 4, 5, 8])), nseq=draw(st.integers(1, 4)),
        max_blocks=draw(st.integers(1, 5)), tables=draw(st.sampled_from(["disjoint", "shared", "random"])),
        mode=draw(st.sampled_from(["decode", "prefill", "mixed"])), n_pad=draw(st.integers(0, 3)),
        pad_pos=draw(st.sampled_from(["zero", "any"])), garbage=draw(st.booleans()), shuffle=draw(st.booleans()),
        scale=draw(st.one_of(st.just(d**-0.5), st.sampled_from([0.0, 1.0, 2.0]))),
        softcap=draw(st.one_of(st.none(), st.sampled_from([1.0, 30.0]))),
        window=draw(st.one_of(st.none(), st.just(1), st.integers(1, 90))),
    )
    launch = dict(blocks_per_step=draw(st.sampled_from([None, 1, 2, 3])), splits=draw(st.sampled_from([None, 1, 2, 3, 8])))
    case = build_case(np.random.default_rng(draw(st.integers(0, 2**32 - 1))), **params)
    return case, draw(st.sampled_from(DTYPE_PAIRS)), launch


@pytest.mark.slow
@settings(max_examples=25, deadline=None)
@given(case_dtypes=pallas_cases())
def test_matches_reference_and_oracle(case_dtypes):
    case, dtypes, launch = case_dtypes
    check(case, *dtypes, **launch)


@pytest.mark.parametrize("splits", [1, 2, 3, 7, 64])
@pytest.mark.parametrize("blocks_per_step", [1, 4])
def test_split_keys_fold_to_the_same_softmax(splits, blocks_per_step):
    """Each token's blocks split over several programs (flash-decoding), their partial softmaxes folded after:
    shares that are empty (more splits than loop steps, or blocks before a window), ragged last shares."""
    rng = np.random.default_rng(splits * 10 + blocks_per_step)
    for window in (None, 21):
        case = build_case(rng, bs=4, d=16, kv=2, group=4, nseq=3, max_blocks=13, mode="mixed", tables="shared",
                          window=window, max_chunk=3, n_pad=1)
        check(case, splits=splits, blocks_per_step=blocks_per_step)
        check(case, BF16, BF16, splits=splits, blocks_per_step=blocks_per_step)


def test_position_past_the_table_reads_only_the_table():
    """A token whose position lies past its row's capacity sees the row's keys only, as the reference does,
    not the padding a last loop step reads past the row."""
    case = build_case(np.random.default_rng(13), bs=4, d=16, kv=1, group=2, nseq=2, max_blocks=3, mode="decode",
                      tables="disjoint")
    case.tp[case.ts >= 0] = 3 * 4 + 5
    ref = _reference(*case.arrays(), **case.kw)
    for launch in (dict(blocks_per_step=2, splits=1), dict(blocks_per_step=1, splits=2)):
        np.testing.assert_allclose(_f32(_pallas(*case.arrays(), **case.kw, **launch)), _f32(ref), rtol=1e-5, atol=1e-6)


def test_launch_shape():
    """32 keys per loop step (at least a 16-key tile); splits fill ~1024 programs, never more than a row has
    steps."""
    assert launch_shape(tokens=1, kv_heads=8, block_size=16, max_blocks=2048) == (2, 128)
    assert launch_shape(tokens=64, kv_heads=8, block_size=16, max_blocks=128) == (2, 2)
    assert launch_shape(tokens=2048, kv_heads=8, block_size=16, max_blocks=128) == (2, 1)
    assert launch_shape(tokens=1, kv_heads=1, block_size=16, max_blocks=6) == (2, 3)
    assert launch_shape(tokens=1, kv_heads=1, block_size=64, max_blocks=6) == (1, 6)
    assert launch_shape(tokens=1, kv_heads=8, block_size=16, max_blocks=2048, interpret=True) == (2, 2)
    assert launch_shape(tokens=1, kv_heads=1, block_size=2, max_blocks=100, blocks_per_step=1, splits=3) == (8, 3)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_head_dims_and_gqa_ratios(d, group):
    """Real models' shapes: head_dim 64 (SmolLM2, Llama 3.2 1B), 128 (Llama 3 8B, Qwen), 256 (Gemma);
    GQA 1, 4 and 8 query heads per kv head; a window and a softcap on half of them."""
    rng = np.random.default_rng(d * 10 + group)
    windowed = group != 4
    case = build_case(rng, bs=16, d=d, kv=2, group=group, nseq=3, max_blocks=4, mode="mixed", n_pad=1,
                      window=20 if windowed else None, softcap=30.0 if windowed else None, max_chunk=8)
    check(case)
    check(case, BF16, BF16)


def test_ragged_decode_step_over_long_sequences():
    """One decode token per sequence, lengths from 1 to 16 blocks, tables sharing blocks."""
    rng = np.random.default_rng(3)
    check(build_case(rng, bs=16, d=64, kv=1, group=8, nseq=4, max_blocks=16, mode="decode", tables="shared"))


def test_all_padding_step_is_zero():
    rng = np.random.default_rng(5)
    case = build_case(rng, bs=4, d=8, kv=1, group=2, nseq=1, max_blocks=2)
    case.ts[:] = -1
    out = _pallas(*case.arrays(), **case.kw)
    assert np.all(_f32(out) == 0.0)


def test_stale_nan_in_unread_slots_is_never_read():
    rng = np.random.default_rng(7)
    case = build_case(rng, bs=8, d=16, kv=2, group=2, nseq=2, max_blocks=3, mode="decode", tables="disjoint")
    visible = np.zeros(case.kc.shape[:2], bool)
    for t in np.flatnonzero(case.ts >= 0):
        for p in range(int(case.tp[t]) + 1):
            visible[case.bt[case.ts[t], p // 8], p % 8] = True
    case.kc[~visible] = np.nan
    case.vc[~visible] = np.nan
    out = _pallas(*case.arrays(), **case.kw)
    assert np.all(np.isfinite(_f32(out)))
    np.testing.assert_allclose(_f32(out), dense_oracle(*case.arrays(), **case.kw), rtol=1e-4, atol=1e-5)


def test_out_of_pool_ids_are_clamped_not_read_out_of_bounds():
    """A device kernel cannot raise: an invalid id in a row a token reads is clamped into the pool (the
    CPU op raises instead; the engine validates its tables on the host)."""
    rng = np.random.default_rng(9)
    case = build_case(rng, bs=4, d=8, kv=1, group=1, nseq=1, max_blocks=2, mode="decode", tables="disjoint")
    case.bt[0, 0] = 10**6
    out = _pallas(*case.arrays(), **case.kw)
    assert np.all(np.isfinite(_f32(out)))


def test_supported_shapes():
    assert supported(jnp.zeros((4, 16, 2, 64)))
    assert not supported(jnp.zeros((4, 16, 2, 72)))  # head_dim 72: the reference runs instead
    assert not supported(jnp.zeros((4, 12, 2, 64)))


def test_gradients_are_the_reference_gradients():
    rng = np.random.default_rng(11)
    case = build_case(rng, bs=4, d=8, kv=2, group=2, nseq=2, max_blocks=3, mode="mixed", softcap=5.0, window=6)
    q, kc, vc, *rest = case.arrays()
    ct = jnp.asarray(rng.standard_normal(case.q.shape), jnp.float32)
    with_pallas = _ffi_mode_attention("interpret")
    got = jax.grad(lambda *a: jnp.sum(with_pallas(*a, *rest, **case.kw) * ct), argnums=(0, 1, 2))(q, kc, vc)
    want = jax.grad(lambda *a: jnp.sum(paged_attention_reference(*a, *rest, **case.kw) * ct), argnums=(0, 1, 2))(q, kc, vc)
    for a, e in zip(got, want):
        np.testing.assert_allclose(_f32(a), _f32(e), rtol=1e-5, atol=1e-6)


def _ffi_mode_attention(mode: str):
    """paged_attention as traced under TUNIX_RT_KERNELS=mode."""

    def attend(*args, **kw):
        with kernels(mode):
            return paged_attention(*args, **kw)

    return attend


def _program(mode: str, d: int = 16) -> str:
    case = build_case(np.random.default_rng(1), bs=4, d=d, kv=1, group=2, nseq=1, max_blocks=2)
    return str(jax.make_jaxpr(functools.partial(_ffi_mode_attention(mode), **case.kw))(*case.arrays()))


def test_kernel_modes_pick_the_path():
    assert "pallas_call" in _program("interpret")
    assert "pallas_call" not in _program("interpret", d=24)  # unsupported head_dim: the reference
    assert "pallas_call" not in _program("reference") and "ffi_call" not in _program("reference")
    if _ffi.cpu_targets():
        assert "ffi_call" in _program("native")


def test_unknown_kernel_mode_is_refused():
    code = "from tunix_rt.ops import _ffi; _ffi.kernel_mode()"
    env = dict(os.environ, TUNIX_RT_KERNELS="fast")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "TUNIX_RT_KERNELS='fast' is not one of native, reference, interpret" in run.stderr


@pytest.mark.parametrize("d,group,dtype,splits", [(64, 3, BF16, 1), (128, 4, BF16, 2), (256, 8, F32, 1), (64, 1, F32, 3)])
def test_lowers_to_triton_for_cuda(d, group, dtype, splits):
    """The kernel lowers through Pallas's Triton path (not Mosaic GPU) for CUDA; no GPU is needed for that."""
    case = build_case(np.random.default_rng(2), bs=16, d=d, kv=2, group=group, nseq=2, max_blocks=3,
                      softcap=30.0, window=17)
    fn = jax.jit(functools.partial(paged_attention_pallas, **case.kw, splits=splits, blocks_per_step=1))
    text = fn.trace(*case.arrays(dtype, dtype)).lower(lowering_platforms=("cuda",)).as_text()
    assert "xla.gpu.triton" in text and "tunix_rt_paged_attention" in text
