"""Teacher-forced log-probs of the decoder vs HF transformers on tiny random models of each family."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.models.hf_tiny import FAMILIES, make_hf_model
from tunix_rt.checkpoints import hf_dir
from tunix_rt.checkpoints.weights import build_decoder

pytestmark = pytest.mark.usefixtures("fast_compiles")  # compile-bound (conftest.fast_compiles says when)

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

SEQ = 40  # longer than the sliding window (8) of the Gemma configs


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pair(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    hf = make_hf_model(request.param, out)
    return request.param, hf, build_decoder(hf_dir.read_config(out), hf_dir.iter_tensors(out)), out


def _hf_logprobs(hf, tokens, attention_mask=None):
    with torch.no_grad():
        kwargs = {}
        if attention_mask is not None:
            kwargs["attention_mask"] = torch.tensor(attention_mask)
            kwargs["position_ids"] = torch.tensor(np.maximum(np.cumsum(attention_mask, -1) - 1, 0))
        logits = hf(torch.tensor(tokens), **kwargs).logits.float()
    return torch.log_softmax(logits, -1).numpy()


def _gather_next(logp, tokens):
    return np.take_along_axis(logp[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]


def test_teacher_forced_logprobs_match_hf(pair):
    family, hf, ours, _ = pair
    tokens = np.random.default_rng(1).integers(0, 256, (2, SEQ))
    positions = np.broadcast_to(np.arange(SEQ), tokens.shape)
    ref = _hf_logprobs(hf, tokens)
    got = np.asarray(jax.nn.log_softmax(ours(jnp.asarray(tokens), jnp.asarray(positions)), -1))
    delta = np.abs(_gather_next(ref, tokens) - _gather_next(got, tokens)).max()
    assert delta <= 1e-4, f"{family}: max |delta log p| = {delta:.2e}"
    assert np.abs(ref - got).max() <= 1e-4


@pytest.mark.slow
def test_left_padded_batch_matches_hf(pair):
    """Padding keys carry position -1 and are never attended to, as HF's attention mask does."""
    family, hf, ours, _ = pair
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, 256, (2, 24))
    mask = np.ones_like(tokens)
    mask[0, :7] = 0
    positions = np.where(mask == 1, np.cumsum(mask, -1) - 1, -1)
    ref = _hf_logprobs(hf, tokens, mask)
    got = np.asarray(jax.nn.log_softmax(ours(jnp.asarray(tokens), jnp.asarray(positions)), -1))
    real = mask[:, 1:] == 1
    delta = np.abs(_gather_next(ref, tokens) - _gather_next(got, tokens))[real].max()
    assert delta <= 1e-4, f"{family}: max |delta log p| = {delta:.2e}"


@pytest.mark.slow
def test_bf16_weights_track_f32(pair):
    family, _, ours_f32, out = pair
    ours = build_decoder(hf_dir.read_config(out), hf_dir.iter_tensors(out), dtype=jnp.bfloat16)
    assert ours.embed.embedding[...].dtype == jnp.bfloat16
    tokens = np.random.default_rng(3).integers(0, 256, (1, SEQ))
    positions = np.arange(SEQ)[None]
    p32 = jax.nn.softmax(ours_f32(jnp.asarray(tokens), jnp.asarray(positions)), -1)
    p16 = jax.nn.softmax(ours(jnp.asarray(tokens), jnp.asarray(positions)), -1)
    assert np.isfinite(np.asarray(p16)).all()
    assert float(jnp.abs(p32 - p16).max()) < 0.05, family
