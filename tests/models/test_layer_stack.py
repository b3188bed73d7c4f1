"""The decoder's layers stored stacked per kind and run as scanned segments (models/layer_stack.py): the plan
covers every layer once, in order; the scanned forward is the layer-by-layer one; reading the stacks in place
(the engine) gives the same bits as slicing them; dropout and sown values come out per layer; and the engine's
compiled step copies neither a layer's weights nor the KV pools."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given
from hypothesis import strategies as st

from tunix_rt.models.batch_invariant import use_batch_invariant_kernels
from tunix_rt.models.config import FULL, SLIDING, ModelConfig, RopeConfig
from tunix_rt.models.decoder import Decoder, MoEMLP, record_router_logits
from tunix_rt.models.layer_stack import layer_places, plan_segments
from tunix_rt.models.lora import LoRALinear, apply_lora
from tunix_rt.models.quant_layers import QuantLinear, quantize_stacked

ROPE = (FULL, RopeConfig(theta=10000.0)), (SLIDING, RopeConfig(theta=10000.0))


def _config(**kw) -> ModelConfig:
    base = dict(architecture="gemma3_text", vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=8,
                num_heads=4, num_kv_heads=2, head_dim=8, rope=ROPE, sliding_window=4, sandwich_norms=True,
                layer_types=tuple(SLIDING if (i + 1) % 3 else FULL for i in range(8)))  # (S S F) x 2 + S S
    return ModelConfig(**{**base, **kw})


def _unrolled_hidden(model: Decoder, tokens, positions):
    """The decoder's hidden states computed one unstacked layer at a time, in Python."""
    x = model.embed(tokens)
    if model.config.embed_scale is not None:
        x = x * jnp.asarray(model.config.embed_scale, model.dtype)
    for i in range(len(model.layers)):
        x, _ = model.layers.unstacked(i)(x, positions, None, None, i)
    return model.final_norm(x)


@given(st.lists(st.sampled_from("abc"), min_size=1, max_size=40))
def test_plan_covers_every_layer_once_with_repeating_groups(kinds):
    segments = plan_segments(kinds)
    at = 0
    for seg in segments:
        assert seg.start == at and seg.period >= 1 and seg.repeats >= 1
        group = kinds[seg.start:seg.start + seg.period]
        for r in range(seg.repeats):
            assert kinds[seg.start + r * seg.period:seg.start + (r + 1) * seg.period] == group
        at += seg.period * seg.repeats
    assert at == len(kinds)


@given(st.lists(st.sampled_from("ab"), min_size=1, max_size=6), st.integers(2, 12), st.integers(0, 5))
def test_depth_adds_no_segments(pattern, repeats, extra):
    """A group repeated any number of times, then part of it, takes as many segments as two repeats do: the
    traced bodies do not grow with depth."""
    tail = pattern[:extra % len(pattern)]
    count = len(plan_segments(pattern * repeats + tail))
    assert count == len(plan_segments(pattern * 2 + tail)) <= 1 + len(pattern)


def test_places_number_each_kinds_layers_in_order():
    assert layer_places("aabab") == ((0, 0), (0, 1), (1, 0), (0, 2), (1, 1))


def test_gemma3_pattern_is_two_kinds_and_two_segments():
    model = Decoder(_config(), rngs=nnx.Rngs(0))
    assert len(model.layers.kinds) == 2
    assert [(s.start, s.period, s.repeats) for s in model.layers.segments] == [(0, 3, 2), (6, 1, 2)]
    assert model.layers.kinds[0].attn.q_proj.kernel.shape == (6, 32, 32)  # the 6 sliding layers, stacked


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_scanned_forward_is_the_layer_by_layer_forward(dtype):
    model = Decoder(_config(), dtype=dtype, rngs=nnx.Rngs(1))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 61, (2, 11)))
    positions = jnp.broadcast_to(jnp.arange(11), (2, 11))
    scanned, _ = jax.jit(lambda m, t, p: m.hidden_states(t, p))(model, tokens, positions)
    unrolled = jax.jit(_unrolled_hidden)(model, tokens, positions)
    np.testing.assert_allclose(np.asarray(scanned, np.float32), np.asarray(unrolled, np.float32),
                               rtol=1e-5 if dtype == jnp.float32 else 2e-2, atol=1e-5 if dtype == jnp.float32 else 2e-2)


