"""Quantization-aware training: the fake quantizer is the export's quantizer forward and the identity backward,
and a QAT run's export serves exactly the function training saw (full fine-tuning and LoRA)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.train.test_train_cli import COMMON, cli, write_jsonl
from tunix_rt.checkpoints.loader import load_model
from tunix_rt.checkpoints.peft_adapter import load_adapter
from tunix_rt.models.qat import enable_qat, fake_quant
from tunix_rt.ops.quant import dequantize, quantize
from tunix_rt.train.config import DistillConfig, GRPOConfig, SFTConfig

pytestmark = pytest.mark.usefixtures("fast_compiles")
TOKENS = np.random.default_rng(1).integers(3, 100, (2, 12))


@pytest.mark.parametrize("fmt, group", [("q8_0", None), ("q4_0", None), ("q4_1", None), ("int4", 64)])
def test_fake_quant_is_the_quantizer_forward_and_the_identity_backward(fmt, group):
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((3, 128, 24)), jnp.float32)
    fq = fake_quant(fmt, group)
    got = fq(w)
    for layer in range(3):  # bit for bit the FFI quantizer's round trip, layer by layer
        want = dequantize(quantize(w[layer], fmt, group))
        np.testing.assert_array_equal(np.asarray(got[layer]), np.asarray(want))
    c = jnp.asarray(rng.standard_normal(w.shape), jnp.float32)
    np.testing.assert_array_equal(np.asarray(jax.grad(lambda w: jnp.sum(fq(w) * c))(w)), np.asarray(c))
    table = w[0].T  # (V, D): rows of D, as the export stores an embedding
    np.testing.assert_array_equal(np.asarray(fq.rows(table)), np.asarray(fq(w[0]).T))
    odd = jnp.ones((100, 8), jnp.float32)  # K not a multiple of the group: stays float, as the export leaves it
    np.testing.assert_array_equal(np.asarray(fq(odd)), np.asarray(odd))


def _logits(model, tokens=TOKENS):
    return np.asarray(model(jnp.asarray(tokens), jnp.asarray(np.broadcast_to(np.arange(tokens.shape[1]),
                                                                            tokens.shape))))


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_qat_export_serves_what_training_saw(tiny, root, lora):
    """A q8_0 QAT run, exported as q8_0 GGUF and read back as float: its logits are the trained model's with
    the fake quantizer on (the weights the forward saw are the ones the file holds)."""
    data = write_jsonl(root / "qat" / "data.jsonl", [{"text": f"the theme {i} the thesis"} for i in range(8)])
    out = root / f"qat_{'lora' if lora else 'full'}"
    rank = ["--lora-rank", "4"] if lora else []
    assert cli("sft", "--model", tiny, "--data", data, "--output", out, "--steps", "3", *rank, "batch_size=2",
               "qat=q8_0", f"learning_rate={1e-2 if lora else 1e-3}", *COMMON) == 0
    gguf = root / f"qat_{'lora' if lora else 'full'}.gguf"
    source = ["--model", tiny, "--lora", out / "adapter"] if lora else ["--model", out / "final"]
    assert cli("export", *source, "--format", "gguf", "--quant", "q8_0", "--output", gguf) == 0
    if lora:
        trained = load_model(tiny).model
        load_adapter(trained, out / "adapter")
    else:
        trained = load_model(out / "final").model
    enable_qat(trained, fake_quant("q8_0"))
    served = load_model(gguf, dequantize=True).model
    np.testing.assert_allclose(_logits(served), _logits(trained), rtol=1e-5, atol=1e-5)
    # and the fake quantizer made a difference: the float model's logits are not these
    for _, module in nnx.iter_modules(trained):
        module.fake_quant = None
    assert np.abs(_logits(trained) - _logits(served)).max() > 1e-4


@pytest.mark.parametrize("kwargs, match", [
    (dict(qat="q5_k"), "qat must be one of"),
    (dict(qat="int4", qat_group_size=48), "group_size for int4"),
    (dict(qat="q8_0", compute_dtype="bfloat16"), "qat needs compute_dtype=float32"),
    (dict(qat_group_size=64), "qat_group_size is set but qat is not"),
])
def test_qat_options_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SFTConfig(data="d", output="o", **kwargs)


def test_qat_is_refused_where_rollouts_sample_the_float_weights():
    with pytest.raises(ValueError, match="qat is for sft, dpo and distill"):
        GRPOConfig(data="d", output="o", reward=("brevity",), qat="q4_0")
    with pytest.raises(ValueError, match="qat with on_policy=true"):
        DistillConfig(data="d", output="o", teacher="t", qat="q8_0", on_policy=True)


def test_int_formats_follow_tunix_rt_quantize(tiny):
    """int8/int4 QAT covers what `tunix-rt quantize` packs (the projections, an untied lm_head); the GGUF formats
    also the embedding and a tied head, as the GGUF export quantizes them."""
    from tunix_rt.models.decoder import Decoder, Embed

    for fmt, group, embedding in (("int8", None, False), ("q8_0", None, True)):
        model = load_model(tiny).model  # the tiny llama: lm_head untied
        enable_qat(model, fake_quant(fmt, group))
        modules = [m for _, m in nnx.iter_modules(model)]
        assert all((m.fake_quant is not None) == embedding for m in modules if isinstance(m, Embed)), fmt
        assert [m for m in modules if isinstance(m, Decoder)][0].fake_quant is not None  # untied: always
