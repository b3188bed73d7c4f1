"""LoRA adapters on the decoder's linear layers, float or quantized (QLoRA), and merging them back.

The adapters are nnx.LoRAParam variables, so `nnx.LoRAParam` selects exactly what LoRA trains;
the base weights (nnx.Param or a frozen QuantWeight) are never touched. A base that is a
QuantLinear trains through quant_matmul's custom_vjp: that is QLoRA.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from tunix_rt.models.decoder import MLP, Decoder, Linear
from tunix_rt.models.quant_layers import QuantLinear, dequantize_stacked
from tunix_rt.ops.bf16_matmul import lora_matmul
from tunix_rt.ops.matmul import matmul
from tunix_rt.ops.quant import QuantizedTensor

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
ALL_TARGETS = ATTENTION_TARGETS + MLP_TARGETS


def dense_kernel(base: nnx.Module) -> jax.Array:
    """The (..., in, out) float kernel of an nnx.Linear or a QuantLinear (dequantized), layer-stacked or not."""
    if isinstance(base, QuantLinear):
        return dequantize_stacked(base.kernel.get_value())
    return base.kernel[...]


def stack_shape(base: nnx.Module) -> tuple[int, ...]:
    """The leading (layer-stack) axes of a linear layer's kernel: () for one layer's."""
    value = base.kernel.get_value()
    return tuple((value.qs if isinstance(value, QuantizedTensor) else value).shape[:-2])


def _dot(a: jax.Array, b: jax.Array, contract_a: int, contract_b: int) -> jax.Array:
    dims = (((contract_a,), (contract_b,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32).astype(a.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, scaling: float) -> jax.Array:
    """(x @ a) @ b * scaling for x (M, K), a (K, r), b (r, N).

    The backward is written out so that every product contracts the thin rank axis or reads the big
    operands (x, dy) in their own layout: under plain autodiff XLA chose to transpose each (tokens, N)
    output gradient, fused with the activation's derivative, costing more than the adapter's products
    (a third of a LoRA step on the default model)."""
    return _dot(_dot(x, a, 1, 0), b, 1, 0) * scaling


def _lora_delta_fwd(x, a, b, scaling):
    u = _dot(x, a, 1, 0)
    return _dot(u, b, 1, 0) * scaling, (x, u, a, b)


def _lora_delta_bwd(scaling, res, dy):
    x, u, a, b = res
    dyb = _dot(dy, b, 1, 1) * scaling  # (M, r)
    dx = _dot(dyb, a, 1, 1)  # (M, K)
    da = _dot(dyb, x, 0, 0).T  # (r, K) -> (K, r)
    db = _dot(u, dy, 0, 0) * scaling  # (r, N)
    return dx, da.astype(a.dtype), db.astype(b.dtype)


lora_delta.defvjp(_lora_delta_fwd, _lora_delta_bwd)


class LoRALinear(nnx.Module):
    """base(x) + dropout(x) @ A @ B * alpha / rank, with A (in, r) and B (r, out) zero at the start; over a
    layer-stacked base, A and B are stacked alike (one adapter per layer)."""

    def __init__(self, base: nnx.Module, *, rank: int, alpha: float, dropout: float, rngs: nnx.Rngs):
        din, dout = base.kernel.get_value().shape[-2:]  # a float array or a QuantizedTensor, both (..., in, out)
        lead = stack_shape(base)
        self.base = base
        bound = 1.0 / math.sqrt(din)  # kaiming-uniform with a = sqrt(5), as peft initialises A
        self.lora_a = nnx.LoRAParam(jax.random.uniform(rngs.params(), (*lead, din, rank), jnp.float32, -bound, bound))
        self.lora_b = nnx.LoRAParam(jnp.zeros((*lead, rank, dout), jnp.float32))
        self.scaling = alpha / rank
        self.dropout = nnx.Dropout(dropout, rngs=rngs) if dropout > 0 else None
        self.invariant = False  # the engine's row-invariant products (models/batch_invariant.py)

    fake_quant = None  # models/qat.py

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.fake_quant is not None:
            return self._fake_quantized(x)
        kernel = self._fused_kernel(x)
        if kernel is not None:
            base = self.base
            y = lora_matmul(x, base.kernel[...].astype(x.dtype), self.lora_a[...].astype(x.dtype),
                            self.lora_b[...].astype(x.dtype), scaling=self.scaling, kernel=kernel)
            return y if base.bias is None else y + base.bias[...].astype(y.dtype)
        y = self.base(x)
        h = x if self.dropout is None else self.dropout(x)
        flat = h.reshape(-1, h.shape[-1])
        a, b = self.lora_a[...].astype(h.dtype), self.lora_b[...].astype(h.dtype)
        if self.invariant:  # the scaled delta behind a barrier: no FMA with the add, whatever the fusion
            delta = jax.lax.optimization_barrier(matmul(matmul(flat, a), b) * self.scaling)
        else:
            delta = lora_delta(flat, a, b, self.scaling)
        return y + delta.reshape(*h.shape[:-1], -1).astype(y.dtype)

    def _fused_kernel(self, x: jax.Array) -> str | None:
        """The bf16 kernel the base's product runs on (ops/bf16_matmul.py) where the adapter can ride in its sums
        (lora_matmul): a float base computing in bf16 (with a bf16 result) on one layer's kernel, no dropout,
        neither QAT nor the engine's row-invariant path. None elsewhere: the adapter's delta is added to the
        base's output."""
        base = self.base
        kernel = getattr(getattr(base, "dot_general", None), "bf16_kernel", None)
        if (kernel is None or self.dropout is not None or self.invariant or not isinstance(base, nnx.Linear)
                or getattr(base, "fake_quant", None) is not None or base.preferred_element_type is not None
                or x.dtype != jnp.bfloat16 or base.dtype != jnp.bfloat16):
            return None
        w = base.kernel.get_value()
        return kernel if isinstance(w, jax.Array) and w.ndim == 2 else None

    def _fake_quantized(self, x: jax.Array) -> jax.Array:
        """x @ fake_quant(W + s A B) (+ b): the merged weight as the export quantizes it (models/qat.py); dropout
        still reaches only the adapter's path, through the difference it makes to x."""
        y = jnp.matmul(x, self.fake_quant(self.merged_kernel()).astype(x.dtype))
        if self.dropout is not None:
            flat = (self.dropout(x) - x).reshape(-1, x.shape[-1])
            delta = lora_delta(flat, self.lora_a[...].astype(x.dtype), self.lora_b[...].astype(x.dtype), self.scaling)
            y = y + delta.reshape(*x.shape[:-1], -1).astype(y.dtype)
        bias = getattr(self.base, "bias", None)
        return y if bias is None else y + bias[...].astype(y.dtype)

    def merged_kernel(self) -> jax.Array:
        """W + s A B in f32, (..., in, out): what merging writes and QAT quantizes (one expression for both)."""
        return dense_kernel(self.base).astype(jnp.float32) + self.scaling * (self.lora_a[...] @ self.lora_b[...])

    def merged(self) -> nnx.Linear:
        """A plain float Linear computing the same function (dropout off), stacked as the base is."""
        kernel = self.merged_kernel()
        din, dout = kernel.shape[-2:]
        bias = getattr(self.base, "bias", None)
        dtype = kernel.dtype
        linear = Linear(din, dout, use_bias=bias is not None, dtype=dtype, param_dtype=dtype,
                            kernel_init=nnx.initializers.zeros, rngs=nnx.Rngs(0))
        linear.kernel.set_value(kernel)
        if bias is not None:
            linear.bias.set_value(bias[...].astype(dtype))
        return linear