@pytest.mark.parametrize("weights", ["f32", "q4_1"])
def test_reading_in_place_gives_the_sliced_bits(weights):
    """The engine's mode (every kernel indexes the stacks) against the sliced mode, row-invariant kernels both."""
    model = Decoder(_config(architecture="llama", sandwich_norms=False, layer_types=(FULL,) * 8, intermediate_size=64),
                    rngs=nnx.Rngs(2))
    if weights != "f32":
        for layer in model.layers.kinds:
            for parent, names in ((layer.attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                                  (layer.mlp, ("gate_proj", "up_proj", "down_proj"))):
                for name in names:
                    setattr(parent, name, QuantLinear(quantize_stacked(getattr(parent, name).kernel[...], weights)))
    use_batch_invariant_kernels(model)
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 61, (1, 9)))
    positions = jnp.arange(9)[None]

    def run(model, in_place):
        model.layers.read_in_place = in_place
        return model.hidden_states(tokens, positions)[0]

    sliced = jax.jit(lambda m: run(m, False))(model)
    in_place = jax.jit(lambda m: run(m, True))(model)
    np.testing.assert_array_equal(np.asarray(in_place), np.asarray(sliced))


def test_dropout_draws_a_new_mask_for_every_layer():
    """LoRA dropout's RNG counter is carried through the scan: each of a stack's layers draws its own mask, and
    the stacked module's counter advances by its layers."""
    model = apply_lora(Decoder(_config(), rngs=nnx.Rngs(3)), rank=2, alpha=4.0, dropout=0.5, targets=("q_proj",))
    for kind in model.layers.kinds:  # a nonzero B, so dropout's mask shows in the output
        kind.attn.q_proj.lora_b.set_value(jnp.full(kind.attn.q_proj.lora_b.shape, 0.5))
    model.train()
    counts = lambda: [int(k.attn.q_proj.dropout.rngs.count[...]) for k in model.layers.kinds]
    before = counts()
    tokens, positions = jnp.zeros((1, 5), jnp.int32), jnp.arange(5)[None]
    first = model.hidden_states(tokens, positions)[0]
    assert [a - b for a, b in zip(counts(), before)] == [6, 2]
    second = model.hidden_states(tokens, positions)[0]
    assert not np.array_equal(np.asarray(first), np.asarray(second))


def test_sown_router_logits_come_out_one_per_moe_layer():
    cfg = _config(architecture="qwen2_moe", sandwich_norms=False, layer_types=(FULL,) * 5, num_layers=5,
                  num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                  moe_layers=(False, True, False, True, True))
    model = Decoder(cfg, rngs=nnx.Rngs(4))
    assert sum(isinstance(k.mlp, MoEMLP) for k in model.layers.kinds) == 1
    tokens, positions = jnp.asarray([[1, 2, 3, 4]]), jnp.arange(4)[None]
    record_router_logits(model)
    _, recorded = nnx.capture(lambda m: m(tokens, positions), nnx.Intermediate)(model)
    got = jax.tree.leaves(recorded)
    x = model.embed(tokens)
    want = []
    for i in range(5):
        layer = model.layers.unstacked(i)
        if isinstance(layer.mlp, MoEMLP):
            h, _ = layer.attn(layer.input_norm(x), positions, None)
            want.append(layer.mlp.router(layer.pre_mlp_norm(x + h).reshape(-1, 32)))
        x, _ = layer(x, positions, None, None, i)
    assert len(got) == 3
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


def test_lora_stacks_hold_one_adapter_per_layer():
    model = apply_lora(Decoder(_config(), rngs=nnx.Rngs(5)), rank=3, alpha=6.0, targets=("v_proj",))
    lora = model.layers.kinds[1].attn.v_proj
    assert isinstance(lora, LoRALinear) and lora.lora_a.shape == (2, 32, 3) and lora.lora_b.shape == (2, 3, 16)


