"""Custom XLA FFI ops, each beside its pure-JAX reference (same signature)."""

from tunix_rt.ops.paged_attention import paged_attention, paged_attention_reference, write_kv, write_kv_reference
from tunix_rt.ops.quant import (
    FORMATS,
    QuantizedTensor,
    dequantize,
    dequantize_reference,
    quant_matmul,
    quant_matmul_reference,
    quantize,
    quantize_reference,
)
from tunix_rt.ops.rms_norm import rms_norm, rms_norm_reference

__all__ = [
    "FORMATS",
    "QuantizedTensor",
    "dequantize",
    "dequantize_reference",
    "paged_attention",
    "paged_attention_reference",
    "quant_matmul",
    "quant_matmul_reference",
    "quantize",
    "quantize_reference",
    "rms_norm",
    "rms_norm_reference",
    "write_kv",
    "write_kv_reference",
]
