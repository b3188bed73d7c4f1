"""The rollout engine end to end on tiny random models: greedy output equals the reference generator
(chunked prefill, preemption, prefix caching, sliding windows and softcaps, bf16), n > 1 shares the
prompt, seeded sampling is batch-independent, no KV leaks, input errors, a bounded set of compiled
programs, weight updates, sleep / wake-up, streaming, logprobs, stop rules and text.

Engines compile a fresh set of programs each, so each is built once per module and reused; every
test leaves its engine idle (no request in flight, every KV block free).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.engine.idle import assert_idle
from tunix_rt.engine.config import EngineConfig
from tunix_rt.engine.engine import Engine
from tunix_rt.engine.errors import (
    ContextLengthExceededError,
    DuplicateRequestIdError,
    EngineUnavailableError,
    InvalidPromptError,
    InvalidRequestError,
    InvalidSamplingParamError,
    RequestTooLargeError,
)
from tunix_rt.engine.params import SamplingParams
from tunix_rt.engine.reference_generator import GenerationConfig
from tunix_rt.engine.reference_generator import generate as reference_generate
from tunix_rt.models.config import FULL, SLIDING, ModelConfig, RopeConfig
from tunix_rt.models.decoder import Decoder
from tunix_rt.models.quant_layers import QuantLinear, quantize_stacked

pytestmark = pytest.mark.slow

GREEDY = dict(temperature=0.0)
_ENGINES: list[Engine] = []


# -- models and engines -----------------------------------------------------------------------


def _llama_config(**kw) -> ModelConfig:
    base = dict(architecture="llama", vocab_size=97, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=8, rope=((FULL, RopeConfig(theta=10000.0)),))
    return ModelConfig(**{**base, **kw})


def _gemma_config() -> ModelConfig:
    return ModelConfig(
        architecture="gemma2", vocab_size=97, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=8, layer_types=(SLIDING, FULL), sliding_window=5,
        rope=((FULL, RopeConfig(theta=10000.0)), (SLIDING, RopeConfig(theta=100.0))),
        attn_logit_softcap=20.0, final_logit_softcap=3.0, norm_offset=1.0, sandwich_norms=True,
        embed_scale=32**0.5, activation="gelu_tanh", tie_word_embeddings=True)


def _engine(model, tokenizer=None, **kw) -> Engine:
    engine = Engine(model, tokenizer, **kw)
    _ENGINES.append(engine)
    return engine


@pytest.fixture(scope="module")
def llama():
    """The workhorse: chunked prefill past 16 tokens; 64 blocks of 4 hold ~4 full-length sequences of 8."""
    model = Decoder(_llama_config(), rngs=nnx.Rngs(0))
    return model, _engine(model, max_model_len=64, max_num_seqs=8, max_num_batched_tokens=16, block_size=4,
                          num_kv_blocks=64)


@pytest.fixture(scope="module")
def gemma():
    """Sliding window 5 over blocks of 3, an 8-token budget and a pool too small for 64-token requests."""
    model = Decoder(_gemma_config(), rngs=nnx.Rngs(0))
    return model, _engine(model, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=8, block_size=3,
                          num_kv_blocks=20)


@pytest.fixture(autouse=True)
def _cleanup():
    """Whatever a failing test left behind must not break the next one."""
    yield
    for engine in _ENGINES:
        for rid in list(engine._requests):
            engine.abort(rid)
        if engine.is_sleeping:
            engine.wake_up()


def _prompts(seed: int, lengths, vocab: int = 97) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=n).tolist() for n in lengths]


def _reference(model, prompts, max_tokens, stop_token_ids=()):
    """The reference generator's greedy tokens. The batch is padded to 8 prompts, one of 33 tokens, so that
    calls with up to 8 prompts of up to 64 tokens and up to 64 new tokens share one pair of compiled programs."""
    assert len(prompts) <= 8 and max_tokens <= 64
    padded = list(prompts) + [[0] * 33] * (8 - len(prompts))
    config = GenerationConfig(max_tokens=max_tokens, stop_token_ids=tuple(stop_token_ids))
    return [o.token_ids for o in reference_generate(model, padded, config)][:len(prompts)]


@contextlib.contextmanager
def _scheduled(engine: Engine, row=lambda s: (s.request.seq_id, s.start, s.num_new, s.completes)):
    """Record each step's schedule, a `row(ScheduledRequest)` per request (by default (seq_id, start,
    num_new, completes) tuples)."""
    log: list[list] = []
    schedule = engine.scheduler.schedule

    def recording():
        out = schedule()
        log.append([row(s) for s in out])
        return out

    engine.scheduler.schedule = recording
    try:
        yield log
    finally:
        del engine.scheduler.schedule


@contextlib.contextmanager
def _backend_compiles():
    """Count XLA compilations (jax's backend_compile duration events) inside the block."""
    events: list[str] = []

    def listener(event, duration, **kwargs):
        if "backend_compile" in event:
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


@functools.partial(jax.jit, static_argnums=0)
def _forward_logits(graphdef, state, tokens):
    return nnx.merge(graphdef, state)(tokens[None], jnp.arange(tokens.shape[0])[None])[0]


def _log_softmax_teacher_forced(model, seq: list[int], pad_to: int = 64) -> np.ndarray:
    """log_softmax of the model's logits at every position of `seq` (causal: end padding changes nothing)."""
    tokens = np.zeros(pad_to, np.int32)
    tokens[:len(seq)] = seq
    graphdef, state = nnx.split(model)
    return np.asarray(jax.nn.log_softmax(_forward_logits(graphdef, state, jnp.asarray(tokens))))[:len(seq)]


# -- greedy equals the reference generator ----------------------------------------------------


@pytest.mark.accelerator_path
def test_greedy_matches_reference_with_chunked_prefill(llama):
    model, engine = llama
    prompts = _prompts(1, [1, 2, 5, 9, 16, 23, 33, 40])
    preempted = engine.stats().num_preemptions
    with _scheduled(engine) as log:
        outs = engine.generate(prompts, SamplingParams(max_tokens=8, **GREEDY))
    assert [o.token_ids for o in outs] == _reference(model, prompts, 8)
    assert all(o.finish_reason == "length" and o.prompt_token_ids == p for o, p in zip(outs, prompts))
    # prompts longer than the 16-token budget were prefilled in chunks, alongside decodes
    chunks = [s for step in log for s in step if not s[3]]
    assert chunks and all(sum(s[2] for s in step) <= 16 for step in log)
    assert any(len(step) > 1 and any(s[3] and s[2] == 1 for s in step) and any(not s[3] for s in step)
               for step in log)
    assert engine.stats().num_preemptions == preempted
    assert_idle(engine)


def test_a_long_prefill_gives_way_to_a_short_request(llama):
    """long_prefill_token_threshold: a 60-token prompt advances at most 6 tokens a step and sits out the steps
    in which a short request that came after it has work (at most LONG_PREFILL_MAX_WAITS in a row), so the short
    one finishes long before the long one; both equal the reference, as without the threshold."""
    from tunix_rt.engine.scheduler import LONG_PREFILL_MAX_WAITS

    model, _ = llama
    engine = _engine(model, max_model_len=64, max_num_seqs=8, max_num_batched_tokens=16, block_size=4,
                     num_kv_blocks=64, long_prefill_token_threshold=6)
    long_prompt, short_prompt = _prompts(40, [60, 3])
    params = SamplingParams(max_tokens=4, **GREEDY)
    done = {}
    with _scheduled(engine, row=lambda s: (s.request.request_id, s.num_new, s.limit)) as log:
        long_id = engine.add_request(long_prompt, params)
        engine.step()
        short_id = engine.add_request(short_prompt, params)
        steps = 1
        while engine.has_unfinished_requests():
            steps += 1
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = (steps, out.token_ids)
    assert [done[long_id][1], done[short_id][1]] == _reference(model, [long_prompt, short_prompt], 4)
    assert all(n <= 6 for step in log for rid, n, _ in step if rid == long_id)
    short_steps = [i for i, step in enumerate(log) if any(rid == short_id for rid, _, _ in step)]
    assert done[short_id][0] <= 1 + len(short_steps) <= 1 + 4  # its prefill, then decodes, one step each or looped
    assert not any(rid == long_id for i in short_steps[1:] for rid, _, _ in log[i])  # sat out its decodes
    waits = 0
    for step in log[1:]:
        waits = 0 if any(rid == long_id for rid, _, _ in step) else waits + 1
        assert waits <= LONG_PREFILL_MAX_WAITS
    assert done[short_id][0] < done[long_id][0]
    assert_idle(engine)


def test_long_prefills_alone_in_a_full_pool_always_progress(llama):
    """Two long prompts that cannot both fit in the pool, under long_prefill_token_threshold: no step is empty
    (one preempts the other), and both give what they give without the threshold."""
    model, _ = llama
    sizes = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16, block_size=4, num_kv_blocks=14)
    prompts = _prompts(41, [50, 50])
    params = SamplingParams(max_tokens=4, **GREEDY)
    want = _engine(model, **sizes).generate(prompts, params)
    engine = _engine(model, long_prefill_token_threshold=6, **sizes)
    got = engine.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert engine.stats().num_preemptions > 0
    assert_idle(engine)


