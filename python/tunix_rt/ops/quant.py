"""Weight-only quantized matmul: GGUF q8_0/q4_0/q4_1 blocks and int8/int4 with per-group scales.

`quantize(w, fmt)` takes w of shape (K, N) and quantizes along K in blocks (ggml's row blocks: one
GGUF weight row is one column here). `quant_matmul(x, qt)` ~= x @ dequantize(qt) for x (..., K):
up to `int8_rows` rows (4 by default; None for every row, as the engine runs it) the compiled op
quantizes x to int8 per 32-block and uses integer dot products, as llama.cpp does; more rows
(scoring, training) or exact=True run exact f32 products over dequantized weights. The int8 products
of a row never depend on the other rows of the call; `invariant=True` makes exact ones so too. Its
gradient with respect to x is exact (dy @ dequantize(qt).T) and the weights stay frozen, which is
what QLoRA needs. Each FFI op has a pure-JAX reference with the same signature; quantize and
dequantize references reproduce gguf.quants bit for bit. On CUDA GPUs the matmul of bf16 activations is a
Pallas kernel that reads the packed weight (quant_matmul_pallas), with the same gradient.

A QuantizedTensor with a `layer` is a stack of weights (every array on a leading layer axis) standing for
its layer `layer`: quant_matmul reads that layer in place, where a scanned decoder's slice of the stack
would be a copy of the weight per layer.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from tunix_rt.ops._ffi import platform_dispatch, zero_cotangent
from tunix_rt.ops.matmul import check_layer
from tunix_rt.ops.quant_matmul_pallas import quant_matmul_pallas
from tunix_rt.ops.quant_matmul_pallas import supported as pallas_supported

_QUANTIZE, _DEQUANTIZE, _MATMUL = "tunix_rt_quantize", "tunix_rt_dequantize", "tunix_rt_quant_matmul"
SUB_BLOCK = 32  # nibble packing and activation blocks
GEMV_ROWS = 4  # rows that quantize x to int8 by default (single-stream decode)
INT8, EXACT, EXACT_ROW_INVARIANT = 0, 1, 2  # the compiled op's routes (csrc/quant_kernels.h's Route)


@dataclasses.dataclass(frozen=True)
class QuantFormat:
    """One row of the format table (the C++ side keeps the same rows, indexed by `id`)."""

    name: str
    id: int
    bits: int
    scale_dtype: jnp.dtype
    has_min: bool  # value = d * q + m (q4_1)
    offset8: bool  # nibble holds q + 8 (q4_0, int4)
    groups: tuple[int, ...]  # allowed group sizes; the first is the default
    ggml_type: str | None  # gguf.GGMLQuantizationType name, for GGUF formats


FORMATS: dict[str, QuantFormat] = {
    f.name: f
    for f in (
        QuantFormat("q8_0", 0, 8, jnp.dtype(jnp.float16), False, False, (32,), "Q8_0"),
        QuantFormat("q4_0", 1, 4, jnp.dtype(jnp.float16), False, True, (32,), "Q4_0"),
        QuantFormat("q4_1", 2, 4, jnp.dtype(jnp.float16), True, False, (32,), "Q4_1"),
        QuantFormat("int8", 3, 8, jnp.dtype(jnp.float32), False, False, (32, 64, 128), None),
        QuantFormat("int4", 4, 4, jnp.dtype(jnp.float32), False, True, (32, 64, 128), None),
    )
}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedTensor:
    """A quantized (K, N) weight: per output column n, K runs in blocks of `group`.

    qs: (N, K) int8 for 8-bit formats, (N, K/2) uint8 for 4-bit (byte j of each 32-block holds
    element j low and j+16 high); scales: (N, K/group); mins: (N, K/group) for q4_1, else None.
    N leads every array, so sharding over output features splits all three alike.

    lanes (optional, `with_lane_scales`): the same scales (and mins) laid out for the SIMD GEMVs, 16 columns
    side by side per group (AVX-512 VNNI reads a tile, AVX2 half of one); a copy the engine makes once per
    weight so decode does not gather them on every call. Products are the same with or without it.

    layer (optional, an integer scalar): the arrays are a stack of S such weights on one more leading axis,
    and the tensor stands for the weight at `layer` (`shape` is still one layer's); quant_matmul reads that
    layer in place, so a scan over layers copies no weight.
    """

    qs: jax.Array
    scales: jax.Array
    mins: jax.Array | None
    fmt: str = dataclasses.field(metadata=dict(static=True))
    shape: tuple[int, int] = dataclasses.field(metadata=dict(static=True))  # logical (K, N)
    group: int = dataclasses.field(metadata=dict(static=True))
    lanes: jax.Array | None = None
    layer: jax.Array | None = None

    @property
    def format(self) -> QuantFormat:
        return FORMATS[self.fmt]

    @property
    def nbytes(self) -> int:
        """The weight arrays' bytes (a stack's, all layers)."""
        arrays = (self.qs, self.scales, self.mins, self.lanes)
        return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in arrays if a is not None)


def resolve_format(fmt: str, group_size: int | None = None) -> tuple[QuantFormat, int]:
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {sorted(FORMATS)}, got {fmt!r}")
    f = FORMATS[fmt]
    group = f.groups[0] if group_size is None else group_size
    if group not in f.groups:
        raise ValueError(f"group_size for {fmt} must be one of {f.groups}, got {group_size!r}")
    return f, group


def _buffers(f: QuantFormat, k: int, n: int, group: int):
    qs = jax.ShapeDtypeStruct((n, k * f.bits // 8), jnp.int8 if f.bits == 8 else jnp.uint8)
    scales = jax.ShapeDtypeStruct((n, k // group), f.scale_dtype)
    mins = jax.ShapeDtypeStruct((n, k // group if f.has_min else 0), jnp.float16)
    return qs, scales, mins


def _check_weight(w, f: QuantFormat, group: int) -> None:
    if not hasattr(w, "shape") or not hasattr(w, "dtype"):
        raise ValueError(f"quantize: w must be an array, got {type(w).__name__}")
    if w.ndim != 2:
        raise ValueError(f"quantize: w must have shape (K, N), got {w.shape}")
    if jnp.dtype(w.dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"quantize: w must be float32 or bfloat16, got {jnp.dtype(w.dtype)}")
    if w.shape[0] % group:
        raise ValueError(f"quantize: w's K dimension ({w.shape[0]}) must be a multiple of the {f.name} block size {group}")
    if not isinstance(w, jax.core.Tracer) and not bool(jnp.isfinite(w).all()):
        raise ValueError("quantize: w holds non-finite values (inf or NaN)")


# --- quantize -----------------------------------------------------------------------------------


def _round_half_away(v):
    """C's roundf (ggml's rounding), exact: floor(|v|) + floor(2 * frac), with v's sign."""
    a = jnp.abs(v)
    fl = jnp.floor(a)
    return jnp.sign(v) * (fl + jnp.floor(2 * (a - fl)))


