"""The training losses against independent float64 NumPy references written from the formulas."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tunix_rt.train.losses import (
    PREFERENCE_LOSSES,
    PreferenceConfig,
    PreferenceStats,
    cross_entropy,
    distillation_loss,
    preference_loss,
    sequence_logprobs,
    teacher_topk,
    token_logprobs,
    topk_distillation_loss,
)

HYP = settings(max_examples=25)
TOL = dict(rtol=1e-5, atol=1e-5)
# (B, T, V) drawn from a few shapes spanning B 1..4, T 1..6, V 2..11: each new shape compiles every op
# again, so random shapes per example would dominate the run time.
SHAPES = [(1, 1, 2), (2, 3, 5), (4, 6, 11)]
LOSS_TYPES = sorted(PREFERENCE_LOSSES)

# ---------------------------------------------------------------------------------------------------
# NumPy references (float64)
# ---------------------------------------------------------------------------------------------------


def np_log_softmax(x):
    x = np.asarray(x, np.float64)
    shifted = x - x.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def np_logsigmoid(z):
    return -np.logaddexp(0.0, -z)


def np_token_logprobs(logits, targets):
    lp = np_log_softmax(logits)
    b, t = targets.shape
    return np.array([[lp[i, j, targets[i, j]] for j in range(t)] for i in range(b)])


def np_sequence_logprobs(logits, targets, mask):
    b, t = targets.shape
    sums, counts = np.zeros(b), np.zeros(b)
    lp = np_log_softmax(logits)
    for i in range(b):
        for j in range(t):
            if mask[i, j]:
                sums[i] += lp[i, j, targets[i, j]]
                counts[i] += 1
    return sums, counts


def np_cross_entropy(logits, targets, mask):
    sums, counts = np_sequence_logprobs(logits, targets, mask)
    return -sums.sum() / max(counts.sum(), 1)


def np_masked_mean_kl(log_p, log_q, mask):
    kl = (np.exp(log_p) * (log_p - log_q)).sum(-1)
    m = np.asarray(mask) != 0
    return kl[m].sum() / max(m.sum(), 1)


def np_distillation(student, teacher, targets, mask, temperature, alpha):
    log_p, log_q = np_log_softmax(teacher / temperature), np_log_softmax(student / temperature)
    kd = temperature**2 * np_masked_mean_kl(log_p, log_q, mask)
    ce = np_cross_entropy(student, targets, mask)
    return alpha * kd + (1 - alpha) * ce, kd, ce


def np_topk_distillation(student, topk_logits, topk_ids, targets, mask, temperature, alpha):
    log_p = np_log_softmax(topk_logits / temperature)
    log_q = np.take_along_axis(np_log_softmax(student / temperature), topk_ids, axis=-1)
    kd = temperature**2 * np_masked_mean_kl(log_p, log_q, mask)
    ce = np_cross_entropy(student, targets, mask)
    return alpha * kd + (1 - alpha) * ce, kd, ce


def np_preference(loss_type, stats, beta, ls, gamma):
    """(losses, metrics) per pair, as TRL's dpo_loss / CPO simpo / ORPO odds_ratio_loss define them."""
    c, r, n_c, n_r, rc, rr = (np.asarray(x, np.float64) for x in stats)
    if loss_type in ("ipo", "simpo", "orpo"):  # length-averaged log-probs; an empty completion averages to 0
        n_c, n_r = np.maximum(n_c, 1), np.maximum(n_r, 1)
        c, rc, r, rr = c / n_c, rc / n_c, r / n_r, rr / n_r
    if loss_type in ("simpo", "orpo"):
        reward_c, reward_r = beta * c, beta * r
    else:
        reward_c, reward_r = beta * (c - rc), beta * (r - rr)
    z = beta * ((c - r) - (rc - rr))
    if loss_type == "sigmoid":
        losses = -np_logsigmoid(z) * (1 - ls) - np_logsigmoid(-z) * ls
    elif loss_type == "robust":
        losses = (-np_logsigmoid(z) * (1 - ls) + np_logsigmoid(-z) * ls) / (1 - 2 * ls)
    elif loss_type == "hinge":
        losses = np.maximum(0.0, 1 - z)
    elif loss_type == "ipo":
        losses = ((c - r) - (rc - rr) - 1 / (2 * beta)) ** 2
    elif loss_type == "simpo":
        x = beta * (c - r) - gamma
        losses = -np_logsigmoid(x) * (1 - ls) - np_logsigmoid(-x) * ls
    elif loss_type == "orpo":
        cc, rcl = np.minimum(c, -1e-7), np.minimum(r, -1e-7)
        log_odds = (c - r) - (np.log1p(-np.exp(cc)) - np.log1p(-np.exp(rcl)))
        losses = -c - beta * np_logsigmoid(log_odds)
    else:
        raise AssertionError(f"no NumPy reference for {loss_type}")
    metrics = {"rewards/chosen": reward_c, "rewards/rejected": reward_r,
               "rewards/margins": reward_c - reward_r,
               "rewards/accuracies": (reward_c > reward_r).astype(np.float64)}
    return losses, metrics