@pytest.mark.accelerator_path
def test_greedy_matches_reference_under_preemption(llama):
    model, engine = llama
    prompts = _prompts(2, [30, 40, 35, 38, 31, 40, 33, 36])  # ~15 blocks each at the end: the pool holds 4
    before = engine.stats().num_preemptions
    outs = engine.generate(prompts, SamplingParams(max_tokens=24, **GREEDY))
    assert engine.stats().num_preemptions > before
    assert [o.token_ids for o in outs] == _reference(model, prompts, 24)
    assert_idle(engine)


@pytest.mark.accelerator_path
def test_greedy_matches_reference_with_shared_prefixes(llama):
    model, engine = llama
    [prefix] = _prompts(3, [27])
    prompts = [prefix + tail for tail in _prompts(4, [1, 3, 6, 9, 12, 2, 5, 11])]
    stats = engine.stats()
    outs = engine.generate(prompts, SamplingParams(max_tokens=8, **GREEDY))
    after = engine.stats()
    assert after.prefix_cache_hits > stats.prefix_cache_hits
    assert after.prefix_cache_queries - stats.prefix_cache_queries == sum(map(len, prompts))
    expected = _reference(model, prompts, 8)
    assert [o.token_ids for o in outs] == expected
    assert any(o.num_cached_tokens >= 24 for o in outs)
    # again: now every prompt is served from the cache up to its last full block
    again = engine.generate(prompts, SamplingParams(max_tokens=8, **GREEDY))
    assert [o.token_ids for o in again] == expected
    assert [o.num_cached_tokens for o in again] == [(len(p) - 1) // 4 * 4 for p in prompts]
    assert_idle(engine)


@pytest.mark.accelerator_path
def test_gemma_style_greedy_matches_reference(gemma):
    """Sliding window + attention softcap + final softcap, under an 8-token budget and preemption."""
    model, engine = gemma
    prompts = _prompts(5, [1, 4, 11, 17, 29, 40])
    preempted = engine.stats().num_preemptions
    with _scheduled(engine) as log:
        outs = engine.generate(prompts, SamplingParams(max_tokens=8, **GREEDY))
    assert [o.token_ids for o in outs] == _reference(model, prompts, 8)
    assert any(not s[3] for step in log for s in step)  # chunked
    assert engine.stats().num_preemptions > preempted
    assert_idle(engine)


def test_bf16_greedy_matches_reference():
    cfg = _llama_config()
    model = Decoder(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(3))
    engine = _engine(model, max_model_len=64, max_num_seqs=1, max_num_batched_tokens=8, block_size=4,
                     num_kv_blocks=32)
    prompts = _prompts(6, [1, 9, 24, 40])  # steps of 8 or 1 tokens only: few programs
    outs = engine.generate(prompts, SamplingParams(max_tokens=6, **GREEDY))
    assert engine.runner.k.dtype == jnp.bfloat16
    assert [o.token_ids for o in outs] == _reference(model, prompts, 6)
    assert_idle(engine)


@pytest.mark.accelerator_path
def test_moe_greedy_matches_reference():
    """A Qwen3-MoE-style model (8 experts, top-2, renormalised) under chunked prefill: each token's
    experts do not depend on what else the step batches."""
    cfg = _llama_config(architecture="qwen3_moe", qk_norm=True, num_experts=8, num_experts_per_tok=2,
                        moe_intermediate_size=16, norm_topk_prob=True)
    _assert_greedy_matches_reference(Decoder(cfg, rngs=nnx.Rngs(4)), _prompts(7, [3, 11, 20, 37]))


def _assert_greedy_matches_reference(model: Decoder, prompts: list[list[int]]) -> None:
    """8 greedy tokens per prompt from a small engine (4 sequences, 16-token steps: chunked prefill) equal the
    reference generator's, and the engine ends idle."""
    engine = _engine(model, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16, block_size=4,
                     num_kv_blocks=64)
    outs = engine.generate(prompts, SamplingParams(max_tokens=8, **GREEDY))
    assert [o.token_ids for o in outs] == _reference(model, prompts, 8)
    assert_idle(engine)


# -- n > 1 and seeds --------------------------------------------------------------------------


def test_n_samples_share_the_prompt(llama):
    model, engine = llama
    [prompt] = _prompts(7, [21])
    before = engine.stats()
    with _scheduled(engine) as log:
        [outs] = engine.generate(prompt, SamplingParams(n=8, temperature=1.0, seed=1234, max_tokens=8))
    after = engine.stats()
    assert isinstance(outs, list) and len(outs) == 8 and [o.index for o in outs] == list(range(8))
    full = (len(prompt) - 1) // 4 * 4  # 20 tokens in full blocks
    assert after.prefix_cache_queries - before.prefix_cache_queries == 8 * len(prompt)
    assert after.prefix_cache_hits - before.prefix_cache_hits == 7 * full  # hit rate 140/168 ~ 7/8
    # the prompt's full blocks were computed once: 21 tokens, then 1 per other copy
    prefill = sum(n for step in log for (sid, start, n, _) in step if start < len(prompt))
    assert prefill == len(prompt) + 7 * (len(prompt) - full)
    samples = [tuple(o.token_ids) for o in outs]
    assert len(set(samples)) == 8  # different seeds per sample
    [again] = engine.generate(prompt, SamplingParams(n=8, temperature=1.0, seed=1234, max_tokens=8))
    assert [tuple(o.token_ids) for o in again] == samples
    [other] = engine.generate(prompt, SamplingParams(n=8, temperature=1.0, seed=99, max_tokens=8))
    assert [tuple(o.token_ids) for o in other] != samples
    # greedy samples agree with each other and the reference
    [greedy] = engine.generate(prompt, SamplingParams(n=3, max_tokens=8, **GREEDY))
    assert [o.token_ids for o in greedy] == _reference(model, [prompt], 8) * 3
    assert_idle(engine)


def test_seeded_request_is_independent_of_its_batch(llama):
    _, engine = llama
    [prompt, a, b, c] = _prompts(8, [13, 5, 37, 22])
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=10)
    [alone] = [o.token_ids for o in engine.generate(prompt, params)]
    noisy = SamplingParams(temperature=0.8, max_tokens=14)
    outs = engine.generate([a, prompt, b, c], [noisy, params, SamplingParams(max_tokens=3, **GREEDY), noisy])
    assert outs[1].token_ids == alone
    # and when it joins a batch already decoding, through add_request / step
    rid = engine.add_request(b, SamplingParams(temperature=1.0, max_tokens=20))
    engine.step()
    engine.step()
    mine = engine.add_request(prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert done[mine].token_ids == alone and done[rid].finished
    assert_idle(engine)


# -- leaks --------------------------------------------------------------------------------------


def test_no_leaks_after_finished_aborted_and_preempted(llama):
    _, engine = llama
    prompts = _prompts(9, [40, 38, 36, 35, 39, 2, 30, 37, 33, 20])
    before = engine.stats().num_preemptions
    ids = [engine.add_request(p, SamplingParams(max_tokens=24, temperature=0.5, n=1 + i % 2))
           for i, p in enumerate(prompts)]
    aborted = {}
    for step in range(300):
        if not engine.has_unfinished_requests():
            break
        engine.step()
        if step == 1:  # one still waiting, never scheduled
            waiting = engine.scheduler.waiting[-1].request_id
            aborted[waiting] = engine.abort(waiting)
        decoding = [r for r in engine.scheduler.running if len(r.output_token_ids) >= 3]
        if decoding and "decoding" not in aborted:  # one mid-generation
            aborted["decoding"] = engine.abort(decoding[0].request_id)
            assert all(o.finish_reason == "abort" for o in aborted["decoding"])
            assert max(len(o.token_ids) for o in aborted["decoding"]) >= 3
        if step == 12:  # one aborted straight after it was queued
            late = engine.add_request(prompts[0], SamplingParams(max_tokens=5))
            aborted[late] = engine.abort(late)
    assert not engine.has_unfinished_requests()
    assert engine.stats().num_preemptions > before
    assert len(aborted) == 3
    for outs in aborted.values():
        assert outs and all(o.finish_reason == "abort" for o in outs)
    assert engine.abort(ids[0]) == [] and engine.abort("no such request") == []
    assert_idle(engine)


# -- errors ---------------------------------------------------------------------------------------


def test_request_that_can_never_fit_raises(gemma):
    _, engine = gemma  # 20 blocks of 3 = 60 tokens < max_model_len 64
    with pytest.raises(RequestTooLargeError, match="can never fit"):
        engine.add_request(list(range(40)), SamplingParams(max_tokens=None))
    # generate aborts the prompts it already queued
    with pytest.raises(ValueError, match="can never fit"):
        engine.generate([[1, 2, 3], list(range(40))], SamplingParams(max_tokens=24))
    assert_idle(engine)
    [out] = engine.generate(list(range(40)), SamplingParams(max_tokens=8, **GREEDY))
    assert out.finish_reason == "length"


def test_prompt_errors(llama):
    _, engine = llama
    for n in (64, 100):
        with pytest.raises(ContextLengthExceededError, match="maximum context length") as e:
            engine.add_request([1] * n)
        assert (e.value.code, e.value.max_model_len, e.value.num_tokens) == ("context_length_exceeded", 64, n)
    with pytest.raises(InvalidPromptError, match="empty"):
        engine.add_request([])
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[]])
    for bad in ([1, 97], [-1, 2], [5, 1000]):
        with pytest.raises(InvalidPromptError, match="vocabulary"):
            engine.add_request(bad)
    with pytest.raises(InvalidPromptError, match="tokenizer"):
        engine.add_request("some text")
    with pytest.raises(InvalidRequestError, match="stop strings need a tokenizer") as e:
        engine.add_request([1, 2], SamplingParams(stop=["x"]))
    assert e.value.param == "stop"
    with pytest.raises(ValueError, match="SamplingParams"):
        engine.add_request([1, 2], {"temperature": 0})
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        engine.generate([[1, 2]], [SamplingParams(), SamplingParams()])
    rid = engine.add_request([1, 2], request_id="dup")
    with pytest.raises(DuplicateRequestIdError, match="already in use"):
        engine.add_request([3, 4], request_id="dup")
    engine.abort(rid)
    assert engine.generate([]) == []
    assert_idle(engine)


