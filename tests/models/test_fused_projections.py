"""The engine's fused projections (models/fused_projections.py): q/k/v and gate/up as one packed product each,
with the bits of the separate products on every route, and the caller's model left as it was."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tunix_rt.models.batch_invariant import use_batch_invariant_kernels
from tunix_rt.models.config import FULL, ModelConfig, RopeConfig
from tunix_rt.models.decoder import Decoder
from tunix_rt.models.fused_projections import FusedWeights
from tunix_rt.models.lora import apply_lora
from tunix_rt.models.quant_layers import QuantLinear, quantize_stacked
from tunix_rt.ops.quant import quant_matmul, quantize

_ATTENTION, _MLP = ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj")


def _model(fmts: dict[str, str] | str = "q4_1", qkv_bias: bool = False) -> Decoder:
    """A tiny llama with its projections quantized (`fmts`: one format, or one per projection name); k and v have
    8 columns each, so in the fused weight v starts inside a 16-column tile of the GEMVs' scales."""
    cfg = ModelConfig(architecture="llama", vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2,
                      num_heads=4, num_kv_heads=1, head_dim=8, rope=((FULL, RopeConfig(theta=10000.0)),),
                      qkv_bias=qkv_bias)
    model = Decoder(cfg, rngs=nnx.Rngs(3))
    for layer in model.layers.kinds:
        for parent, names in ((layer.attn, _ATTENTION), (layer.mlp, _MLP)):
            for name in names:
                fmt = fmts if isinstance(fmts, str) else fmts.get(name, "q4_1")
                old = getattr(parent, name)
                bias = None if old.bias is None else old.bias[...] + 0.1
                setattr(parent, name, QuantLinear(quantize_stacked(old.kernel[...] * 5, fmt), bias))
    return model


def _hidden(model: Decoder, tokens: np.ndarray, invariant: bool) -> jax.Array:
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state, tokens):
        m = nnx.merge(graphdef, state)
        if invariant:
            m = use_batch_invariant_kernels(m)
        m.layers.read_in_place = invariant  # the engine reads the stacks in place
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        return m.hidden_states(tokens, positions, None)[0]

    return run(state, jnp.asarray(tokens))


def _quant_calls(model: Decoder, tokens: np.ndarray) -> int:
    graphdef, state = nnx.split(model)

    def run(state, tokens):
        m = use_batch_invariant_kernels(nnx.merge(graphdef, state))
        m.layers.read_in_place = True
        return m.hidden_states(tokens, jnp.arange(tokens.shape[1])[None], None)[0]

    text = jax.jit(run).lower(state, jnp.asarray(tokens)).compile().as_text()
    return text.count('custom_call_target="tunix_rt_quant_matmul"')


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0"])
@pytest.mark.parametrize("rows", [1, 3, 9])  # the int8 GEMV (up to 4 rows) and the int8 GEMM past them
@pytest.mark.parametrize("invariant", [False, True])  # the model's own routes, and the engine's
def test_fused_projections_give_the_separate_products_bits(fmt, rows, invariant):
    model = _model(fmt, qkv_bias=True)
    fused = FusedWeights().apply(*nnx.split(model))
    tokens = np.random.default_rng(rows).integers(0, 97, (1, rows))
    np.testing.assert_array_equal(np.asarray(_hidden(fused, tokens, invariant)),
                                  np.asarray(_hidden(model, tokens, invariant)))


def test_fusion_merges_the_products_and_leaves_the_model_alone():
    model = _model()
    before = jax.tree.leaves(nnx.state(model))
    fused = FusedWeights().apply(*nnx.split(model))
    layer = fused.layers.kinds[0]
    q, k, v = (getattr(layer.attn, n) for n in _ATTENTION[:3])
    assert q.kernel is k.kernel is v.kernel and q.kernel.get_value().shape == (64, 32 + 8 + 8)
    assert (q.columns, k.columns, v.columns) == ((0, 32), (32, 40), (40, 48))
    assert layer.mlp.gate_proj.kernel is layer.mlp.up_proj.kernel and layer.mlp.up_proj.columns == (96, 192)
    assert layer.attn.o_proj.columns is None and layer.mlp.down_proj.columns is None
    # the caller's model: its own modules and arrays, unfused
    assert all(a is b for a, b in zip(jax.tree.leaves(nnx.state(model)), before))
    assert model.layers.kinds[0].attn.q_proj.columns is None
    # one call for q/k/v and one for gate/up in the layers' scanned body: 4 instead of 7
    tokens = np.arange(5)[None]
    assert (_quant_calls(model, tokens), _quant_calls(fused, tokens)) == (7, 4)