@pytest.mark.slow
def test_the_engine_step_copies_no_weight_and_no_pool():
    """The engine's compiled forward reads every layer's weights and KV pools in place: no dynamic-slice makes a
    layer's weight and no copy makes a pool (either would be a second pass over memory on every layer)."""
    from tunix_rt.engine.engine import Engine

    cfg = _config(architecture="llama", sandwich_norms=False, layer_types=(FULL,) * 8, hidden_size=64,
                  intermediate_size=96)
    model = Decoder(cfg, rngs=nnx.Rngs(6))
    for layer in model.layers.kinds:
        for parent, names in ((layer.attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                              (layer.mlp, ("gate_proj", "up_proj", "down_proj"))):
            for name in names:
                setattr(parent, name, QuantLinear(quantize_stacked(getattr(parent, name).kernel[...], "q4_0")))
    engine = Engine(model, None, max_model_len=32, max_num_seqs=2, num_kv_blocks=8, block_size=4)
    runner = engine.runner
    t = 4
    forward = runner._programs.function("forward")
    hlo = forward.lower(runner.leaves, runner.k, runner.v, np.zeros(t, np.int32), np.zeros(t, np.int32),
                        np.full((1, t), -1, np.int32), np.full(t, -1, np.int32),
                        np.zeros((1, 1, runner.max_blocks_per_seq), np.int32), None, None).compile().as_text()
    layer_shapes = {tuple(leaf.shape[1:]) for leaf in runner.leaves if leaf.ndim >= 3 and leaf.shape[0] == 8}
    shape_of = lambda line: tuple(int(d) for d in re.search(r"= \w+\[([\d,]*)\]", line).group(1).split(",") if d)
    for line in hlo.splitlines():
        if " dynamic-slice(" in line or "dynamic-slice_" in line.split("=")[0]:
            assert shape_of(line) not in layer_shapes, line
        if " copy(" in line:
            assert shape_of(line) != tuple(runner.k.shape), line


def _scan_residuals(model: Decoder) -> int:
    """How many arrays the forward scan of a LoRA training step hands its backward (stacked over the layers)."""
    tokens = jnp.arange(12, dtype=jnp.int32).reshape(2, 6) % model.config.vocab_size
    positions = jnp.broadcast_to(jnp.arange(6, dtype=jnp.int32), (2, 6))
    graphdef, adapters, rest = nnx.split(model, nnx.LoRAParam, ...)

    def loss(adapters):
        return jnp.sum(nnx.merge(graphdef, adapters, rest).hidden_states(tokens, positions)[0] ** 2)

    jaxpr = jax.make_jaxpr(jax.grad(loss))(adapters).jaxpr
    scans = [eqn for eqn in jaxpr.eqns if eqn.primitive.name == "scan"]
    forward = scans[0]
    return len(forward.outvars) - forward.params["num_carry"]


def test_a_trained_scanned_layer_keeps_only_its_named_values():
    """In training a scanned layer hands its backward only the values the decoder names (the products and the
    attention kernel's results), stacked over the layers; without the names it hands every intermediate."""
    cfg = _config(architecture="llama", sandwich_norms=False, layer_types=(FULL,) * 4, num_layers=4)
    model = apply_lora(Decoder(cfg, rngs=nnx.Rngs(3)), rank=4, alpha=8.0)
    named = _scan_residuals(model)
    everything = model.layers.saved
    model.layers.saved = ()
    try:
        unnamed = _scan_residuals(model)
    finally:
        model.layers.saved = everything
    assert named < unnamed
    from tunix_rt.models.decoder import SAVED_IN_TRAINING

    assert named <= len(SAVED_IN_TRAINING) + 1  # and the positions


def test_bf16_training_scans_move_uint16_bits_and_differentiate_the_same():
    """A bf16 LoRA step's layer scan takes the frozen base's stacks as uint16 bits (`constant_params`) and hands
    its backward the named bf16 values as uint16 (models/remat.py saved_value): XLA:CPU has no bf16 dynamic
    slice or update and converted whole stacks to f32 for each layer. Loss and adapter gradients are the ones
    the plain bf16 stacks give, bit for bit."""
    from tunix_rt.models.layer_stack import as_bits
    from tunix_rt.train.trainer import set_compute_dtype

    cfg = _config(architecture="llama", sandwich_norms=False, layer_types=(FULL,) * 4, num_layers=4)
    model = apply_lora(Decoder(cfg, rngs=nnx.Rngs(3)), rank=4, alpha=8.0)
    set_compute_dtype(model, jnp.bfloat16)
    graphdef, adapters, frozen = nnx.split(model, nnx.LoRAParam, ...)
    adapters = jax.tree.map(lambda a: a + 0.01, adapters)  # B starts at zero: make every adapter count
    frozen = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if a.dtype == jnp.float32 else a, frozen)
    tokens = jnp.arange(12, dtype=jnp.int32).reshape(2, 6) % cfg.vocab_size
    positions = jnp.broadcast_to(jnp.arange(6, dtype=jnp.int32), (2, 6))

    def loss(adapters, frozen, constant):
        model = nnx.merge(graphdef, adapters, frozen)
        model.layers.constant_params = constant
        return jnp.sum(model.hidden_states(tokens, positions)[0].astype(jnp.float32) ** 2)

    bits = {k: (as_bits(v) if k == "layers" else v) for k, v in frozen.items()}
    plain = jax.value_and_grad(loss)(adapters, frozen, False)
    through_bits = jax.value_and_grad(loss)(adapters, bits, True)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, plain), jax.tree.map(np.asarray, through_bits))

    jaxpr = jax.make_jaxpr(lambda a: jax.grad(loss)(a, bits, True))(adapters).jaxpr
    forward = next(eqn for eqn in jaxpr.eqns if eqn.primitive.name == "scan")
    residuals = forward.outvars[forward.params["num_carry"]:]
    stacked_in = forward.invars[forward.params["num_consts"] + forward.params["num_carry"]:]
    assert residuals and jnp.dtype(jnp.uint16) in {v.aval.dtype for v in residuals}
    assert jnp.dtype(jnp.bfloat16) not in {v.aval.dtype for v in [*residuals, *stacked_in]}


