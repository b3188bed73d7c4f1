"""Rope frequencies and cos/sin scaling against transformers' own rope functions (the decoder's logits parity
with transformers, tests/models/test_hf_parity.py, covers every rope type a tiny family uses)."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from tunix_rt.models.config import ModelConfig, RopeConfig, UnsupportedArchitecture
from tunix_rt.models.rope import attention_scaling, inverse_frequencies

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

pytestmark = pytest.mark.usefixtures("fast_compiles")  # compile-bound (conftest.fast_compiles says when)

BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096)

YARN = [  # Qwen2.5 / Qwen3 style, DeepSeek style (mscale), a given attention factor, no truncation, beta defaults
    dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=1024),
    dict(rope_type="yarn", factor=40.0, original_max_position_embeddings=128, beta_fast=32, beta_slow=1, mscale=1.0,
         mscale_all_dim=0.707),
    dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=512, attention_factor=0.9, truncate=False),
    dict(rope_type="yarn", factor=2.0, original_max_position_embeddings=2048, beta_fast=0, beta_slow=0),
]


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("theta,head_dim", [(10000.0, 32), (1_000_000.0, 128)])
@pytest.mark.parametrize("scaling", YARN, ids=range(len(YARN)))
def test_yarn_matches_transformers(scaling, theta, head_dim):
    cfg = transformers.Qwen3Config(**BASE, head_dim=head_dim, rope_theta=theta, rope_scaling=dict(scaling))
    inv_ref, att_ref = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    d = cfg.to_dict() | {"model_type": "qwen3"}
    rope = ModelConfig.from_hf_dict(d).rope_for(0)
    assert rope.rope_type == "yarn"
    got = inverse_frequencies(rope, head_dim)
    assert got.dtype == np.float32
    # float32 powers round alike but for an ulp now and then (numpy's and torch's pow), as for the default rope
    np.testing.assert_allclose(got, inv_ref.numpy(), rtol=2.5e-7, atol=0)
    assert attention_scaling(rope) == pytest.approx(att_ref, rel=1e-12)


def test_yarn_defaults_follow_transformers():
    """No original length: the model's own; no factor: the ratio of the two (transformers' rules)."""
    d = dict(BASE, model_type="qwen3", head_dim=32, rope_theta=10000.0, max_position_embeddings=4096,
             rope_scaling={"rope_type": "yarn", "original_max_position_embeddings": 1024})
    rope = ModelConfig.from_hf_dict(d).rope_for(0)
    assert rope.factor == 4.0 and rope.beta_fast == 32.0 and rope.beta_slow == 1.0
    d["rope_scaling"] = {"rope_type": "yarn", "factor": 2.0}
    assert ModelConfig.from_hf_dict(d).rope_for(0).original_max_position_embeddings == 4096


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("rope_type", ["llama3", "yarn"])
@pytest.mark.parametrize("where", ["top level", "absent"])
def test_pretraining_length_follows_transformers(rope_type, where):
    """A top-level original_max_position_embeddings (Phi-3 style) takes priority over the rope's; with none at
    all, the model's max_position_embeddings (transformers' standardize_rope_params)."""
    scaling = {"rope_type": rope_type, "factor": 4.0}
    if rope_type == "llama3":
        scaling |= {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
    extra = {"original_max_position_embeddings": 512} if where == "top level" else {}
    cfg = transformers.LlamaConfig(**BASE, rope_theta=10000.0, rope_scaling=dict(scaling), **extra)
    inv_ref, _ = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu")
    rope = ModelConfig.from_hf_dict(dict(BASE, model_type="llama", rope_theta=10000.0, rope_scaling=scaling, **extra)
                                    ).rope_for(0)
    assert rope.original_max_position_embeddings == (512 if extra else BASE["max_position_embeddings"])
    np.testing.assert_allclose(inverse_frequencies(rope, 16), inv_ref.numpy(), rtol=2.5e-7, atol=0)


def test_other_rope_types_do_not_scale_cos_sin():
    for rope in (RopeConfig(theta=1e4), RopeConfig(theta=1e4, rope_type="linear", factor=2.0),
                 RopeConfig(theta=1e4, rope_type="llama3", factor=8.0)):
        assert attention_scaling(rope) == 1.0


@pytest.mark.parametrize("kw,match", [
    (dict(rope_type="longrope"), "unsupported rope_type 'longrope'"),
    (dict(rope_type="yarn", factor=0.0), "factor must be positive"),
    (dict(rope_type="yarn", beta_fast=1.0, beta_slow=32.0), "beta_fast > beta_slow"),
    (dict(rope_type="yarn", attention_factor=-1.0), "attention_factor must be positive"),
    (dict(rope_type="yarn", original_max_position_embeddings=0), "original_max_position_embeddings"),
])
def test_bad_rope_parameters_are_named(kw, match):
    with pytest.raises((ValueError, UnsupportedArchitecture), match=match):
        RopeConfig(theta=1e4, **kw)


@pytest.mark.parametrize("factor", [2.0, 4.0])
@pytest.mark.parametrize("length", [1, 16, 17, 40, 5000])
def test_dynamic_frequencies_match_transformers(factor, length):
    """Per token, the frequencies transformers' dynamic rope computes for a sequence of `length` tokens."""
    import jax.numpy as jnp
    import torch

    from tunix_rt.models.rope import dynamic_inverse_frequencies

    d = dict(BASE, model_type="llama", max_position_embeddings=16,
             rope_scaling={"rope_type": "dynamic", "factor": factor})
    rope = ModelConfig.from_hf_dict(d).rope_for(0)
    assert rope.rope_type == "dynamic" and rope.original_max_position_embeddings == 16
    ref, _ = ROPE_INIT_FUNCTIONS["dynamic"](transformers.LlamaConfig(**d), "cpu", seq_len=torch.tensor(length))
    got = np.asarray(dynamic_inverse_frequencies(rope, 16, jnp.full((1, 1), length - 1)))[0, 0]
    np.testing.assert_allclose(got, ref.numpy(), rtol=2e-6)
    if length <= 16:  # within the model's length: the default rope's frequencies
        np.testing.assert_allclose(got, inverse_frequencies(rope, 16), rtol=2e-6)


