"""MoE's grouped matmul as Pallas kernels: the path `grouped_matmul` takes on CUDA GPUs (Triton lowering), and
on any platform in interpret mode (`TUNIX_RT_KERNELS=interpret`), where the tests check it.

Same contract as the op (tunix_rt.ops.moe.grouped_matmul): group g owns the group_sizes[g] rows after the
groups before it and multiplies them by w[g]; rows past the groups are zero. XLA compiles the reference,
jax.lax.ragged_dot, for the GPU at ~5 TFLOP/s on one H200, ~1/50 of a dense matmul of the same rows
(benchmarks/device_check.py's moe part); JAX's own grouped kernels are TPU's megablox and Mosaic GPU's
ragged_dot_mgpu, which has no interpret mode for the CPU-only CI, so this one is written the megablox way
for Triton.

Forward (and dx, the same product against w transposed): the rows are cut into tiles of TM; a work item is
one (group, row tile) pair the group touches, so a tile straddling a group boundary is visited once per
group, each visit storing only its group's rows (a masked store: the items never write the same row). One
program per (item, column tile) sums over K in TK steps. The item list is made by XLA from group_sizes, at
its static bound (row tiles + experts); group sizes are clamped into x's rows, since a device kernel cannot
raise. dw[g] = x_g^T dy_g: one program per (expert, K tile, N tile) walks its group's rows TM at a time.
f32 sums (of f32 tiles in TF32 on the tensor cores, as XLA's own f32 dots there); K and N must be multiples
of 16 (`supported`), the tiles the largest powers of two dividing them up to 64 (K, and dw's both sides) and
128 (the product's N).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

# Pallas (and its Triton backend) is imported where a kernel is traced, not with this module (see
# paged_attention_pallas).

_TM = 64  # rows per tile


def _tile(n: int, widest: int) -> int:
    """The largest power of two from 16 to `widest` dividing n (a multiple of 16: `supported`)."""
    if n % 16:
        raise ValueError(f"grouped_matmul_pallas: {n} is not a multiple of 16")
    tile = widest
    while n % tile:
        tile //= 2
    return tile


def supported(x, w, transpose_w: bool) -> bool:
    """Whether the kernels run on this product: K and N multiples of 16 (Triton's tiles; no edge masks), at
    least one expert."""
    n, k = (w.shape[1], w.shape[2]) if transpose_w else (w.shape[2], w.shape[1])
    return n % 16 == 0 and k % 16 == 0 and n > 0 and k > 0 and w.shape[0] > 0


def _dot(a, b, dims):
    """f32 sums at JAX's default precision: bf16 tiles exact, f32 tiles in TF32 on the tensor cores (as XLA's
    own f32 dots on the GPU)."""
    return jax.lax.dot_general(a, b, (dims, ((), ())), preferred_element_type=jnp.float32)


def _bounds(group_sizes, rows: int):
    """Each group's [start, end) rows, 0 <= start <= end <= rows. A device kernel cannot raise (the CPU op
    does), so a negative size counts as empty and rows past x's are dropped: no read or write out of bounds.
    The sum saturates at `rows` as it goes, so sizes whose int32 sum would overflow stay in bounds too."""
    sizes = jnp.clip(group_sizes, 0, rows)
    ends = jax.lax.associative_scan(lambda a, b: jnp.minimum(a + b, rows), sizes)
    return jnp.concatenate([jnp.zeros(1, ends.dtype), ends[:-1]]), ends


def _items(group_sizes, rows: int, row_tiles: int):
    """(group, row tile) of every work item, padded with group -1 to the static bound row_tiles + experts, and
    the groups' [start, end) rows."""
    starts, ends = _bounds(group_sizes, rows)
    first, last = starts // _TM, (ends - 1) // _TM
    counts = jnp.where(ends > starts, last - first + 1, 0)
    bound = row_tiles + group_sizes.shape[0]
    item = jnp.arange(bound, dtype=jnp.int32)
    ends_items = jnp.cumsum(counts)
    group = jnp.searchsorted(ends_items, item, side="right").astype(jnp.int32)
    valid = item < ends_items[-1]
    g = jnp.minimum(group, group_sizes.shape[0] - 1)
    tile = first[g] + item - (ends_items[g] - counts[g])
    return jnp.where(valid, g, -1).astype(jnp.int32), jnp.where(valid, tile, 0).astype(jnp.int32), starts, ends


