"""Batch-invariant kernels: a row's numbers never depend on the rows computed beside it.

The engine runs a request's tokens packed with other requests' tokens, prefill chunks beside decodes, and a
prompt cut into chunks by the other requests' use of the token budget. For a request to get the same
tokens and log-probs however it was batched (and for RL to sample exactly the policy it trains), every
product on the path must sum each row in one fixed order: `use_batch_invariant_kernels` switches a model
to such kernels, in place (the engine does it to the copy it merges inside each traced program):
- float linear layers and tied embedding heads: ops/matmul.py's FFI GEMM instead of XLA's dot;
- quantized linear layers: int8 activations on every row (the GEMV and the int8 GEMM share one order,
  so the route a row count picks no longer matters; prefill moves onto the integer path too);
- quantized output heads: exact products in one column-dot order per row;
- LoRA adapters (anything with an `invariant` switch): their products through the same GEMM.
RMSNorm, paged attention, MoE routing and grouped matmuls, RoPE and the elementwise ops are row-wise
already; the sampler draws each row from its own seed.
"""

from __future__ import annotations

import jax
from flax import nnx

from tunix_rt.models.quant_layers import QuantLinear
from tunix_rt.ops import _ffi
from tunix_rt.ops.matmul import invariant_dot_general


def unavailable_reason() -> str | None:
    """Why this process cannot run the row-invariant kernels (None when it can). They are the CPU FFI ops:
    elsewhere XLA's dots pick their reduction order by shape, so a row's sums depend on its batch."""
    if jax.default_backend() != "cpu":
        return (f"the default backend is {jax.default_backend()}, where XLA's dots pick their reduction order by "
                "shape; the row-invariant kernels are CPU ops")
    if _ffi.kernel_mode() != "native":
        return f"TUNIX_RT_KERNELS={_ffi.kernel_mode()} takes XLA's dots, not the row-invariant CPU kernels"
    if not _ffi.cpu_targets():
        return "the compiled extension (tunix_rt._ext) is not built, so XLA's dots run instead of its kernels"
    return None


def use_batch_invariant_kernels(model: nnx.Module) -> nnx.Module:
    """Switch every product of `model` to its row-invariant kernel, in place; returns the model."""
    for _, module in nnx.iter_modules(model):
        if isinstance(module, QuantLinear):
            module.int8_rows = None
        if hasattr(module, "invariant"):  # QuantLinear, QuantEmbed, LoRALinear
            module.invariant = True
        if hasattr(module, "dot_general"):
            module.dot_general = invariant_dot_general
    return model
