"""RL losses and estimators as pure JAX functions: advantages (GRPO, Dr. GRPO, RLOO, GAE), the clipped
policy objective (PPO/GRPO, DAPO's asymmetric clip, GSPO's sequence-level ratio), the k3 KL estimator,
the loss aggregation modes, the clipped value loss, and token log-probs with their entropy.

Conventions as in losses.py: per-token arrays are (B, T) over the completion tokens; `mask` (B, T) is
nonzero where a token counts. Every loss returns (sum, weight) in the aggregation's own unit (tokens or
sequences), so the trainer's accumulation over micro-batches gives the same update as one big batch.
Estimators are registered by name (ADVANTAGE_ESTIMATORS, AGGREGATIONS), as Tunix's algo_core does.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from tunix_rt.train.config import SAMPLING_CORRECTION_MODES

Metrics = dict[str, jax.Array]

# --------------------------------------------------------------------------------------------------
# Group advantages (one scalar per completion; completions of one prompt are adjacent, G per group)
# --------------------------------------------------------------------------------------------------

_STD_EPS = 1e-4  # TRL's: a group whose rewards all agree gets advantage 0, not 0/0


def _grouped(rewards: jax.Array, group_size: int) -> jax.Array:
    rewards = jnp.asarray(rewards, jnp.float32)
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be 1-D (one per completion), got shape {rewards.shape}")
    if not isinstance(group_size, int) or group_size < 2:
        raise ValueError(f"group_size must be an integer >= 2 (completions per prompt), got {group_size!r}")
    if rewards.shape[0] % group_size:
        raise ValueError(f"rewards ({rewards.shape[0]}) must be a whole number of groups of {group_size}")
    return rewards.reshape(-1, group_size)


def _centred(g: jax.Array) -> jax.Array:
    """r - group mean, taken about the group's first reward: equal rewards give exactly 0, where an f32
    mean of equal values can be off by an ulp, which GRPO's division by a ~0 std would blow up."""
    shifted = g - g[:, :1]
    return shifted - shifted.mean(axis=1, keepdims=True)


def grpo_advantages(rewards: jax.Array, group_size: int) -> jax.Array:
    """GRPO: (r - group mean) / (group std + eps), the std unbiased (ddof=1) as TRL computes it."""
    centred = _centred(_grouped(rewards, group_size))
    std = jnp.sqrt((centred**2).sum(axis=1, keepdims=True) / (group_size - 1))
    return (centred / (std + _STD_EPS)).reshape(-1)


def dr_grpo_advantages(rewards: jax.Array, group_size: int) -> jax.Array:
    """Dr. GRPO: r - group mean, no std scaling (which favours groups of near-equal rewards)."""
    return _centred(_grouped(rewards, group_size)).reshape(-1)


def rloo_advantages(rewards: jax.Array, group_size: int) -> jax.Array:
    """RLOO: r_i minus the mean reward of the other G-1 completions of its prompt, which is G/(G-1) times
    r_i minus the group mean (taken as `_centred` takes it: equal rewards give exactly 0)."""
    return (_centred(_grouped(rewards, group_size)) * (group_size / (group_size - 1))).reshape(-1)


ADVANTAGE_ESTIMATORS: dict[str, Callable[[jax.Array, int], jax.Array]] = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
}


def group_advantages(rewards: jax.Array, group_size: int, estimator: str) -> jax.Array:
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; valid: {', '.join(ADVANTAGE_ESTIMATORS)}")
    return ADVANTAGE_ESTIMATORS[estimator](rewards, group_size)


# --------------------------------------------------------------------------------------------------
# GAE (PPO): per-token advantages from per-token rewards and values, by a reverse scan over time
# --------------------------------------------------------------------------------------------------


def gae(rewards: jax.Array, values: jax.Array, mask: jax.Array, *, gamma: float,
        lam: float) -> tuple[jax.Array, jax.Array]:
    """(advantages, returns), both (B, T): A_t = delta_t + gamma * lam * A_{t'} with
    delta_t = r_t + gamma * V_{t'} - V_t, where t' is the next counted token: uncounted tokens between two
    counted ones (an agentic trajectory's tool results) are the environment's, not time steps of the policy,
    and past the last counted token rewards and values are 0, so the last token bootstraps from nothing.
    Returns are A + V (the value targets)."""
    if jnp.shape(values) != jnp.shape(rewards) or jnp.shape(mask) != jnp.shape(rewards):
        raise ValueError(f"rewards {jnp.shape(rewards)}, values {jnp.shape(values)} and mask {jnp.shape(mask)} "
                         "must have one shape")
    if not (0 <= gamma <= 1 and 0 <= lam <= 1):
        raise ValueError(f"gamma and lam must be in [0, 1], got {gamma} and {lam}")
    m = mask.astype(jnp.float32)
    r, v = rewards.astype(jnp.float32) * m, values.astype(jnp.float32) * m

    def back(carry, step):
        next_a, next_v = carry
        r_t, v_t, counted = step
        a = r_t + gamma * next_v - v_t + gamma * lam * next_a
        return (jnp.where(counted, a, next_a), jnp.where(counted, v_t, next_v)), jnp.where(counted, a, 0.0)

    zeros = jnp.zeros_like(r[:, 0])
    _, adv = jax.lax.scan(back, (zeros, zeros), (r.T, v.T, m.T > 0), reverse=True)
    adv = adv.T
    return adv, (adv + v) * m


