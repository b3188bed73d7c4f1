"""The rollout sampler against independent NumPy references: penalties, min-p, greedy, seeds, logprobs."""

from __future__ import annotations

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tunix_rt.engine.sampler import (
    SamplerOutput,
    SamplingTensors,
    add_logit_bias,
    apply_penalties,
    categorical,
    filter_logits,
    greedy_tokens,
    row_sum,
    sample_tokens,
)

B, V, LP, LO, K = 6, 24, 10, 12, 5  # the fixed shapes most tests use: one compile each

_sample = jax.jit(functools.partial(sample_tokens, num_top_logprobs=K))  # K = 0 only via eval_shape: one compile
_penalties = jax.jit(apply_penalties)
_filter = jax.jit(filter_logits)
NO_PROMPT, NO_OUTPUT = -np.ones((B, LP), np.int32), -np.ones((B, LO), np.int32)


@jax.jit
def _draws(logits, params, steps):
    """One (1, V) row drawn at every step in `steps`: vmap over the step counter."""
    none = -np.ones((1, 1), np.int32)
    one = lambda s: sample_tokens(logits, dataclasses.replace(params, step=s[None]), none, none).tokens[0]
    return jax.vmap(one)(steps)


def _params(batch=B, **columns) -> SamplingTensors:
    """Neutral (B,) columns, with the given ones (scalars broadcast) replacing them."""
    base = SamplingTensors.from_rows([], batch)
    return dataclasses.replace(base, **{k: np.broadcast_to(np.asarray(v, getattr(base, k).dtype), (batch,)).copy()
                                        for k, v in columns.items()})


