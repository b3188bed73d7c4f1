"""RL estimators and losses against independent NumPy implementations (loops, written from the papers'
formulas), on hypothesis-drawn rewards, lengths and masks."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tunix_rt.train import rl_losses as rl

pytestmark = pytest.mark.usefixtures("fast_compiles")  # compile-bound (conftest.fast_compiles says when)

SETTINGS = settings(max_examples=40)


# --- NumPy references ------------------------------------------------------------------------------------


def np_group_advantages(rewards, g, estimator):
    out = np.zeros_like(rewards, dtype=np.float64)
    for start in range(0, len(rewards), g):
        group = rewards[start : start + g].astype(np.float64)
        for i in range(g):
            if estimator == "grpo":
                std = np.sqrt(((group - group.mean()) ** 2).sum() / (g - 1))
                out[start + i] = (group[i] - group.mean()) / (std + 1e-4)
            elif estimator == "dr_grpo":
                out[start + i] = group[i] - group.mean()
            else:  # rloo
                out[start + i] = group[i] - (group.sum() - group[i]) / (g - 1)
    return out


def np_gae(rewards, values, mask, gamma, lam):
    b, t = rewards.shape
    adv = np.zeros((b, t))
    for r in range(b):
        length = int(mask[r].sum())  # counted tokens form a prefix of the row here
        last = 0.0
        for i in reversed(range(length)):
            next_v = values[r, i + 1] if i + 1 < length else 0.0
            delta = rewards[r, i] + gamma * next_v - values[r, i]
            last = delta + gamma * lam * last
            adv[r, i] = last
    returns = (adv + values) * mask
    return adv, returns


def np_policy_loss(logps, old, adv, mask, eps_low, eps_high, level):
    b, t = logps.shape
    per = np.zeros((b, t))
    for r in range(b):
        n = mask[r].sum()
        seq_ratio = np.exp(((logps[r] - old[r]) * mask[r]).sum() / max(n, 1))
        for i in range(t):
            ratio = seq_ratio if level == "sequence" else np.exp(logps[r, i] - old[r, i])
            a = adv[r] if adv.ndim == 1 else adv[r, i]
            per[r, i] = -min(ratio * a, np.clip(ratio, 1 - eps_low, 1 + eps_high) * a)
    return per


def np_aggregate(per, mask, mode, max_len):
    if mode == "token-mean":
        return (per * mask).sum(), mask.sum()
    rows = [r for r in range(per.shape[0]) if mask[r].sum() > 0]
    if mode == "seq-mean-token-mean":
        return sum((per[r] * mask[r]).sum() / mask[r].sum() for r in rows), len(rows)
    return sum((per[r] * mask[r]).sum() for r in rows) / max_len, len(rows)


# --- strategies ----------------------------------------------------------------------------------------------


@st.composite
def grouped_rewards(draw):
    g = draw(st.integers(2, 6))
    groups = draw(st.integers(1, 4))
    values = st.one_of(st.sampled_from([0.0, 1.0]), st.floats(-5, 5, allow_nan=False, width=32))
    return np.array(draw(st.lists(values, min_size=g * groups, max_size=g * groups)), np.float32), g


@st.composite
def token_batch(draw, with_empty_rows=True):
    b, t = draw(st.integers(1, 4)), draw(st.integers(1, 7))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    lengths = rng.integers(0 if with_empty_rows else 1, t + 1, b)
    mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float32)
    logps = -rng.exponential(1.0, (b, t)).astype(np.float32)
    old = (logps + rng.normal(0, 0.3, (b, t))).astype(np.float32)
    return logps, old, mask, rng


# --- advantages ----------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
@SETTINGS
@given(data=grouped_rewards())
def test_group_advantages_match_numpy(estimator, data):
    rewards, g = data
    ours = np.asarray(rl.group_advantages(jnp.asarray(rewards), g, estimator))
    np.testing.assert_allclose(ours, np_group_advantages(rewards, g, estimator), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_equal_rewards_give_zero_advantage(estimator):
    """Found by hypothesis: an f32 mean of three equal rewards is off by an ulp, and GRPO's division by
    std + 1e-4 turned that into advantages of -1e-3 for a group with nothing to learn."""
    rewards = jnp.full((6,), 2.9, jnp.float32)
    assert np.all(np.asarray(rl.group_advantages(rewards, 3, estimator)) == 0)


def test_equal_integer_rewards_give_zero_advantage_for_every_estimator():
    for estimator in rl.ADVANTAGE_ESTIMATORS:
        assert np.all(np.asarray(rl.group_advantages(jnp.full((8,), 3.0), 4, estimator)) == 0)


def test_group_advantage_errors():
    with pytest.raises(ValueError, match="whole number of groups"):
        rl.grpo_advantages(jnp.zeros(5), 2)
    with pytest.raises(ValueError, match="group_size"):
        rl.rloo_advantages(jnp.zeros(4), 1)
    with pytest.raises(ValueError, match="1-D"):
        rl.dr_grpo_advantages(jnp.zeros((2, 2)), 2)
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'"):
        rl.group_advantages(jnp.zeros(4), 2, "ppo")


# --- GAE, whitening --------------------------------------------------------------------------------------


@pytest.mark.slow
@SETTINGS
@given(data=token_batch(), gamma=st.floats(0, 1), lam=st.floats(0, 1))
def test_gae_matches_numpy(data, gamma, lam):
    _, _, mask, rng = data
    rewards = rng.normal(size=mask.shape).astype(np.float32) * mask
    values = rng.normal(size=mask.shape).astype(np.float32) * mask
    adv, ret = rl.gae(jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(mask), gamma=gamma, lam=lam)
    want_adv, want_ret = np_gae(rewards, values, mask, gamma, lam)
    np.testing.assert_allclose(np.asarray(adv), want_adv, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(ret), want_ret, rtol=1e-4, atol=1e-4)


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), gamma=st.floats(0, 1), lam=st.floats(0, 1))
def test_gae_steps_over_uncounted_tokens(seed, gamma, lam):
    """An agentic trajectory's tool results sit between the policy's turns, uncounted: GAE runs over the counted
    tokens as if they were adjacent (NumPy over the compacted row), whatever the values at the holes hold."""
    rng = np.random.default_rng(seed)
    mask = (rng.random((3, 12)) < 0.6).astype(np.float32)
    rewards = rng.normal(size=mask.shape).astype(np.float32) * mask
    values = rng.normal(size=mask.shape).astype(np.float32)
    adv, ret = rl.gae(jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(mask), gamma=gamma, lam=lam)
    for r in range(3):
        kept = np.flatnonzero(mask[r])
        ones = np.ones((1, len(kept)), np.float32)
        want_adv, want_ret = np_gae(rewards[r:r + 1, kept], values[r:r + 1, kept], ones, gamma, lam)
        np.testing.assert_allclose(np.asarray(adv)[r, kept], want_adv[0], rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(np.asarray(ret)[r, kept], want_ret[0], rtol=1e-4, atol=1e-4)
        assert not np.asarray(adv)[r, mask[r] == 0].any() and not np.asarray(ret)[r, mask[r] == 0].any()


def test_gae_ignores_values_past_the_mask():
    """Garbage in the padding (a value head's output there) must not leak into the advantages."""
    mask = jnp.array([[1.0, 1.0, 0.0, 0.0]])
    rewards = jnp.array([[0.0, 1.0, 0.0, 0.0]])
    clean = rl.gae(rewards, jnp.array([[0.5, 0.2, 0.0, 0.0]]), mask, gamma=0.9, lam=0.8)
    dirty = rl.gae(rewards, jnp.array([[0.5, 0.2, 7.0, -3.0]]), mask, gamma=0.9, lam=0.8)
    np.testing.assert_allclose(np.asarray(clean[0]), np.asarray(dirty[0]))
    # one-step check by hand: A_1 = 1 - 0.2; A_0 = 0 + 0.9 * 0.2 - 0.5 + 0.9 * 0.8 * A_1
    np.testing.assert_allclose(np.asarray(clean[0])[0, :2], [0.18 - 0.5 + 0.72 * 0.8, 0.8], rtol=1e-6)


def test_whiten_over_counted_entries():
    x = jnp.array([[1.0, 2.0, 3.0, 100.0]])
    mask = jnp.array([[1.0, 1.0, 1.0, 0.0]])
    out = np.asarray(rl.whiten(x, mask))
    np.testing.assert_allclose(out[0, :3], np.array([-1.0, 0.0, 1.0]) / np.std([1, 2, 3], ddof=1), rtol=1e-5)
    assert out[0, 3] == 0


# --- per-token pieces --------------------------------------------------------------------------------------


@SETTINGS
@given(data=token_batch())
def test_kl_k3_matches_formula_and_is_nonnegative(data):
    logps, ref, _, _ = data
    ours = np.asarray(rl.kl_k3(jnp.asarray(logps), jnp.asarray(ref)))
    d = ref.astype(np.float64) - logps
    np.testing.assert_allclose(ours, np.exp(d) - d - 1, rtol=1e-4, atol=1e-6)
    assert (ours >= -1e-7).all()


def test_logprobs_and_entropy():
    logits = jnp.array([[[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]]])
    logps, entropy = rl.logprobs_and_entropy(logits, jnp.array([[2, 0]]))
    np.testing.assert_allclose(np.asarray(entropy), [[np.log(4), 0.0]], atol=1e-6)
    np.testing.assert_allclose(np.asarray(logps), [[-np.log(4), 0.0]], atol=1e-6)
    # tempered: softmax([2, 0] / 2) = softmax([1, 0])
    logps, entropy = rl.logprobs_and_entropy(jnp.array([[[2.0, 0.0]]]), jnp.array([[1]]), temperature=2.0)
    p = np.exp([1.0, 0.0]) / np.exp([1.0, 0.0]).sum()
    np.testing.assert_allclose(np.asarray(logps), [[np.log(p[1])]], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(entropy), [[-(p * np.log(p)).sum()]], rtol=1e-6)
    with pytest.raises(ValueError, match="targets shape"):
        rl.logprobs_and_entropy(logits, jnp.zeros((1, 3), jnp.int32))


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(rl.AGGREGATIONS))
@SETTINGS
@given(data=token_batch())
def test_aggregations_match_numpy(mode, data):
    per, _, mask, _ = data
    total, weight = rl.aggregate(jnp.asarray(per), jnp.asarray(mask), mode, max_len=7)
    want_total, want_weight = np_aggregate(per.astype(np.float64), mask, mode, 7)
    np.testing.assert_allclose(float(total), want_total, rtol=1e-4, atol=1e-5)
    assert float(weight) == want_weight