def test_dynamic_rope_matches_transformers_generating_past_its_length(tmp_path):
    """A tiny model with rope_type dynamic (max_position_embeddings 16) fed 40 tokens one at a time through its
    cache, as transformers generates: every step's log-probs equal the decoder's over the whole sequence at once
    (each token rotated by its own length), and the decoder's own cached steps agree."""
    import jax
    import jax.numpy as jnp
    import torch

    from tests.models.hf_tiny import make_hf_model
    from tunix_rt.checkpoints import hf_dir
    from tunix_rt.checkpoints.weights import build_decoder

    hf = make_hf_model("qwen2", tmp_path, max_position_embeddings=16,
                       rope_scaling={"rope_type": "dynamic", "factor": 4.0})
    ours = build_decoder(hf_dir.read_config(tmp_path), hf_dir.iter_tensors(tmp_path))
    assert ours.config.rope_for(0).rope_type == "dynamic"
    tokens = np.random.default_rng(3).integers(0, 256, (1, 40))
    prompt = 6
    cache_arg = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"  # 5.x renamed it
    with torch.no_grad():
        out = hf(torch.tensor(tokens[:, :prompt]), use_cache=True)
        steps, past = [out.logits[0]], out.past_key_values
        for t in range(prompt, 40):
            out = hf(torch.tensor(tokens[:, t:t + 1]), use_cache=True, position_ids=torch.tensor([[t]]),
                     **{cache_arg: past})
            steps.append(out.logits[0])
            past = out.past_key_values
    ref = torch.log_softmax(torch.cat(steps).float(), -1).numpy()
    positions = jnp.arange(40)[None]
    got = np.asarray(jax.nn.log_softmax(ours(jnp.asarray(tokens), positions), -1))[0]
    assert np.abs(got - ref).max() <= 1e-4
    # a one-shot transformers forward rotates the early tokens by the whole length: not what it generates
    with torch.no_grad():
        whole = torch.log_softmax(hf(torch.tensor(tokens)).logits[0].float(), -1).numpy()
    assert np.abs(whole - ref)[:prompt].max() > 1e-3
    cache = ours.new_cache(1, 40)
    logits, cache = ours(jnp.asarray(tokens[:, :prompt]), positions[:, :prompt], cache)
    cached = [np.asarray(jax.nn.log_softmax(logits, -1))[0]]
    for t in range(prompt, 40):
        logits, cache = ours(jnp.asarray(tokens[:, t:t + 1]), positions[:, t:t + 1], cache)
        cached.append(np.asarray(jax.nn.log_softmax(logits, -1))[0])
    assert np.abs(np.concatenate(cached) - got).max() <= 1e-5