def _history(rng, batch, length, vocab, pad_frac=0.3):
    """Ids from a small range (duplicates), some -1 padding anywhere in the row."""
    toks = rng.integers(0, vocab, size=(batch, length)).astype(np.int32)
    toks[:, : length // 2] = rng.integers(0, 4, size=(batch, length // 2))  # many repeats
    toks[rng.random((batch, length)) < pad_frac] = -1
    return toks


def _np_penalties(logits, prompt, output, presence, frequency, repetition):
    """vLLM's apply_penalties, one row and one token at a time."""
    out = logits.astype(np.float32).copy()
    for b in range(out.shape[0]):
        counts = collections.Counter(int(t) for t in output[b] if t >= 0)
        seen = counts.keys() | {int(t) for t in prompt[b] if t >= 0}
        r = np.float32(repetition[b])
        for t in seen:
            out[b, t] = out[b, t] / r if out[b, t] > 0 else out[b, t] * r
        for t, c in counts.items():
            out[b, t] -= np.float32(frequency[b]) * np.float32(c)
            out[b, t] -= np.float32(presence[b])
    return out


def _np_log_softmax(x):
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _np_filter(row, top_k, top_p, min_p):
    """vLLM: min_p on the probabilities, then top-k, then top-p renormalised over the survivors."""
    probs = np.exp(_np_log_softmax(row))
    keep = probs >= min_p * probs.max()
    order = [i for i in np.argsort(-row, kind="stable") if keep[i]]
    p = probs[order] / probs[order].sum()
    out = np.zeros_like(keep)
    cum = 0.0
    for rank, idx in enumerate(order):
        if (top_k and rank >= top_k) or (top_p < 1 and cum >= top_p):
            break
        out[idx] = True
        cum += p[rank]
    return out


# ----------------------------------------------------------------------------------------------
# penalties


@settings(max_examples=25)
@given(which=st.sampled_from(["presence", "frequency", "repetition", "all"]), seed=st.integers(0, 2**32 - 1))
def test_penalties_match_numpy(which, seed):
    rng = np.random.default_rng(seed)
    logits = (rng.normal(size=(B, V)) * 3).astype(np.float32)
    prompt, output = _history(rng, B, LP, V), _history(rng, B, LO, V)
    on = rng.random(B) < 0.7  # some rows neutral in a penalised batch
    presence = np.where(on & (which in ("presence", "all")), rng.uniform(-2, 2, B), 0).astype(np.float32)
    frequency = np.where(on & (which in ("frequency", "all")), rng.uniform(-2, 2, B), 0).astype(np.float32)
    repetition = np.where(on & (which in ("repetition", "all")), rng.uniform(0.3, 3, B), 1).astype(np.float32)
    params = _params(presence_penalty=presence, frequency_penalty=frequency, repetition_penalty=repetition)
    got = np.asarray(_penalties(logits, params, prompt, output))
    want = _np_penalties(logits, prompt, output, presence, frequency, repetition)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_penalties_prompt_vs_output():
    logits = np.array([[2.0, -2.0, 2.0, -2.0, 1.0, 5.0]], np.float32)
    prompt = np.array([[0, 1, -1, -1]], np.int32)  # 0 and 1 only in the prompt
    output = np.array([[2, 3, 3, -1, 3]], np.int32)  # 2 once, 3 three times; -1 padding anywhere
    params = _params(1, presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0)
    got = np.asarray(_penalties(logits, params, prompt, output))[0]
    # prompt only: repetition only; output: repetition, then frequency * count and presence once.
    np.testing.assert_allclose(got, [1.0, -4.0, 1.0 - 0.25 - 0.5, -4.0 - 0.75 - 0.5, 1.0, 5.0], rtol=1e-6)


def test_penalties_neutral_rows_unchanged():
    logits = np.random.default_rng(0).normal(size=(B, V)).astype(np.float32)
    hist = _history(np.random.default_rng(1), B, LO, V)
    got = np.asarray(_penalties(logits, _params(), hist, hist))
    np.testing.assert_array_equal(got, logits)


# ----------------------------------------------------------------------------------------------
# filtering


@settings(max_examples=30)
@given(seed=st.integers(0, 2**32 - 1), top_k=st.sampled_from([0, 1, 3, 10, 100]),
       top_p=st.sampled_from([1.0, 0.95, 0.6, 0.2]), min_p=st.sampled_from([0.0, 0.01, 0.1, 0.5, 1.0]))
def test_min_p_top_k_top_p_match_numpy(seed, top_k, top_p, min_p):
    rng = np.random.default_rng(seed)
    logits = (rng.normal(size=(B, V)) * 2.5).astype(np.float32)
    mp = np.where(rng.random(B) < 0.8, min_p, 0.0).astype(np.float32)  # per-row: some rows off
    got = _filter(logits, np.full(B, top_k, np.int32), np.full(B, top_p, np.float32), mp)
    for row in range(B):
        assert (np.isfinite(np.asarray(got[row])) == _np_filter(logits[row], top_k, top_p, mp[row])).all()


def test_min_p_applies_after_temperature():
    # p(1) / p(0) = 0.3 >= min_p 0.2 at T = 1; at T = 0.5 the ratio is 0.09 < 0.2, so token 1 is gone.
    logits = np.array([[0.0, np.log(0.3), -np.inf, -np.inf, -np.inf]], np.float32)  # 5 tokens, as below
    steps = jnp.arange(2000, dtype=jnp.int32)
    draws = lambda temperature: np.asarray(_draws(logits, _params(1, temperature=temperature, min_p=0.2, seed=3), steps))

    assert (draws(0.5) == 0).all()
    assert 0.19 < (draws(1.0) == 1).mean() < 0.27  # 0.3 / 1.3 = 0.23


# ----------------------------------------------------------------------------------------------
# sampling


def _random_case(rng, greedy_frac=0.5):
    logits = (rng.normal(size=(B, V)) * 3).astype(np.float32)
    prompt, output = _history(rng, B, LP, V), _history(rng, B, LO, V)
    params = _params(
        temperature=np.where(rng.random(B) < greedy_frac, 0.0, rng.uniform(0.3, 2.0, B)),
        top_k=rng.choice([0, 1, 5], B), top_p=rng.choice([1.0, 0.8], B), min_p=rng.choice([0.0, 0.05], B),
        presence_penalty=rng.uniform(-1, 1, B), frequency_penalty=rng.uniform(-1, 1, B),
        repetition_penalty=rng.uniform(0.5, 2, B), seed=rng.integers(0, 2**32, B), step=rng.integers(0, 1000, B))
    return logits, params, prompt, output


@settings(max_examples=20)
@given(seed=st.integers(0, 2**32 - 1))
def test_greedy_rows_take_argmax_of_penalised_logits(seed):
    logits, params, prompt, output = _random_case(np.random.default_rng(seed))
    out = _sample(logits, params, prompt, output)
    penalised = _np_penalties(logits, prompt, output, params.presence_penalty, params.frequency_penalty,
                              params.repetition_penalty)
    greedy = params.temperature == 0
    np.testing.assert_array_equal(np.asarray(out.tokens)[greedy], penalised.argmax(-1)[greedy])
    # top_k = 1 draws equal greedy, whatever the temperature and the other filters.
    top1 = _sample(logits, dataclasses.replace(params, top_k=np.ones(B, np.int32),
                                               temperature=np.full(B, 1.7, np.float32)), prompt, output)
    np.testing.assert_array_equal(np.asarray(top1.tokens), penalised.argmax(-1))


_greedy_tokens = jax.jit(greedy_tokens)


@settings(deadline=None, max_examples=30)
@given(vocab=st.sampled_from([5, 2048, 2049, 3 * 1024, 49_152, 50_001]), seed=st.integers(0, 2**32 - 1),
       special=st.sampled_from(["none", "ties", "nan", "inf", "all_neg_inf", "constant"]))
def test_greedy_tokens_is_argmax(vocab, seed, special):
    """The blocked argmax gives argmax's index, the first one, on ties and infinities too; a NaN counts as +inf."""
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((3, vocab)).astype(np.float32)
    picks = rng.integers(0, vocab, size=(3, 4))
    if special == "ties":
        logits[np.arange(3)[:, None], picks] = 10.0
    elif special == "nan":
        logits[np.arange(3)[:, None], picks] = np.nan
    elif special == "inf":
        logits[np.arange(3)[:, None], picks[:, :2]] = np.inf
        logits[np.arange(3)[:, None], picks[:, 2:]] = -np.inf
    elif special == "all_neg_inf":
        logits[:] = -np.inf
    elif special == "constant":
        logits[:] = 1.5
    want = np.argmax(np.where(np.isnan(logits), np.inf, logits), axis=-1)
    got = np.asarray(_greedy_tokens(jnp.asarray(logits)))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, want)