def whiten(x: jax.Array, mask: jax.Array, *, shift_mean: bool = True) -> jax.Array:
    """Normalise x over its counted entries (mean 0 unless shift_mean is False, variance 1), as TRL's PPO does."""
    m = mask.astype(jnp.float32)
    n = jnp.maximum(m.sum(), 1.0)
    mean = (x * m).sum() / n
    var = (((x - mean) * m) ** 2).sum() / jnp.maximum(n - 1, 1.0)
    out = (x - mean) * jax.lax.rsqrt(var + 1e-8)
    return (out if shift_mean else out + mean) * m


# --------------------------------------------------------------------------------------------------
# Token-level pieces
# --------------------------------------------------------------------------------------------------


def kl_k3(logps: jax.Array, ref_logps: jax.Array) -> jax.Array:
    """Schulman's k3 estimator of KL(policy || reference) per token: exp(d) - d - 1, d = ref - policy (>= 0)."""
    d = ref_logps - logps
    return jnp.exp(d) - d - 1


def logprobs_and_entropy(logits: jax.Array, targets: jax.Array, *,
                         temperature: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """(B, T) log-probs of `targets` and (B, T) entropy under softmax(logits / temperature), in f32, from one
    log-softmax over the vocabulary (the losses need both)."""
    if jnp.shape(targets) != jnp.shape(logits)[:-1]:
        raise ValueError(f"targets shape {jnp.shape(targets)} must equal logits shape[:-1] {jnp.shape(logits)[:-1]}")
    logp = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
    picked = jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return picked, -jnp.sum(jnp.exp(logp) * logp, axis=-1)


# --------------------------------------------------------------------------------------------------
# Aggregation: how per-token losses become one number
# --------------------------------------------------------------------------------------------------


def _token_mean(x, m, max_len):
    return (x * m).sum(), m.sum()


def _seq_mean_token_mean(x, m, max_len):
    per_seq = (x * m).sum(-1) / jnp.maximum(m.sum(-1), 1.0)
    has = (m.sum(-1) > 0).astype(jnp.float32)
    return (per_seq * has).sum(), has.sum()


def _seq_mean_token_sum_norm(x, m, max_len):
    return (x * m).sum() / max_len, (m.sum(-1) > 0).astype(jnp.float32).sum()


# name -> (per_token (B, T), mask (B, T) f32, max_len) -> (sum, weight). The loss is sum / weight, summed
# and weighed over all micro-batches: token-mean (DAPO, TRL "bnpo"/"dapo"), sequence-mean-token-mean
# (GRPO's paper, TRL "grpo"), seq-mean-token-sum-norm (Dr. GRPO: a constant normaliser, no length bias).
AGGREGATIONS: dict[str, Callable[[jax.Array, jax.Array, int], tuple[jax.Array, jax.Array]]] = {
    "token-mean": _token_mean,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
}


def aggregate(per_token: jax.Array, mask: jax.Array, mode: str, *, max_len: int | None = None
              ) -> tuple[jax.Array, jax.Array]:
    """(sum, weight) of per-token values under an aggregation mode; sum / weight is the loss."""
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {mode!r}; valid: {', '.join(AGGREGATIONS)}")
    if jnp.shape(mask) != jnp.shape(per_token):
        raise ValueError(f"mask shape {jnp.shape(mask)} must equal per_token shape {jnp.shape(per_token)}")
    max_len = jnp.shape(per_token)[-1] if max_len is None else max_len
    return AGGREGATIONS[mode](per_token.astype(jnp.float32), mask.astype(jnp.float32), max_len)


# --------------------------------------------------------------------------------------------------
# The clipped policy objective
# --------------------------------------------------------------------------------------------------

IMPORTANCE_LEVELS = ("token", "sequence")


def policy_ratio(logps: jax.Array, old_logps: jax.Array, mask: jax.Array, level: str = "token") -> jax.Array:
    """pi / pi_old: (B, T) per token, or (B, 1) for GSPO's sequence level (the exponent of the sequence's mean
    log-ratio); differentiable in logps only."""
    log_ratio = logps - jax.lax.stop_gradient(old_logps)
    if level == "sequence":
        m = mask.astype(jnp.float32)
        log_ratio = (log_ratio * m).sum(-1, keepdims=True) / jnp.maximum(m.sum(-1, keepdims=True), 1.0)
    return jnp.exp(log_ratio)


def clipped_policy_loss(logps: jax.Array, old_logps: jax.Array, advantages: jax.Array, mask: jax.Array, *,
                        epsilon: float, epsilon_high: float | None = None,
                        importance_sampling_level: str = "token") -> tuple[jax.Array, Metrics]:
    """Per-token -min(ratio * A, clip(ratio, 1 - eps, 1 + eps_high) * A) and per-token clip indicators.

    `advantages` is (B,) (one per completion, GRPO) or (B, T) (per token, PPO). The ratio is
    exp(logp - old_logp) per token, or for GSPO (sequence level) the exponent of the sequence's mean
    log-ratio, shared by its tokens. Metrics (per token, for masked means): "clip_low", "clip_high"
    (where the clipped side won) and "clip_ratio" (either).
    """
    if importance_sampling_level not in IMPORTANCE_LEVELS:
        raise ValueError(f"importance_sampling_level must be one of {', '.join(IMPORTANCE_LEVELS)}, "
                         f"got {importance_sampling_level!r}")
    if jnp.shape(old_logps) != jnp.shape(logps) or jnp.shape(mask) != jnp.shape(logps):
        raise ValueError(f"logps {jnp.shape(logps)}, old_logps {jnp.shape(old_logps)} and mask {jnp.shape(mask)} "
                         "must have one shape")
    adv = advantages[:, None] if jnp.ndim(advantages) == 1 else advantages
    if jnp.shape(adv)[0] != jnp.shape(logps)[0] or jnp.ndim(adv) != 2:
        raise ValueError(f"advantages {jnp.shape(advantages)} must be (B,) or (B, T) for logps {jnp.shape(logps)}")
    eps_low, eps_high = epsilon, epsilon if epsilon_high is None else epsilon_high
    ratio = policy_ratio(logps, old_logps, mask, importance_sampling_level)
    clipped = jnp.clip(ratio, 1 - eps_low, 1 + eps_high)
    per_token = -jnp.minimum(ratio * adv, clipped * adv)
    per_token = jnp.broadcast_to(per_token, jnp.shape(logps))
    low = jnp.broadcast_to((ratio < 1 - eps_low) & (adv < 0), jnp.shape(logps)).astype(jnp.float32)
    high = jnp.broadcast_to((ratio > 1 + eps_high) & (adv > 0), jnp.shape(logps)).astype(jnp.float32)
    return per_token, {"clip_low": low, "clip_high": high, "clip_ratio": low + high}


def clipped_value_loss(values: jax.Array, old_values: jax.Array, returns: jax.Array, *,
                       clip_range: float) -> jax.Array:
    """Per-token 0.5 * max((V - R)^2, (clip(V, V_old +- c) - R)^2) (PPO's value clipping)."""
    clipped = old_values + jnp.clip(values - old_values, -clip_range, clip_range)
    return 0.5 * jnp.maximum((values - returns) ** 2, (clipped - returns) ** 2)


# --------------------------------------------------------------------------------------------------
# Importance sampling over the sampler/trainer mismatch
# --------------------------------------------------------------------------------------------------

def sampling_correction(trainer_logps: jax.Array, sampler_logps: jax.Array, mask: jax.Array, *, mode: str,
                        cap: float) -> tuple[jax.Array, Metrics, Metrics]:
    """The weight of each sampled token's policy loss for having been sampled by the engine rather than the
    policy trained (TRL's vllm_importance_sampling_correction): the ratio p_trainer / p_sampler of the sampled
    tokens, per token (token_*) or per sequence (sequence_*: the product over its counted tokens), truncated at
    `cap` (*_truncate) or set to 0 above it (*_mask). `trainer_logps` are the trainer's log-probs at sampling
    time (a constant here). Returns the (B, T) weights, per-token metrics for masked means (the weight, and
    "capped": whether the ratio was over the cap), and the weight's extremes over counted tokens (*_max, *_min).
    """
    if mode not in SAMPLING_CORRECTION_MODES:
        raise ValueError(f"importance_sampling_mode must be one of {', '.join(SAMPLING_CORRECTION_MODES)}, got {mode!r}")
    m = mask.astype(jnp.float32)
    log_ratio = (jax.lax.stop_gradient(trainer_logps) - sampler_logps) * m
    if mode.startswith("sequence"):
        log_ratio = log_ratio.sum(-1, keepdims=True)
    ratio = jnp.exp(log_ratio)
    capped = ratio > cap
    weight = jnp.minimum(ratio, cap) if mode.endswith("truncate") else jnp.where(capped, 0.0, ratio)
    weight = jnp.broadcast_to(weight, jnp.shape(mask))
    counted = m > 0
    extremes = {"importance_sampling/weight_max": jnp.max(jnp.where(counted, weight, -jnp.inf)),
                "importance_sampling/weight_min": jnp.min(jnp.where(counted, weight, jnp.inf))}
    per_token = {"importance_sampling/weight_mean": weight,
                 "importance_sampling/capped_fraction": jnp.broadcast_to(capped, jnp.shape(mask))}
    return weight, per_token, extremes