def test_aggregation_splits_add_up():
    """The trainer adds (sum, weight) over micro-batches: two halves give the loss of the whole."""
    rng = np.random.default_rng(0)
    per = jnp.asarray(rng.normal(size=(6, 5)), jnp.float32)
    mask = jnp.asarray(np.arange(5)[None, :] < rng.integers(1, 6, (6, 1)), jnp.float32)
    for mode in rl.AGGREGATIONS:
        whole = rl.aggregate(per, mask, mode)
        halves = [rl.aggregate(per[i : i + 3], mask[i : i + 3], mode) for i in (0, 3)]
        np.testing.assert_allclose(float(whole[0] / whole[1]),
                                   float(sum(h[0] for h in halves) / sum(h[1] for h in halves)), rtol=1e-5)


def test_aggregate_errors():
    with pytest.raises(ValueError, match="unknown loss aggregation 'mean'"):
        rl.aggregate(jnp.zeros((1, 2)), jnp.ones((1, 2)), "mean")
    with pytest.raises(ValueError, match="mask shape"):
        rl.aggregate(jnp.zeros((1, 2)), jnp.ones((1, 3)), "token-mean")


# --- the clipped objective -------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("per_token_advantages", [False, True])
@SETTINGS
@given(data=token_batch(), eps=st.floats(0.05, 0.5), eps_high=st.one_of(st.none(), st.floats(0.05, 0.5)))
def test_clipped_policy_loss_matches_numpy(level, per_token_advantages, data, eps, eps_high):
    logps, old, mask, rng = data
    if per_token_advantages and level == "sequence":
        return  # GSPO's sequence ratio goes with one advantage per sequence
    adv = rng.normal(size=logps.shape if per_token_advantages else logps.shape[:1]).astype(np.float32)
    per, metrics = rl.clipped_policy_loss(jnp.asarray(logps), jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask),
                                          epsilon=eps, epsilon_high=eps_high, importance_sampling_level=level)
    want = np_policy_loss(logps.astype(np.float64), old, adv, mask, eps, eps if eps_high is None else eps_high, level)
    np.testing.assert_allclose(np.asarray(per) * mask, want * mask, rtol=2e-4, atol=2e-5)
    assert set(metrics) == {"clip_low", "clip_high", "clip_ratio"}