def test_all_greedy_batch():
    logits, params, prompt, output = _random_case(np.random.default_rng(5), greedy_frac=1.0)
    out = _sample(logits, params, prompt, output)
    penalised = _np_penalties(logits, prompt, output, params.presence_penalty, params.frequency_penalty,
                              params.repetition_penalty)
    np.testing.assert_array_equal(np.asarray(out.tokens), penalised.argmax(-1))


_greedy_program = {processed: jax.jit(functools.partial(sample_tokens, num_top_logprobs=K, all_greedy=True,
                                                        processed_logprobs=processed)) for processed in (False, True)}


@settings(max_examples=15)
@given(seed=st.integers(0, 2**32 - 1), processed=st.booleans(), penalties=st.booleans())
def test_all_greedy_program_gives_the_full_programs_bits(seed, processed, penalties):
    """The program the engine compiles for an all-greedy step (no draw traced) returns what the full one
    does for the same rows, bit for bit: tokens, log-probs (raw or processed) and top log-probs."""
    logits, params, prompt, output = _random_case(np.random.default_rng(seed), greedy_frac=1.0)
    if not penalties:
        params = dataclasses.replace(params, presence_penalty=np.zeros(B, np.float32),
                                     frequency_penalty=np.zeros(B, np.float32),
                                     repetition_penalty=np.ones(B, np.float32))
    full = (_sample_processed if processed else _sample)(logits, params, prompt, output)
    fast = _greedy_program[processed](logits, params, prompt, output)
    for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(fast)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if not penalties:  # no histories at all: the penalty step is not traced, and nothing changes
        none = _greedy_program[processed](logits, params, None, None)
        for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(none)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_no_histories_equal_empty_ones():
    """None histories (no row has penalties) give the bits that all-padding histories give, for draws too."""
    logits, params, _, _ = _random_case(np.random.default_rng(8), greedy_frac=0.3)
    params = dataclasses.replace(params, presence_penalty=np.zeros(B, np.float32),
                                 frequency_penalty=np.zeros(B, np.float32), repetition_penalty=np.ones(B, np.float32))
    for a, b in zip(jax.tree.leaves(_sample(logits, params, NO_PROMPT, NO_OUTPUT)),
                    jax.tree.leaves(_sample(logits, params, None, None))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@settings(max_examples=15)
@given(seed=st.integers(0, 2**32 - 1), where=st.integers(0, B - 1), neighbours_greedy=st.booleans())
def test_row_draw_independent_of_batch(seed, where, neighbours_greedy):
    rng = np.random.default_rng(seed)
    logits, params, prompt, output = _random_case(rng, greedy_frac=1.0 if neighbours_greedy else 0.3)
    if rng.random() < 0.5:  # neighbours with and without penalties: the penalty cond both ways
        params = dataclasses.replace(params, presence_penalty=np.zeros(B, np.float32),
                                     frequency_penalty=np.zeros(B, np.float32), repetition_penalty=np.ones(B, np.float32))
    row = dict(temperature=1.3, top_k=0, top_p=0.9, min_p=0.01, presence_penalty=0.0, frequency_penalty=0.0,
               repetition_penalty=1.0, seed=1234, step=7)
    row_logits = np.random.default_rng(99).normal(size=V).astype(np.float32) * 2
    alone = _sample(row_logits[None], SamplingTensors.from_rows([row], 1), -np.ones((1, LP), np.int32),
                    -np.ones((1, LO), np.int32))
    cols = {f.name: np.array(getattr(params, f.name)) for f in dataclasses.fields(params)}
    for name, value in row.items():
        cols[name][where] = value
    logits[where], prompt[where], output[where] = row_logits, -1, -1
    mixed = _sample(logits, SamplingTensors(**cols), prompt, output)
    assert int(mixed.tokens[where]) == int(alone.tokens[0])
    assert float(mixed.logprobs[where]) == pytest.approx(float(alone.logprobs[0]), abs=1e-6)


@settings(max_examples=25, deadline=None)
@given(width=st.integers(1, 600), rows=st.integers(1, 5), seed=st.integers(0, 2**32 - 1))
def test_row_sum_is_a_fixed_order_sum(width, rows, seed):
    """row_sum is the row's sum, and each row's rounding is the same alone, in a batch, and fused with the
    exp that feeds it (XLA's reduce would pick its order by the program around it)."""
    x = np.random.default_rng(seed).normal(size=(rows, width)).astype(np.float32) * 4
    np.testing.assert_allclose(np.asarray(row_sum(jnp.asarray(x))), x.astype(np.float64).sum(-1), rtol=1e-5, atol=1e-4)
    fused = np.asarray(jax.jit(lambda v: row_sum(jnp.exp(v)))(x))
    exp = jax.jit(jnp.exp)
    alone = [np.asarray(jax.jit(row_sum)(exp(x[r:r + 1])))[0] for r in range(rows)]
    np.testing.assert_array_equal(fused, np.asarray(alone))
    assert row_sum(jnp.zeros((2, 3, width))).shape == (2, 3)


def test_seeds_and_steps_change_the_draw():
    logits = np.zeros((B, V), np.float32)  # uniform: every draw is informative
    compiled = _sample._cache_size()
    by_seed = [int(_sample(logits, _params(temperature=1.0, seed=s, step=0), NO_PROMPT, NO_OUTPUT).tokens[0]) for s in range(60)]
    by_step = [int(_sample(logits, _params(temperature=1.0, seed=0, step=s), NO_PROMPT, NO_OUTPUT).tokens[0]) for s in range(60)]
    assert len(set(by_seed)) > 20 and len(set(by_step)) > 20  # 60 uniform draws over 24 tokens: ~22 distinct
    assert by_seed != by_step
    again = [int(_sample(logits, _params(temperature=1.0, seed=0, step=s), NO_PROMPT, NO_OUTPUT).tokens[0]) for s in range(60)]
    assert again == by_step
    # One call, one seed per row: rows differ.
    rows = _sample(logits, _params(temperature=1.0, seed=np.arange(B) * 7919, step=3), NO_PROMPT, NO_OUTPUT).tokens
    assert len(set(np.asarray(rows).tolist())) > 1
    assert _sample._cache_size() <= compiled + 1  # changing seeds, steps, temperatures never recompiles


@settings(max_examples=15)
@given(seed=st.integers(0, 2**32 - 1))
def test_logprobs_are_raw(seed):
    logits, params, prompt, output = _random_case(np.random.default_rng(seed), greedy_frac=0.3)
    out = _sample(logits, params, prompt, output)
    raw = _np_log_softmax(logits)
    tokens = np.asarray(out.tokens)
    np.testing.assert_allclose(np.asarray(out.logprobs), raw[np.arange(B), tokens], rtol=1e-5, atol=1e-5)
    top_ids, top_lp = np.asarray(out.top_ids), np.asarray(out.top_logprobs)
    assert top_ids.shape == top_lp.shape == (B, K) and top_ids.dtype == np.int32
    assert (np.diff(top_lp, axis=-1) <= 0).all()
    np.testing.assert_array_equal(top_ids, np.argsort(-raw, axis=-1, kind="stable")[:, :K])
    np.testing.assert_allclose(top_lp, np.take_along_axis(raw, top_ids, -1), rtol=1e-5, atol=1e-5)
    plain = jax.eval_shape(functools.partial(sample_tokens, num_top_logprobs=0), logits, params, prompt, output)
    assert plain.top_ids.shape == plain.top_logprobs.shape == (B, 0) and plain.tokens.shape == (B,)


_sample_processed = jax.jit(functools.partial(sample_tokens, num_top_logprobs=K, processed_logprobs=True))


@settings(max_examples=15)
@given(seed=st.integers(0, 2**32 - 1))
def test_processed_logprobs_are_of_the_distribution_drawn_from(seed):
    """vLLM's "processed_logprobs": log_softmax after penalties, temperature and min_p/top_k/top_p (a greedy row's
    after penalties only); the tokens drawn are the raw mode's."""
    logits, params, prompt, output = _random_case(np.random.default_rng(seed), greedy_frac=0.3)
    out = _sample_processed(logits, params, prompt, output)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(_sample(logits, params, prompt, output).tokens))
    penalised = _np_penalties(logits, prompt, output, params.presence_penalty, params.frequency_penalty,
                              params.repetition_penalty)
    tokens = np.asarray(out.tokens)
    for b in range(B):
        t = float(params.temperature[b])
        if t == 0:
            want = _np_log_softmax(penalised[b])
        else:
            scaled = penalised[b] / np.float32(t)
            kept = _np_filter(scaled, int(params.top_k[b]), float(params.top_p[b]), float(params.min_p[b]))
            want = np.where(kept, _np_log_softmax(np.where(kept, scaled, -np.inf)), -np.inf)
        assert np.isfinite(want[tokens[b]])  # the drawn token survived the filters
        assert float(out.logprobs[b]) == pytest.approx(want[tokens[b]], abs=2e-5)
        top_ids = np.asarray(out.top_ids[b])
        np.testing.assert_allclose(np.asarray(out.top_logprobs[b]), want[top_ids], rtol=1e-5, atol=2e-5)


