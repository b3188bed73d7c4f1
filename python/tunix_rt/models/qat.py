"""Quantization-aware training: each weight the export quantizes is seen by the forward pass as quantize ->
dequantize of itself, with a straight-through gradient to the float weight (Tunix leans on qwix for this).

The fake quantization is the pure-JAX reference of our ggml-exact quantizer (bit for bit the FFI op's), so a
weight's forward value is exactly what the export stores: the served model equals what training saw. The GGUF
formats (q8_0, q4_0, q4_1) follow `export --format gguf --quant FMT`: every linear layer (a LoRA layer's
merged weight W + s A B, the weight the export merges and quantizes), the embedding table and the output
head. The int formats follow `tunix-rt quantize --format FMT`, which packs the linear layers and an untied
lm_head and keeps the embedding (and a head tied to it) in float. A matrix whose input size is not a
multiple of the group stays float, as both leave it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from tunix_rt.ops.quant import FORMATS, dequantize_reference, quantize_reference, resolve_format

QAT_FORMATS = tuple(FORMATS)  # q8_0, q4_0, q4_1, int8, int4
GGUF_FORMATS = ("q8_0", "q4_0", "q4_1")


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
    """Give every linear layer (float, packed or LoRA) `fq`, and for a GGUF format the embedding and the decoder
    (its output head; for an int format the decoder only when its head is an untied lm_head); returns how many
    modules took it. LoRA must be applied first (a LoRA layer fake-quantizes its merged weight,
    its base then none). A packed layer is seen as its dequantized weight quantized again to `fq`'s format."""
    from tunix_rt.models.decoder import Decoder, Embed, Linear
    from tunix_rt.models.lora import LoRALinear
    from tunix_rt.models.quant_layers import QuantEmbed, QuantLinear

    if getattr(model, "config", None) is not None and any(model.config.moe_layers):
        raise ValueError("qat does not cover MoE expert weights; train a dense model or leave qat unset")
    bases = {id(m.base) for _, m in nnx.iter_modules(model) if isinstance(m, LoRALinear)}
    gguf = fq.fmt in GGUF_FORMATS
    count = 0
    for _, module in nnx.iter_modules(model):
        if id(module) in bases:
            continue
        if isinstance(module, Decoder):  # its output head, read by the training losses
            takes = gguf or not module.config.tie_word_embeddings
        else:
            takes = isinstance(module, (Linear, LoRALinear, QuantLinear)) or (
                gguf and isinstance(module, (Embed, QuantEmbed)))
        if takes:
            module.fake_quant = fq
            count += 1
    return count