def _gmm_kernel(group_ref, tile_ref, starts_ref, ends_ref, x_ref, w_ref, y_in_ref, y_ref, *, tk, tn, transpose_w):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pl_triton

    del y_in_ref  # the zeroed output, aliased to y_ref
    i, j = pl.program_id(0), pl.program_id(1)
    g = group_ref[i]

    @pl.when(g >= 0)
    def _():
        r0 = tile_ref[i] * _TM
        rows = r0 + jnp.arange(_TM)
        mine = (rows >= starts_ref[g]) & (rows < ends_ref[g])
        cols = pl.ds(j * tn, tn)

        def body(kk, acc):
            ks = pl.ds(kk * tk, tk)
            x = x_ref[pl.ds(r0, _TM), ks]
            if transpose_w:
                return acc + _dot(x, w_ref[g, cols, ks], ((1,), (1,)))
            return acc + _dot(x, w_ref[g, ks, cols], ((1,), (0,)))

        k = x_ref.shape[1]
        acc = jax.lax.fori_loop(0, k // tk, body, jnp.zeros((_TM, tn), jnp.float32))
        pl_triton.store(y_ref.at[pl.ds(r0, _TM), cols], acc.astype(y_ref.dtype), mask=mine[:, None])


def _pad_rows(x, rows: int):
    return x if x.shape[0] == rows else jnp.pad(x, ((0, rows - x.shape[0]), (0, 0)))


def _gmm(x, w, group_sizes, transpose_w: bool, interpret: bool):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pl_triton

    m, k = x.shape
    n = w.shape[1] if transpose_w else w.shape[2]
    tk, tn = _tile(k, 64), _tile(n, 128)
    row_tiles = max(-(-m // _TM), 1)
    group, tile, starts, ends = _items(group_sizes, m, row_tiles)
    xp = _pad_rows(x, row_tiles * _TM)
    whole = pl.BlockSpec()
    y = pl.pallas_call(
        functools.partial(_gmm_kernel, tk=tk, tn=tn, transpose_w=transpose_w),
        out_shape=jax.ShapeDtypeStruct((row_tiles * _TM, n), x.dtype),
        grid=(group.shape[0], n // tn),
        in_specs=[whole] * 7,
        out_specs=whole,
        input_output_aliases={6: 0},  # rows no group owns stay zero
        interpret=interpret,
        compiler_params=pl_triton.CompilerParams(num_warps=4, num_stages=2),
        name="tunix_rt_grouped_matmul",
    )(group, tile, starts, ends, xp, w, jnp.zeros((row_tiles * _TM, n), x.dtype))
    return y[:m]


def _dw_kernel(starts_ref, ends_ref, a_ref, b_ref, dw_ref):
    """dw[g] tile = a[rows of g]^T @ b[rows of g] (a: (rows, A), b: (rows, B))."""
    from jax.experimental import pallas as pl

    g, ka, kb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    ta, tb = dw_ref.shape
    start, end = starts_ref[g], ends_ref[g]

    def body(c, acc):
        r0 = start + c * _TM
        mine = (r0 + jnp.arange(_TM)) < end
        a = jnp.where(mine[:, None], a_ref[pl.ds(r0, _TM), pl.ds(ka * ta, ta)], 0)
        b = jnp.where(mine[:, None], b_ref[pl.ds(r0, _TM), pl.ds(kb * tb, tb)], 0)
        return acc + _dot(a, b, ((0,), (0,)))

    acc = jax.lax.fori_loop(0, pl.cdiv(end - start, _TM), body, jnp.zeros((ta, tb), jnp.float32))
    dw_ref[...] = acc.astype(dw_ref.dtype)


def _dw(a, b, group_sizes, interpret: bool):
    """(experts, A, B): each group's a^T b over its rows."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pl_triton

    e = group_sizes.shape[0]
    m, ca = a.shape
    cb = b.shape[1]
    ta, tb = _tile(ca, 64), _tile(cb, 64)
    starts, ends = _bounds(group_sizes, m)
    whole = pl.BlockSpec()
    return pl.pallas_call(
        _dw_kernel,
        out_shape=jax.ShapeDtypeStruct((e, ca, cb), a.dtype),
        grid=(e, ca // ta, cb // tb),
        in_specs=[whole] * 4,
        out_specs=pl.BlockSpec((None, ta, tb), lambda g, i, j: (g, i, j)),
        interpret=interpret,
        compiler_params=pl_triton.CompilerParams(num_warps=4, num_stages=2),
        name="tunix_rt_grouped_matmul_dw",
    )(starts, ends, _pad_rows(a, m + _TM), _pad_rows(b, m + _TM))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _grouped(x, w, group_sizes, transpose_w, interpret):
    return _gmm(x, w, group_sizes, transpose_w, interpret)


def _grouped_fwd(x, w, group_sizes, transpose_w, interpret):
    return _gmm(x, w, group_sizes, transpose_w, interpret), (x, w, group_sizes)


def _grouped_bwd(transpose_w, interpret, residuals, dy):
    x, w, group_sizes = residuals
    dy = dy.astype(x.dtype)
    dx = _gmm(dy, w, group_sizes, not transpose_w, interpret)
    dw = _dw(dy, x, group_sizes, interpret) if transpose_w else _dw(x, dy, group_sizes, interpret)
    return dx, dw, np.zeros(group_sizes.shape, jax.dtypes.float0)


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def grouped_matmul_pallas(x, w, group_sizes, *, transpose_w: bool = False, interpret: bool = False):
    """The op's grouped matmul as Pallas kernels, differentiable in x and w; arguments as `grouped_matmul`'s
    (checked there)."""
    return _grouped(x, w, group_sizes, bool(transpose_w), bool(interpret))
