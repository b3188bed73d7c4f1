"""Training losses as pure JAX functions: token log-probs, SFT cross-entropy, the DPO family, distillation.

Conventions: `logits` (B, T, V) of any float dtype, computed in f32; `targets` (B, T) int32, the token
each position must predict (the caller has already shifted them); `mask` (B, T), nonzero where the
target counts. Masked positions never contribute: every mean is over counted tokens only, and their
targets may be anything (e.g. -100). Shapes are checked in Python, so every function is jit-able;
the keyword-only hyperparameters (and `PreferenceConfig`) are static.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

# ---------------------------------------------------------------------------------------------------
# Token log-probs and cross-entropy
# ---------------------------------------------------------------------------------------------------


def _check_shape(what: str, shape: tuple, expected: str, expected_shape: tuple) -> None:
    """ValueError "`what` (...) must equal `expected` (...)" unless the static shapes agree."""
    if tuple(shape) != tuple(expected_shape):
        raise ValueError(f"{what} {tuple(shape)} must equal {expected} {tuple(expected_shape)}")


def _check_masked_args(logits_name: str, logits: jax.Array, targets: jax.Array, mask: jax.Array) -> None:
    _check_shape("targets shape", jnp.shape(targets), f"{logits_name} shape[:-1]", jnp.shape(logits)[:-1])
    _check_shape("mask shape", jnp.shape(mask), "targets shape", jnp.shape(targets))


def _masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean of `x` over the counted positions; 0 (not NaN) when none count."""
    return jnp.sum(jnp.where(mask, x, 0.0)) / jnp.maximum(jnp.sum(mask), 1)


