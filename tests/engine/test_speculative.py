"""Speculative decoding by n-gram prompt lookup: the proposer, the config, and the engine's output, which must be
exactly plain decoding's (greedy and seeded requests' tokens and their log-probs), with drafts proposed and
accepted, under chunked prefill, preemption, stops and prefix caching; a draft kept with the target's
probability."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given
from hypothesis import strategies as st

from tests.engine.idle import assert_idle
from tests.engine.test_engine import _llama_config, _reference
from tunix_rt.engine.config import EngineConfig
from tunix_rt.engine.draft_model import DraftModelProposer
from tunix_rt.engine.engine import Engine
from tunix_rt.engine.params import SamplingParams
from tunix_rt.engine.speculative import SpeculativeConfig, ngram_drafts
from tunix_rt.models.decoder import Decoder

GREEDY = dict(temperature=0.0)
# 64 blocks of 4 tokens, a 16-token step budget
SIZES = dict(max_model_len=64, max_num_seqs=8, max_num_batched_tokens=16, block_size=4, num_kv_blocks=64)
SPEC = dict(method="ngram", num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1,
            disable_by_batch_size=None)


def _brute_drafts(tokens, k, min_n, max_n):
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # latest occurrence that ends before the suffix
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


@given(tokens=st.lists(st.integers(0, 3), min_size=0, max_size=30), k=st.integers(1, 5), min_n=st.integers(1, 3),
       extra=st.integers(0, 3))
def test_ngram_drafts_match_a_brute_force_search(tokens, k, min_n, extra):
    assert ngram_drafts(tokens, k, min_n, min_n + extra) == _brute_drafts(tokens, k, min_n, min_n + extra)


def test_ngram_drafts_prefer_the_longest_then_latest_match():
    assert ngram_drafts([1, 2, 3, 9, 2, 3, 7, 5, 3], 2, 1, 3) == [7, 5]  # [3] last seen before 7
    assert ngram_drafts([1, 2, 3, 9, 2, 3, 7, 1, 2, 3], 3, 1, 3) == [9, 2, 3]  # [1, 2, 3] beats the later [2, 3]
    assert ngram_drafts([4, 5, 6], 3, 1, 3) == [] and ngram_drafts([], 3, 1, 3) == []


@pytest.mark.parametrize("value,message", [
    ({"method": "eagle"}, "method must be one of ngram, draft_model"),
    ({"method": "draft_model"}, "method draft_model needs a model"),
    ({"method": "ngram", "model": "default"}, "model is for method draft_model, not 'ngram'"),
    ({"model": 3}, "model must be a path, 'default' or a Decoder, got int"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens must be an integer from 1 to 64"),
    ({"num_speculative_tokens": True}, "num_speculative_tokens must be an integer"),
    ({"prompt_lookup_max": 2, "prompt_lookup_min": 3}, "prompt_lookup_min (3) must not exceed prompt_lookup_max (2)"),
    ({"draft_model": "x"}, "unknown key(s) draft_model"),
    ({"disable_by_batch_size": 0}, "disable_by_batch_size must be a positive integer or None"),
    ("ngram", "speculative_config must be a dict"),
])
def test_bad_speculative_config_names_the_fault(value, message):
    with pytest.raises(ValueError) as e:
        EngineConfig(speculative_config=value)
    assert message in str(e.value)


def test_config_takes_vllm_dict_shape():
    assert EngineConfig(speculative_config=SPEC).speculative_config == SpeculativeConfig(**SPEC)
    assert EngineConfig(speculative_config={"model": "some/dir", "num_speculative_tokens": 5}).speculative_config == \
        SpeculativeConfig(method="draft_model", model="some/dir", num_speculative_tokens=5)
    assert EngineConfig(speculative_config={}).speculative_config == SpeculativeConfig(
        method="ngram", num_speculative_tokens=3, prompt_lookup_max=4, prompt_lookup_min=1, disable_by_batch_size=1)
    assert EngineConfig().speculative_config is None


@pytest.fixture(scope="module")
def model():
    return Decoder(_llama_config(), rngs=nnx.Rngs(0))


def _engines(model, **kw):
    """The same engine with and without speculation."""
    sizes = {**SIZES, **kw}
    return Engine(model, None, speculative_config=SPEC, **sizes), Engine(model, None, **sizes)


@pytest.fixture(scope="module")
def engines(model):
    return _engines(model)


def _repetitive_prompts(seed: int, count: int) -> list[list[int]]:
    """Prompts that repeat a random phrase: n-gram lookup finds drafts in them at once."""
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, 97, size=int(rng.integers(3, 7))).tolist() * 4)[:int(rng.integers(12, 30))]
            for _ in range(count)]


@pytest.mark.slow
def test_greedy_output_is_plain_decodings_with_drafts_accepted(model, engines):
    spec, plain = engines
    prompts = _repetitive_prompts(0, 6) + [list(range(20))]
    before = spec.stats()
    params = SamplingParams(max_tokens=20, logprobs=2, **GREEDY)
    got, want = spec.generate(prompts, params), plain.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want] == _reference(model, prompts, 20)
    assert [o.logprobs for o in got] == [o.logprobs for o in want]  # the sampled token's and the top 2, bit for bit
    stats = spec.stats()
    drafts = stats.spec_draft_tokens - before.spec_draft_tokens
    accepted = stats.spec_accepted_tokens - before.spec_accepted_tokens
    assert drafts > 20 and 0 < accepted <= drafts
    assert plain.stats().spec_draft_tokens == 0
    assert_idle(spec)


@pytest.mark.slow
@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5])
def test_stops_and_max_tokens_cut_the_drafts(model, engines, max_tokens):
    spec, plain = engines
    prompts = _repetitive_prompts(1, 4)
    first = plain.generate(prompts, SamplingParams(max_tokens=8, **GREEDY))
    stop = {o.token_ids[2] for o in first}  # each prompt's third greedy token stops some of them early
    params = SamplingParams(max_tokens=max_tokens, stop_token_ids=sorted(stop), **GREEDY)
    got, want = spec.generate(prompts, params), plain.generate(prompts, params)
    assert [(o.token_ids, o.finish_reason) for o in got] == [(o.token_ids, o.finish_reason) for o in want]
    assert all(len(o.token_ids) <= max_tokens for o in got)
    assert_idle(spec)


@pytest.mark.slow
def test_seeded_sampled_requests_speculate_and_draw_plain_decodings_tokens(engines):
    """A draft's row samples with the key of the output position it stands at and counts the drafts before it in
    its penalties: seeded requests get plain decoding's tokens and log-probs draw for draw, whatever their
    options; greedy requests share the steps; a grammar-free request's drafts are kept when its draw agrees."""
    spec, plain = engines
    prompts = _repetitive_prompts(2, 6)
    # the random model is flat: a bias on the prompt's own tokens makes its drafts likely, so that rows past a
    # request's first draw (and their keys) decide kept tokens often
    options = [dict(temperature=1.0), dict(temperature=0.7, top_k=5, top_p=0.9),
               dict(temperature=1.0, presence_penalty=1.0, frequency_penalty=1.5, repetition_penalty=1.3),
               dict(temperature=1.0, min_p=0.05), dict(temperature=0.0), dict(temperature=0.5, min_tokens=3)]
    params = [SamplingParams(max_tokens=14, seed=5 + i, logprobs=2, logit_bias=dict.fromkeys(prompt, 5.0), **o)
              for i, (prompt, o) in enumerate(zip(prompts, options))]
    before = spec.stats()
    got, want = spec.generate(prompts, params), plain.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.logprobs for o in got] == [o.logprobs for o in want]
    sampled = spec.generate(prompts[:4], params[:4])  # the sampled ones alone: their drafts are kept too
    assert [o.token_ids for o in sampled] == [o.token_ids for o in want[:4]]
    after = spec.stats()
    assert after.spec_accepted_tokens - before.spec_accepted_tokens > 0
    assert_idle(spec)


