"""KTO (train/kto.py, losses.kto_losses): the loss and its gradient against an independent NumPy version of TRL's
formula, the mismatched KL partners, and a run through `tunix-rt kto` on unpaired rows made from preference pairs
that raises the desirable completions' log-ratio."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.models.hf_tiny import make_tiny_model_dir
from tests.train.test_train_cli import cli
from tunix_rt.checkpoints.loader import load_model
from tunix_rt.train.config import KTOConfig
from tunix_rt.train.data import DataError, load_unpaired
from tunix_rt.train.kto import KTOObjective
from tunix_rt.train.losses import kto_losses

pytestmark = pytest.mark.usefixtures("fast_compiles")  # compile-bound (conftest.fast_compiles says when)


def _numpy_kto(r, kl_r, desirable, valid, beta, wd, wu):
    """TRL's KTOTrainer.kto_loss (loss_type "kto"), written out: z0 = clamp(mean KL, min=0), detached."""
    z0 = max(float(np.sum(kl_r * valid) / max(valid.sum(), 1.0)), 0.0)
    sig = lambda x: 1.0 / (1.0 + np.exp(-x))  # noqa: E731
    loss = np.where(desirable, wd * (1 - sig(beta * (r - z0))), wu * (1 - sig(beta * (z0 - r))))
    # d loss / d r (z0 held constant): -w beta s (1 - s) for desirable, +w beta s (1 - s) for undesirable
    s = np.where(desirable, sig(beta * (r - z0)), sig(beta * (z0 - r)))
    grad = np.where(desirable, -wd * beta * s * (1 - s), wu * beta * s * (1 - s))
    return loss, grad, z0


@pytest.mark.parametrize("shift", [0.0, 3.0])  # a KL estimate clamped to 0, and a positive one
def test_kto_loss_and_gradient_match_numpy(shift):
    rng = np.random.default_rng(0)
    r = rng.normal(size=10).astype(np.float32)
    kl_r = (rng.normal(size=10) + shift).astype(np.float32) - (1.5 if shift == 0 else 0)
    desirable = rng.random(10) < 0.5
    valid = np.ones(10, np.float32)
    valid[-2:] = 0
    kw = dict(beta=0.3, desirable_weight=1.5, undesirable_weight=0.7)
    want, want_grad, z0 = _numpy_kto(r, kl_r, desirable, valid, 0.3, 1.5, 0.7)
    losses, metrics = kto_losses(jnp.asarray(r), jnp.asarray(kl_r), jnp.asarray(desirable), jnp.asarray(valid), **kw)
    np.testing.assert_allclose(np.asarray(losses), want, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(float(metrics["kl"][0]), z0, rtol=1e-5, atol=1e-7)
    grad = jax.grad(lambda x: jnp.sum(kto_losses(x, jnp.asarray(kl_r), jnp.asarray(desirable), jnp.asarray(valid),
                                                 **kw)[0] * valid))(jnp.asarray(r))
    np.testing.assert_allclose(np.asarray(grad), want_grad * valid, rtol=1e-4, atol=1e-7)
    kl_grad = jax.grad(lambda k: jnp.sum(kto_losses(jnp.asarray(r), k, jnp.asarray(desirable), jnp.asarray(valid),
                                                    **kw)[0]))(jnp.asarray(kl_r))
    assert not np.any(np.asarray(kl_grad))  # z0 is a constant to the gradient, as in TRL


def _unpaired(n: int, seed: int) -> list[dict]:
    """The reward test's preference pairs split into unpaired rows: replies ending "please" desirable."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        ask = "".join(rng.choice(list("abcdefgh"), 5))
        prompt = [{"role": "user", "content": f"do {ask}"}]
        rows.append({"prompt": prompt, "completion": [{"role": "assistant", "content": f"{ask} please"}], "label": True})
        rows.append({"prompt": prompt, "completion": [{"role": "assistant", "content": f"{ask} now"}], "label": False})
    return rows


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("kto")
    make_tiny_model_dir(root / "model", "llama")
    return root


def test_partners_are_fixed_and_never_self(tiny):
    loaded = load_model(tiny / "model")
    path = tiny / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _unpaired(5, 0)))
    examples = load_unpaired(path, loaded.tokenizer, max_length=64)
    objective = KTOObjective(examples, KTOConfig(data="d", output="o"), max_length=64, pad_id=0)
    assert sorted(objective.partner) == list(range(10)) and not np.any(objective.partner == np.arange(10))
    rows = objective.rows(np.array([0, 3]))
    mismatched = rows[2].input_ids
    assert mismatched[: len(examples[0].prompt_ids)].tolist() == examples[0].prompt_ids.tolist()
    assert mismatched[len(examples[0].prompt_ids):].tolist() == examples[objective.partner[0]].completion_ids.tolist()


def test_kto_cli_raises_the_desirable_log_ratio(tiny):
    data = tiny / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _unpaired(24, 1)))
    out = tiny / "run"
    assert cli("kto", "--model", tiny / "model", "--data", data, "--output", out, "--steps", 12, "--lora-rank", 4,
               "batch_size=8", "learning_rate=5e-3", "max_length=64", "progress=false") == 0
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    per_chosen = [m["rewards/chosen"] for m in metrics]  # each class's own mean, as TRL logs it
    per_rejected = [m["rewards/rejected"] for m in metrics]
    assert np.mean(per_chosen[-3:]) > np.mean(per_chosen[:3])
    assert np.mean(per_chosen[-3:]) - np.mean(per_rejected[-3:]) > 0


def test_bad_rows_and_options(tiny, tmp_path):
    loaded = load_model(tiny / "model")
    row = {"prompt": "x", "completion": "y", "label": "yes"}
    (tmp_path / "bad.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(DataError, match='field "label" must be true or false'):
        load_unpaired(tmp_path / "bad.jsonl", loaded.tokenizer, max_length=64)
    row = {"prompt": "x", "completion": [{"role": "assistant", "content": "y"}], "label": True}
    (tmp_path / "mixed.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(DataError, match='mixed.jsonl:1: fields "prompt" and "completion" must both be strings or both '
                                        'be lists of messages, got str and list'):
        load_unpaired(tmp_path / "mixed.jsonl", loaded.tokenizer, max_length=64)
    with pytest.raises(ValueError, match="desirable_weight must be a positive"):
        KTOConfig(data="d", output="o", desirable_weight=0.0)
