"""Training a MoE model: the router's auxiliary losses (load balancing, z-loss) join the objective with
their coefficients, are logged, and the router learns through them."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from tests.train import sharded_worker as W
from tunix_rt.models.config import ModelConfig, RopeConfig
from tunix_rt.models.decoder import Decoder
from tunix_rt.train.sft import SFTObjective
from tunix_rt.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("fast_compiles")  # compile-bound (conftest.fast_compiles says when)


def _moe_model() -> Decoder:
    cfg = ModelConfig(architecture="qwen3_moe", vocab_size=W.VOCAB, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True,
                      rope=(("full_attention", RopeConfig(theta=10000.0)),), num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=16, norm_topk_prob=True)
    return Decoder(cfg, rngs=nnx.Rngs(0))


def _first_step(tmp_path, **overrides) -> dict[str, float]:
    objective = SFTObjective(W.make_items(16), max_length=W.SEQ, pad_id=0)
    trainer = Trainer(W.config(tmp_path, steps=2, **overrides), _moe_model(), objective)
    return trainer.run_step(0)


@pytest.mark.slow
def test_router_losses_add_to_the_objective(tmp_path):
    plain = _first_step(tmp_path / "plain")
    assert "router_aux_loss" not in plain
    both = _first_step(tmp_path / "both", router_aux_loss_coef=0.5, router_z_loss_coef=0.25)
    assert both["router_aux_loss"] > 0
    assert both["router_z_loss"] > 0
    expected = plain["loss"] + 0.5 * both["router_aux_loss"] + 0.25 * both["router_z_loss"]
    np.testing.assert_allclose(both["loss"], expected, rtol=1e-5)
    assert both["grad_norm"] != plain["grad_norm"]  # the router's gradient changed


@pytest.mark.parametrize("value", [-0.1, float("nan")])
def test_bad_router_loss_coefficient(tmp_path, value):
    with pytest.raises(ValueError, match="router_aux_loss_coef must be a finite number >= 0"):
        W.config(tmp_path, router_aux_loss_coef=value)