@pytest.mark.slow
def test_a_draft_is_kept_with_the_targets_probability(model):
    """Rejection sampling with a one-token proposal: the draft d is kept with probability p(d). 300 unseeded
    samples of one 17-token prompt, one at a time with a 16-token budget: each prompt's last token is computed
    in a step of its own, as a decode with the draft d the prompt proposes (a logit bias makes p(d) about 0.4;
    the random model is flat). The kept fraction is p(d) from the model's logits, within 4.5 standard
    deviations."""
    spec = Engine(model, None, speculative_config=SPEC, enable_prefix_caching=False,
                  **{**SIZES, "max_num_seqs": 1})
    prompt = (_repetitive_prompts(4, 1)[0] * 2)[:17]
    [draft] = ngram_drafts(prompt, 1, SPEC["prompt_lookup_min"], SPEC["prompt_lookup_max"])
    bias = {draft: 4.0}
    logits = model(jnp.asarray([prompt]), jnp.arange(len(prompt))[None])[0, -1].at[draft].add(bias[draft])
    p = float(jax.nn.softmax(logits)[draft])
    assert 0.2 < p < 0.8, p
    n = 300
    spec.generate(prompt, SamplingParams(n=n, max_tokens=2, temperature=1.0, logit_bias=bias))
    stats = spec.stats()
    assert stats.spec_draft_tokens == n
    kept = stats.spec_accepted_tokens
    assert abs(kept - n * p) < 4.5 * np.sqrt(n * p * (1 - p)), (kept, n, p)


