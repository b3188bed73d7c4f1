"""One packed product for the projections that read the same input: each attention's q/k/v, each MLP's gate/up.

The engine's copy of a quantized decoder concatenates those weights once along N (their output columns), and
the projections share that one kernel, each keeping its own column range (QuantLinear.columns). Their products
are then the same op on the same operands, which XLA merges into one call. Each output column is summed on its
own, so the bits are those of the separate products; what goes is the per-call cost: a single-stream decode
step of the default model makes 90 calls fewer (4 per layer instead of 7), each of which handed its columns to
the thread pool and started a weight stream of its own.

The bits are the same where each column's sums are the kernel's own: the CPU FFI routes (the engine's). Elsewhere
(XLA's dot, the CUDA Pallas kernel) the fused product is the same product, to rounding.

The caller's model is left as it is (the trainer reads its separate weights), so the fused weights are a second
copy of q/k/v and gate/up, which are most of a dense layer's weights: 48 MB on the default model (66 MB of
packed layers).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx

from tunix_rt.models.array_reuse import ReuseByIdentity
from tunix_rt.models.decoder import MLP, Attention
from tunix_rt.models.quant_layers import QuantLinear, QuantWeight
from tunix_rt.ops.quant import QuantizedTensor

_GROUPS = {Attention: ("q_proj", "k_proj", "v_proj"), MLP: ("gate_proj", "up_proj")}


def _quantized_base(module: nnx.Module) -> QuantLinear | None:
    """The QuantLinear under a projection's LoRA wrappers (they add their delta to `base`'s output), if any; None
    where anything on the way fake-quantizes (QAT reads the whole kernel: models/qat.py)."""
    while module is not None and getattr(module, "fake_quant", None) is None:
        if isinstance(module, QuantLinear):
            return module
        module = getattr(module, "base", None)
    return None


def _fusable(linears: Sequence[QuantLinear | None]) -> bool:
    """One product can stand for these: quantized alike, over the same input, on the same route."""
    if any(m is None or m.columns is not None for m in linears):
        return False
    first = linears[0]
    w0 = first.kernel.get_value()
    for m in linears[1:]:
        w = m.kernel.get_value()
        if ((w.fmt, w.group, w.shape[0], w.qs.shape[:-2]) != (w0.fmt, w0.group, w0.shape[0], w0.qs.shape[:-2])
                or w.layer is not None or (m.exact, m.int8_rows, m.invariant) != (first.exact, first.int8_rows,
                                                                                   first.invariant)):
            return False
    return w0.layer is None


class FusedWeights:
    """Fuses the projections of a model's engine copy; remembers the fused weights it made by their parts, so a
    weight sync that brings the same packed arrays again (an RL step training adapters or float layers) reuses
    them instead of concatenating again."""

    def __init__(self):
        self._reuse = ReuseByIdentity()

    def apply(self, graphdef: nnx.GraphDef, state: nnx.State) -> nnx.Module:
        """The model `graphdef` and `state` make, as a new module tree whose fusable projection groups share one
        kernel each (the arrays not concatenated are the state's own, not copies; the modules `state` came from
        are left as they are)."""
        copy = nnx.merge(graphdef, state)
        with self._reuse.sweep() as reuse:
            for _, module in nnx.iter_modules(copy):
                names = next((names for kind, names in _GROUPS.items() if type(module) is kind), None)
                if names is None:
                    continue
                linears = [_quantized_base(getattr(module, name)) for name in names]
                if not _fusable(linears):
                    continue
                parts = tuple(m.kernel.get_value() for m in linears)
                arrays = tuple(a for p in parts for a in (p.qs, p.scales, p.mins))
                shared = QuantWeight(reuse(arrays, lambda parts=parts: _concatenate(parts)))
                start = 0
                for m, p in zip(linears, parts):
                    m.kernel = shared
                    m.columns = (start, start + p.shape[1])
                    start += p.shape[1]
        return copy


def _concatenate(parts: Sequence[QuantizedTensor]) -> QuantizedTensor:
    """The weights side by side along N (the axis before the last in qs, scales and mins, stacks included)."""
    def cat(name):  # on the host: no XLA program to compile for each weight's shape
        arrays = [getattr(p, name) for p in parts]
        return None if arrays[0] is None else jax.device_put(np.concatenate([np.asarray(a) for a in arrays], -2))

    first = parts[0]
    return dataclasses.replace(first, qs=cat("qs"), scales=cat("scales"), mins=cat("mins"), lanes=None,
                               shape=(first.shape[0], sum(p.shape[1] for p in parts)))
