"""Quantization-aware training: each weight the export quantizes is seen by the forward pass as quantize ->
dequantize of itself, with a straight-through gradient to the float weight (Tunix leans on qwix for this).

The fake quantization is the pure-JAX reference of our ggml-exact quantizer (bit for bit the FFI op's), so a
weight's forward value is exactly what `export --format gguf --quant FMT` writes and `tunix-rt quantize`
packs: the served model equals what training saw. Covered: every linear layer (a LoRA layer's merged
weight W + s A B, the weight the export merges and quantizes), the embedding table and the output head. A
matrix whose input size is not a multiple of the group stays float, as the export leaves it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from tunix_rt.ops.quant import FORMATS, dequantize_reference, quantize_reference, resolve_format

QAT_FORMATS = tuple(FORMATS)  # q8_0, q4_0, q4_1, int8, int4


@dataclasses.dataclass(frozen=True)
class FakeQuant:
    """quantize -> dequantize of a (..., K, N) weight along K, straight through in the backward pass."""

    fmt: str
    group: int

    def __call__(self, w: jax.Array) -> jax.Array:
        if w.shape[-2] % self.group:
            return w

        def qdq(m):
            return dequantize_reference(quantize_reference(m, self.fmt, self.group), jnp.float32)

        for _ in range(w.ndim - 2):
            qdq = jax.vmap(qdq)
        q = qdq(jax.lax.stop_gradient(w).astype(jnp.float32)).astype(w.dtype)
        return q + (w - jax.lax.stop_gradient(w))  # forward: exactly q; gradient: identity to w

    def rows(self, table: jax.Array) -> jax.Array:
        """The same along the last axis: an embedding table (V, D) is stored as rows of D."""
        return jnp.swapaxes(self(jnp.swapaxes(table, -1, -2)), -1, -2)


def fake_quant(fmt: str, group_size: int | None = None) -> FakeQuant:
    if fmt not in QAT_FORMATS:
        raise ValueError(f"qat must be one of {', '.join(QAT_FORMATS)}, got {fmt!r}")
    _, group = resolve_format(fmt, group_size)
    return FakeQuant(fmt, group)


def enable_qat(model: nnx.Module, fq: FakeQuant) -> int:
    """Give every linear layer (float, packed or LoRA), the embedding and the decoder (its output head) `fq`;
    returns how many modules took it. LoRA must be applied first (a LoRA layer fake-quantizes its merged weight,
    its base then none). A packed layer is seen as its dequantized weight quantized again to `fq`'s format."""
    from tunix_rt.models.decoder import Decoder, Embed, Linear
    from tunix_rt.models.lora import LoRALinear
    from tunix_rt.models.quant_layers import QuantEmbed, QuantLinear

    if getattr(model, "config", None) is not None and any(model.config.moe_layers):
        raise ValueError("qat does not cover MoE expert weights; train a dense model or leave qat unset")
    bases = {id(m.base) for _, m in nnx.iter_modules(model) if isinstance(m, LoRALinear)}
    count = 0
    for _, module in nnx.iter_modules(model):
        if isinstance(module, (Linear, Embed, LoRALinear, QuantLinear, QuantEmbed, Decoder)) and id(module) not in bases:
            module.fake_quant = fq
            count += 1
    return count
