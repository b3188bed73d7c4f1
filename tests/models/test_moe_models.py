"""MoE models beyond HF parity (test_hf_parity.py covers Mixtral, Qwen2-MoE and Qwen3-MoE): config
parsing, the checkpoint layouts experts come in, and a token reading only its routed experts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.models.hf_tiny import make_hf_model
from tunix_rt.checkpoints import hf_dir
from tunix_rt.checkpoints.errors import CheckpointError
from tunix_rt.checkpoints.weights import build_decoder
from tunix_rt.models.config import ModelConfig
from tunix_rt.models.decoder import MLP, Decoder, MoEMLP
from tunix_rt.ops import router_topk

pytest.importorskip("torch")
pytest.importorskip("transformers")

BASE = dict(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=4, num_attention_heads=2)


def test_qwen_moe_layers_follow_sparse_step_and_mlp_only_layers():
    cfg = ModelConfig.from_hf_dict({**BASE, "model_type": "qwen2_moe", "num_experts": 4, "num_experts_per_tok": 2,
                                    "moe_intermediate_size": 8, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert cfg.moe_layers == (False, True, False, False)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    assert [type(model.layers.locate(i)[0].mlp) for i in range(4)] == [MLP, MoEMLP, MLP, MLP]
    assert cfg.qkv_bias  # Qwen2's switches carry over


def test_transformers5_qwen3_moe_config_names_experts_num_local_experts():
    cfg = ModelConfig.from_hf_dict({**BASE, "model_type": "qwen3_moe", "num_local_experts": 6, "num_experts_per_tok": 2,
                                    "moe_intermediate_size": 8, "norm_topk_prob": True})
    assert (cfg.num_experts, cfg.norm_topk_prob, cfg.qk_norm, all(cfg.moe_layers)) == (6, True, True, True)


def test_mixtral_always_renormalises_and_uses_intermediate_size():
    cfg = ModelConfig.from_hf_dict({**BASE, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2})
    assert (cfg.moe_intermediate_size, cfg.norm_topk_prob, cfg.shared_expert_intermediate_size) == (24, True, 0)


@pytest.mark.parametrize("bad, pattern", [
    ({"num_experts_per_tok": 5}, r"num_experts_per_tok \(5\) exceeds num_experts \(4\)"),
    ({"moe_intermediate_size": 0}, "moe_intermediate_size must be a positive integer"),
])
def test_bad_moe_config(bad, pattern):
    d = {**BASE, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8, **bad}
    with pytest.raises(ValueError, match=pattern):
        ModelConfig.from_hf_dict(d)


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen3_moe")
    make_hf_model("qwen3_moe", out)
    cfg = hf_dir.read_config(out)
    return cfg, dict(hf_dir.iter_tensors(out)), build_decoder(cfg, hf_dir.iter_tensors(out))


def _logits(model, tokens):
    return np.asarray(model(jnp.asarray(tokens), jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)))


def _stacked(tensors, cfg, layer, proj):
    return np.stack([tensors[f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"] for e in range(cfg.num_experts)])


def test_fused_and_stacked_expert_layouts_load_the_same_model(qwen3_moe):
    """transformers 5 keeps experts fused in memory (gate_up_proj (E, 2I, H), down_proj (E, H, I));
    GGUF stacks them (E, out, in). Both give the model the per-expert tensors give."""
    cfg, tensors, model = qwen3_moe
    fused, stacked = {}, {}
    for name, value in tensors.items():
        if ".mlp.experts." not in name:
            fused[name] = stacked[name] = value
    for layer in range(cfg.num_layers):
        gate, up, down = (_stacked(tensors, cfg, layer, p) for p in ("gate_proj", "up_proj", "down_proj"))
        base = f"model.layers.{layer}.mlp.experts."
        fused[base + "gate_up_proj"] = np.concatenate([gate, up], axis=1)
        fused[base + "down_proj"] = down
        stacked.update({base + "gate_proj": gate, base + "up_proj": up, base + "down_proj": down})
    tokens = np.random.default_rng(0).integers(0, 256, (2, 12))
    want = _logits(model, tokens)
    for layout in (fused, stacked):
        np.testing.assert_array_equal(_logits(build_decoder(cfg, layout.items()), tokens), want)


def test_missing_expert_is_named(qwen3_moe):
    cfg, tensors, _ = qwen3_moe
    partial = {k: v for k, v in tensors.items() if k != "model.layers.1.mlp.experts.5.up_proj.weight"}
    with pytest.raises(CheckpointError, match=r"missing expert\(s\) \[5\] of layers\.1\.mlp\.experts\.up_proj"):
        build_decoder(cfg, partial.items())


def test_expert_with_wrong_shape_is_named(qwen3_moe):
    cfg, tensors, _ = qwen3_moe
    bad = dict(tensors)
    bad["model.layers.0.mlp.experts.2.gate_proj.weight"] = np.zeros((5, 64), np.float32)
    with pytest.raises(CheckpointError, match=r"experts\.2\.gate_proj\.weight' has shape \(5, 64\)"):
        build_decoder(cfg, bad.items())


def test_a_token_reads_only_its_routed_experts(qwen3_moe):
    """Poisoning every expert a token is not routed to (NaN weights) leaves its output unchanged:
    the grouped matmul never touches an expert without rows."""
    cfg, _, model = qwen3_moe
    layer = model.layers.unstacked(0).mlp  # a copy to poison: the fixture's model stays clean
    x = jnp.asarray(np.random.default_rng(1).standard_normal((1, 1, cfg.hidden_size)), jnp.float32)
    want = layer(x)
    _, ids = router_topk(layer.router(x.reshape(1, -1)), cfg.num_experts_per_tok)
    unused = np.setdiff1d(np.arange(cfg.num_experts), np.asarray(ids))
    assert unused.size
    for proj in ("gate_proj", "up_proj", "down_proj"):
        param = getattr(layer.experts, proj)
        param.set_value(param[...].at[unused].set(jnp.nan))
    got = layer(x)
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_moe_training_gradients_reach_router_and_routed_experts_only(qwen3_moe):
    cfg, _, model = qwen3_moe
    layer = model.layers.unstacked(0).mlp
    x = jnp.asarray(np.random.default_rng(2).standard_normal((3, cfg.hidden_size)), jnp.float32)
    graphdef, params = nnx.split(layer, nnx.Param)

    def loss(p):
        return jnp.sum(nnx.merge(graphdef, p)(x) ** 2)

    grads = jax.grad(loss)(params)
    assert float(jnp.abs(grads["router"]["kernel"][...]).sum()) > 0
    _, ids = router_topk(layer.router(x), cfg.num_experts_per_tok)
    per_expert = np.abs(np.asarray(grads["experts"]["gate_proj"][...])).sum(axis=(1, 2))
    routed = np.zeros(cfg.num_experts, bool)
    routed[np.asarray(ids).ravel()] = True
    assert (per_expert[routed] > 0).all() and (per_expert[~routed] == 0).all()


@pytest.mark.slow
def test_lora_on_a_moe_model_adapts_attention_and_the_shared_expert():
    from tunix_rt.models.lora import LoRALinear, apply_lora, merge_lora

    cfg = ModelConfig.from_hf_dict({**BASE, "model_type": "qwen2_moe", "num_experts": 4, "num_experts_per_tok": 2,
                                    "moe_intermediate_size": 8, "shared_expert_intermediate_size": 12,
                                    "mlp_only_layers": [0]})
    model = apply_lora(Decoder(cfg, rngs=nnx.Rngs(0)), rank=2, alpha=4.0)
    moe_layer, dense_layer = model.layers.locate(1)[0].mlp, model.layers.locate(0)[0].mlp
    assert isinstance(moe_layer.shared_expert.up_proj, LoRALinear) and isinstance(dense_layer.up_proj, LoRALinear)
    assert not isinstance(moe_layer.router, LoRALinear)
    for _, module in nnx.iter_modules(model):  # a nonzero adapter, so merging has something to fold in
        if isinstance(module, LoRALinear):
            module.lora_b.set_value(jnp.full(module.lora_b.shape, 0.05, module.lora_b.dtype))
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 64, (1, 9)))
    positions = jnp.arange(9)[None]
    merged = merge_lora(model)
    np.testing.assert_allclose(np.asarray(merged(tokens, positions)), np.asarray(model(tokens, positions)),
                               rtol=1e-5, atol=1e-5)


def test_expert_given_twice_is_refused(qwen3_moe):
    cfg, tensors, _ = qwen3_moe
    stacked = np.stack([tensors[f"model.layers.0.mlp.experts.{e}.up_proj.weight"] for e in range(cfg.num_experts)])
    both = list(tensors.items()) + [("model.layers.0.mlp.experts.up_proj", stacked)]
    with pytest.raises(CheckpointError, match="given already|given twice"):
        build_decoder(cfg, both)
