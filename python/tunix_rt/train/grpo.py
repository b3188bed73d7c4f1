"""GRPO and its variants as an RL objective: group advantages (GRPO, Dr. GRPO, RLOO), the clipped
objective per token (or GSPO's per sequence) with DAPO's clip-higher, an optional k3 KL to the reference,
three loss aggregations, truncated-completion masking and DAPO's dynamic sampling.

Old log-probs: with one iteration per rollout the ratio is 1 by construction (the current policy,
detached, as TRL does); with num_iterations > 1 they are the engine's log-probs of the sampled tokens
(its processed_logprobs: the tempered distribution it drew from, the one the loss uses), or a scoring pass
of the policy at rollout time when top_k, top_p or min_p truncate that distribution (the loss's is not).
Either way the engine's log-probs are compared with the trainer's on each rollout's first step
(RLObjective.mismatch), and with importance_sampling_correction (on by default, as in TRL) each token's
policy loss is weighed by p_trainer / p_sampler (RLObjective.sampling_weights); the old log-probs are then
the trainer's too, so the mismatch is weighed out rather than clipped. With use_bias_correction_kl the k3 KL
is multiplied by pi / pi_old, as TRL does.
"""

from __future__ import annotations

import jax
import numpy as np

from tunix_rt.train.config import GRPOConfig
from tunix_rt.train.rl_losses import aggregate, clipped_policy_loss, group_advantages, kl_k3, policy_ratio
from tunix_rt.train.rl_trainer import RLObjective
from tunix_rt.train.rollout import Completions
from tunix_rt.train.trainer import LossContext


class GRPOObjective(RLObjective):
    def __init__(self, cfg: GRPOConfig, sampler, tokenizer, pad_id: int):
        super().__init__(cfg, sampler, tokenizer, pad_id)
        self.needs_reference = cfg.beta > 0
        truncated = cfg.top_k > 0 or cfg.top_p < 1.0 or cfg.min_p > 0.0
        # Old log-probs from the engine would put its mismatch into the clipped ratio, so the sampling correction
        # (which weighs it out) and a truncated sampling distribution (not the loss's) take the trainer's.
        self.old_from_score = cfg.num_iterations > 1 and (truncated or cfg.importance_sampling_correction)

    # --- host: rollouts -------------------------------------------------------------------------------

    def sample_batch(self, prompt_indices: np.ndarray) -> tuple[dict[str, np.ndarray], dict]:
        cfg, g = self.cfg, self.cfg.num_generations
        first = self.sampler.sample(self.rollout, prompt_indices)
        metrics = self.sampler.metrics(first)
        spread = first.rewards.reshape(-1, g).std(axis=1) > 0
        metrics["frac_reward_zero_std"] = float(1.0 - spread.mean())
        chosen = first
        if cfg.dynamic_sampling:
            chosen, extra = self._dynamic_sample(first)
            metrics.update(extra)
        batch = self.pack(chosen, self.sampler.seq_len)
        batch["advantages"] = np.asarray(group_advantages(chosen.rewards, g, cfg.advantage_estimator), np.float32)
        return batch, metrics

    def _dynamic_sample(self, first: Completions) -> tuple[Completions, dict]:
        """DAPO's dynamic sampling: keep groups whose rewards differ, sample fresh prompts for up to
        max_resample_rounds more rounds until the step's groups are full, then fill any shortfall with
        the agreeing groups (their advantages are 0: they add no policy gradient)."""
        cfg, g = self.cfg, self.cfg.num_generations
        want = len(first) // g
        kept, spare = [], []
        rounds = 0
        current = first
        while True:
            for k in range(len(current) // g):
                rows = np.arange(k * g, (k + 1) * g)
                (kept if current.rewards[rows].std() > 0 else spare).append(current.select(rows))
            if len(kept) >= want or rounds >= cfg.max_resample_rounds:
                break
            rounds += 1
            rng = np.random.default_rng(self.rollout.seed(0, stream=rounds))  # the round's fresh prompts
            n = len(self.sampler.examples)
            current = self.sampler.sample(self.rollout, rng.choice(n, want, replace=n < want), stream=rounds)
        filled = max(0, want - len(kept))
        groups = kept[:want] + spare[:filled]
        return Completions.concat(groups), {"dynamic_sampling/rounds": float(rounds),
                                            "dynamic_sampling/filled_groups": float(filled)}

    # --- traced: scoring pass and loss ----------------------------------------------------------------

    def score(self, ctx: LossContext, batch: dict) -> dict:
        out = {}
        if self.needs_reference:
            out["ref_logps"] = self.logprobs(ctx.reference(), batch)[0]
        if self.old_from_score:
            out["old_logps"] = self.logprobs(ctx.policy, batch)[0]
        return out

    def loss(self, ctx: LossContext, batch: dict):
        cfg = self.cfg
        logps, entropy = self.logprobs(ctx.policy, batch, entropy=True)
        mask = batch["loss_mask"]
        if cfg.num_iterations == 1:
            old = jax.lax.stop_gradient(logps)
        else:
            old = batch["old_logps"] if self.old_from_score else batch["sampler_logps"]
        per_token, clip = clipped_policy_loss(logps, old, batch["advantages"], mask, epsilon=cfg.epsilon,
                                              epsilon_high=cfg.epsilon_high,
                                              importance_sampling_level=cfg.importance_sampling_level)
        mismatch, extremes = self.mismatch(logps, batch["sampler_logps"], mask)
        token_metrics = {**clip, **mismatch, "entropy": jax.lax.stop_gradient(entropy)}
        if cfg.importance_sampling_correction:  # old: the trainer's log-probs at rollout time (see __init__)
            weights, is_metrics, is_extremes = self.sampling_weights(old, batch, mask)
            per_token = per_token * weights
            token_metrics.update(is_metrics)
            extremes.update(is_extremes)
        if self.needs_reference:
            kl = kl_k3(logps, batch["ref_logps"])
            token_metrics["kl"] = jax.lax.stop_gradient(kl)
            if cfg.use_bias_correction_kl:
                kl = kl * policy_ratio(logps, old, mask, cfg.importance_sampling_level)
            per_token = per_token + cfg.beta * kl
        loss_sum, weight = aggregate(per_token, mask, cfg.loss_agg_mode, max_len=cfg.max_completion_length)
        return loss_sum, weight, {**self.token_sums(token_metrics, mask), **extremes}