@settings(max_examples=15)
@given(seed=st.integers(0, 2**32 - 1), width=st.sampled_from([1, 4, 9]))
def test_logit_bias_is_added_before_penalties_and_leaves_raw_logprobs(seed, width):
    """OpenAI's logit_bias, sparse: ids padded with -1 (and ids past the vocabulary) add nothing; repeated ids add
    up. The draw is the unbiased one's on the biased logits; the raw logprobs stay the model's."""
    rng = np.random.default_rng(seed)
    logits, params, prompt, output = _random_case(rng, greedy_frac=0.5)
    ids = rng.integers(-1, V + 2, size=(B, width)).astype(np.int32)
    values = rng.uniform(-100, 100, size=(B, width)).astype(np.float32)
    dense = logits.astype(np.float32).copy()
    for b in range(B):
        for t, v in zip(ids[b], values[b]):
            if 0 <= t < V:
                dense[b, t] += v
    np.testing.assert_allclose(np.asarray(jax.jit(add_logit_bias)(logits, ids, values)), dense, rtol=1e-6, atol=1e-4)
    biased = _sample(logits, params, prompt, output, logit_bias=(ids, values))
    plain_on_dense = _sample(np.asarray(jax.jit(add_logit_bias)(logits, ids, values)), params, prompt, output)
    np.testing.assert_array_equal(np.asarray(biased.tokens), np.asarray(plain_on_dense.tokens))
    raw = _np_log_softmax(logits)
    np.testing.assert_allclose(np.asarray(biased.logprobs), raw[np.arange(B), np.asarray(biased.tokens)],
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="logit_bias must be two"):
        sample_tokens(logits, params, prompt, output, logit_bias=(ids, values[:, :0]))


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (2.0, 3)])
def test_draw_frequencies_match_softmax(temperature, top_k):
    logits = np.array([[1.0, 0.5, 0.0, -0.5, -1.5]], np.float32)
    n = 2000
    draws = np.asarray(_draws(logits, _params(1, temperature=temperature, top_k=top_k, seed=2024),
                              jnp.arange(n, dtype=jnp.int32)))
    scaled = logits[0].astype(np.float64) / temperature
    if top_k:
        scaled[np.argsort(-scaled)[top_k:]] = -np.inf
    p = np.exp(scaled - scaled.max())
    p /= p.sum()
    observed = np.bincount(draws, minlength=5)
    assert (observed[p == 0] == 0).all()
    expected = n * p[p > 0]
    chi2 = (((observed[p > 0] - expected) ** 2) / expected).sum()
    assert chi2 < 23.5  # chi-square, 4 degrees of freedom at most: p = 1e-4