def test_clip_indicators_and_gradient_zero_when_clipped():
    logps = jnp.array([[np.log(2.0), np.log(0.5), 0.0]])  # ratios 2, 0.5, 1 against old log p = 0
    old = jnp.zeros((1, 3))
    mask = jnp.ones((1, 3))
    adv_pos, adv_neg = jnp.array([[1.0, 1.0, 1.0]]), jnp.array([[-1.0, -1.0, -1.0]])
    _, m = rl.clipped_policy_loss(logps, old, adv_pos, mask, epsilon=0.2)
    assert np.asarray(m["clip_high"]).tolist() == [[1.0, 0.0, 0.0]] and np.asarray(m["clip_low"]).sum() == 0
    _, m = rl.clipped_policy_loss(logps, old, adv_neg, mask, epsilon=0.2)
    assert np.asarray(m["clip_low"]).tolist() == [[0.0, 1.0, 0.0]] and np.asarray(m["clip_high"]).sum() == 0
    # clip-higher: eps_high = 1.5 lets the ratio-2 token through
    _, m = rl.clipped_policy_loss(logps, old, adv_pos, mask, epsilon=0.2, epsilon_high=1.5)
    assert np.asarray(m["clip_high"]).sum() == 0
    grad = jax.grad(lambda lp: rl.clipped_policy_loss(lp, old, adv_pos, mask, epsilon=0.2)[0].sum())(logps)
    np.testing.assert_allclose(np.asarray(grad), [[0.0, -0.5, -1.0]], atol=1e-6)  # clipped token: no gradient


