"""The decoder's layers stored stacked and run as scanned bodies, so a program's trace, lowering and compile
cost does not grow with depth (MaxText's scan_layers).

Layers are grouped by kind (whatever changes a layer's program: attention type, a MoE or dense MLP): each
kind is ONE module whose weights carry a leading axis over that kind's layers, in order. The forward walks
a plan of segments, each a group of `period` consecutive layers repeated `repeats` times (Gemma 3: five
sliding-window layers and a global one, four times, then two more sliding ones), and scans each segment
over its repeats: one traced body per segment, whatever the depth.

Reading a layer out of a stack in a scan is a copy on XLA:CPU (a dynamic slice feeding a kernel is
materialised), which a weight-bound decode step cannot afford. So a stack runs one of two ways:
- sliced (the default): the scan's xs are the stacks, so the weights are differentiable as usual
  (the gradient of a stack is stacked by the scan, never accumulated whole);
- in place (`read_in_place`, the engine: never differentiated): every weight stays one stacked buffer,
  the body gets views (`LayerView`, a QuantizedTensor with its `layer` set) that the kernels index
  directly; what has no indexing kernel reads its slice, which only small tensors do.

A bf16 stack that is never differentiated (a LoRA base: `constant_params`) goes into the scan as its uint16
bits (`as_bits`; the trainer holds them so where its layers cannot cast their own f32 weights, under
nnx.remat) and each layer's slice is read back as bf16: XLA:CPU has no bf16
dynamic slice, and converted every such stack to f32 at each step to slice it there. With the named values
kept as bits too (models/remat.py saved_value), the default model's bf16 LoRA reward step went 1.08 -> 0.73 s
(benchmarks/reward.py's rows, without checkpointing, XLA's bf16 dot, 2 threads, AVX-512 BF16).

What a scanned layer keeps for its backward is stacked too: each value is written into a zeroed buffer over
the layers and sliced out again, three passes over memory that an unrolled layer does not make. So when
differentiated a scanned layer keeps only the values its model names in `saved` (jax.checkpoint's
save_only_these_names: the products and the attention kernel's results) and recomputes the cheap rest
(norms, activations, LoRA's rank-r products): the default model's f32 LoRA step on short chats went 1.74 ->
1.60 s (benchmarks/train_real.py; 1.58 s before the layers were scanned), its peak RSS 2.35 -> 1.97 GB. A
layer function that recomputes itself (gradient checkpointing: `recomputes`) gets no policy from the scan,
which would keep each layer's input a second time (a bf16 one through those whole-stack converts).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from tunix_rt.ops.quant import QuantizedTensor


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerView:
    """Entry `index` of `stack` (the layer axis leads), read in place by the kernels that take a stack and
    an index; anything else reads it through `[...]`, which slices (a copy)."""

    stack: jax.Array
    index: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.stack.shape[1:]

    @property
    def dtype(self):
        return self.stack.dtype

    def read(self) -> jax.Array:
        return jax.lax.dynamic_index_in_dim(self.stack, self.index, keepdims=False)

    def __getitem__(self, key):
        return self.read()[key]


@dataclasses.dataclass(frozen=True)
class Segment:
    """Layers [start, start + period * repeats): the group of `period` layers repeated `repeats` times."""

    start: int
    period: int
    repeats: int


def plan_segments(kinds: Sequence[Hashable]) -> tuple[Segment, ...]:
    """Cover the layers with repeating groups, greedily: at each layer the repeated group that covers the most
    layers (the shortest such group on ties), else the layer alone. Uniform models are one segment of period 1."""
    out, i, n = [], 0, len(kinds)
    while i < n:
        best = (1, 1)
        for p in range(1, (n - i) // 2 + 1):
            r = 1
            while i + (r + 1) * p <= n and kinds[i + r * p:i + (r + 1) * p] == kinds[i:i + p]:
                r += 1
            if r > 1 and p * r > best[0] * best[1]:
                best = (p, r)
        out.append(Segment(i, *best))
        i += best[0] * best[1]
    return tuple(out)


def layer_places(kinds: Sequence[Hashable]) -> tuple[tuple[int, int], ...]:
    """(kind number, entry in that kind's stack) of every layer: kinds numbered by first appearance, a kind's
    layers in order. The one rule LayerStack stores by and checkpoints address layers by."""
    names = list(dict.fromkeys(kinds))
    counts = [0] * len(names)
    out = []
    for kind in kinds:
        k = names.index(kind)
        out.append((k, counts[k]))
        counts[k] += 1
    return tuple(out)


def _stacked(path, value) -> bool:
    """The variables a stack holds one entry per layer of: weights (not RNG state or sown values)."""
    return isinstance(value, nnx.Variable) and not isinstance(value, (nnx.RngState, nnx.Intermediate))


def _make_stack(make: Callable[[int, nnx.Rngs], nnx.Module], layer: int, count: int, rngs: nnx.Rngs) -> nnx.Module:
    """`count` layers like layer `layer`, made as one module with stacked weights (each layer its own random
    draw): the layer's constructor is traced once, not once per layer."""

    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def stacked(rngs):
        return make(layer, rngs)

    return stacked(rngs)


def _view(state, index) -> Any:
    """The stacked weights' views of entry `index` (in-place reading)."""

    def one(var):
        value = var.get_value()
        if isinstance(value, QuantizedTensor):
            return var.replace(dataclasses.replace(value, layer=jnp.asarray(index, jnp.int32)))
        return var.replace(LayerView(value, jnp.asarray(index, jnp.int32)))

    return jax.tree.map(one, state, is_leaf=lambda v: isinstance(v, nnx.Variable))


def as_bits(state) -> Any:
    """bf16 arrays as their uint16 bits; others as they are. XLA:CPU copies a whole array to bitcast it, so a
    caller that runs the stack many times (the trainer) hands it constant stacks as bits made once."""
    return jax.tree.map(lambda a: jax.lax.bitcast_convert_type(a, jnp.uint16) if a.dtype == jnp.bfloat16 else a, state)


def _from_bits(state) -> Any:
    """A constant stack's uint16 arrays (`as_bits`) back as bf16: no model has uint16 weights of its own."""
    return jax.tree.map(lambda a: jax.lax.bitcast_convert_type(a, jnp.bfloat16) if a.dtype == jnp.uint16 else a, state)


def _slice(state, first: int, count: int, step: int) -> Any:
    """Entries first, first + step, ... (count of them) of every stacked weight, stacked: a scan's xs."""
    return jax.tree.map(lambda a: a[first:first + (count - 1) * step + 1:step], state)


class LayerStack(nnx.Module):
    """The layers of a decoder, `kinds[i]` naming layer i's kind, each kind's layers made by `make(layer index,
    rngs)` as one stacked module (the layers of a kind have one structure; the first one's index is given).

    `kinds` (the stacked modules, one per kind), `kind_of[i]` and `index_in_kind[i]` say where layer i
    lives: checkpoints and adapters address a layer through `locate`."""

    def __init__(self, make: Callable[[int, nnx.Rngs], nnx.Module], kinds: Sequence[Hashable], *, rngs: nnx.Rngs,
                 saved: Sequence[str] = ()):
        if not kinds:
            raise ValueError("a layer stack needs at least one layer")
        places = layer_places(kinds)
        self.kind_of = tuple(k for k, _ in places)
        self.index_in_kind = tuple(i for _, i in places)
        self.kinds = nnx.List([_make_stack(make, self.kind_of.index(kind), self.kind_of.count(kind), rngs)
                               for kind in range(max(self.kind_of) + 1)])
        self.segments = plan_segments(self.kind_of)
        self.saved = tuple(saved)  # checkpoint names of what a scanned layer keeps for its backward
        self.read_in_place = False
        self.constant_params = False  # the stacked nnx.Params but LoRA's are never differentiated (a LoRA base)

    def __len__(self) -> int:
        return len(self.kind_of)

    def locate(self, layer: int) -> tuple[nnx.Module, int]:
        """The stacked module holding layer `layer` and the layer's entry in its stacks."""
        if not 0 <= layer < len(self.kind_of):
            raise IndexError(f"layer {layer} of {len(self.kind_of)}")
        return self.kinds[self.kind_of[layer]], self.index_in_kind[layer]

    def unstacked(self, layer: int) -> nnx.Module:
        """A copy of layer `layer` as a module of its own (weights sliced out of the stacks): for inspection."""
        module, entry = self.locate(layer)
        graphdef, weights, other = nnx.split(module, _stacked, ...)
        return nnx.merge(graphdef, jax.tree.map(lambda a: a[entry], weights), other)

    def __call__(self, carry, layer_fn: Callable[[nnx.Module, Any, Any], Any], *, recomputes: bool = False):
        """Run every layer in order: carry = layer_fn(layer module, carry, layer index), where the layer index
        (a traced int32 inside a scanned segment) is the layer's place in the decoder. `recomputes`: layer_fn
        keeps what its backward needs itself (gradient checkpointing), so the scan adds no policy of its own
        (which would keep each layer's input a second time)."""
        constant = (nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))
                    if self.constant_params and not self.read_in_place else nnx.Nothing)
        split = [nnx.split(m, nnx.All(_stacked, constant), _stacked, nnx.Intermediate, nnx.RngState, ...)
                 for m in self.kinds]
        graphdefs, constants, stacks, sown_before, rngs, rest = (list(parts) for parts in zip(*split))
        stacks = [(as_bits(c), s) for c, s in zip(constants, stacks)]
        rngs = tuple(rngs)  # dropout's counters: carried from layer to layer and written back
        for seg in self.segments:
            carry, rngs = self._segment(seg, carry, rngs, graphdefs, stacks, sown_before, rest, layer_fn, recomputes)
        for module, rng in zip(self.kinds, rngs):
            if jax.tree.leaves(rng):
                nnx.update(module, rng)
        return carry

    def _segment(self, seg: Segment, carry, rngs, graphdefs, stacks, sown_before, rest, layer_fn, recomputes):
        """`stacks[k]`: kind k's (constant stacks as `as_bits`, the differentiable ones)."""
        kinds = [self.kind_of[seg.start + j] for j in range(seg.period)]
        first = [self.index_in_kind[seg.start + j] for j in range(seg.period)]
        step = [kinds.count(k) for k in kinds]  # entries of a kind a repeat of the group takes

        def group(state, g, xs):
            carry, rngs = state
            rngs = list(rngs)
            sown = []
            for j, k in enumerate(kinds):
                bits, weights = _view(stacks[k], first[j] + g * step[j]) if self.read_in_place else xs[j]
                # fresh containers to sow into: nnx.capture's are dicts the outer modules share
                module = nnx.merge(graphdefs[k], _from_bits(bits), weights,
                                   jax.tree.map(lambda v: v, sown_before[k]), rngs[k], rest[k])
                carry = layer_fn(module, carry, seg.start + g * seg.period + j)
                _, _, layer_sown, rngs[k], _ = nnx.split(module, _stacked, nnx.Intermediate, nnx.RngState, ...)
                sown.append(layer_sown)
            return (carry, tuple(rngs)), sown

        if seg.repeats == 1:
            xs = None if self.read_in_place else [jax.tree.map(lambda a, i=i: a[i], stacks[k]) for k, i in zip(kinds, first)]
            (carry, rngs), sown = group((carry, rngs), 0, xs)
            self._sow(sown, stacked=False)
            return carry, rngs
        xs = None if self.read_in_place else [_slice(stacks[k], i, seg.repeats, s) for k, i, s in zip(kinds, first, step)]
        if self.saved and not self.read_in_place and not recomputes:
            group = jax.checkpoint(group, policy=jax.checkpoint_policies.save_only_these_names(*self.saved))
        (carry, rngs), sown = jax.lax.scan(lambda state, x: group(state, x[0], x[1]), (carry, rngs),
                                           (jnp.arange(seg.repeats, dtype=jnp.int32), xs))
        self._sow(sown, stacked=True)
        return carry, rngs

    def _sow(self, sown, *, stacked: bool) -> None:
        """Values the layers sowed (MoE router logits), sown again here one per layer call, for nnx.capture to
        collect (a layer module made inside the scan is not in the model's graph)."""
        for state in sown:
            for path, var in nnx.to_flat_state(state):
                value = var.get_value()
                named = value.items() if isinstance(value, dict) else [(path[-1], value)]  # nnx.capture's, or an attribute
                for name, values in named:
                    for leaf in jax.tree.leaves(values):
                        for one in (list(leaf) if stacked else [leaf]):
                            self.sow(nnx.Intermediate, str(name), one)