@pytest.mark.parametrize("vocab", [5, 256, 1000])
def test_categorical_frequencies_over_blocks(vocab):
    """The inverse-CDF draw against the softmax: mass spread over several 256-token blocks (and the
    last, partial one), -inf tokens never drawn, a lone allowed token always drawn."""
    rng = np.random.default_rng(vocab)
    logits = np.full(vocab, -np.inf, np.float32)
    live = rng.choice(vocab, size=min(vocab, 6), replace=False)
    live[-1] = vocab - 1
    logits[live] = rng.normal(size=len(live))
    n = 3000
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(7), i))(jnp.arange(n))
    draws = np.asarray(jax.jit(categorical)(keys, jnp.asarray(np.tile(logits, (n, 1)))))
    p = np.exp(logits.astype(np.float64) - logits.max())
    p /= p.sum()
    observed = np.bincount(draws, minlength=vocab)
    assert (observed[p == 0] == 0).all()
    expected = n * p[p > 0]
    assert (((observed[p > 0] - expected) ** 2) / expected).sum() < 27.0  # chi-square, 5 dof: p = 1e-4
    lone = np.full((2, vocab), -np.inf, np.float32)
    lone[:, vocab // 2] = 3.0
    assert np.asarray(categorical(keys[:2], jnp.asarray(lone))).tolist() == [vocab // 2] * 2


# ----------------------------------------------------------------------------------------------
# host side


def test_from_rows_pads_with_neutral_values():
    t = SamplingTensors.from_rows([dict(temperature=0.7, top_k=5, seed=2**32 + 3), dict(min_p=0.1)], 4)
    assert t.temperature.dtype == np.float32 and t.top_k.dtype == np.int32 and t.seed.dtype == np.uint32
    np.testing.assert_allclose(t.temperature, [0.7, 0.0, 0.0, 0.0])
    np.testing.assert_array_equal(t.top_k, [5, 0, 0, 0])
    np.testing.assert_array_equal(t.seed, [3, 0, 0, 0])
    np.testing.assert_allclose(t.min_p, [0.0, 0.1, 0.0, 0.0])
    np.testing.assert_array_equal(t.repetition_penalty, np.ones(4))
    with pytest.raises(ValueError, match="do not fit"):
        SamplingTensors.from_rows([{}] * 3, 2)
    with pytest.raises(ValueError, match="top_kk"):
        SamplingTensors.from_rows([dict(top_kk=3)], 2)


def test_bad_shapes():
    none = -np.ones((B, 1), np.int32)
    with pytest.raises(ValueError, match="params.top_p"):
        sample_tokens(np.zeros((B, V), np.float32), dataclasses.replace(_params(), top_p=np.ones(B + 1)), none, none)
    with pytest.raises(ValueError, match="output_tokens"):
        sample_tokens(np.zeros((B, V), np.float32), _params(), none, none[:1])
    with pytest.raises(ValueError, match="both be arrays or both be None"):
        sample_tokens(np.zeros((B, V), np.float32), _params(), none, None)
    assert isinstance(_sample(np.zeros((B, V), np.float32), _params(), NO_PROMPT, NO_OUTPUT), SamplerOutput)