def lora_targets(model: Decoder, names: tuple[str, ...]):
    """(owner module, attribute) for every targeted projection of the layers, each a stack of that projection
    over the layers of one kind (models/layer_stack.py). A MoE layer's routed experts (stacked weights, no
    Linear) take no adapter; its shared expert, if any, does."""
    for layer in model.layers.kinds:
        mlp = layer.mlp if isinstance(layer.mlp, MLP) else getattr(layer.mlp, "shared_expert", None)
        for name in names:
            if name in ATTENTION_TARGETS:
                yield layer.attn, name
            elif mlp is not None:
                yield mlp, name


def apply_lora(model: Decoder, *, rank: int, alpha: float, dropout: float = 0.0,
               targets: tuple[str, ...] = ALL_TARGETS, seed: int = 0) -> Decoder:
    """Wrap the targeted projections of `model` in LoRALinear, in place; returns the model."""
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"lora_rank must be a positive integer, got {rank!r}")
    if not alpha > 0:
        raise ValueError(f"lora_alpha must be positive, got {alpha!r}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"lora_dropout must be in [0, 1), got {dropout!r}")
    unknown = [t for t in targets if t not in ALL_TARGETS]
    if unknown or not targets:
        raise ValueError(f"lora_targets {list(targets)!r}: valid names are {', '.join(ALL_TARGETS)}")
    rngs = nnx.Rngs(params=seed, dropout=seed + 1)
    for owner, name in lora_targets(model, tuple(targets)):
        base = getattr(owner, name)
        if isinstance(base, LoRALinear):
            raise ValueError(f"{name} already has a LoRA adapter")
        setattr(owner, name, LoRALinear(base, rank=rank, alpha=alpha, dropout=dropout, rngs=rngs))
    return model


def has_lora(model: nnx.Module) -> bool:
    return any(isinstance(m, LoRALinear) for _, m in nnx.iter_modules(model))


def merge_lora(model: Decoder) -> Decoder:
    """A copy of `model` with every adapter folded into a float kernel (what an HF export holds)."""
    merged = nnx.clone(model)
    for owner, name in lora_targets(merged, ALL_TARGETS):
        module = getattr(owner, name)
        if isinstance(module, LoRALinear):
            setattr(owner, name, module.merged())
    return merged