def token_logprobs(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """(B, T) f32 log-probability of each target: logit minus logsumexp, so no (B, T, V) softmax is kept."""
    _check_shape("targets shape", jnp.shape(targets), "logits shape[:-1]", jnp.shape(logits)[:-1])
    logits = logits.astype(jnp.float32)
    picked = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return picked - jax.nn.logsumexp(logits, axis=-1)


def sequence_logprobs(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(sum, count), both (B,) f32: each row's summed target log-probs and its number of counted tokens.

    The sum is what preference losses compare; the count lets length-normalised ones (IPO, SimPO,
    ORPO) average it. Masked targets are replaced by 0 before the gather so they may be out of range.
    """
    _check_masked_args("logits", logits, targets, mask)
    counted = mask.astype(bool)
    logps = token_logprobs(logits, jnp.where(counted, targets, 0))
    return jnp.sum(jnp.where(counted, logps, 0.0), axis=-1), jnp.sum(counted, axis=-1, dtype=jnp.float32)


def cross_entropy(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> jax.Array:
    """Token-mean NLL over every counted token of the batch (long rows weigh more, as in SFT); 0 if none."""
    sums, counts = sequence_logprobs(logits, targets, mask)
    return -jnp.sum(sums) / jnp.maximum(jnp.sum(counts), 1.0)


# ---------------------------------------------------------------------------------------------------
# Preference losses (DPO family), formulas as in TRL
# ---------------------------------------------------------------------------------------------------


class PreferenceStats(NamedTuple):
    """Per-pair (B,) statistics every preference loss reads (a pytree, so it passes through jit).

    `*_logps` are masked sums of completion token log-probs (`sequence_logprobs`), `*_len` the
    completion token counts. The reference columns are ignored by reference-free losses (pass zeros).
    """

    chosen_logps: jax.Array
    rejected_logps: jax.Array
    chosen_len: jax.Array
    rejected_len: jax.Array
    ref_chosen_logps: jax.Array
    ref_rejected_logps: jax.Array


# Losses that use no reference model: their rewards are beta * the policy's average log-probs.
_REFERENCE_FREE = frozenset({"orpo", "simpo"})


@dataclasses.dataclass(kw_only=True, unsafe_hash=True)
class PreferenceConfig:
    """Which preference loss and its hyperparameters; DPOConfig inherits these fields, so they are declared once.

    Hashed by value, so it can be a static jit argument; nothing changes it after construction.

    `beta` is DPO's inverse temperature; for ORPO it is TRL's lambda, the weight of the odds-ratio
    term. `label_smoothing` is the assumed fraction of flipped labels (conservative / robust DPO,
    SimPO); `simpo_gamma` is SimPO's target reward margin.
    """

    loss_type: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5

    def __post_init__(self):
        self._check_preference()

    def _check_preference(self) -> None:
        _lookup(self.loss_type)
        if not (math.isfinite(self.beta) and self.beta > 0):
            raise ValueError(f"beta must be a finite number > 0, got {self.beta}")
        limit = 0.5 if self.loss_type == "robust" else 1.0
        if not 0.0 <= self.label_smoothing < limit:
            raise ValueError(f"label_smoothing must be in [0, {limit}) for loss_type {self.loss_type!r}, "
                             f"got {self.label_smoothing}")
        if not math.isfinite(self.simpo_gamma):
            raise ValueError(f"simpo_gamma must be finite, got {self.simpo_gamma}")

    @property
    def reference_free(self) -> bool:
        """True when the loss needs no reference model (the caller can skip its forward pass)."""
        return self.loss_type in _REFERENCE_FREE


Metrics = dict[str, jax.Array]


def _average(logps: jax.Array, length: jax.Array) -> jax.Array:
    """Length-normalised log-prob; an empty completion averages to 0 instead of NaN."""
    return logps / jnp.maximum(length, 1)


def _policy_averages(stats: PreferenceStats) -> tuple[jax.Array, jax.Array]:
    """The policy's average chosen and rejected log-probs, what reference-free losses compare."""
    return _average(stats.chosen_logps, stats.chosen_len), _average(stats.rejected_logps, stats.rejected_len)


def _reward_metrics(chosen: jax.Array, rejected: jax.Array) -> Metrics:
    """TRL's per-pair reward metrics; detached, they are for logging only."""
    chosen, rejected = jax.lax.stop_gradient(chosen), jax.lax.stop_gradient(rejected)
    return {"rewards/chosen": chosen, "rewards/rejected": rejected, "rewards/margins": chosen - rejected,
            "rewards/accuracies": (chosen > rejected).astype(jnp.float32)}


def _smoothed_nll(z: jax.Array, label_smoothing: float) -> jax.Array:
    """Binary NLL of preferring chosen given margin z, with a fraction of labels assumed flipped."""
    return -jax.nn.log_sigmoid(z) * (1 - label_smoothing) - jax.nn.log_sigmoid(-z) * label_smoothing


def _dpo_logits(stats: PreferenceStats, cfg: PreferenceConfig, *,
                average: bool = False) -> tuple[jax.Array, Metrics]:
    """Policy log-ratio minus reference log-ratio, and rewards beta * (policy - reference) log-probs.

    The reference is detached (it is a frozen model); `average` length-normalises all four terms.
    """
    chosen, rejected = stats.chosen_logps, stats.rejected_logps
    ref_chosen = jax.lax.stop_gradient(stats.ref_chosen_logps)
    ref_rejected = jax.lax.stop_gradient(stats.ref_rejected_logps)
    if average:
        chosen, ref_chosen = _average(chosen, stats.chosen_len), _average(ref_chosen, stats.chosen_len)
        rejected = _average(rejected, stats.rejected_len)
        ref_rejected = _average(ref_rejected, stats.rejected_len)
    logits = (chosen - rejected) - (ref_chosen - ref_rejected)
    return logits, _reward_metrics(cfg.beta * (chosen - ref_chosen), cfg.beta * (rejected - ref_rejected))


def _sigmoid_loss(stats: PreferenceStats, cfg: PreferenceConfig) -> tuple[jax.Array, Metrics]:
    """DPO (Rafailov et al.); with label_smoothing > 0 conservative DPO."""
    logits, metrics = _dpo_logits(stats, cfg)
    return _smoothed_nll(cfg.beta * logits, cfg.label_smoothing), metrics


def _robust_loss(stats: PreferenceStats, cfg: PreferenceConfig) -> tuple[jax.Array, Metrics]:
    """Robust DPO (Chowdhury et al.): an unbiased loss under label noise of rate label_smoothing."""
    logits, metrics = _dpo_logits(stats, cfg)
    z, ls = cfg.beta * logits, cfg.label_smoothing
    return (-jax.nn.log_sigmoid(z) * (1 - ls) + jax.nn.log_sigmoid(-z) * ls) / (1 - 2 * ls), metrics


def _hinge_loss(stats: PreferenceStats, cfg: PreferenceConfig) -> tuple[jax.Array, Metrics]:
    """SLiC's hinge on the DPO margin: no gradient once beta * margin exceeds 1."""
    logits, metrics = _dpo_logits(stats, cfg)
    return jax.nn.relu(1 - cfg.beta * logits), metrics


def _ipo_loss(stats: PreferenceStats, cfg: PreferenceConfig) -> tuple[jax.Array, Metrics]:
    """IPO (Azar et al.): regress the margin to 1/(2 beta), which does not saturate like DPO.

    As in TRL, on length-averaged log-probs (policy and reference), rewards included.
    """
    logits, metrics = _dpo_logits(stats, cfg, average=True)
    return (logits - 1 / (2 * cfg.beta)) ** 2, metrics


def _simpo_loss(stats: PreferenceStats, cfg: PreferenceConfig) -> tuple[jax.Array, Metrics]:
    """SimPO (Meng et al.): reference-free, the margin of average log-probs must exceed simpo_gamma."""
    chosen, rejected = _policy_averages(stats)
    z = cfg.beta * (chosen - rejected) - cfg.simpo_gamma
    return _smoothed_nll(z, cfg.label_smoothing), _reward_metrics(cfg.beta * chosen, cfg.beta * rejected)


# Average log-probs are clamped below 0 so log(1 - p) stays finite when the policy is certain.
_MAX_AVG_LOGP = -1e-7


def _log1mexp(x: jax.Array) -> jax.Array:
    """log(1 - exp(x)) for x < 0, accurate at both ends (Maechler 2012)."""
    return jnp.where(x > -math.log(2), jnp.log(-jnp.expm1(x)), jnp.log1p(-jnp.exp(x)))


def _orpo_loss(stats: PreferenceStats, cfg: PreferenceConfig) -> tuple[jax.Array, Metrics]:
    """ORPO (Hong et al.): SFT NLL on chosen minus beta * log sigmoid(log odds ratio), reference-free.

    Per pair, the NLL is the chosen completion's token-mean (TRL takes one token-mean over the batch).
    """
    chosen, rejected = _policy_averages(stats)
    log_odds = (chosen - rejected) - (_log1mexp(jnp.minimum(chosen, _MAX_AVG_LOGP))
                                      - _log1mexp(jnp.minimum(rejected, _MAX_AVG_LOGP)))
    losses = -chosen - cfg.beta * jax.nn.log_sigmoid(log_odds)
    return losses, _reward_metrics(cfg.beta * chosen, cfg.beta * rejected)


PreferenceLoss = Callable[[PreferenceStats, PreferenceConfig], tuple[jax.Array, Metrics]]

# Every entry: (stats, cfg) -> ((B,) losses, {name: (B,) metric}).
PREFERENCE_LOSSES: dict[str, PreferenceLoss] = {
    "sigmoid": _sigmoid_loss,
    "robust": _robust_loss,
    "hinge": _hinge_loss,
    "ipo": _ipo_loss,
    "simpo": _simpo_loss,
    "orpo": _orpo_loss,
}


def _lookup(loss_type: str) -> PreferenceLoss:
    if loss_type not in PREFERENCE_LOSSES:
        raise ValueError(f"unknown loss_type {loss_type!r}; valid: {', '.join(sorted(PREFERENCE_LOSSES))}")
    return PREFERENCE_LOSSES[loss_type]


def preference_loss(stats: PreferenceStats, cfg: PreferenceConfig) -> tuple[jax.Array, Metrics]:
    """The batch-mean loss of `cfg.loss_type` and the batch mean of each metric."""
    loss_fn = _lookup(cfg.loss_type)
    for name, value in zip(PreferenceStats._fields[1:], stats[1:]):
        _check_shape(f"stats.{name} shape", jnp.shape(value), "stats.chosen_logps shape",
                     jnp.shape(stats.chosen_logps))
    losses, metrics = loss_fn(stats, cfg)
    return jnp.mean(losses), {name: jnp.mean(value) for name, value in metrics.items()}


# ---------------------------------------------------------------------------------------------------
# Knowledge distillation
# ---------------------------------------------------------------------------------------------------


def kto_losses(logratios: jax.Array, kl_logratios: jax.Array, desirable: jax.Array, valid: jax.Array, *,
               beta: float, desirable_weight: float = 1.0, undesirable_weight: float = 1.0
               ) -> tuple[jax.Array, Metrics]:
    """TRL's KTO (loss_type "kto"), per example: with z0 = max(0, mean over the batch's valid rows of the
    mismatched pairs' policy/reference log-ratio), held constant (no gradient through it), a desirable
    completion loses w_d * (1 - sigmoid(beta * (logratio - z0))) and an undesirable one
    w_u * (1 - sigmoid(beta * (z0 - logratio))). `logratios`, `kl_logratios` (B,) are summed completion
    log-prob differences (policy - reference); `desirable`, `valid` (B,) booleans/weights."""
    valid = valid.astype(jnp.float32)
    kl = jax.lax.stop_gradient(jnp.maximum(jnp.sum(kl_logratios * valid) / jnp.maximum(jnp.sum(valid), 1.0), 0.0))
    good = desirable.astype(bool)
    losses = jnp.where(good, desirable_weight * (1.0 - jax.nn.sigmoid(beta * (logratios - kl))),
                       undesirable_weight * (1.0 - jax.nn.sigmoid(beta * (kl - logratios))))
    rewards = beta * jax.lax.stop_gradient(logratios)
    metrics = {"kl": jnp.broadcast_to(kl, logratios.shape), "rewards/chosen": jnp.where(good, rewards, 0.0),
               "rewards/rejected": jnp.where(good, 0.0, rewards), "count/chosen": good.astype(jnp.float32),
               "count/rejected": (~good).astype(jnp.float32)}
    return losses, metrics


def _check_kd_hparams(temperature: float, alpha: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")


def _kl(log_p: jax.Array, log_q: jax.Array) -> jax.Array:
    """KL(p || q) over the last axis; entries where p is 0 contribute 0 (even where log_q is -inf)."""
    p = jnp.exp(log_p)
    return jnp.sum(jnp.where(p > 0, p * (log_p - log_q), 0.0), axis=-1)


def _mix(kl: jax.Array, student_logits: jax.Array, targets: jax.Array, mask: jax.Array,
         temperature: float, alpha: float) -> tuple[jax.Array, Metrics]:
    """alpha * T^2 * masked-mean KL + (1 - alpha) * CE; T^2 keeps the soft gradients' scale T-independent."""
    kd = temperature**2 * _masked_mean(kl, mask.astype(bool))
    ce = cross_entropy(student_logits, targets, mask)
    return alpha * kd + (1 - alpha) * ce, {"kd": kd, "ce": ce}


def distillation_loss(student_logits: jax.Array, teacher_logits: jax.Array, targets: jax.Array,
                      mask: jax.Array, *, temperature: float, alpha: float) -> tuple[jax.Array, Metrics]:
    """Hinton KD: alpha * T^2 * KL(teacher_T || student_T) + (1 - alpha) * CE on the hard targets.

    The KL is averaged over counted positions only (Tunix's averages over padding too). The teacher
    is detached. Returns the loss and {"kd": T^2 * KL term, "ce": cross-entropy term}.
    """
    _check_kd_hparams(temperature, alpha)
    _check_shape("teacher_logits shape", jnp.shape(teacher_logits), "student_logits shape",
                 jnp.shape(student_logits))
    _check_masked_args("student_logits", student_logits, targets, mask)
    teacher = jax.lax.stop_gradient(teacher_logits).astype(jnp.float32)
    log_p = jax.nn.log_softmax(teacher / temperature, axis=-1)
    log_q = jax.nn.log_softmax(student_logits.astype(jnp.float32) / temperature, axis=-1)
    return _mix(_kl(log_p, log_q), student_logits, targets, mask, temperature, alpha)


def teacher_topk(teacher_logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The teacher's k largest logits and their (int32) ids per position, for storing only those."""
    if not 1 <= k <= jnp.shape(teacher_logits)[-1]:
        raise ValueError(f"k must be in [1, {jnp.shape(teacher_logits)[-1]}] (the vocab size), got {k}")
    return jax.lax.top_k(teacher_logits, k)


def topk_distillation_loss(student_logits: jax.Array, teacher_topk_logits: jax.Array,
                           teacher_topk_ids: jax.Array, targets: jax.Array, mask: jax.Array, *,
                           temperature: float, alpha: float) -> tuple[jax.Array, Metrics]:
    """`distillation_loss` from a teacher stored as its top-k logits: the teacher distribution is the
    softmax over its k entries, the student's log-probs are over the full vocab gathered at those ids
    (so student mass outside the teacher's top k still costs). With k = V it equals full KD.
    """
    _check_kd_hparams(temperature, alpha)
    _check_shape("teacher_topk_ids shape", jnp.shape(teacher_topk_ids), "teacher_topk_logits shape",
                 jnp.shape(teacher_topk_logits))
    _check_shape("teacher_topk_logits shape[:-1]", jnp.shape(teacher_topk_logits)[:-1],
                 "student_logits shape[:-1]", jnp.shape(student_logits)[:-1])
    _check_masked_args("student_logits", student_logits, targets, mask)
    teacher = jax.lax.stop_gradient(teacher_topk_logits).astype(jnp.float32)
    log_p = jax.nn.log_softmax(teacher / temperature, axis=-1)
    log_q_full = jax.nn.log_softmax(student_logits.astype(jnp.float32) / temperature, axis=-1)
    log_q = jnp.take_along_axis(log_q_full, teacher_topk_ids.astype(jnp.int32), axis=-1)
    return _mix(_kl(log_p, log_q), student_logits, targets, mask, temperature, alpha)