@pytest.mark.parametrize("field,value", [
    ("n", 0), ("n", 1.5), ("temperature", -0.1), ("temperature", math.nan), ("top_p", 0.0), ("top_p", 1.01),
    ("top_k", -2), ("min_p", 1.5), ("presence_penalty", 2.5), ("frequency_penalty", -3.0),
    ("repetition_penalty", 0.0), ("seed", 1.5), ("max_tokens", -1), ("stop", [""]), ("stop", [3]),
    ("stop_token_ids", [-1]), ("logprobs", 21), ("logprobs", -1), ("prompt_logprobs", -1), ("prompt_logprobs", 21),
    ("prompt_logprobs", True), ("logit_bias", [1, 2]), ("logit_bias", {-1: 1.0}), ("logit_bias", {"5": 1.0}),
    ("logit_bias", {5: 101}), ("logit_bias", {5: math.inf}),
])
def test_bad_sampling_params_name_the_field(field, value):
    with pytest.raises(InvalidSamplingParamError, match=rf"SamplingParams\.{field}\b") as e:
        SamplingParams(**{field: value})
    assert e.value.param == field and isinstance(e.value, ValueError)


def test_top_k_past_int32_means_off():
    """The server fuzz found top_k = 2**31 overflowing the sampler's int32 column: no vocabulary is that large."""
    assert [SamplingParams(top_k=k).top_k for k in (-1, 0, 5, 2**31 - 1, 2**31, 10**30)] == [0, 0, 5, 2**31 - 1, 0, 0]


@pytest.mark.parametrize("kw", [dict(max_model_len=-1), dict(max_model_len=2.5), dict(max_num_seqs=0),
                                dict(max_num_batched_tokens=-1), dict(block_size=0), dict(num_kv_blocks=0),
                                dict(decode_steps=0)])
def test_bad_engine_arguments(llama, kw):
    model, _ = llama
    with pytest.raises(ValueError, match=next(iter(kw))):
        Engine(model, **kw)


def test_engine_config_and_keyword_options_are_one_thing(llama):
    """Engine(model, tok, config) and keyword options (each replacing one EngineConfig field) build the same
    engine; an unknown option is named; the serve command's flags are EngineConfig's flagged fields."""
    model, _ = llama
    config = EngineConfig(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16, block_size=4, num_kv_blocks=8,
                          token_buckets=(16, 4, 4))
    assert config.token_buckets == (4, 16)
    engine = Engine(model, None, config, decode_steps=2)
    assert engine.config == dataclasses.replace(config, decode_steps=2)
    assert (engine.max_model_len, engine.kv.groups[0].pool.num_blocks, engine.runner.token_buckets) == (64, 8, (4, 16))
    with pytest.raises(ValueError, match="unknown option.*max_num_sequences"):
        Engine(model, None, config, max_num_sequences=4)
    with pytest.raises(ValueError, match="max_num_seqs must be a positive integer"):
        dataclasses.replace(config, max_num_seqs=0)
    from tunix_rt.cli import _parser

    serve = _parser().parse_args(["serve", "--max-num-seqs", "3", "--no-enable-prefix-caching"])
    assert (serve.max_num_seqs, serve.enable_prefix_caching, serve.decode_steps) == (3, False, EngineConfig().decode_steps)


def test_zero_max_model_len_is_refused(llama):
    model, _ = llama
    with pytest.raises(ValueError, match="max_model_len"):
        Engine(model, max_model_len=0, num_kv_blocks=4)


# -- compiled programs ------------------------------------------------------------------------------


