"""Custom XLA FFI ops, each beside its pure-JAX reference (same signature)."""

from tunix_rt.ops.attention import attention, attention_reference
from tunix_rt.ops.moe import (
    grouped_matmul,
    grouped_matmul_reference,
    load_balancing_loss,
    permute,
    permute_reference,
    router_topk,
    router_topk_reference,
    router_z_loss,
    unpermute,
    unpermute_reference,
)
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
    "attention",
    "attention_reference",
    "dequantize",
    "dequantize_reference",
    "grouped_matmul",
    "grouped_matmul_reference",
    "load_balancing_loss",
    "paged_attention",
    "paged_attention_reference",
    "permute",
    "permute_reference",
    "quant_matmul",
    "quant_matmul_reference",
    "quantize",
    "quantize_reference",
    "rms_norm",
    "rms_norm_reference",
    "router_topk",
    "router_topk_reference",
    "router_z_loss",
    "unpermute",
    "unpermute_reference",
    "write_kv",
    "write_kv_reference",
]
