"""PPO with a value-head critic on the policy's own trunk (one model, no second copy): per-token rewards
(the sequence reward at its last token, minus kl_coef times the policy/reference log-ratio on every
token), GAE by a reverse scan, whitened advantages, the clipped policy objective, the clipped value loss
and an entropy bonus. The rollout-time pass computes old log-probs, values, rewards and GAE once; the
num_iterations (PPO epochs) optimizer steps then reuse them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tunix_rt.models.decoder import Decoder, HeadParam
from tunix_rt.train.config import PPOConfig
from tunix_rt.train.rl_losses import aggregate, clipped_policy_loss, clipped_value_loss, gae, whiten
from tunix_rt.train.rl_trainer import RLObjective
from tunix_rt.train.trainer import LossContext


class ValueHead(nnx.Module):
    """hidden states (B, T, D) -> values (B, T): one linear unit, zero at the start (values start at 0)."""

    def __init__(self, hidden_size: int):
        self.kernel = HeadParam(jnp.zeros((hidden_size, 1), jnp.float32))
        self.bias = HeadParam(jnp.zeros((1,), jnp.float32))

    def start_from(self, kernel) -> None:
        """Begin as another (D, 1) head does (a reward model's score head), bias 0."""
        kernel = jnp.asarray(kernel, jnp.float32)
        if kernel.shape != self.kernel.get_value().shape:
            raise ValueError(f"value_model_init=reward: the reward model's head is {tuple(kernel.shape)}, the policy's "
                             f"value head {tuple(self.kernel.get_value().shape)} (their hidden sizes differ)")
        self.kernel.set_value(kernel)

    def __call__(self, h: jax.Array) -> jax.Array:
        h = h.astype(jnp.float32)
        return (h @ self.kernel[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32))[..., 0]


def attach_value_head(model: Decoder) -> Decoder:
    """Give the model a value head (in place) unless it has one; returns the model."""
    if not hasattr(model, "value_head"):
        model.value_head = ValueHead(model.config.hidden_size)
    return model


def policy_only(model: Decoder) -> Decoder:
    """The model without its value head (what an HF export holds), in place."""
    if hasattr(model, "value_head"):
        del model.value_head
    return model


def last_token_rewards(scores: jax.Array, mask: jax.Array) -> jax.Array:
    """(B, T) with each row's score at its last counted token and 0 elsewhere (a row with none gets none)."""
    t = mask.shape[1]
    counted = mask > 0
    last = t - 1 - jnp.argmax(counted[:, ::-1], axis=1)
    onehot = (jnp.arange(t)[None, :] == last[:, None]) & counted.any(axis=1, keepdims=True)
    return onehot * scores[:, None]


class PPOObjective(RLObjective):
    def __init__(self, cfg: PPOConfig, sampler, tokenizer, pad_id: int):
        super().__init__(cfg, sampler, tokenizer, pad_id)
        self.needs_reference = cfg.kl_coef > 0

    def _forward(self, model: Decoder, batch: dict, *, entropy: bool = False):
        """(log-probs, entropy or None, values) in the completion window from one pass through the trunk."""
        h = self.hidden(model, batch)
        logps, ent = self.logprobs(model, batch, entropy=entropy, hidden=h)
        return logps, ent, model.value_head(h)

    def sample_batch(self, prompt_indices: np.ndarray) -> tuple[dict[str, np.ndarray], dict]:
        completions = self.sampler.sample(self.rollout, prompt_indices)
        batch = self.pack(completions, self.sampler.seq_len)
        batch["scores"] = completions.rewards.astype(np.float32)
        return batch, self.sampler.metrics(completions)

    def score(self, ctx: LossContext, batch: dict) -> dict:
        cfg, mask = self.cfg, batch["loss_mask"]
        old, _, values = self._forward(ctx.policy, batch)
        rewards = last_token_rewards(batch["scores"], mask)
        out = {}
        if self.needs_reference:
            ref = self.logprobs(ctx.reference(), batch)[0]
            kl = (old - ref) * mask
            rewards = rewards - cfg.kl_coef * kl
            out["kl"] = kl
        advantages, returns = gae(rewards, values, mask, gamma=cfg.gamma, lam=cfg.lam)
        if cfg.whiten_advantages:
            advantages = whiten(advantages, mask)
        return {**out, "old_logps": old, "old_values": values * mask, "advantages": advantages, "returns": returns}

    def loss(self, ctx: LossContext, batch: dict):
        cfg, mask = self.cfg, batch["loss_mask"]
        logps, entropy, values = self._forward(ctx.policy, batch, entropy=True)
        pg, clip = clipped_policy_loss(logps, batch["old_logps"], batch["advantages"], mask, epsilon=cfg.epsilon,
                                       epsilon_high=cfg.epsilon_high)
        mismatch, extremes = self.mismatch(logps, batch["sampler_logps"], mask)
        if cfg.importance_sampling_correction:  # old_logps: the trainer's at rollout time (the scoring pass)
            weights, is_metrics, is_extremes = self.sampling_weights(batch["old_logps"], batch, mask)
            pg = pg * weights
            mismatch.update(is_metrics)
            extremes.update(is_extremes)
        vf = clipped_value_loss(values, batch["old_values"], batch["returns"], clip_range=cfg.cliprange_value)
        per_token = pg + cfg.vf_coef * vf
        if cfg.entropy_coef:
            per_token = per_token - cfg.entropy_coef * entropy
        loss_sum, weight = aggregate(per_token, mask, cfg.loss_agg_mode, max_len=cfg.max_completion_length)
        sg = jax.lax.stop_gradient
        metrics = {**clip, **mismatch, "entropy": sg(entropy), "value_loss": sg(vf), "policy_loss": sg(pg),
                   "approx_kl": sg(0.5 * (logps - batch["old_logps"]) ** 2)}
        if self.needs_reference:
            metrics["kl"] = batch["kl"]
        return loss_sum, weight, {**self.token_sums(metrics, mask), **extremes}