def test_warmup_compiles_every_plain_program(llama):
    """warmup() compiles each token bucket's forward and each reachable sampler shape up front (on steps that
    write nothing), so generating afterwards compiles nothing and gives what an unwarmed engine gives."""
    model, plain = llama
    engine = _engine(model, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16, block_size=4,
                     num_kv_blocks=64, token_buckets=(4, 16))
    assert engine.runner.token_buckets == (4, 16)
    asked = []
    assert engine.warmup(stop=lambda: asked.append(1) or len(asked) > 1) == 1  # stopped after its first compile
    compiled = 1 + engine.warmup()
    # two forwards (4 and 16 tokens), the row gathers of the reachable shapes, two samplers per row bucket
    # (all greedy, drawing), the two decode loops of the one decode bucket (4 rows) and the prompt scorer with
    # and without top k; the engine's count adds the program of its empty KV pools, made when it starts
    shapes = engine.runner.reachable_shapes()
    assert compiled == 2 + len(shapes) + 2 * len({b for _, b in shapes}) + 2 + 2 == engine.stats().num_compiles - 1
    assert engine.stats().kv_cache_usage == 0
    prompts = _prompts(7, [1, 3, 9, 20])
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=3)
    with _backend_compiles() as events:
        outs = engine.generate(prompts, params)
        greedy = engine.generate(prompts, SamplingParams(max_tokens=12, **GREEDY))
        for k in (0, 3):
            [scored] = engine.generate([prompts[3]], SamplingParams(max_tokens=0, prompt_logprobs=k))
            assert len(scored.prompt_logprobs) == 20
    assert not events and engine.stats().num_compiles == compiled + 1
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain.generate(prompts, params)]
    assert [o.token_ids for o in greedy] == _reference(model, prompts, 12)
    assert engine.warmup() == 0


def test_warmup_for_lone_requests_then_the_rest(llama):
    """warmup(max_rows=1) compiles what one request of any length needs (a server's phase before /health): a
    lone request, greedy or drawing, short or long, then compiles nothing; a later warmup() goes on with the
    batched steps' programs only and gives what an unwarmed engine gives."""
    model, plain = llama
    engine = _engine(model, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16, block_size=4,
                     num_kv_blocks=64, token_buckets=(4, 16))
    first = engine.warmup(max_rows=1)
    # two forwards, one row gather each, the lone row's two samplers and its two decode loops (and the empty KV
    # pools' program, made when the engine starts)
    assert first == 2 + 2 + 2 + 2 == engine.stats().num_compiles - 1
    with _backend_compiles() as events:
        for params in (SamplingParams(max_tokens=9, **GREEDY), SamplingParams(max_tokens=9, temperature=0.8, seed=2)):
            for prompt in _prompts(12, [1, 6, 16, 40]):
                engine.generate([prompt], params)
    assert not events
    shapes = engine.runner.reachable_shapes()
    rest = engine.warmup()
    assert first + rest == 2 + len(shapes) + 2 * len({b for _, b in shapes}) + 2 + 2 == engine.stats().num_compiles - 1
    prompts = _prompts(7, [1, 3, 9, 20])
    with _backend_compiles() as events:
        outs = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0.8, seed=3))
    assert not events
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain.generate(prompts, SamplingParams(
        max_tokens=12, temperature=0.8, seed=3))]
    with pytest.raises(ValueError, match="max_rows"):
        engine.warmup(max_rows=0)


def test_warmup_without_greedy_programs(llama):
    """warmup(greedy=False) (RL rollouts, which always draw) compiles no all-greedy sampler or decode loop, and
    drawing requests then compile nothing."""
    model, _ = llama
    engine = _engine(model, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16, block_size=4,
                     num_kv_blocks=64, token_buckets=(4, 16))
    engine.warmup(greedy=False)
    assert not [key for key in engine.runner.compiled if key[0] in ("sample", "decode_loop") and key[-1]]
    with _backend_compiles() as events:
        engine.generate(_prompts(9, [2, 7, 15]), SamplingParams(max_tokens=10, temperature=1.0, seed=4))
    assert not events


def test_warmup_options_compiles_the_samplers_request_options_pick(llama):
    """runner.warmup_options (a server runs it while idle): afterwards top-k log-probs, logit_bias,
    min_tokens and penalties compile nothing, and give what an engine that compiled them on first use gives."""
    model, plain = llama
    engine = _engine(model, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16, block_size=4,
                     num_kv_blocks=64, token_buckets=(4, 16))
    engine.warmup()
    compiled = engine.runner.warmup_options()
    assert compiled == 2 * 4 * len(engine.runner.seq_buckets) and engine.runner.warmup_options() == 0
    prompts = _prompts(8, [3, 9])
    options = [dict(logprobs=5), dict(logit_bias={3: 5.0}), dict(min_tokens=4, stop_token_ids=[1]),
               dict(frequency_penalty=0.5, repetition_penalty=1.2), dict(logprobs=5, **GREEDY),
               dict(frequency_penalty=0.5, **GREEDY)]
    with _backend_compiles() as events:
        outs = [engine.generate(prompts, SamplingParams(max_tokens=6, seed=1, **kw)) for kw in options]
    assert not events
    for kw, got in zip(options, outs):
        want = plain.generate(prompts, SamplingParams(max_tokens=6, seed=1, **kw))
        assert [(o.token_ids, o.logprobs) for o in got] == [(o.token_ids, o.logprobs) for o in want]