def test_ratio_one_gives_reinforce_gradient():
    """With old = the detached current log-probs, the gradient is -A * d log p (the policy gradient)."""
    logps = jnp.array([[-1.0, -2.0], [-0.5, -0.1]])
    adv = jnp.array([0.7, -1.3])
    grad = jax.grad(lambda lp: rl.clipped_policy_loss(lp, jax.lax.stop_gradient(lp), adv, jnp.ones((2, 2)),
                                                      epsilon=0.2)[0].sum())(logps)
    np.testing.assert_allclose(np.asarray(grad), -np.repeat(np.asarray(adv)[:, None], 2, 1), rtol=1e-6)


def test_policy_loss_errors():
    with pytest.raises(ValueError, match="importance_sampling_level"):
        rl.clipped_policy_loss(jnp.zeros((1, 2)), jnp.zeros((1, 2)), jnp.zeros(1), jnp.ones((1, 2)), epsilon=0.2,
                               importance_sampling_level="seq")
    with pytest.raises(ValueError, match="advantages"):
        rl.clipped_policy_loss(jnp.zeros((1, 2)), jnp.zeros((1, 2)), jnp.zeros(3), jnp.ones((1, 2)), epsilon=0.2)


@SETTINGS
@given(data=token_batch(), clip=st.floats(0.01, 1.0))
def test_clipped_value_loss_matches_numpy(data, clip):
    values, old, _, rng = data
    returns = rng.normal(size=values.shape).astype(np.float32)
    ours = np.asarray(rl.clipped_value_loss(jnp.asarray(values), jnp.asarray(old), jnp.asarray(returns),
                                            clip_range=clip))
    v, o, r = values.astype(np.float64), old.astype(np.float64), returns.astype(np.float64)
    clipped = np.clip(v, o - clip, o + clip)
    np.testing.assert_allclose(ours, 0.5 * np.maximum((v - r) ** 2, (clipped - r) ** 2), rtol=1e-4, atol=1e-5)


