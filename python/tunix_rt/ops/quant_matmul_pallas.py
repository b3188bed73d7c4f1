"""The quantized matmul as a Pallas kernel: the path `quant_matmul` takes on CUDA GPUs (Triton lowering), and
on any platform in interpret mode (`TUNIX_RT_KERNELS=interpret`), where the tests check it.

The weight stays packed in memory: each program loads a tile of codes with its scales (and mins), unpacks
and scales it in registers and multiplies it into its output tile, so no float copy of the weight is ever
made (the reference path dequantizes the whole weight before XLA's dot). Every format of the op's table runs
(q8_0, q4_0, q4_1, int8, int4 with groups of 32, 64 or 128), and a stack of layers is read at its `layer` in
place, as the CPU op reads it.

Layout. A 4-bit weight's byte j of each 32-block holds element j in its low nibble and j + 16 in its high
one, so the wrapper splits x's columns the same way (each block's first and second halves) and the kernel
takes two dots, low nibbles against the first halves and high nibbles against the second: no interleave
in the kernel. Grid: (row tiles, column tiles, K splits). A decode step has one row tile and few column
tiles, too few programs to keep a GPU's streaming multiprocessors busy, so K is split as well and XLA adds
the splits' partial sums afterwards (so a row's summation order depends on the rows beside it, as XLA's
dot's does on a GPU). A device kernel cannot raise: a layer index outside the stack is taken as jax's dynamic
index takes it in the reference (a negative one counts from the end, then it is clamped into the stack; the
CPU op raises).

Precision: bf16 x multiplies bf16 tiles into f32 accumulators, as XLA's bf16 dot does; f32 x multiplies in
IEEE f32 (no TF32). Triton needs tiles of at least 16 along each dot dimension and power-of-two shapes; rows
are padded to the row tile.

Where it runs (`supported`): bf16 x and N a multiple of 16. On one H200 (jax 0.11.2) the kernel multiplied
bf16 x by a q4_1 or q8_0 (2048, 8192) weight in 0.11-0.43 ms at 1, 16 and 512 rows, 1.3-2.2x faster than
the reference (dequantize, then XLA's dot); but an f32 engine (the default dtype) with it decoded a
Llama-1B-shaped q4_1 model 9x and prefilled 14x slower than with the reference (f32 IEEE dots in Triton,
and K tiles of 256 in f32 registers, are the suspects), so f32 x keeps the reference there until a
device check measures an f32 variant faster.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# Pallas is imported where the kernel is traced, not with this module (as paged_attention_pallas does).

TARGET_PROGRAMS = 256  # programs a launch aims for (H100 and H200 have 132 multiprocessors)
MAX_K_TILE = 256
MAX_ROW_TILE = 64


def supported(n: int, dtype) -> bool:
    """Whether `quant_matmul` runs the kernel on CUDA for x of `dtype` times a weight with N output columns
    (K is a multiple of the weight's group already): bf16 x only, see the module's note."""
    return n % 16 == 0 and jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16)


def _pow2_divisor(value: int, cap: int) -> int:
    """The largest power of two that divides `value`, at most `cap`."""
    return min(value & -value, cap)


def tiles(m: int, k: int, n: int) -> tuple[int, int, int, int]:
    """(row tile, column tile, K tile, K splits) for an (m, k) x (k, n) product."""
    bm = min(MAX_ROW_TILE, max(16, 1 << (m - 1).bit_length()))
    bn = _pow2_divisor(n, 64)
    bk = _pow2_divisor(k, MAX_K_TILE)
    programs = -(-m // bm) * (n // bn)
    k_tiles = k // bk
    splits = max((s for s in range(1, k_tiles + 1) if k_tiles % s == 0 and s * programs <= TARGET_PROGRAMS),
                 default=1)
    return bm, bn, bk, splits


def _dequantize(codes, scales, mins, *, offset8: bool, group_width: int):
    """codes (bn, width) f32 in groups of `group_width` columns; scales, mins (bn, width // group_width)."""
    bn, width = codes.shape
    codes = codes.reshape(bn, width // group_width, group_width)
    if offset8:
        codes = codes - 8.0
    values = codes * scales[:, :, None]
    if mins is not None:
        values = values + mins[:, :, None]
    return values.reshape(bn, width)


def _kernel(layer_ref, *refs, bits, offset8, has_min, group, bm, bn, bk, k_tiles, precision):
    from jax.experimental import pallas as pl

    if bits == 4:
        x_lo_ref, x_hi_ref, qs_ref, scales_ref, *rest = refs
    else:
        x_ref, qs_ref, scales_ref, *rest = refs
    mins_ref, o_ref = rest if has_min else (None, *rest)
    i, j, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    stack = qs_ref.shape[0]
    layer = layer_ref[0]
    layer = jnp.clip(jnp.where(layer < 0, layer + stack, layer), 0, stack - 1)  # as jax's dynamic index
    rows, cols = pl.ds(i * bm, bm), pl.ds(j * bn, bn)

    def dot(x, w):
        if x.dtype != jnp.float32:
            w = w.astype(x.dtype)
        return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), precision=precision,
                                   preferred_element_type=jnp.float32)

    def body(t, acc):
        k0 = (split * k_tiles + t) * bk
        groups = pl.ds(k0 // group, bk // group)
        scales = scales_ref[layer, cols, groups].astype(jnp.float32)
        mins = mins_ref[layer, cols, groups].astype(jnp.float32) if has_min else None
        if bits == 8:
            codes = qs_ref[layer, cols, pl.ds(k0, bk)].astype(jnp.float32)
            w = _dequantize(codes, scales, mins, offset8=offset8, group_width=group)
            return acc + dot(x_ref[rows, pl.ds(k0, bk)], w)
        half = pl.ds(k0 // 2, bk // 2)
        packed = qs_ref[layer, cols, half].astype(jnp.int32)
        parts = ((x_lo_ref, packed & 0x0F), (x_hi_ref, packed >> 4))
        for x_half_ref, codes in parts:
            w = _dequantize(codes.astype(jnp.float32), scales, mins, offset8=offset8, group_width=group // 2)
            acc = acc + dot(x_half_ref[rows, half], w)
        return acc

    acc = jax.lax.fori_loop(0, k_tiles, body, jnp.zeros((bm, bn), jnp.float32))
    o_ref[...] = acc


@functools.partial(jax.jit, static_argnames=("fmt", "k", "n", "group", "interpret"))
def quant_matmul_pallas(x2, qs, scales, mins, layer, *, fmt: str, k: int, n: int, group: int,
                        interpret: bool = False):
    """x2 (M, K) f32/bf16 times the packed (K, N) weight -> (M, N) in x2's dtype; the arguments are the
    QuantizedTensor's arrays (one weight, or a stack with `layer` an int32 scalar), checked by `quant_matmul`."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pl_triton

    from tunix_rt.ops.quant import FORMATS, SUB_BLOCK

    f = FORMATS[fmt]
    m = x2.shape[0]
    if m == 0:
        return jnp.zeros((0, n), x2.dtype)
    bm, bn, bk, splits = tiles(m, k, n)
    padded_m = -(-m // bm) * bm
    x = jnp.pad(x2, ((0, padded_m - m), (0, 0))) if padded_m != m else x2
    if f.bits == 4:  # each 32-block's first and second halves, as the nibbles hold them
        halves = x.reshape(padded_m, k // SUB_BLOCK, 2, SUB_BLOCK // 2)
        xs = [halves[:, :, 0].reshape(padded_m, k // 2), halves[:, :, 1].reshape(padded_m, k // 2)]
    else:
        xs = [x]
    stacked = [a if a.ndim == 3 else a[None] for a in (qs, scales) + ((mins,) if f.has_min else ())]
    layer = jnp.zeros((1,), jnp.int32) if layer is None else jnp.reshape(layer, (1,)).astype(jnp.int32)
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else jax.lax.Precision.DEFAULT
    kernel = functools.partial(_kernel, bits=f.bits, offset8=f.offset8, has_min=f.has_min, group=group, bm=bm,
                               bn=bn, bk=bk, k_tiles=k // bk // splits, precision=precision)
    whole = pl.BlockSpec()  # no blocking: the kernel indexes the whole array
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((splits, padded_m, n), jnp.float32),
        grid=(padded_m // bm, n // bn, splits),
        in_specs=[whole] * (1 + len(xs) + len(stacked)),
        out_specs=pl.BlockSpec((None, bm, bn), lambda i, j, s: (s, i, j)),
        interpret=interpret,
        compiler_params=pl_triton.CompilerParams(num_warps=4, num_stages=2),  # Triton, not Mosaic GPU
        name="tunix_rt_quant_matmul",
    )(layer, *xs, *stacked)
    return out.sum(axis=0)[:m].astype(x2.dtype)