# ---------------------------------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------------------------------


@st.composite
def token_batches(draw):
    """(logits f32 (B, T, V), targets (B, T) in range, mask f32 (B, T)) with zero rows / all-zero masks."""
    b, t, v = draw(st.sampled_from(SHAPES))
    scale = draw(st.sampled_from([1.0, 5.0, 30.0]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    logits = (rng.uniform(-1, 1, (b, t, v)) * scale).astype(np.float32)
    targets = rng.integers(0, v, (b, t)).astype(np.int32)
    mask = rng.random((b, t)) < 0.6
    mode = draw(st.sampled_from(["random", "zero_rows", "all_zero", "all_one"]))
    if mode == "zero_rows":
        mask[rng.random(b) < 0.5] = False
        mask[0] = False
    elif mode == "all_zero":
        mask[:] = False
    elif mode == "all_one":
        mask[:] = True
    return logits, targets, mask.astype(np.float32)


def _random_stats(rng, b, min_len, low, high):
    """NumPy f32 PreferenceStats: per pair, min_len..6 tokens of average log-prob in -[low, high)."""
    n_c, n_r = rng.integers(min_len, 7, b), rng.integers(min_len, 7, b)
    logps = lambda n: -rng.uniform(low, high, b) * n
    columns = (logps(n_c), logps(n_r), n_c, n_r, logps(n_c), logps(n_r))
    return PreferenceStats(*(np.asarray(x, np.float32) for x in columns))


@st.composite
def pair_stats(draw):
    """Stats of 1..4 pairs, empty completions included, at small to large log-prob scales."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return _random_stats(rng, draw(st.integers(1, 4)), 0, 0.0, draw(st.sampled_from([0.01, 1.0, 10.0])))


# (beta, label_smoothing, simpo_gamma); every label_smoothing here is valid for every loss
preference_hparams = st.tuples(st.floats(0.01, 2.0), st.sampled_from([0.0, 0.1, 0.3, 0.45]),
                               st.floats(-1.0, 2.0))


def _fixed_stats(rng):
    """Stats of 3 pairs away from ties, kinks and empty completions (for gradients)."""
    return _random_stats(rng, 3, 1, 0.1, 2.0)


def _check_preference(stats, cfg):
    losses, metrics = PREFERENCE_LOSSES[cfg.loss_type](stats, cfg)
    ref_losses, ref_metrics = np_preference(cfg.loss_type, stats, cfg.beta, cfg.label_smoothing,
                                            cfg.simpo_gamma)
    np.testing.assert_allclose(losses, ref_losses, **TOL)
    assert set(metrics) == set(ref_metrics)
    decided = np.abs(ref_metrics["rewards/margins"]) > 1e-4  # ties are a coin flip in f32 vs f64
    for name, ref in ref_metrics.items():
        got = np.asarray(metrics[name])
        assert got.shape == ref.shape, name
        if name == "rewards/accuracies":
            np.testing.assert_array_equal(got[decided], ref[decided])
        else:
            np.testing.assert_allclose(got, ref, **TOL, err_msg=name)
    mean_loss, mean_metrics = preference_loss(stats, cfg)
    np.testing.assert_allclose(mean_loss, ref_losses.mean(), **TOL)
    np.testing.assert_allclose(mean_metrics["rewards/margins"], ref_metrics["rewards/margins"].mean(), **TOL)


# ---------------------------------------------------------------------------------------------------
# Token log-probs, sequence log-probs, cross-entropy
# ---------------------------------------------------------------------------------------------------


@HYP
@given(token_batches())
def test_token_logprobs(batch):
    logits, targets, _ = batch
    got = token_logprobs(logits, targets)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, np_token_logprobs(logits, targets), **TOL)


def test_token_logprobs_computes_low_precision_logits_in_f32():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(2, 3, 7)) * 10, jnp.bfloat16)
    targets = rng.integers(0, 7, (2, 3)).astype(np.int32)
    got = token_logprobs(logits, targets)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, np_token_logprobs(np.asarray(logits, np.float64), targets), **TOL)


@HYP
@given(token_batches())
def test_sequence_logprobs_and_cross_entropy(batch):
    logits, targets, mask = batch
    ignored = np.where(mask != 0, targets, -100)  # masked targets may be out of range (an ignore index)
    sums, counts = sequence_logprobs(logits, ignored, mask)
    ref_sums, ref_counts = np_sequence_logprobs(logits, targets, mask)
    np.testing.assert_allclose(sums, ref_sums, **TOL)
    np.testing.assert_array_equal(counts, ref_counts)
    ce = cross_entropy(logits, ignored, mask)
    assert np.isfinite(ce)
    np.testing.assert_allclose(ce, np_cross_entropy(logits, targets, mask), **TOL)
    np.testing.assert_allclose(cross_entropy(logits, targets, mask.astype(bool)), ce, **TOL)


def test_all_masked_batch_has_zero_loss_not_nan():
    logits = np.full((2, 3, 5), np.nan, np.float32)  # nothing of a masked position may leak, not even NaN
    targets, mask = np.zeros((2, 3), np.int32), np.zeros((2, 3), np.float32)
    assert float(cross_entropy(logits, targets, mask)) == 0.0
    sums, counts = sequence_logprobs(logits, targets, mask)
    np.testing.assert_array_equal(sums, 0.0)
    np.testing.assert_array_equal(counts, 0.0)
    loss, metrics = distillation_loss(logits, logits, targets, mask, temperature=2.0, alpha=0.5)
    assert float(loss) == float(metrics["kd"]) == float(metrics["ce"]) == 0.0


# ---------------------------------------------------------------------------------------------------
# Preference losses
# ---------------------------------------------------------------------------------------------------


def test_registry_and_reference_free_losses():
    assert set(LOSS_TYPES) == {"sigmoid", "robust", "hinge", "ipo", "simpo", "orpo"}
    assert {t for t in LOSS_TYPES if PreferenceConfig(loss_type=t).reference_free} == {"orpo", "simpo"}


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@HYP
@given(pair_stats(), preference_hparams)
def test_preference_loss_matches_reference(loss_type, stats, hparams):
    beta, label_smoothing, simpo_gamma = hparams
    _check_preference(stats, PreferenceConfig(loss_type=loss_type, beta=beta, label_smoothing=label_smoothing,
                                              simpo_gamma=simpo_gamma))


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_preference_loss_jits_with_static_config(loss_type):
    stats = _fixed_stats(np.random.default_rng(1))
    cfg = PreferenceConfig(loss_type=loss_type, beta=0.3, label_smoothing=0.1)
    jitted = jax.jit(preference_loss, static_argnums=1)(stats, cfg)
    eager = preference_loss(stats, cfg)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), jitted, eager)


def test_sigmoid_dpo_gradient_is_analytic():
    rng = np.random.default_rng(2)
    stats = _fixed_stats(rng)
    beta, ls = 0.7, 0.2
    cfg = PreferenceConfig(loss_type="sigmoid", beta=beta, label_smoothing=ls)

    def loss(c, r, rc, rr):
        return preference_loss(stats._replace(chosen_logps=c, rejected_logps=r, ref_chosen_logps=rc,
                                              ref_rejected_logps=rr), cfg)[0]

    grads = jax.grad(loss, argnums=(0, 1, 2, 3))(stats.chosen_logps, stats.rejected_logps,
                                                 stats.ref_chosen_logps, stats.ref_rejected_logps)
    c, r, _, _, rc, rr = (np.asarray(x, np.float64) for x in stats)
    z = beta * ((c - r) - (rc - rr))
    sigmoid = lambda x: 1 / (1 + np.exp(-x))
    # d (batch-mean loss) / d (policy log-ratio) per pair
    d_margin = beta * (-(1 - ls) * sigmoid(-z) + ls * sigmoid(z)) / len(c)
    np.testing.assert_allclose(grads[0], d_margin, **TOL)
    np.testing.assert_allclose(grads[1], -d_margin, **TOL)
    np.testing.assert_array_equal(grads[2], 0.0)  # the reference model is frozen
    np.testing.assert_array_equal(grads[3], 0.0)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_preference_gradients_match_finite_differences(loss_type):
    stats = _fixed_stats(np.random.default_rng(3))
    cfg = PreferenceConfig(loss_type=loss_type, beta=0.4, label_smoothing=0.1, simpo_gamma=0.3)
    grads = jax.grad(lambda c, r: preference_loss(stats._replace(chosen_logps=c, rejected_logps=r), cfg)[0],
                     argnums=(0, 1))(stats.chosen_logps, stats.rejected_logps)
    ref64 = [np.asarray(x, np.float64) for x in stats]
    for field, grad in zip((0, 1), grads):
        fd = np.zeros(len(ref64[0]))
        for i in range(len(fd)):
            bumped = [[x.copy() for x in ref64] for _ in range(2)]
            bumped[0][field][i] += 1e-6
            bumped[1][field][i] -= 1e-6
            f = [np_preference(loss_type, s, cfg.beta, cfg.label_smoothing, cfg.simpo_gamma)[0].mean()
                 for s in bumped]
            fd[i] = (f[0] - f[1]) / 2e-6
        np.testing.assert_allclose(grad, fd, rtol=1e-4, atol=1e-6)


def test_orpo_is_finite_when_the_policy_is_certain():
    n = np.array([3.0, 1.0, 0.0, 2.0], np.float32)
    certain = np.array([0.0, -1e-9, 0.0, -1e-3], np.float32)  # average log-probs at or next to 0
    stats = PreferenceStats(certain, np.array([-1.0, 0.0, -2.0, -1e-8], np.float32), n, n,
                            np.zeros(4, np.float32), np.zeros(4, np.float32))
    cfg = PreferenceConfig(loss_type="orpo", beta=0.1)
    losses, _ = PREFERENCE_LOSSES["orpo"](stats, cfg)
    assert np.all(np.isfinite(losses))
    grads = jax.grad(lambda c, r: preference_loss(stats._replace(chosen_logps=c, rejected_logps=r), cfg)[0],
                     argnums=(0, 1))(stats.chosen_logps, stats.rejected_logps)
    assert all(np.all(np.isfinite(g)) for g in grads)


# ---------------------------------------------------------------------------------------------------
# Distillation
# ---------------------------------------------------------------------------------------------------

temperatures = st.floats(0.5, 4.0)
alphas = st.floats(0.0, 1.0)


@HYP
@given(token_batches(), temperatures, alphas, st.integers(0, 2**32 - 1))
def test_distillation_matches_reference(batch, temperature, alpha, seed):
    student, targets, mask = batch
    scale = np.abs(student).max()  # the teacher at the student's logit scale
    teacher = (np.random.default_rng(seed).uniform(-1, 1, student.shape) * scale).astype(np.float32)
    loss, metrics = distillation_loss(student, teacher, targets, mask, temperature=temperature, alpha=alpha)
    ref_loss, ref_kd, ref_ce = np_distillation(student, teacher, targets, mask, temperature, alpha)
    np.testing.assert_allclose(loss, ref_loss, **TOL)
    np.testing.assert_allclose(metrics["kd"], ref_kd, **TOL)
    np.testing.assert_allclose(metrics["ce"], ref_ce, **TOL)


@HYP
@given(token_batches(), temperatures, alphas, st.integers(0, 2**32 - 1))
def test_distillation_ignores_masked_positions(batch, temperature, alpha, seed):
    student, targets, mask = batch
    rng = np.random.default_rng(seed)
    teacher = rng.normal(size=student.shape).astype(np.float32)
    masked = (mask == 0)[..., None]
    noise = lambda: (rng.uniform(-1e3, 1e3, student.shape)).astype(np.float32)
    kwargs = dict(temperature=temperature, alpha=alpha)
    loss = distillation_loss(student, teacher, targets, mask, **kwargs)
    changed = distillation_loss(np.where(masked, noise(), student), np.where(masked, noise(), teacher),
                                np.where(mask == 0, -100, targets), mask, **kwargs)
    jax.tree.map(np.testing.assert_array_equal, changed, loss)


@HYP
@given(token_batches(), temperatures, alphas, st.data())
def test_topk_distillation_matches_reference(batch, temperature, alpha, data):
    student, targets, mask = batch
    v = student.shape[-1]
    k = data.draw(st.integers(1, v))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    teacher = (rng.normal(size=student.shape) * 5).astype(np.float32)
    ids = np.argsort(-teacher, axis=-1, kind="stable")[..., :k].astype(np.int32)
    topk_logits = np.take_along_axis(teacher, ids, axis=-1)
    loss, metrics = topk_distillation_loss(student, topk_logits, ids, targets, mask, temperature=temperature,
                                           alpha=alpha)
    ref_loss, ref_kd, ref_ce = np_topk_distillation(student, topk_logits, ids, targets, mask, temperature,
                                                    alpha)
    np.testing.assert_allclose(loss, ref_loss, **TOL)
    np.testing.assert_allclose(metrics["kd"], ref_kd, **TOL)
    np.testing.assert_allclose(metrics["ce"], ref_ce, **TOL)


@HYP
@given(token_batches(), temperatures, alphas, st.integers(0, 2**32 - 1))
def test_topk_with_full_vocab_equals_full_distillation(batch, temperature, alpha, seed):
    student, targets, mask = batch
    teacher = (np.random.default_rng(seed).normal(size=student.shape) * 5).astype(np.float32)
    topk_logits, ids = teacher_topk(teacher, student.shape[-1])
    kwargs = dict(temperature=temperature, alpha=alpha)
    full = distillation_loss(student, teacher, targets, mask, **kwargs)
    topk = topk_distillation_loss(student, topk_logits, ids, targets, mask, **kwargs)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), topk, full)


def test_teacher_topk_returns_the_largest_logits_and_their_ids():
    teacher = np.random.default_rng(4).normal(size=(2, 3, 9)).astype(np.float32)
    values, ids = teacher_topk(teacher, 4)
    assert ids.dtype == jnp.int32 and values.shape == ids.shape == (2, 3, 4)
    np.testing.assert_array_equal(values, -np.sort(-teacher, axis=-1)[..., :4])
    np.testing.assert_array_equal(np.take_along_axis(teacher, np.asarray(ids), axis=-1), values)


def test_distillation_gradient_matches_finite_differences():
    rng = np.random.default_rng(5)
    student = rng.normal(size=(2, 2, 3)).astype(np.float32) * 2
    teacher = rng.normal(size=(2, 2, 3)).astype(np.float32) * 2
    targets = np.array([[0, 2], [1, 1]], np.int32)
    mask = np.array([[1, 1], [1, 0]], np.float32)
    temperature, alpha = 1.5, 0.6
    kd = jax.jit(functools.partial(distillation_loss, temperature=temperature, alpha=alpha))
    d_student, d_teacher = jax.grad(lambda s, t: kd(s, t, targets, mask)[0], argnums=(0, 1))(student, teacher)
    fd = np.zeros(student.shape)
    s64 = student.astype(np.float64)
    for idx in np.ndindex(student.shape):
        up, down = s64.copy(), s64.copy()
        up[idx] += 1e-6
        down[idx] -= 1e-6
        fd[idx] = (np_distillation(up, teacher, targets, mask, temperature, alpha)[0]
                   - np_distillation(down, teacher, targets, mask, temperature, alpha)[0]) / 2e-6
    np.testing.assert_allclose(d_student, fd, **TOL)
    np.testing.assert_array_equal(d_student[1, 1], 0.0)  # the masked position gets no gradient
    np.testing.assert_array_equal(d_teacher, 0.0)  # the teacher is detached


# ---------------------------------------------------------------------------------------------------
# Argument validation
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, field", [
    (dict(loss_type="kto"), "loss_type"),
    (dict(beta=0.0), "beta"),
    (dict(beta=float("nan")), "beta"),
    (dict(label_smoothing=1.0), "label_smoothing"),
    (dict(label_smoothing=-0.1), "label_smoothing"),
    (dict(loss_type="robust", label_smoothing=0.5), "label_smoothing"),
    (dict(simpo_gamma=float("inf")), "simpo_gamma"),
])
def test_preference_config_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        PreferenceConfig(**kwargs)


def test_preference_config_is_keyword_only():
    with pytest.raises(TypeError):
        PreferenceConfig("sigmoid")


def test_preference_loss_rejects_unknown_loss_type_and_mismatched_stats():
    cfg = PreferenceConfig()
    object.__setattr__(cfg, "loss_type", "kto")  # bypass __post_init__
    stats = _fixed_stats(np.random.default_rng(6))
    with pytest.raises(ValueError, match="loss_type 'kto'.*valid: .*ipo.*sigmoid"):
        preference_loss(stats, cfg)
    with pytest.raises(ValueError, match="stats.rejected_len"):
        preference_loss(stats._replace(rejected_len=np.ones(2, np.float32)), PreferenceConfig())


def test_distillation_argument_validation():
    student = np.zeros((2, 3, 5), np.float32)
    targets, mask = np.zeros((2, 3), np.int32), np.ones((2, 3), np.float32)
    ok = dict(temperature=1.0, alpha=0.5)
    with pytest.raises(ValueError, match="temperature"):
        distillation_loss(student, student, targets, mask, temperature=0.0, alpha=0.5)
    with pytest.raises(ValueError, match="alpha"):
        distillation_loss(student, student, targets, mask, temperature=1.0, alpha=1.5)
    with pytest.raises(ValueError, match=r"teacher_logits shape \(2, 3, 4\) must equal student_logits shape"):
        distillation_loss(student, student[..., :4], targets, mask, **ok)
    with pytest.raises(ValueError, match="targets"):
        distillation_loss(student, student, targets[:, :2], mask, **ok)
    with pytest.raises(ValueError, match="mask"):
        distillation_loss(student, student, targets, mask[:1], **ok)
    topk_logits, ids = teacher_topk(student, 2)
    with pytest.raises(ValueError, match="alpha"):
        topk_distillation_loss(student, topk_logits, ids, targets, mask, temperature=1.0, alpha=-0.1)
    with pytest.raises(ValueError, match="teacher_topk_ids"):
        topk_distillation_loss(student, topk_logits, ids[..., :1], targets, mask, **ok)
    with pytest.raises(ValueError, match="teacher_topk_logits"):
        topk_distillation_loss(student, topk_logits[:1], ids[:1], targets, mask, **ok)
    for k in (0, 6):
        with pytest.raises(ValueError, match="k must be"):
            teacher_topk(student, k)


def test_masked_loss_shape_validation():
    logits = np.zeros((2, 3, 5), np.float32)
    with pytest.raises(ValueError, match="targets"):
        token_logprobs(logits, np.zeros((2, 4), np.int32))
    with pytest.raises(ValueError, match="mask"):
        cross_entropy(logits, np.zeros((2, 3), np.int32), np.ones((3, 2), np.float32))