def _quantized_llama(dtype=jnp.float32) -> Decoder:
    """The tiny llama with every projection quantized to q4_0 (as GGUF weights load)."""
    model = Decoder(_llama_config(intermediate_size=64), dtype=dtype, rngs=nnx.Rngs(2))
    for layer in model.layers.kinds:
        for parent, names in ((layer.attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                              (layer.mlp, ("gate_proj", "up_proj", "down_proj"))):
            for name in names:
                setattr(parent, name, QuantLinear(quantize_stacked(getattr(parent, name).kernel[...], "q4_0")))
    return model


def test_quantized_model_compiles_one_forward_per_bucket():
    """Quantized weights take int8 activations on every row (batch-invariant kernels), prefill included:
    one forward program per token bucket, so a batch of 8 streams after warmup() compiles nothing more."""
    model = _quantized_llama()
    engine = _engine(model, max_model_len=64, max_num_seqs=8, max_num_batched_tokens=32, block_size=4,
                     num_kv_blocks=128, token_buckets=(4, 8, 32))
    compiled = engine.warmup()
    assert {key for key in engine.runner.compiled if key[0] == "forward"} == {("forward", t) for t in (4, 8, 32)}
    prompts = _prompts(21, [3, 9, 14, 5, 7, 2, 11, 6])
    with _backend_compiles() as events:
        together = engine.generate(prompts, SamplingParams(max_tokens=10, **GREEDY))
    assert not events and engine.stats().num_compiles == compiled + 1  # + the empty KV pools' program
    assert all(len(o.token_ids) == 10 for o in together)
    assert_idle(engine)


@pytest.mark.accelerator_path
def test_quantized_greedy_matches_reference():
    """Packed q4_0 projections (the GGUF default model's kind of weight) under chunked prefill, bf16: on the
    CPU path the int8 kernels, on the accelerator path the Pallas quantized matmul, in the engine as in the
    reference generator."""
    _assert_greedy_matches_reference(_quantized_llama(jnp.bfloat16), _prompts(22, [2, 9, 19, 33]))


@pytest.mark.parametrize("buckets", [(4, 8), (0, 16), (4.0, 16), ()])
def test_bad_token_buckets(llama, buckets):
    with pytest.raises(ValueError, match="token_buckets"):
        Engine(llama[0], max_num_batched_tokens=16, num_kv_blocks=8, token_buckets=buckets)


def test_no_recompiles_after_warm_up(llama):
    _, engine = llama
    runner = engine.runner
    # warm-up: one step per reachable shape, b prompts of t tokens in all, one token each
    shapes = runner.reachable_shapes()
    for i, (t, b) in enumerate(shapes):
        s = min(b, t)
        lengths = [t // s + (j < t % s) for j in range(s)]
        engine.reset_prefix_cache()  # so every prompt token is computed
        engine.generate(_prompts(100 + i, lengths), SamplingParams(max_tokens=1, **GREEDY))
    expected = ({("forward", t) for t in runner.token_buckets} | {("rows", t, b) for t, b in shapes}
                | {("sample", b, 0, 0, False, 0, True) for _, b in shapes})
    assert expected <= runner.compiled
    compiled, num_compiles = set(runner.compiled), engine.stats().num_compiles
    # samplers per row bucket x {no penalties, penalties} x {no logprobs, logprobs} x {no grammar, grammar}
    # x {all greedy, drawing}, and the empty KV pools' program
    bound = len(runner.token_buckets) + len(shapes) + len(runner.seq_buckets) * 2 * 2 * 2 * 2 + 1
    assert num_compiles <= bound
    engine.warmup()  # the multi-step decode loops, which the steps above do not reach
    compiled, num_compiles = set(runner.compiled), engine.stats().num_compiles

    # ~50 requests of varied lengths and options arriving while others run
    rng = np.random.default_rng(0)
    with _backend_compiles() as events:
        added, done = 0, 0
        while added < 50 or engine.has_unfinished_requests():
            for _ in range(rng.integers(0, 4) if added < 50 else 0):
                prompt = rng.integers(0, 97, size=int(rng.integers(1, 41))).tolist()
                params = SamplingParams(temperature=float(rng.choice([0.0, 0.7, 1.0])),
                                        top_k=int(rng.choice([0, 5])), top_p=float(rng.choice([1.0, 0.8])),
                                        max_tokens=int(rng.integers(1, 17)), n=int(rng.choice([1, 1, 2])),
                                        seed=int(rng.integers(100)) if rng.random() < 0.5 else None)
                rid = engine.add_request(prompt, params)
                added += 1
                if rng.random() < 0.1:
                    engine.abort(rid)
            done += sum(o.finished for o in engine.step())
    assert done > 40
    assert runner.compiled == compiled and engine.stats().num_compiles == num_compiles
    assert events == []
    assert_idle(engine)


# -- weights and memory -----------------------------------------------------------------------------


def test_update_weights(llama):
    model, engine = llama
    other = Decoder(_llama_config(), rngs=nnx.Rngs(1))
    prompts = _prompts(11, [5, 17, 29, 40, 2, 11, 36, 23])
    params = SamplingParams(max_tokens=8, **GREEDY)
    first = engine.generate(prompts, params)  # warm, and the prompts are in the prefix cache
    assert engine.kv.groups[0].pool.key_of
    try:
        with _backend_compiles() as events:
            engine.update_weights(other)
            assert not engine.kv.groups[0].pool.key_of  # the prefix cache was reset
            outs = engine.generate(prompts, params)
        assert events == []
        assert [o.num_cached_tokens for o in outs] == [0] * len(prompts)
        assert [o.token_ids for o in outs] == _reference(other, prompts, 8)
        assert [o.token_ids for o in outs] != [o.token_ids for o in first]
        # an nnx.State works as well as a model
        engine.update_weights(nnx.split(model)[1])
        assert [o.token_ids for o in engine.generate(prompts, params)] == [o.token_ids for o in first]
        # wrong shapes, dtypes or structure are refused, and the old weights stay (abstract models: no init cost)
        for cfg, dtype in ((_llama_config(hidden_size=16, intermediate_size=24), jnp.float32),
                           (_llama_config(), jnp.bfloat16), (_llama_config(num_layers=3), jnp.float32)):
            bad = nnx.eval_shape(lambda: Decoder(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
            with pytest.raises(ValueError, match="update_weights"):
                engine.update_weights(bad)
            with pytest.raises(ValueError, match="update_weights"):
                engine.update_weights(nnx.split(bad)[1])
        assert [o.token_ids for o in engine.generate(prompts, params)] == [o.token_ids for o in first]
    finally:
        engine.update_weights(model)
    assert_idle(engine)


def test_update_weights_of_a_quantized_model():
    """The engine keeps each packed weight's column-lane scales (laid out once for the GEMV) and its fused q/k/v
    and gate/up weights (models/fused_projections.py): an update that brings the same packed arrays reuses
    them, one with new packed weights makes them again, and either way the engine generates what a fresh
    engine on those weights does."""
    model = _quantized_llama()
    other = nnx.merge(*nnx.split(model))  # the same arrays, but for new packed up projections
    for layer in other.layers.kinds:
        layer.mlp.up_proj = QuantLinear(quantize_stacked(jax.random.normal(jax.random.key(5), (2, 32, 64)), "q4_0"))
    kw = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, block_size=4, num_kv_blocks=64)
    engine = _engine(model, **kw)
    prompts = _prompts(13, [5, 17, 9])
    params = SamplingParams(max_tokens=6, **GREEDY)
    first = [o.token_ids for o in engine.generate(prompts, params)]
    # the lanes, one per packed product stacked over the 2 layers (q/k/v, o, gate/up, down): (layers, tiles,
    # groups, 16)
    lanes = [leaf for leaf in engine.runner.leaves if leaf.ndim == 4]
    assert len(lanes) == 4 and lanes[0].shape[0] == 2 and lanes[0].shape[-1] == 16
    packed = [leaf for leaf in engine.runner.leaves if leaf.ndim == 3]
    engine.update_weights(model)
    assert all(a is b for a, b in zip([leaf for leaf in engine.runner.leaves if leaf.ndim == 4], lanes))
    assert all(a is b for a, b in zip([leaf for leaf in engine.runner.leaves if leaf.ndim == 3], packed))
    engine.update_weights(other)
    after = [leaf for leaf in engine.runner.leaves if leaf.ndim == 4]
    assert sum(a is b for a, b in zip(after, lanes)) == 3  # the fused gate/up projections' lanes are new
    assert [o.token_ids for o in engine.generate(prompts, params)] == [
        o.token_ids for o in _engine(other, **kw).generate(prompts, params)]
    engine.update_weights(model)
    assert [o.token_ids for o in engine.generate(prompts, params)] == first
    # float weights of the same config (as many variables) are refused before anything is fused, and the old stay
    plain = Decoder(_llama_config(intermediate_size=64), rngs=nnx.Rngs(2))
    with pytest.raises(ValueError, match="update_weights: the new weights' structure differs"):
        engine.update_weights(plain)
    assert [o.token_ids for o in engine.generate(prompts, params)] == first


def test_sleep_and_wake_up(llama):
    _, engine = llama
    prompts = _prompts(12, [3, 19, 33])
    params = SamplingParams(max_tokens=6, **GREEDY)
    first = [o.token_ids for o in engine.generate(prompts, params)]
    rid = engine.add_request(prompts[0], params)
    with pytest.raises(RuntimeError, match="in flight"):
        engine.sleep()
    engine.abort(rid)
    engine.sleep()
    assert engine.is_sleeping and engine.runner.k is None and not engine.kv.groups[0].pool.key_of
    engine.sleep()  # twice is harmless
    engine.wake_up()
    assert not engine.is_sleeping
    with _backend_compiles() as events:
        assert [o.token_ids for o in engine.generate(prompts, params)] == first
    assert events == []
    assert_idle(engine)


def test_generate_while_asleep_raises_and_changes_nothing(llama):
    _, engine = llama
    prompts = _prompts(13, [9, 26])
    params = SamplingParams(max_tokens=6, **GREEDY)
    first = [o.token_ids for o in engine.generate(prompts, params)]
    engine.sleep()
    try:
        with pytest.raises(EngineUnavailableError, match="asleep"):
            engine.generate(prompts, params)
        left_in_flight = engine.has_unfinished_requests()
        engine.wake_up()
        for rid in list(engine._requests):  # even with the stuck requests gone,
            engine.abort(rid)
        again = [o.token_ids for o in engine.generate(prompts, params)]  # the prefix cache serves unwritten blocks
        assert (left_in_flight, again) == (False, first)
    finally:
        engine.wake_up()
        for rid in list(engine._requests):
            engine.abort(rid)
        engine.reset_prefix_cache()


# -- streaming ----------------------------------------------------------------------------------------


def test_stream_deltas_add_up(llama):
    _, engine = llama
    [prompt] = _prompts(14, [11])
    params = SamplingParams(max_tokens=7, **GREEDY)
    outs = list(engine.stream(prompt, params))
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert [t for o in outs for t in o.delta_token_ids] == outs[-1].token_ids
    # the prompt's step brings the first token, one decode loop the other six
    assert [len(o.delta_token_ids) for o in outs] == [1, 6]
    assert outs[-1].token_ids == engine.generate(prompt, params)[0].token_ids
    # n = 2: each sample's deltas add up to its own tokens
    outs = list(engine.stream(prompt, SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=5)))
    for i in range(2):
        mine = [o for o in outs if o.index == i]
        assert [t for o in mine for t in o.delta_token_ids] == mine[-1].token_ids and mine[-1].finished
    assert_idle(engine)


def test_closing_a_stream_aborts_it(llama):
    _, engine = llama
    [prompt] = _prompts(15, [30])
    it = engine.stream(prompt, SamplingParams(max_tokens=30, temperature=1.0), request_id="s")
    next(it)
    next(it)
    assert engine.kv.groups[0].pool.num_free < engine.kv.groups[0].pool.num_blocks
    it.close()
    assert_idle(engine)


# -- logprobs -----------------------------------------------------------------------------------------


def test_logprobs_match_the_model(llama):
    model, engine = llama
    prompts = _prompts(16, [6, 25])
    params = [SamplingParams(logprobs=3, max_tokens=6, **GREEDY),
              SamplingParams(logprobs=3, temperature=1.0, seed=5, max_tokens=6)]
    outs = engine.generate(prompts, params)
    for prompt, out, p in zip(prompts, outs, params):
        lsm = _log_softmax_teacher_forced(model, prompt + out.token_ids)
        assert len(out.logprobs) == len(out.top_logprobs) == len(out.token_ids) == 6
        for i, (tok, lp, top) in enumerate(zip(out.token_ids, out.logprobs, out.top_logprobs)):
            row = lsm[len(prompt) - 1 + i]
            assert lp == pytest.approx(row[tok], abs=1e-4)
            assert len(top) == 3
            assert list(top) == sorted(top, key=top.get, reverse=True)  # most likely first
            assert set(top) == set(np.argsort(-row)[:3].tolist())
            for t, v in top.items():
                assert v == pytest.approx(row[t], abs=1e-4)
            if p.temperature == 0:
                assert tok in top and top[tok] == pytest.approx(lp, abs=1e-6) and tok == int(np.argmax(row))
    # logprobs=0: the sampled token's logprob only
    [out] = engine.generate(prompts[0], SamplingParams(logprobs=0, max_tokens=3, **GREEDY))
    assert out.top_logprobs is None and len(out.logprobs) == 3
    assert engine.generate(prompts[0], SamplingParams(max_tokens=3, **GREEDY))[0].logprobs is None
    assert_idle(engine)


def test_processed_logprobs_are_of_the_tempered_distribution(llama):
    """logprobs_mode="processed_logprobs" (what RL rollouts use): the same tokens as the raw mode, their log-probs
    under softmax(logits / T), the distribution drawn from, through prefill steps and decode loops alike."""
    model, raw_engine = llama
    engine = _engine(model, max_model_len=64, max_num_seqs=8, max_num_batched_tokens=16, block_size=4,
                     num_kv_blocks=64, logprobs_mode="processed_logprobs")
    prompts = _prompts(17, [6, 25, 3])
    t = 0.6
    params = SamplingParams(logprobs=2, temperature=t, seed=9, max_tokens=12)
    outs, raw = engine.generate(prompts, params), raw_engine.generate(prompts, params)
    for prompt, out, plain in zip(prompts, outs, raw):
        assert out.token_ids == plain.token_ids
        lsm = _log_softmax_teacher_forced(model, prompt + out.token_ids).astype(np.float64)  # logits - a constant
        for i, (tok, lp, top) in enumerate(zip(out.token_ids, out.logprobs, out.top_logprobs)):
            row = lsm[len(prompt) - 1 + i] / t
            tempered = row - row.max() - np.log(np.exp(row - row.max()).sum())
            assert lp == pytest.approx(tempered[tok], abs=1e-4)
            assert {k: pytest.approx(v, abs=1e-4) for k, v in top.items()} == {k: tempered[k] for k in top}
    with pytest.raises(ValueError, match="logprobs_mode must be one of raw_logprobs, processed_logprobs"):
        EngineConfig(logprobs_mode="raw_logits")
    assert_idle(engine)


def test_prompt_logprobs_match_the_model_through_chunks_and_n(llama):
    """prompt_logprobs: log p of every prompt token given those before it (None first), and the top k, computed in
    the prefill chunks (a 25-token prompt takes two steps of 16); n > 1 and max_tokens=0 (score only) alike."""
    model, engine = llama
    prompts = _prompts(61, [25, 6, 1])
    params = [SamplingParams(prompt_logprobs=3, max_tokens=2, n=2, temperature=1.0, seed=3),
              SamplingParams(prompt_logprobs=0, max_tokens=0), SamplingParams(prompt_logprobs=2, max_tokens=0)]
    with _scheduled(engine) as schedule:
        outs = engine.generate(prompts, params)
    assert any(completes is False for step in schedule for *_, completes in step)  # a prefill chunk ran
    for prompt, out, p in zip(prompts, outs, params):
        for o in out if isinstance(out, list) else [out]:
            lsm = _log_softmax_teacher_forced(model, prompt)
            assert len(o.prompt_logprobs) == len(prompt) and o.prompt_logprobs[0] is None
            np.testing.assert_allclose(o.prompt_logprobs[1:], [lsm[i - 1, prompt[i]] for i in range(1, len(prompt))],
                                       atol=1e-4)
            assert o.prompt_ranks[0] is None
            assert o.prompt_ranks[1:] == [1 + int(np.sum(lsm[i - 1] > lsm[i - 1, prompt[i]]))
                                          for i in range(1, len(prompt))]
            if p.prompt_logprobs:
                assert o.prompt_top_logprobs[0] is None
                for i, top in enumerate(o.prompt_top_logprobs[1:], 1):
                    assert list(top) == np.argsort(-lsm[i - 1], kind="stable")[:p.prompt_logprobs].tolist()
                    np.testing.assert_allclose(list(top.values()), lsm[i - 1, list(top)], atol=1e-4)
            else:
                assert o.prompt_top_logprobs is None
            if p.max_tokens == 0:
                assert o.token_ids == [] and o.finish_reason == "length" and o.text == ""
    assert engine.generate(prompts[1], SamplingParams(max_tokens=1)).pop().prompt_logprobs is None
    assert_idle(engine)


def test_prompt_logprobs_equal_the_sampled_logprobs_and_skip_the_prefix_cache(llama):
    """Scoring a prompt + its greedy continuation gives the continuation's sampled logprobs bit for bit (the same
    head, the same kernels, whatever the chunking); a prompt whose blocks are cached is computed again."""
    _, engine = llama
    [prompt] = _prompts(62, [21])
    [greedy] = engine.generate(prompt, SamplingParams(max_tokens=9, logprobs=0, **GREEDY))
    full = prompt + greedy.token_ids
    engine.generate(full, SamplingParams(max_tokens=1))  # full's blocks are now in the prefix cache
    [scored] = engine.generate(full, SamplingParams(max_tokens=0, prompt_logprobs=0))
    assert scored.num_cached_tokens == 0
    assert scored.prompt_logprobs[len(prompt):] == greedy.logprobs
    assert_idle(engine)


def test_prompt_logprobs_under_preemption_and_abort(gemma):
    """Preempted requests recompute their prompts (the same values land again); an abort leaves nothing held."""
    model, engine = gemma
    prompts = _prompts(63, [30, 29, 28, 27])
    before = engine.stats().num_preemptions
    outs = engine.generate(prompts, SamplingParams(max_tokens=24, prompt_logprobs=1, **GREEDY))
    assert engine.stats().num_preemptions > before
    for prompt, out in zip(prompts, outs):
        lsm = _log_softmax_teacher_forced(model, prompt)
        np.testing.assert_allclose(out.prompt_logprobs[1:], [lsm[i - 1, prompt[i]] for i in range(1, len(prompt))],
                                   atol=1e-4)
    rid = engine.add_request(prompts[0], SamplingParams(max_tokens=4, prompt_logprobs=2))
    engine.step()
    engine.abort(rid)
    assert_idle(engine)


def test_logit_bias(llama):
    """OpenAI's logit_bias: -100 bans a token, +100 forces one; the raw logprobs stay the model's; biased requests
    decode one step at a time; a token id past the vocabulary is refused, naming logit_bias and the vocabulary."""
    model, engine = llama
    [prompt] = _prompts(64, [7])
    [plain] = engine.generate(prompt, SamplingParams(max_tokens=6, **GREEDY))
    banned = plain.token_ids[0]
    with _limits(engine) as limits:
        [out] = engine.generate(prompt, SamplingParams(max_tokens=6, logit_bias={banned: -100.0}, **GREEDY))
    assert banned not in out.token_ids and all(max(step) == 1 for step in limits)
    [forced] = engine.generate(prompt, SamplingParams(max_tokens=4, logprobs=0, logit_bias={42: 100}, **GREEDY))
    assert forced.token_ids == [42] * 4
    lsm = _log_softmax_teacher_forced(model, prompt + forced.token_ids)
    np.testing.assert_allclose(forced.logprobs, [lsm[len(prompt) - 1 + i, 42] for i in range(4)], atol=1e-4)
    with pytest.raises(InvalidRequestError, match=r"logit_bias holds token id 97, outside .*\[0, 97\)") as e:
        engine.add_request(prompt, SamplingParams(logit_bias={97: 1.0}))
    assert e.value.param == "logit_bias"
    assert_idle(engine)


def test_logprobs_with_a_vocabulary_smaller_than_max_logprobs():
    cfg = _llama_config(vocab_size=11, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=1, num_kv_heads=1)
    engine = _engine(Decoder(cfg, rngs=nnx.Rngs(0)), max_model_len=8, max_num_seqs=1, max_num_batched_tokens=4,
                     block_size=4, num_kv_blocks=4)
    [out] = engine.generate([[1, 2, 3]], SamplingParams(logprobs=2, max_tokens=2, **GREEDY))
    assert [len(top) for top in out.top_logprobs] == [2, 2]


# -- multi-step decoding -------------------------------------------------------------------------------


def _limits(engine: Engine):
    """Record each step's per-request token limits (all 1 unless the step is a multi-step decode)."""
    return _scheduled(engine, lambda s: s.limit)


def test_multi_step_decode_equals_one_step_at_a_time(llama):
    """Decode loops of 8 tokens give what single steps give: greedy and seeded tokens, logprobs, top logprobs,
    stops inside a loop, max_tokens that do not divide by 8; blocks taken for unused lookahead come back."""
    model, engine = llama
    single = _engine(model, max_model_len=64, max_num_seqs=8, max_num_batched_tokens=16, block_size=4,
                     num_kv_blocks=64, decode_steps=1)
    prompts = _prompts(37, [5, 17, 9, 2, 30])
    [free] = single.generate(prompts[0], SamplingParams(max_tokens=20, **GREEDY))
    # a token first seen after the first loop of 8 tokens: the stop lands inside the second loop
    stop = free.token_ids[next(j for j in range(9, 20) if free.token_ids[j] not in free.token_ids[:j])]
    params = [SamplingParams(max_tokens=20, stop_token_ids=[stop], **GREEDY),
              SamplingParams(max_tokens=13, temperature=1.0, top_p=0.9, seed=5, logprobs=3),
              SamplingParams(max_tokens=27, temperature=0.7, top_k=20, n=2, seed=1),
              SamplingParams(max_tokens=3, **GREEDY),
              SamplingParams(max_tokens=17, logprobs=0, **GREEDY)]
    want = single.generate(prompts, params)
    with _limits(engine) as limits:
        got = engine.generate(prompts, params)
    assert max(max(step) for step in limits) == 8
    assert sum(max(step) > 1 for step in limits) >= 2
    for g, w in zip(got, want):
        for a, b in zip(g if isinstance(g, list) else [g], w if isinstance(w, list) else [w]):
            assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason and a.stop_reason == b.stop_reason
            if b.logprobs is not None:
                np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-5, atol=1e-5)
            if b.top_logprobs is not None:
                assert [list(t) for t in a.top_logprobs] == [list(t) for t in b.top_logprobs]
    assert got[0].finish_reason == "stop" and got[0].token_ids == free.token_ids[:free.token_ids.index(stop) + 1]
    assert len(got[0].token_ids) > 8
    assert_idle(engine)
    assert_idle(single)


def test_multi_step_only_for_plain_decodes_with_nothing_waiting(llama):
    """Penalties need the host between tokens, and a waiting request must be admitted at the next step:
    both keep steps single. Requests near max_tokens get smaller limits, down to a last loop shorter
    than 8."""
    _, engine = llama
    prompts = _prompts(29, [6, 6])
    with _limits(engine) as limits:
        engine.generate(prompts, [SamplingParams(max_tokens=12, **GREEDY),
                                  SamplingParams(max_tokens=12, presence_penalty=0.5, **GREEDY)])
    assert all(max(step) == 1 for step in limits)
    with _limits(engine) as limits:
        engine.generate(prompts, [SamplingParams(max_tokens=12, **GREEDY), SamplingParams(max_tokens=4, **GREEDY)])
    # the first token comes with the prompt; a loop where the short request may take 3 tokens; the last 3
    assert limits == [[1, 1], [8, 3], [3]]
    rid = engine.add_request(prompts[0], SamplingParams(max_tokens=20, **GREEDY))
    with _limits(engine) as limits:
        engine.step()
        engine.step()
        late = engine.add_request(prompts[1], SamplingParams(max_tokens=20, **GREEDY))
        engine.step()
    assert limits == [[1], [8], [1, 1]]
    for r in (rid, late):
        engine.abort(r)
    assert_idle(engine)


# -- stop rules ---------------------------------------------------------------------------------------


def test_stop_token_ids_and_max_tokens(llama, monkeypatch):
    model, engine = llama
    [prompt] = _prompts(17, [9])
    [free] = engine.generate(prompt, SamplingParams(max_tokens=10, **GREEDY))
    assert free.finish_reason == "length" and free.stop_reason is None and len(free.token_ids) == 10
    stop = free.token_ids[4]
    cut = free.token_ids.index(stop) + 1
    [out] = engine.generate(prompt, SamplingParams(max_tokens=10, stop_token_ids=[stop], **GREEDY))
    assert out.token_ids == free.token_ids[:cut] and out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == _reference(model, [prompt], 10, stop_token_ids=[stop])[0]
    # max_tokens=None runs to the context window
    [long] = engine.generate(list(range(60)), SamplingParams(max_tokens=None, **GREEDY))
    assert len(long.token_ids) == 4 and long.finish_reason == "length"
    # EOS (a tokenizer's) stops unless ignore_eos; explicit stop ids still stop with ignore_eos
    monkeypatch.setattr(engine, "eos_token_ids", frozenset({stop}))
    [eos] = engine.generate(prompt, SamplingParams(max_tokens=10, **GREEDY))
    assert eos.token_ids == free.token_ids[:cut] and eos.finish_reason == "stop" and eos.stop_reason == stop
    [ignored] = engine.generate(prompt, SamplingParams(max_tokens=10, ignore_eos=True, **GREEDY))
    assert ignored.token_ids == free.token_ids and ignored.finish_reason == "length"
    [both] = engine.generate(prompt, SamplingParams(max_tokens=10, ignore_eos=True, stop_token_ids=[stop], **GREEDY))
    assert both.token_ids == free.token_ids[:cut] and both.finish_reason == "stop"
    assert_idle(engine)


def test_min_tokens_holds_back_every_stop(llama, monkeypatch):
    """vLLM's min_tokens: no stop id (nor EOS) can be sampled and nothing stops the request before it has that
    many tokens; afterwards stops apply as usual."""
    model, engine = llama
    [prompt] = _prompts(17, [9])
    [free] = engine.generate(prompt, SamplingParams(max_tokens=10, **GREEDY))
    first = free.token_ids[0]
    [stopped] = engine.generate(prompt, SamplingParams(max_tokens=10, stop_token_ids=[first], **GREEDY))
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"
    monkeypatch.setattr(engine, "eos_token_ids", frozenset({first}))
    for min_tokens in (1, 4, 10):
        [out] = engine.generate(prompt, SamplingParams(max_tokens=10, min_tokens=min_tokens, **GREEDY))
        assert len(out.token_ids) >= min_tokens and first not in out.token_ids[:min_tokens]
        if first in out.token_ids:  # a stop after min_tokens still stops
            assert out.token_ids[-1] == first and out.finish_reason == "stop"
    with pytest.raises(InvalidSamplingParamError, match="min_tokens"):
        SamplingParams(max_tokens=3, min_tokens=4)
    assert_idle(engine)


# -- text -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def text_engine():
    gguf = pytest.importorskip("gguf")
    from tunix_rt.checkpoints.default_model import DefaultModelMissing, default_model_path
    from tunix_rt.checkpoints.tokenizer import Tokenizer

    try:
        path = default_model_path()
    except DefaultModelMissing as e:
        pytest.skip(str(e))
    tokenizer = Tokenizer.from_gguf(gguf.GGUFReader(path))
    cfg = _llama_config(vocab_size=tokenizer.vocab_size, hidden_size=16, intermediate_size=32, num_layers=1,
                        num_heads=2, num_kv_heads=1, tie_word_embeddings=True)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    return tokenizer, _engine(model, tokenizer, max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16,
                              block_size=8, num_kv_blocks=16)


PROMPT = "The quick brown fox jumps over"


def test_text_is_the_decoded_tokens(text_engine):
    tokenizer, engine = text_engine
    [out] = engine.generate(PROMPT, SamplingParams(max_tokens=16, **GREEDY))
    assert out.prompt_token_ids == tokenizer.encode(PROMPT)
    assert out.finish_reason == "length" and len(out.token_ids) == 16
    assert out.text == tokenizer.decode(out.token_ids) and out.text
    streamed = list(engine.stream(PROMPT, SamplingParams(max_tokens=16, **GREEDY)))
    assert "".join(o.delta_text for o in streamed) == out.text == streamed[-1].text
    # sampled (varied) tokens too, two prompts at once
    outs = engine.generate([PROMPT, "Hello"], SamplingParams(max_tokens=24, temperature=1.0, seed=1))
    for out in outs:
        assert out.text == tokenizer.decode(out.token_ids) and len(set(out.token_ids)) > 10
    assert_idle(engine)


def test_stop_strings(text_engine):
    _, engine = text_engine
    # the tiny random model's greedy text repeats one token, so a stop string would match at once:
    # seeded sampling gives reproducible, varied text instead
    params = dict(max_tokens=24, temperature=1.0, seed=0)
    [full] = engine.generate(PROMPT, SamplingParams(**params))
    text = full.text
    stop = text[len(text) // 2:len(text) // 2 + 4]
    at = text.find(stop)
    assert at > 0, (text, stop)
    [out] = engine.generate(PROMPT, SamplingParams(stop=[stop], **params))
    assert out.text == text[:at]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == full.token_ids[:len(out.token_ids)] and len(out.token_ids) < len(full.token_ids)
    [kept] = engine.generate(PROMPT, SamplingParams(stop=stop, include_stop_str_in_output=True, **params))
    assert kept.text == text[:at + len(stop)] and kept.stop_reason == stop
    assert kept.token_ids == out.token_ids
    # a stop string that never appears changes nothing
    [same] = engine.generate(PROMPT, SamplingParams(stop=["\x00never"], **params))
    assert same.text == text and same.finish_reason == "length" and same.stop_reason is None
    # streamed text never shows the stop string, not even a prefix of it
    streamed = list(engine.stream(PROMPT, SamplingParams(stop=[stop], **params)))
    assert "".join(o.delta_text for o in streamed) == text[:at] and streamed[-1].finish_reason == "stop"
    assert_idle(engine)


def test_stats_fields(llama):
    _, engine = llama
    [prompt] = _prompts(18, [14])
    engine.generate([prompt, prompt], SamplingParams(max_tokens=2, **GREEDY))
    stats = engine.stats()
    assert dataclasses.asdict(stats)["num_blocks"] == 64 and stats.block_size == 4
    assert stats.prompt_tokens > 0 and stats.generation_tokens > 0
    assert 0 < stats.prefix_cache_hit_rate < 1
    assert stats.prefix_cache_hit_rate == pytest.approx(stats.prefix_cache_hits / stats.prefix_cache_queries)


def test_dynamic_rope_generates_what_the_reference_does_past_its_length():
    """Dynamic NTK rope (a token rotated by its own length once past max_position_embeddings = 12): chunked
    prefill, batched decode and the reference generator's dense cache give the same greedy tokens, the prompts'
    prefixes shared or not."""
    rope = RopeConfig(theta=10000.0, rope_type="dynamic", factor=4.0, original_max_position_embeddings=12)
    model = Decoder(_llama_config(rope=((FULL, rope),)), rngs=nnx.Rngs(3))
    engine = _engine(model, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=8, block_size=4,
                     num_kv_blocks=64)
    prompts = _prompts(31, [3, 10, 20, 20])
    prompts[3] = prompts[2][:16] + prompts[3][16:]  # a cached prefix
    outs = engine.generate(prompts, SamplingParams(max_tokens=24, **GREEDY))
    assert [o.token_ids for o in outs] == _reference(model, prompts, 24)
    assert_idle(engine)
    plain = Decoder(_llama_config(), rngs=nnx.Rngs(3))  # the same weights under the default rope
    assert _reference(plain, prompts, 24) != [o.token_ids for o in outs]