def test_fused_weights_are_reused_for_the_same_packed_arrays():
    model = _model()
    fusion = FusedWeights()
    first = nnx.state(fusion.apply(*nnx.split(model)))
    again = nnx.state(fusion.apply(*nnx.split(model)))  # a weight sync bringing the same arrays
    assert all(a is b for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again)))
    other = nnx.merge(*nnx.split(model))
    for layer in other.layers.kinds:  # new packed up projections: only the gate/up fusion is made again
        layer.mlp.up_proj = QuantLinear(quantize_stacked(jax.random.normal(jax.random.key(5), (2, 64, 96)), "q4_1"))
    changed = nnx.state(fusion.apply(*nnx.split(other)))
    same = [a is b for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(changed))]
    assert sum(not s for s in same) == 3  # the fused gate/up's qs, scales and mins
    tokens = np.arange(7)[None]
    np.testing.assert_array_equal(np.asarray(_hidden(fusion.apply(*nnx.split(other)), tokens, True)),
                                  np.asarray(_hidden(other, tokens, True)))


def test_lora_wrapped_projections_fuse_their_bases():
    model = _model()
    apply_lora(model, rank=2, alpha=4.0)
    for _, module in nnx.iter_modules(model):  # adapters that change the output
        if hasattr(module, "lora_b"):
            module.lora_b.set_value(jax.random.normal(jax.random.key(1), module.lora_b.get_value().shape) * 0.1)
    fused = FusedWeights().apply(*nnx.split(model))
    attn = fused.layers.kinds[0].attn
    assert attn.q_proj.base.kernel is attn.v_proj.base.kernel
    tokens = np.random.default_rng(0).integers(0, 97, (1, 6))
    for invariant in (False, True):
        np.testing.assert_array_equal(np.asarray(_hidden(fused, tokens, invariant)),
                                      np.asarray(_hidden(model, tokens, invariant)))


def test_fake_quantized_projections_stay_separate():
    """QAT's fake quantization (set on the LoRA wrapper) reads its base's whole kernel: that group is not fused."""
    model = _model()
    apply_lora(model, rank=2, alpha=4.0)
    model.layers.kinds[0].attn.k_proj.fake_quant = lambda w: w
    layer = FusedWeights().apply(*nnx.split(model)).layers.kinds[0]
    assert all(getattr(layer.attn, n).base.columns is None for n in _ATTENTION)
    assert layer.mlp.up_proj.base.columns == (96, 192)


def test_projections_that_differ_stay_separate():
    # k in another format than q and v: that group stays as it is; gate/up still fuse
    model = _model({"k_proj": "q8_0"})
    layer = FusedWeights().apply(*nnx.split(model)).layers.kinds[0]
    assert all(getattr(layer.attn, n).columns is None for n in _ATTENTION)
    assert layer.mlp.gate_proj.columns == (0, 96)
    # a float model has nothing to fuse
    plain = Decoder(model.config, rngs=nnx.Rngs(0))
    assert jax.tree.structure(nnx.state(FusedWeights().apply(*nnx.split(plain)))) == jax.tree.structure(nnx.state(plain))


def test_a_column_range_reads_its_columns_of_the_fused_product():
    w = jax.random.normal(jax.random.key(0), (64, 40))
    x = jax.random.normal(jax.random.key(1), (3, 64))
    layer = QuantLinear(quantize(w, "q4_0"))
    layer.columns = (8, 24)
    np.testing.assert_array_equal(np.asarray(layer(x)),
                                  np.asarray(quant_matmul(x, quantize(w, "q4_0")))[:, 8:24])
