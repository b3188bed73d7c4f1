"""Sequence classifiers (reward models): HF *ForSequenceClassification directories load as the decoder with a
score head read at each sequence's last token, giving transformers' scores; our export loads back in
transformers with the same scores."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from tests.models.hf_tiny import COMMON, FAMILIES, write_tiny_tokenizer
from tunix_rt.checkpoints.hf_export import export_hf
from tunix_rt.checkpoints.loader import load_model

pytestmark = pytest.mark.usefixtures("fast_compiles")  # compile-bound (conftest.fast_compiles says when)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

DENSE = ("llama", "qwen2", "qwen3", "gemma2", "gemma3_text")
PAD = 3


def _hf_classifier(family: str, out, num_labels: int = 1, pad: int = PAD):
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
           "gemma2": transformers.Gemma2Config, "gemma3_text": transformers.Gemma3TextConfig}[family]
    config = cls(**{**COMMON, **FAMILIES[family]}, num_labels=num_labels, pad_token_id=pad, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.AutoModelForSequenceClassification.from_config(config).eval().float()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out)
    write_tiny_tokenizer(out)
    return model


def _rows():
    rng = np.random.default_rng(1)
    lengths = (12, 7, 3)
    tokens = np.full((3, 12), PAD, np.int64)
    for i, n in enumerate(lengths):
        tokens[i, :n] = rng.integers(4, 100, n)
    positions = np.where(tokens != PAD, np.arange(12), -1)
    return tokens, positions


def _ours(model, tokens, positions):
    h, _ = model.hidden_states(jnp.asarray(tokens), jnp.asarray(positions))
    return np.asarray(model.sequence_scores(h, jnp.asarray(tokens), jnp.asarray(positions)))


@pytest.mark.parametrize("family", DENSE)
def test_scores_match_transformers(family, tmp_path):
    hf = _hf_classifier(family, tmp_path, num_labels=1 if family != "qwen2" else 3)
    ours = load_model(tmp_path).model
    assert ours.config.num_labels == hf.config.num_labels
    tokens, positions = _rows()
    with torch.no_grad():
        want = hf(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(_ours(ours, tokens, positions), want, atol=1e-4)
    with pytest.raises(ValueError, match="has no vocabulary head"):
        ours.output_head()


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_export_loads_back_in_transformers(family, tmp_path):
    _hf_classifier(family, tmp_path / "src")
    loaded = load_model(tmp_path / "src")
    export_hf(loaded.model, loaded.tokenizer, loaded.hf_config, tmp_path / "out")
    back = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "out").eval()
    assert type(back).__name__ == {"llama": "LlamaForSequenceClassification",
                                   "gemma3_text": "Gemma3TextForSequenceClassification"}[family]
    tokens, positions = _rows()
    with torch.no_grad():
        want = back(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(_ours(loaded.model, tokens, positions), want, atol=1e-4)


def test_rows_ending_with_the_pad_id_are_read_before_it(tmp_path):
    """TRL's reward models pad with EOS: a row whose text ends with EOS is read at the token before it, by
    transformers and by us (the padding id comes from config.json)."""
    eos = 2
    hf = _hf_classifier("llama", tmp_path, pad=eos)
    ours = load_model(tmp_path).model
    assert ours.config.pad_token_id == eos
    tokens = np.array([[1, 40, 41, 42, eos, eos], [1, 50, 51, 52, 53, eos]])
    positions = np.where(np.arange(6) < np.array([[5], [6]]), np.arange(6), -1)
    with torch.no_grad():
        want = hf(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(_ours(ours, tokens, positions), want, atol=1e-4)
