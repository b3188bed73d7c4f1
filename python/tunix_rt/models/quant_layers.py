"""Layers over quantized weights: drop-in replacements for nnx.Linear and nnx.Embed.

The weight lives in a QuantWeight variable, not an nnx.Param, so optimizers and LoRA (which
select Params) leave it frozen; gradients still flow to the activations through quant_matmul.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from tunix_rt.ops.quant import GEMV_ROWS, QuantizedTensor, dequantize, dequantize_reference, quant_matmul, quantize


class QuantWeight(nnx.Variable):
    """A frozen quantized weight (its value is a QuantizedTensor pytree)."""


class QuantLinear(nnx.Module):
    """y = x @ W (+ b) with W a quantized (in, out) weight; up to `int8_rows` rows of x (None: every row)
    take int8 activations, and `invariant` makes exact products row-invariant too (see quant_matmul).
    `columns` (start, stop): W is a weight fused with others, of which this layer is those output columns
    (models/fused_projections.py)."""

    def __init__(self, weight: QuantizedTensor, bias: jax.Array | None = None, *, exact: bool = False,
                 int8_rows: int | None = GEMV_ROWS):
        self.kernel = QuantWeight(weight)
        self.bias = nnx.Param(bias) if bias is not None else None
        self.exact = exact
        self.int8_rows = int8_rows
        self.invariant = False
        self.columns: tuple[int, int] | None = None

    fake_quant = None  # models/qat.py: the weight as an export to another format will quantize it

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.fake_quant is not None:
            y = jnp.matmul(x, self.fake_quant(dequantize_stacked(self.kernel.get_value())).astype(x.dtype))
        else:
            y = quant_matmul(x, self.kernel.get_value(), exact=self.exact, int8_rows=self.int8_rows,
                             invariant=self.invariant)
        if self.columns is not None:
            y = y[..., self.columns[0]:self.columns[1]]
        return y if self.bias is None else y + self.bias[...].astype(y.dtype)


class QuantEmbed(nnx.Module):
    """An embedding table stored quantized as its transpose (hidden, vocab): GGUF's own layout.

    Lookup dequantizes just the gathered columns; `attend` (the tied output head) is an exact
    quant_matmul: int8 activations flip greedy choices of a small model's logits.
    """

    def __init__(self, table_t: QuantizedTensor, dtype):
        self.table_t = QuantWeight(table_t)
        self.dtype = jnp.dtype(dtype)
        self.invariant = False

    fake_quant = None  # models/qat.py

    def __call__(self, tokens: jax.Array) -> jax.Array:
        if self.fake_quant is not None:  # the whole table as the export will quantize it, then the lookup
            return jnp.take(self._fake_quantized_t().T.astype(self.dtype), tokens, axis=0)
        qt = dataclasses.replace(self.table_t.get_value(), lanes=None)  # lanes are whole tiles of columns
        flat = tokens.reshape(-1)
        rows = dataclasses.replace(jax.tree.map(lambda a: a[flat], qt), shape=(qt.shape[0], flat.shape[0]))
        return dequantize_reference(rows, self.dtype).T.reshape(*tokens.shape, qt.shape[0])

    def attend(self, h: jax.Array) -> jax.Array:
        if self.fake_quant is not None:
            return jnp.matmul(h, self._fake_quantized_t().astype(h.dtype))
        return quant_matmul(h, self.table_t.get_value(), exact=True, invariant=self.invariant)

    def _fake_quantized_t(self) -> jax.Array:
        """The (hidden, vocab) table dequantized and quantized again by `fake_quant` (models/qat.py)."""
        return self.fake_quant(dequantize(self.table_t.get_value(), jnp.float32))


def quantize_stacked(w: jax.Array, fmt: str, group_size: int | None = None) -> QuantizedTensor:
    """quantize(w, fmt) of a (K, N) weight or a (layers, K, N) stack of them, each layer quantized alone."""
    if w.ndim == 2:
        return quantize(w, fmt, group_size)
    return jax.tree.map(lambda *a: jnp.stack(a), *[quantize(m, fmt, group_size) for m in w])


def dequantize_stacked(qt: QuantizedTensor, dtype=jnp.float32) -> jax.Array:
    """The (K, N) float weight of a QuantizedTensor (of a stack's layer `layer` when set), or (layers, K, N) for a
    layer stack of them."""
    if qt.qs.ndim == 2 or qt.layer is not None:  # one weight, or one layer of a stack read in place
        return dequantize(qt, dtype)
    return jnp.stack([dequantize(jax.tree.map(lambda a, i=i: a[i], qt), dtype) for i in range(qt.qs.shape[0])])


def set_int8_rows(model: nnx.Module, rows: int | None) -> None:
    """Let every QuantLinear in `model` take int8 activations up to `rows` rows (None: every row; 0: none)."""
    for _, module in nnx.iter_modules(model):
        if isinstance(module, QuantLinear):
            module.int8_rows = rows