@pytest.mark.slow
def test_speculation_stops_past_its_batch_size(model):
    """disable_by_batch_size (1 by default): a lone request speculates, two together decode plainly."""
    engine = Engine(model, None, speculative_config=dict(num_speculative_tokens=3), **SIZES)
    prompts = _repetitive_prompts(5, 2)
    params = SamplingParams(max_tokens=16, **GREEDY)
    both = engine.generate(prompts, params)
    assert engine.stats().spec_draft_tokens == 0
    alone = [engine.generate(p, params)[0] for p in prompts]
    assert engine.stats().spec_draft_tokens > 0
    assert [o.token_ids for o in both] == [o.token_ids for o in alone] == _reference(model, prompts, 16)


@pytest.mark.slow
def test_greedy_matches_reference_under_preemption_with_drafts(model):
    """A pool of 24 blocks for 8 requests growing to ~12 blocks each: preemptions recompute requests whose KV held
    rejected drafts; nothing leaks."""
    spec, _ = _engines(model, num_kv_blocks=24)
    prompts = _repetitive_prompts(3, 8)
    outs = spec.generate(prompts, SamplingParams(max_tokens=24, **GREEDY))
    assert spec.stats().num_preemptions > 0 and spec.stats().spec_accepted_tokens > 0
    assert [o.token_ids for o in outs] == _reference(model, prompts, 24)
    assert_idle(spec)


@pytest.mark.slow
def test_prefix_cache_after_drafts_serves_only_computed_tokens(model, engines):
    """A second request whose prompt is the first's prompt and output reuses the first's cached blocks (whose K/V
    held drafts, rejected ones rewritten) and continues as the reference does."""
    spec, _ = engines
    prompt = _repetitive_prompts(4, 1)[0]
    [first] = spec.generate(prompt, SamplingParams(max_tokens=20, **GREEDY))
    follow = prompt + first.token_ids
    hits = spec.stats().prefix_cache_hits
    [second] = spec.generate(follow, SamplingParams(max_tokens=8, **GREEDY))
    assert spec.stats().prefix_cache_hits - hits >= len(prompt) // 4 * 4
    assert second.token_ids == _reference(model, [follow], 8)[0]
    assert_idle(spec)


@pytest.mark.slow
def test_warmup_covers_a_lone_speculating_request(model):
    """The sampled rows' buckets reach max_num_seqs + (requests that may speculate) x drafts, and a lone request's
    warm-up (max_rows=1) compiles everything its speculative steps run."""
    engine = Engine(model, None, speculative_config=dict(num_speculative_tokens=3), **SIZES)
    assert engine.runner.seq_buckets[-1] == 8 + 1 * 3
    assert Engine(model, None, speculative_config=SPEC, **SIZES).runner.seq_buckets[-1] == 8 + 8 * 3
    engine.warmup(max_rows=1)
    compiled = engine.stats().num_compiles
    for prompt in _repetitive_prompts(0, 6):  # one at a time
        engine.generate(prompt, SamplingParams(max_tokens=20, **GREEDY))
    assert engine.stats().spec_accepted_tokens > 0
    assert engine.stats().num_compiles == compiled


def _perturbed(model: Decoder, scale: float, seed: int) -> Decoder:
    """A draft model that agrees with `model` often but not always: its weights with noise added."""
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    noisy = [x + scale * jnp.std(x) * jax.random.normal(k, x.shape, x.dtype) if jnp.issubdtype(x.dtype, jnp.floating)
             else x for x, k in zip(leaves, keys)]
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, noisy))


def _draft_engines(model, draft, **kw):
    config = dict(method="draft_model", model=draft, num_speculative_tokens=3, disable_by_batch_size=None)
    sizes = {**SIZES, **kw}
    return Engine(model, None, speculative_config=config, **sizes), Engine(model, None, **sizes)