def _pack_nibbles(q):
    """(N, K) codes 0..15 -> (N, K/2) bytes, ggml's order within each 32-block."""
    n, k = q.shape
    q = q.astype(jnp.uint8).reshape(n, k // SUB_BLOCK, 2, SUB_BLOCK // 2)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, k // 2)


def _no_fma(x):
    """Keep XLA's simplifier from fusing x into the next add (ggml rounds after every operation);
    codegen may still contract, which is why quantize_reference avoids adds after products."""
    return jax.lax.optimization_barrier(x)


@functools.cache
def _code_thresholds(c: float, top: int) -> tuple[float, ...]:
    """For n = 1..top, the least f32 t with float32(t + c) >= n (one f32 rounding, as C adds)."""
    c32, out = np.float32(c), []
    for n in range(1, top + 1):
        t = np.float32(n) - c32  # exact: small integers and halves
        while np.float32(np.nextafter(t, np.float32(-np.inf)) + c32) >= n:
            t = np.nextafter(t, np.float32(-np.inf))
        out.append(float(t))
    return tuple(out)


def _trunc_add_codes(t, c: float):
    """clip(trunc(float32(t + c)), 0, 15) for f32 t, ggml's 4-bit codes, without the add: XLA's
    CPU backend contracts a multiply feeding an add into an FMA (optimization barriers are gone by
    code generation), which skips the product's rounding and moves codes at .5 points. Comparisons
    of t against precomputed thresholds are exact whatever t's producer fuses with."""
    codes = jnp.zeros(t.shape, jnp.uint8)
    for threshold in _code_thresholds(c, 15):
        codes = codes + (t >= jnp.float32(threshold)).astype(jnp.uint8)
    return codes


def _div_const(a, c: float):
    """a / c rounded once, as C divides. XLA's simplifier rewrites division by a constant or a
    broadcast scalar into multiplication by its rounded reciprocal (an ulp off for 127 and 15);
    a full-shape divisor behind a barrier keeps the true division."""
    return a / jax.lax.optimization_barrier(jnp.full(a.shape, c, jnp.float32))


def quantize_reference(w: jax.Array, fmt: str, group_size: int | None = None) -> QuantizedTensor:
    f, group = resolve_format(fmt, group_size)
    _check_weight(w, f, group)
    k, n = w.shape
    blocks = w.astype(jnp.float32).T.reshape(n, k // group, group)
    if f.bits == 8:
        d = _div_const(jnp.max(jnp.abs(blocks), axis=-1, keepdims=True), 127)
        inv = jnp.where(d == 0, 0.0, 1.0 / jnp.where(d == 0, 1.0, d))
        qs = _round_half_away(blocks * inv).astype(jnp.int8).reshape(n, k)
        mins = None
    elif not f.has_min:
        imax = jnp.argmax(jnp.abs(blocks), axis=-1)[..., None]
        d = _div_const(jnp.take_along_axis(blocks, imax, axis=-1), -8)
        inv = jnp.where(d == 0, 0.0, 1.0 / jnp.where(d == 0, 1.0, d))
        codes = _trunc_add_codes(blocks * inv, 8.5)
        qs = _pack_nibbles(codes.reshape(n, k))
        mins = None
    else:
        # ggml keeps the first of equal extremes, which only shows for -0.0 vs 0.0; arg{max,min}
        # pick the first index, where XLA's max/min reductions pick either sign of zero.
        hi = jnp.take_along_axis(blocks, jnp.argmax(blocks, axis=-1)[..., None], axis=-1)
        lo = jnp.take_along_axis(blocks, jnp.argmin(blocks, axis=-1)[..., None], axis=-1)
        d = _div_const(hi - lo, 15)
        inv = jnp.where(d == 0, 0.0, 1.0 / jnp.where(d == 0, 1.0, d))
        codes = _trunc_add_codes((blocks - lo) * inv, 0.5)
        qs = _pack_nibbles(codes.reshape(n, k))
        mins = lo[..., 0].astype(jnp.float16)
    return QuantizedTensor(qs, d[..., 0].astype(f.scale_dtype), mins, f.name, (k, n), group)


def quantize(w: jax.Array, fmt: str, group_size: int | None = None) -> QuantizedTensor:
    """Quantize w (K, N), f32 or bf16, to `fmt` (q8_0, q4_0, q4_1, int8, int4) along K."""
    f, group = resolve_format(fmt, group_size)
    _check_weight(w, f, group)
    k, n = w.shape

    def compiled(w):
        call = jax.ffi.ffi_call(_QUANTIZE, _buffers(f, k, n, group))
        qs, scales, mins = call(w.T, fmt=np.int32(f.id), group=np.int64(group))
        return qs, scales, mins if f.has_min else None

    def reference(w):
        qt = quantize_reference(w, fmt, group_size)
        return qt.qs, qt.scales, qt.mins

    qs, scales, mins = platform_dispatch(_QUANTIZE, compiled, reference, w)
    return QuantizedTensor(qs, scales, mins, f.name, (k, n), group)


# --- dequantize ---------------------------------------------------------------------------------


def _mins_buffer(qs, mins):
    """The FFI handlers take a mins buffer for every format: ([S,] N, 0) where there are none."""
    return mins if mins is not None else jnp.zeros((*qs.shape[:-1], 0), jnp.float16)


def check_quantized(qt) -> QuantFormat:
    """Validate a QuantizedTensor's arrays against its format and shape (a stack's: each on one leading axis
    of qs's length, whether or not a `layer` picks one of them); returns the format."""
    if not isinstance(qt, QuantizedTensor):
        raise ValueError(f"qt must be a QuantizedTensor, got {type(qt).__name__}")
    f, group = resolve_format(qt.fmt, qt.group)
    k, n = qt.shape
    if k % group:
        raise ValueError(f"qt.shape's K ({k}) must be a multiple of the {qt.fmt} block size {group}")
    stack = tuple(qt.qs.shape[:1]) if getattr(qt.qs, "ndim", 2) == 3 else ()  # a stored layer stack
    if qt.layer is not None:
        check_layer("quant", "qt.layer", qt.layer)
        if not stack:
            raise ValueError(f"qt.layer is set but qt.qs {list(qt.qs.shape)} holds no stack of layers")
    want = _buffers(f, k, n, group)
    if (qt.mins is not None) != f.has_min:
        raise ValueError(f"qt.mins must be {'an array' if f.has_min else 'None'} for {qt.fmt}")
    want = (*want, _lanes_spec(f, k, n, group))
    for name, arr, spec in zip(("qs", "scales", "mins", "lanes"), (qt.qs, qt.scales, qt.mins, qt.lanes), want):
        if arr is None:
            continue
        shape = (*stack, *spec.shape)
        if tuple(arr.shape) != shape or jnp.dtype(arr.dtype) != jnp.dtype(spec.dtype):
            where = f" in a stack of {stack[0]}" if stack else ""
            raise ValueError(f"qt.{name} must be {spec.dtype}{list(shape)} for {qt.fmt} {qt.shape}{where}, "
                             f"got {jnp.dtype(arr.dtype)}{list(arr.shape)}")
    return f


def _layer_of(qt: QuantizedTensor) -> QuantizedTensor:
    """The weight a stacked qt stands for, sliced out of the stack (a copy under jit)."""
    def pick(a):
        return None if a is None else jax.lax.dynamic_index_in_dim(a, qt.layer, 0, keepdims=False)

    return dataclasses.replace(qt, qs=pick(qt.qs), scales=pick(qt.scales), mins=pick(qt.mins), lanes=pick(qt.lanes),
                               layer=None)


LANE_COLUMNS = 16  # columns per tile of the column-lane scales (csrc/quant_formats.h: kLaneColumns)


def _lanes_spec(f: QuantFormat, k: int, n: int, group: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((-(-n // LANE_COLUMNS), k // group, LANE_COLUMNS * (2 if f.has_min else 1)),
                                f.scale_dtype)


def lane_scales(qt: QuantizedTensor) -> jax.Array:
    """qt's scales (then mins) per tile of 16 columns, the tile's columns side by side per group: the
    layout the SIMD GEMVs read (columns past N are zeros); a stack's for each of its layers."""
    f = check_quantized(qt)
    parts = [qt.scales] + ([qt.mins] if f.has_min else [])
    *stack, n, groups = qt.scales.shape
    pad = [(0, 0)] * len(stack) + [(0, -n % LANE_COLUMNS), (0, 0)]
    # Weights at hand are laid out on the host: no XLA program to compile for each weight's shape.
    host = not any(isinstance(p, jax.core.Tracer) for p in parts)
    xp = np if host else jnp
    tiles = [xp.swapaxes(xp.pad(xp.asarray(p), pad).reshape(*stack, -1, LANE_COLUMNS, groups), -1, -2) for p in parts]
    out = xp.concatenate(tiles, axis=-1).astype(f.scale_dtype)
    return jax.device_put(out) if host else out


def with_lane_scales(qt: QuantizedTensor) -> QuantizedTensor:
    """qt carrying its column-lane scales (`lane_scales`): the GEMV reads them instead of transposing
    each tile's scales on every call (12 % of single-stream decode's profile on the default model)."""
    return dataclasses.replace(qt, lanes=lane_scales(dataclasses.replace(qt, lanes=None)))


def _unpack_codes(qt: QuantizedTensor) -> jax.Array:
    """(N, K) integer codes: signed for 8-bit formats, 0..15 for 4-bit ones."""
    n = qt.shape[1]
    if qt.format.bits == 8:
        return qt.qs.astype(jnp.int32)
    b = qt.qs.reshape(n, -1, SUB_BLOCK // 2)
    codes = jnp.stack([b & 0x0F, b >> 4], axis=2)  # (N, blocks, 2, 16)
    return codes.reshape(n, -1).astype(jnp.int32)


def dequantize_reference(qt: QuantizedTensor, dtype=jnp.float32) -> jax.Array:
    f = check_quantized(qt)
    _check_one_weight("dequantize", qt)
    if qt.layer is not None:
        qt = _layer_of(qt)
    k, n = qt.shape
    codes = _unpack_codes(qt).reshape(n, k // qt.group, qt.group)
    d = qt.scales.astype(jnp.float32)[..., None]
    if f.has_min:
        values = _no_fma(d * codes.astype(jnp.float32)) + qt.mins.astype(jnp.float32)[..., None]
    else:
        values = d * (codes - 8 if f.offset8 else codes).astype(jnp.float32)
    return values.reshape(n, k).T.astype(dtype)


def dequantize(qt: QuantizedTensor, dtype=jnp.float32) -> jax.Array:
    """The (K, N) weight a QuantizedTensor stands for (a stack's layer `layer`), in f32 (or bf16)."""
    f = check_quantized(qt)
    _check_one_weight("dequantize", qt)
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"dequantize: dtype must be float32 or bfloat16, got {jnp.dtype(dtype)}")
    if qt.layer is not None:
        qt = _layer_of(qt)
    k, n = qt.shape

    def compiled(qs, scales, mins):
        call = jax.ffi.ffi_call(_DEQUANTIZE, jax.ShapeDtypeStruct((n, k), dtype))
        return call(qs, scales, _mins_buffer(qs, mins), fmt=np.int32(f.id), group=np.int64(qt.group)).T

    def reference(qs, scales, mins):
        return dequantize_reference(dataclasses.replace(qt, qs=qs, scales=scales, mins=mins), dtype)

    return platform_dispatch(_DEQUANTIZE, compiled, reference, qt.qs, qt.scales, qt.mins)


# --- matmul -------------------------------------------------------------------------------------


def _check_one_weight(op: str, qt: QuantizedTensor) -> None:
    """A stack of layers multiplies or dequantizes as one weight only through its `layer`."""
    if qt.qs.ndim == 3 and qt.layer is None:
        raise ValueError(f"{op}: qt is a stack of {qt.qs.shape[0]} layers' weights: set qt.layer to pick one")


def _check_matmul(x, qt) -> QuantFormat:
    f = check_quantized(qt)
    _check_one_weight("quant_matmul", qt)
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise ValueError(f"quant_matmul: x must be an array, got {type(x).__name__}")
    if jnp.dtype(x.dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"quant_matmul: x must be float32 or bfloat16, got {jnp.dtype(x.dtype)}")
    if x.ndim < 1 or x.shape[-1] != qt.shape[0]:
        raise ValueError(f"quant_matmul: x's last dimension must be K={qt.shape[0]}, got shape {x.shape}")
    return f


def _check_int8_rows(int8_rows) -> None:
    if int8_rows is not None and (isinstance(int8_rows, bool) or not isinstance(int8_rows, int) or int8_rows < 0):
        raise ValueError(f"quant_matmul: int8_rows must be a non-negative int or None (every row), got {int8_rows!r}")


def _route(rows: int, exact: bool, int8_rows: int | None, invariant: bool) -> int:
    if invariant and not exact and int8_rows is not None:
        raise ValueError("quant_matmul: invariant=True needs exact=True or int8_rows=None: a row limit makes the "
                         "products depend on how many rows a call holds")
    if not exact and (int8_rows is None or rows <= int8_rows):
        return INT8
    return EXACT_ROW_INVARIANT if invariant else EXACT


def quant_matmul_reference(x: jax.Array, qt: QuantizedTensor, *, exact: bool = False,
                           int8_rows: int | None = GEMV_ROWS, invariant: bool = False) -> jax.Array:
    """x @ dequantize(qt) in f32, cast to x's dtype (`exact`, `int8_rows` and `invariant` are accepted
    for a matching signature)."""
    _check_matmul(x, qt)
    _check_int8_rows(int8_rows)
    _route(1, bool(exact), int8_rows, bool(invariant))
    w = dequantize_reference(qt)
    return jnp.matmul(x.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST).astype(x.dtype)


def _ffi_matmul(x2, qs, scales, mins, lanes, layer, fmt, k, n, group, route):
    f = FORMATS[fmt]
    call = jax.ffi.ffi_call(_MATMUL, jax.ShapeDtypeStruct((x2.shape[0], n), x2.dtype), vmap_method="sequential")
    no_lanes = jnp.zeros((0, 0, 0), f.scale_dtype)  # the handler takes a lanes buffer always: empty for none
    return call(x2, qs, scales, _mins_buffer(qs, mins), no_lanes if lanes is None else lanes,
                np.int32(0) if layer is None else layer, fmt=np.int32(f.id), group=np.int64(group),
                route=np.int32(route))


def _with_dequantized_vjp(forward):
    """`forward` (the FFI op or the Pallas kernel, neither differentiable) with x's gradient through the
    dequantized weight; the weight's arrays get none (quantized weights are frozen)."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10))
    def matmul(x2, qs, scales, mins, lanes, layer, fmt, k, n, group, route):
        return forward(x2, qs, scales, mins, lanes, layer, fmt, k, n, group, route)

    def fwd(x2, qs, scales, mins, lanes, layer, fmt, k, n, group, route):
        residuals = (qs, scales, mins, lanes, layer)
        return forward(x2, qs, scales, mins, lanes, layer, fmt, k, n, group, route), residuals

    def bwd(fmt, k, n, group, route, residuals, dy):
        qs, scales, mins, lanes, layer = residuals
        w = dequantize(QuantizedTensor(qs, scales, mins, fmt, (k, n), group, layer=layer))
        dx = jnp.matmul(dy.astype(jnp.float32), w.T, precision=jax.lax.Precision.HIGHEST).astype(dy.dtype)
        return dx, *map(zero_cotangent, residuals)

    matmul.defvjp(fwd, bwd)
    return matmul


_matmul = _with_dequantized_vjp(_ffi_matmul)


@functools.cache
def _pallas_matmul(interpret: bool):
    def forward(x2, qs, scales, mins, lanes, layer, fmt, k, n, group, route):
        del lanes, route  # the CPU GEMV's scale layout and int8 route: the kernel multiplies in x's precision
        return quant_matmul_pallas(x2, qs, scales, mins, layer, fmt=fmt, k=k, n=n, group=group, interpret=interpret)

    return _with_dequantized_vjp(forward)


def quant_matmul(x: jax.Array, qt: QuantizedTensor, *, exact: bool = False, int8_rows: int | None = GEMV_ROWS,
                 invariant: bool = False) -> jax.Array:
    """x (..., K) f32/bf16 times the quantized (K, N) weight -> (..., N) in x's dtype.

    Up to `int8_rows` rows (4 by default; None: every row) the compiled op quantizes x to int8 per
    32-block (llama.cpp's scheme, ~0.5% relative error; AVX-512 VNNI integer dots where the CPU has
    them); more rows, or `exact=True`, compute x @ dequantize(qt) in f32 over dequantized panels.
    Each row's int8 products are the same whatever rows share the call (one summation order for the
    GEMV and the GEMM kernels). `invariant=True` asks the same of the exact products (one column-dot
    order per row, slower past 4 rows than the panels) and refuses a finite int8_rows, under which
    the route would depend on the row count. The engine runs int8_rows=None, and its output heads
    exact=True with invariant=True (int8 activations would flip a small model's argmax); training
    and scoring keep the fastest exact products. A stacked qt (`layer` set) multiplies by its layer
    `layer`, read in place; a layer outside the stack is an error when the op runs.

    On CUDA GPUs (and under TUNIX_RT_KERNELS=interpret) bf16 x multiplies through the Pallas kernel in bf16
    whatever `exact`, `int8_rows` and `invariant` say (its sums follow the call's row count, as XLA's dots do
    there), where N is a multiple of 16; elsewhere the reference runs.
    """
    _check_matmul(x, qt)
    _check_int8_rows(int8_rows)
    k, n = qt.shape
    lead = x.shape[:-1]
    x2 = x.reshape(math.prod(lead), k)
    route = _route(x2.shape[0], bool(exact), int8_rows, bool(invariant))
    layer = None if qt.layer is None else jnp.asarray(qt.layer, jnp.int32)

    def compiled(x2, qs, scales, mins, lanes, layer):
        return _matmul(x2, qs, scales, mins, lanes, layer, qt.fmt, k, n, qt.group, route)

    def reference(x2, qs, scales, mins, lanes, layer):
        return quant_matmul_reference(x2, dataclasses.replace(qt, qs=qs, scales=scales, mins=mins, lanes=None,
                                                              layer=layer))

    pallas = None
    if pallas_supported(n, x.dtype):
        def pallas(*args, interpret):
            return _pallas_matmul(interpret)(*args, qt.fmt, k, n, qt.group, route)

    y = platform_dispatch(_MATMUL, compiled, reference, x2, qt.qs, qt.scales, qt.mins, qt.lanes, layer, cuda=pallas)
    return y.reshape(*lead, n)