def test_checkpointed_bf16_layers_stack_no_bf16_residual():
    """With gradient checkpointing the layers keep their own inputs (models/remat.py), a bf16 one as uint16 bits,
    and the scan adds no policy of its own (which kept every layer's bf16 input a second time); the gradients are
    the unchecked layers'."""
    from tunix_rt.train.trainer import set_compute_dtype

    cfg = _config(architecture="llama", sandwich_norms=False, layer_types=(FULL,) * 4, num_layers=4)
    model = apply_lora(Decoder(cfg, rngs=nnx.Rngs(4)), rank=4, alpha=8.0)
    set_compute_dtype(model, jnp.bfloat16)
    graphdef, adapters, frozen = nnx.split(model, nnx.LoRAParam, ...)
    adapters = jax.tree.map(lambda a: a + 0.01, adapters)
    tokens = jnp.arange(12, dtype=jnp.int32).reshape(2, 6) % cfg.vocab_size
    positions = jnp.broadcast_to(jnp.arange(6, dtype=jnp.int32), (2, 6))

    def loss(adapters, remat):
        model = nnx.merge(graphdef, adapters, frozen)
        model.remat = remat
        return jnp.sum(model.hidden_states(tokens, positions)[0].astype(jnp.float32) ** 2)

    checkpointed, plain = (jax.value_and_grad(loss)(adapters, remat) for remat in (True, False))
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, plain), jax.tree.map(np.asarray, checkpointed))
    jaxpr = jax.make_jaxpr(lambda a: jax.grad(loss)(a, True))(adapters).jaxpr
    forward = next(eqn for eqn in jaxpr.eqns if eqn.primitive.name == "scan")
    residuals = forward.outvars[forward.params["num_carry"]:]
    assert jnp.dtype(jnp.uint16) in {v.aval.dtype for v in residuals}
    assert jnp.dtype(jnp.bfloat16) not in {v.aval.dtype for v in residuals}


def test_bf16_full_fine_tuning_stacks_nothing_in_bf16():
    """bf16 full fine-tuning: the f32 params enter the layer scan and each layer casts its own there
    (models/decoder.py), so neither scan takes or stacks a bf16 array: the weights go in and their gradients
    come out in f32, the kept values as uint16 bits."""
    from tunix_rt.train.trainer import set_compute_dtype

    cfg = _config(architecture="llama", sandwich_norms=False, layer_types=(FULL,) * 4, num_layers=4)
    model = Decoder(cfg, rngs=nnx.Rngs(5))
    set_compute_dtype(model, jnp.bfloat16)
    graphdef, params = nnx.split(model)
    tokens = jnp.arange(12, dtype=jnp.int32).reshape(2, 6) % cfg.vocab_size
    positions = jnp.broadcast_to(jnp.arange(6, dtype=jnp.int32), (2, 6))

    def loss(params):
        return jnp.sum(nnx.merge(graphdef, params).hidden_states(tokens, positions)[0].astype(jnp.float32) ** 2)

    grads = jax.grad(loss)(params)
    assert {x.dtype for x in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}
    scans = [eqn for eqn in jax.make_jaxpr(jax.grad(loss))(params).jaxpr.eqns if eqn.primitive.name == "scan"]
    assert len(scans) == 2
    for scan in scans:
        stacked = [*scan.invars[scan.params["num_consts"] + scan.params["num_carry"]:],
                   *scan.outvars[scan.params["num_carry"]:]]
        assert jnp.dtype(jnp.bfloat16) not in {v.aval.dtype for v in stacked}