@pytest.mark.slow
def test_a_draft_model_that_is_the_target_has_every_draft_kept(model):
    """The target as its own draft: the draft's greedy tokens are the target's (batch and chunk invariance), so
    every draft is kept; the output is plain decoding's."""
    spec, plain = _draft_engines(model, model)
    prompts = [list(range(3, 20)), [5, 9, 2], list(range(40, 70))]
    params = SamplingParams(max_tokens=16, **GREEDY)
    got = spec.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain.generate(prompts, params)]
    stats = spec.stats()
    assert stats.spec_draft_tokens > 20 and stats.spec_accepted_tokens == stats.spec_draft_tokens
    assert_idle(spec)
    pool = spec.proposer.kv.groups[0].pool
    assert pool.num_free == pool.num_blocks  # finished requests' drafts freed


@pytest.mark.slow
@pytest.mark.parametrize("kw", [{}, {"num_kv_blocks": 24}], ids=["roomy", "preempting"])
def test_a_draft_model_that_sometimes_disagrees_leaves_output_unchanged(model, kw):
    """A noisy copy of the target drafts: some drafts kept, some rejected (the draft rolls back to what the target
    kept); greedy and seeded sampled requests get plain decoding's tokens and log-probs, with preemptions too."""
    spec, plain = _draft_engines(model, _perturbed(model, 0.3, seed=1), **kw)
    prompts = _repetitive_prompts(7, 8)
    params = [SamplingParams(max_tokens=24, seed=i, logprobs=1, **({} if i % 2 else GREEDY)) for i in range(8)]
    got, want = spec.generate(prompts, params), plain.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.logprobs for o in got] == [o.logprobs for o in want]
    stats = spec.stats()
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
    if "num_kv_blocks" in kw:
        assert stats.num_preemptions > 0
    assert_idle(spec)
    assert spec.proposer.kv.groups[0].pool.num_free == spec.proposer.kv.groups[0].pool.num_blocks


@pytest.mark.slow
def test_a_draft_model_warms_up_with_the_engine(model):
    """A lone request's warm-up compiles the draft's programs too: speculating compiles nothing afterwards."""
    spec, _ = _draft_engines(model, _perturbed(model, 0.3, seed=2))
    spec.warmup(max_rows=1)
    compiled = spec.stats().num_compiles, len(spec.proposer.runner.compiled)
    for prompt in _repetitive_prompts(8, 3):
        spec.generate(prompt, SamplingParams(max_tokens=12, **GREEDY))
    assert spec.stats().spec_draft_tokens > 0
    assert (spec.stats().num_compiles, len(spec.proposer.runner.compiled)) == compiled


@pytest.mark.slow
@pytest.mark.parametrize("max_sequences", [1, 2])
def test_draft_proposals_are_the_draft_models_greedy_tokens_after_rollbacks(model, max_sequences):
    """Two sequences take turns; after each proposal the target keeps some drafts and adds a token of its own (or,
    as plain decodes that agreed with them, only drafts), so the draft rolls back to the kept prefix (or, with
    room for one sequence, starts the other afresh). Every proposal is the draft model's greedy continuation from
    the reference generator."""
    draft = _perturbed(model, 0.3, seed=3)
    config = SpeculativeConfig(method="draft_model", model=draft, num_speculative_tokens=3)
    proposer = DraftModelProposer(config, draft, target_vocab_size=97, max_model_len=64, block_size=4,
                                  max_sequences=max_sequences, max_num_batched_tokens=16)
    rng = np.random.default_rng(0)
    tokens = {"a": rng.integers(0, 97, size=21).tolist(), "b": rng.integers(0, 97, size=5).tolist()}
    for turn in range(12):
        seq = "ab"[turn % 2]
        room = int(rng.integers(2, 4)) if turn % 3 == 2 else int(rng.integers(1, 4))
        got = proposer.propose(seq, tokens[seq], room)
        assert list(got) == _reference(draft, [tokens[seq]], room)[0], (turn, seq)
        kept = int(rng.integers(0, room + 1))
        if turn % 3 == 2:  # plain decodes (no drafts asked) that agreed with some drafts: nothing else new
            tokens[seq] = [*tokens[seq], *got[:int(rng.integers(1, room))]]
        else:
            tokens[seq] = [*tokens[seq], *got[:kept], int(rng.integers(0, 97))]
    proposer.release("a")
    proposer.release("b")
    assert proposer.kv.groups[0].pool.num_free == proposer.kv.groups[0].pool.num_blocks


def test_a_draft_model_of_another_vocabulary_is_refused(model):
    other = Decoder(_llama_config(vocab_size=101), rngs=nnx.Rngs(1))
    with pytest.raises(ValueError, match="the draft model's vocabulary has 101 tokens, the target's 97"):
        _draft_engines(model, other)