# --- importance sampling over the sampler/trainer mismatch ---------------------------------------------------


def np_sampling_correction(trainer, sampler, mask, mode, cap):
    """TRL's vllm_importance_sampling_ratio, one row at a time: exp of the per-token (or summed per-sequence)
    log-ratio, clipped at cap (truncate) or zeroed above it (mask)."""
    b, t = trainer.shape
    out, ratios = np.zeros((b, t)), np.zeros((b, t))
    for r in range(b):
        diffs = [(trainer[r, i] - sampler[r, i]) * mask[r, i] for i in range(t)]
        for i in range(t):
            ratios[r, i] = math.exp(sum(diffs)) if mode.startswith("sequence") else math.exp(diffs[i])
            out[r, i] = min(ratios[r, i], cap) if mode.endswith("truncate") else (0.0 if ratios[r, i] > cap
                                                                                   else ratios[r, i])
    return out, ratios


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@SETTINGS
@given(data=token_batch(with_empty_rows=True), cap=st.sampled_from([0.8, 1.2, 3.0]))
def test_sampling_correction_matches_numpy(mode, data, cap):
    trainer, sampler, mask, _ = data
    weights, per_token, extremes = rl.sampling_correction(jnp.asarray(trainer), jnp.asarray(sampler),
                                                          jnp.asarray(mask), mode=mode, cap=cap)
    want, ratios = np_sampling_correction(trainer.astype(np.float64), sampler.astype(np.float64), mask, mode, cap)
    np.testing.assert_allclose(np.asarray(weights) * mask, want * mask, rtol=1e-5, atol=1e-6)
    counted = mask > 0
    if counted.any():
        assert float(extremes["importance_sampling/weight_max"]) == pytest.approx(want[counted].max(), rel=1e-5)
        assert float(extremes["importance_sampling/weight_min"]) == pytest.approx(want[counted].min(), rel=1e-5)
    capped = np.asarray(per_token["importance_sampling/capped_fraction"])[counted]
    near = np.isclose(ratios[counted], cap, rtol=1e-5)  # f32 and f64 may fall on either side of the cap
    np.testing.assert_array_equal(capped[~near], ratios[counted][~near] > cap)
    # a constant: no gradient reaches the trainer's log-probs through the weights
    grad = jax.grad(lambda lp: rl.sampling_correction(lp, jnp.asarray(sampler), jnp.asarray(mask), mode=mode,
                                                      cap=cap)[0].sum())(jnp.asarray(trainer))
    assert not np.asarray(grad).any()


def test_sampling_correction_rejects_an_unknown_mode():
    with pytest.raises(ValueError, match="importance_sampling_mode must be one of token_truncate"):
        rl.sampling_correction(jnp.zeros((1, 2)), jnp.zeros((1, 2)), jnp.ones((1, 2)), mode="token", cap=2.0)


@SETTINGS
@given(data=token_batch())
def test_bias_corrected_kl_matches_its_gradient(data):
    """TRL's use_bias_correction_kl: k3(logp, ref) * pi / pi_old, whose gradient in logp is
    (1 - exp(ref - logp)) r + k3 r with r = exp(logp - old)."""
    logps, old, mask, rng = data
    ref = (logps + rng.normal(0, 0.3, logps.shape)).astype(np.float32)

    def corrected(lp):
        return rl.kl_k3(lp, jnp.asarray(ref)) * rl.policy_ratio(lp, jnp.asarray(old), jnp.asarray(mask))

    lp, o, r = logps.astype(np.float64), old.astype(np.float64), ref.astype(np.float64)
    k3, ratio = np.exp(r - lp) - (r - lp) - 1, np.exp(lp - o)
    np.testing.assert_allclose(np.asarray(corrected(jnp.asarray(logps))), k3 * ratio, rtol=1e-4, atol=1e-6)
    grad = jax.grad(lambda x: corrected(x).sum())(jnp.asarray(logps))
    np.testing.assert_allclose(np.asarray(grad), (1 - np.exp(r - lp)) * ratio + k3 * ratio, rtol=1e-4, atol=1e-5)
