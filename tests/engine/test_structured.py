"""Structured outputs: JSON schemas, any JSON object, regexes and Lark grammars enforced as token masks.

Engine tests run the default model (SmolLM2-135M Q4_1), whose text is real enough for a grammar to
matter, on one engine built once for the module and small on purpose: a 16-token budget (prompts
over 16 tokens are prefilled in chunks) and 6 KV blocks of 16 (a few concurrent requests preempt
each other). On CPU every new step shape costs a trace and a compile of the 30-layer forward (~2 s);
a second, roomy engine compiled a second set of programs and took the file past 100 s, so the
preemption test's reference is each request run alone on the same engine (it fits without
preemption). Every test leaves the engine idle (no request in flight, every KV block free).
The sampler's mask (`allowed_tokens`, `sample_tokens(bitmask=...)`) is checked on its own against
NumPy.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import re

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from tests.engine.idle import assert_idle
from tunix_rt.engine.engine import Engine
from tunix_rt.engine.errors import InvalidStructuredOutputError
from tunix_rt.engine.params import SamplingParams
from tunix_rt.engine.sampler import SamplingTensors, allowed_tokens, sample_tokens
from tunix_rt.engine.structured import GrammarCompiler, StructuredOutputsParams

pytestmark = pytest.mark.slow

GREEDY = dict(temperature=0.0)

# Every output of this schema is short, whatever the model prefers: the string is at most 8
# characters, the integer at most 3 digits (maximum 120), the enum one of three words, no other key
# may appear, and the compact JSON grammar allows no whitespace between tokens. So once the last
# property is written the only continuation is "}" and the grammar is complete: finish_reason is
# "stop" well inside max_tokens: greedy outputs are ~15 tokens (40 allowed, which also keeps a
# 40-token prompt inside the engine's 6 blocks); sampled ones get 64, room for a name in escapes.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}
JSON_TOKENS = 64
GREEDY_JSON_TOKENS = 40
_ENGINES: list[Engine] = []


def _chat(question: str) -> str:
    """SmolLM2-Instruct's chat template around one user turn."""
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


PERSON = _chat("Describe a person as JSON.")


def _schema_params(**kw) -> SamplingParams:
    max_tokens = GREEDY_JSON_TOKENS if kw.get("temperature") == 0 else JSON_TOKENS
    return SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMA), **{"max_tokens": max_tokens, **kw})


def _assert_valid(out) -> dict:
    assert out.finish_reason == "stop", (out.text, out.finish_reason)
    value = json.loads(out.text)
    jsonschema.validate(value, SCHEMA)
    # compact: no whitespace outside the strings
    assert not re.search(r"\s", re.sub(r'"(\\.|[^"\\])*"', '""', out.text)), out.text
    return value


# -- engines ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine() -> Engine:
    """Up to 4 sequences, a 16-token budget, 6 blocks of 16: requests of up to 80 tokens (5 blocks) fit
    alone, four of ~30 tokens (2 blocks each at first, then 3) do not fit together."""
    from tunix_rt.checkpoints.default_model import DefaultModelMissing, default_model_path

    try:
        default_model_path()
    except DefaultModelMissing as e:
        pytest.skip(f"default model not installed: {e}")
    eng = Engine("default", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16, block_size=16,
                 num_kv_blocks=6)
    _ENGINES.append(eng)
    return eng


@pytest.fixture(autouse=True)
def _leaves_engines_idle():
    """After every test each engine built so far must be idle; leftovers are then cleared so that a
    failing test does not break the next one."""
    yield
    leaks = []
    for eng in _ENGINES:
        try:
            assert_idle(eng)
        except AssertionError as e:
            leaks.append(e)
        for rid in list(eng._requests):
            eng.abort(rid)
    assert not leaks, leaks


@contextlib.contextmanager
def _masks(engine: Engine):
    """Record each step's rows as (seq_id, completes, constrained) and the bitmasks the runner built."""
    log: list[tuple[list[tuple], np.ndarray | None]] = []
    original = engine.runner._grammar_masks

    def recording(scheduled, b_b):
        masks = original(scheduled, b_b)
        rows = [(s.request.seq_id, s.completes, s.request.matcher is not None) for s in scheduled]
        log.append((rows, None if masks is None else np.array(masks)))
        return masks

    engine.runner._grammar_masks = recording
    try:
        yield log
    finally:
        del engine.runner._grammar_masks


def _check_mask_rows(log) -> None:
    """Masks exist exactly for steps where a constrained row samples; every other row is all ones."""
    for rows, masks in log:
        sampling = [i for i, (_, completes, constrained) in enumerate(rows) if completes and constrained]
        assert (masks is None) == (not sampling), rows
        if masks is None:
            continue
        for i in range(masks.shape[0]):
            if i in sampling:
                assert not (masks[i] == -1).all()  # a JSON / regex grammar always forbids something
            else:
                assert (masks[i] == -1).all(), (i, rows)  # unconstrained, mid-prefill or padding


# -- outputs follow the constraint ----------------------------------------------------------------


def test_json_schema_greedy_output_validates(engine):
    [out] = engine.generate(PERSON, _schema_params(**GREEDY))
    _assert_valid(out)
    # the grammar completed (nothing but EOS could follow): it finished without running to the limit
    assert out.stop_reason in (None, *engine.eos_token_ids) and len(out.token_ids) < GREEDY_JSON_TOKENS
    # the same schema as JSON text gives the same output
    text_schema = SamplingParams(max_tokens=GREEDY_JSON_TOKENS, structured_outputs=StructuredOutputsParams(
        json=json.dumps(SCHEMA)), **GREEDY)
    assert engine.generate(PERSON, text_schema)[0].token_ids == out.token_ids


def test_json_object_output_parses(engine):
    # seed 1 draws a nested object here rather than a bare "{}" (both are valid)
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=64,
                            structured_outputs=StructuredOutputsParams(json_object=True))
    [out] = engine.generate("Write a JSON object:", params)
    assert out.text.startswith("{")
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text), dict)
    else:  # an open-ended object may run to the limit; what there is must still start an object
        assert out.finish_reason == "length" and len(out.token_ids) == 64


def _allowed(tokenizer, eos: frozenset[int], words: tuple[str, ...], prefix: str, token: int) -> bool:
    """May `token` follow the output text `prefix` in the regex (w1|w2|...)?"""
    if token in eos:
        return prefix in words
    piece = tokenizer.decode([token])
    return bool(piece) and any(w.startswith(prefix + piece) for w in words)


def test_regex_output_and_masked_logprobs(engine):
    tok, eos, words = engine.tokenizer, engine.eos_token_ids, ("yes", "no")
    prompt = "Is the sky blue? Answer:"
    constraint = StructuredOutputsParams(regex=r"(yes|no)")
    [out] = engine.generate(prompt, SamplingParams(max_tokens=8, logprobs=2, structured_outputs=constraint, **GREEDY))
    assert out.finish_reason == "stop" and re.fullmatch(r"(yes|no)", out.text), out.text
    prefix = ""
    for token, lp, top in zip(out.token_ids, out.logprobs, out.top_logprobs, strict=True):
        assert len(top) == 2
        assert lp == pytest.approx(max(top.values()), abs=1e-6) and top[token] == pytest.approx(lp, abs=1e-6)
        # masked tokens never make the top list: every key is a token the regex allows here
        assert all(_allowed(tok, eos, words, prefix, t) for t in top), (prefix, top)
        assert all(math.isfinite(v) for v in top.values())
        prefix += tok.decode([token])
    # with the top 20, more than the handful of allowed tokens: those outside the regex have -inf,
    # and the allowed ones carry all the probability (logprobs of the constrained distribution)
    [wide] = engine.generate(prompt, SamplingParams(max_tokens=8, logprobs=20, structured_outputs=constraint,
                                                    **GREEDY))
    assert wide.token_ids == out.token_ids and wide.logprobs == pytest.approx(out.logprobs, abs=1e-5)
    first = wide.top_logprobs[0]
    finite = {t: v for t, v in first.items() if math.isfinite(v)}
    assert finite and len(finite) < 20
    assert all(_allowed(tok, eos, words, "", t) for t in finite), finite
    assert all(v == -math.inf for t, v in first.items() if t not in finite)
    assert math.fsum(math.exp(v) for v in finite.values()) == pytest.approx(1.0, abs=1e-4)


def test_n_samples_each_follow_the_schema(engine):
    rid = engine.add_request(PERSON, _schema_params(n=3, temperature=1.0, seed=3))
    seqs = engine._requests[rid]
    assert len({id(s.matcher) for s in seqs}) == 3  # one matcher per sample
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.index] = out
    assert sorted(outs) == [0, 1, 2]
    for out in outs.values():
        _assert_valid(out)
    assert len({o.text for o in outs.values()}) > 1  # the samples drew different outputs


def test_mask_does_not_leak_into_unconstrained_rows(engine):
    question = _chat("What is the capital of France?")
    free = SamplingParams(max_tokens=12, **GREEDY)
    [alone] = engine.generate(question, free)
    with _masks(engine) as log:
        constrained, mixed = engine.generate([PERSON, question], [_schema_params(**GREEDY), free])
    _assert_valid(constrained)
    assert mixed.token_ids == alone.token_ids and mixed.text == alone.text
    assert mixed.finish_reason == alone.finish_reason
    # both sampled in the same steps: the constrained row got a mask, the other row all ones
    shared = [(rows, masks) for rows, masks in log if sum(c for _, c, _ in rows) == 2]
    assert len(shared) >= min(len(constrained.token_ids), len(alone.token_ids)) - 1
    _check_mask_rows(log)


LONG = _chat("I am writing a novel set in a small fishing village on the coast of Norway in the nineteenth "
             "century. Please describe the main character as a JSON object.")


def test_chunked_prefill_advances_the_matcher_only_on_completing_steps(engine):
    assert len(engine.tokenizer.encode(LONG)) > 2 * engine.scheduler.max_num_batched_tokens
    with _masks(engine) as log:
        [out] = engine.generate(LONG, _schema_params(**GREEDY))
    _assert_valid(out)
    seq = [(completes, masks is not None) for rows, masks in log for sid, completes, _ in rows]
    assert sum(not c for c, _ in seq) >= 2  # the prompt was prefilled in chunks
    # one mask per sampled token: none while the prompt was still being prefilled
    assert seq == [(c, c) for c, _ in seq] and sum(c for c, _ in seq) == len(out.token_ids)
    _check_mask_rows(log)
    # again, now with the prompt's full blocks from the prefix cache: a shorter prefill, the same output
    [again] = engine.generate(LONG, _schema_params(**GREEDY))
    assert again.num_cached_tokens > 0 and again.token_ids == out.token_ids


PROMPTS = [_chat(q) for q in (
    "Describe a person as JSON.",
    "Invent a character for a story and give their details in JSON.",
    "Output JSON for a pirate.",
    "Tell me about your favourite football player, in JSON format please.",
)]


def test_preempted_constrained_requests_match_running_alone(engine):
    params = _schema_params(**GREEDY)
    before = engine.stats().num_preemptions
    with _masks(engine) as log:
        outs = engine.generate(PROMPTS, params)
    assert engine.stats().num_preemptions > before
    for out in outs:
        _assert_valid(out)
    _check_mask_rows(log)
    # a preempted request's recompute re-prefills its generated tokens without masking them again:
    # one mask (one completing step) per sampled token
    masked = {}
    for rows, _ in log:
        for sid, completes, _ in rows:
            masked[sid] = masked.get(sid, 0) + completes
    assert masked == {f"{o.request_id}#0": len(o.token_ids) for o in outs}
    # the reference: each request alone, with the pool to itself (so never preempted)
    before = engine.stats().num_preemptions
    alone = [engine.generate(p, params)[0] for p in PROMPTS]
    assert engine.stats().num_preemptions == before
    assert [o.token_ids for o in outs] == [o.token_ids for o in alone]
    assert [o.text for o in outs] == [o.text for o in alone]


def test_boolean_json_schema_true_accepts_any_json(engine):
    params = SamplingParams(max_tokens=32, structured_outputs=StructuredOutputsParams(json=True), **GREEDY)
    [out] = engine.generate("Write some JSON:", params)
    if out.finish_reason == "stop":
        json.loads(out.text)
    with pytest.raises(ValueError, match="schema `false`"):
        StructuredOutputsParams(json=False)


# -- errors ------------------------------------------------------------------------------------------


def test_invalid_constraints_raise(engine):
    S = StructuredOutputsParams
    with pytest.raises(InvalidStructuredOutputError, match="exactly one of json, json_object, regex, grammar; got none"):
        S()
    with pytest.raises(ValueError, match="exactly one.*'json'.*'regex'"):
        S(json=SCHEMA, regex="a")
    with pytest.raises(ValueError, match="exactly one"):
        S(grammar='start: "a"', json_object=True)
    with pytest.raises(ValueError, match="json is not valid JSON"):
        S(json='{"type": "object",')
    for not_a_schema in ("[1, 2]", "5", '"object"', [1, 2], 3.5):
        with pytest.raises(ValueError, match="json must be a JSON schema"):
            S(json=not_a_schema)
    for name in ("regex", "grammar"):
        with pytest.raises(ValueError, match=f"{name} must be a non-empty string"):
            S(**{name: ""})
    with pytest.raises(ValueError, match="SamplingParams.structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs="x")
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"json": SCHEMA})
    # constraints that do not compile are refused at add_request, naming the problem
    bad = {
        "unknown Lark rule": (S(grammar="start: foo"), "unknown name"),
        "broken Lark syntax": (S(grammar="start: ("), "Expected token"),
        "unclosed regex group": (S(regex="("), "unclosed group"),
        "broken regex repetition": (S(regex="a{"), "regex parse error"),
        "unknown schema type": (S(json={"type": "nonsense"}), "nonsense"),
        "dangling $ref": (S(json={"$ref": "#/nope"}), "nope"),
    }
    for case, (constraint, detail) in bad.items():
        with pytest.raises(InvalidStructuredOutputError, match="the constraint does not compile") as info:
            engine.add_request("hi", SamplingParams(structured_outputs=constraint))
        assert detail in str(info.value), (case, str(info.value))
        assert info.value.param == "response_format"
    # generate() with one bad request queues none of them
    with pytest.raises(ValueError, match="does not compile"):
        engine.generate(["hi", "there"], [SamplingParams(max_tokens=2), SamplingParams(
            structured_outputs=S(regex="("))])
    # the compiler needs a tokenizer, and an EOS token to finish on
    with pytest.raises(ValueError, match="need the engine's tokenizer"):
        GrammarCompiler(None, 97, ()).compile(S(regex="a"))
    with pytest.raises(ValueError, match="end-of-sequence"):
        GrammarCompiler(engine.tokenizer, engine.model.config.vocab_size, ()).compile(S(regex="a"))
    # the engine still works
    [out] = engine.generate("Is the sky blue? Answer:", SamplingParams(
        max_tokens=4, structured_outputs=S(grammar='start: "yes" | "no"'), **GREEDY))
    assert out.text in ("yes", "no") and out.finish_reason == "stop"


# -- the sampler's mask ---------------------------------------------------------------------------


def _unpack(mask: np.ndarray, vocab: int) -> np.ndarray:
    return np.unpackbits(np.ascontiguousarray(mask).view(np.uint8), axis=-1, bitorder="little")[:, :vocab].astype(bool)


@st.composite
def _masks_and_vocab(draw):
    # a few shapes (each one compiles), random bits
    vocab = draw(st.sampled_from([1, 7, 31, 33, 63, 65, 100, 257]))
    batch = draw(st.sampled_from([1, 3]))
    mask = draw(hnp.arrays(np.int32, (batch, -(-vocab // 32)),
                           elements=st.integers(-2**31, 2**31 - 1) | st.sampled_from([0, -1, -2**31, 1])))
    return mask, vocab


def test_a_tokenizer_llguidance_cannot_read_is_indexed_from_its_token_bytes(tmp_path):
    """llguidance reads a tokenizer.json's decoder itself and refuses a Metaspace one (the tiny test tokenizer's,
    and many SentencePiece conversions'); the compiler then gives it each token's bytes instead."""
    from tests.models.hf_tiny import write_tiny_tokenizer
    from tunix_rt.checkpoints.tokenizer import Tokenizer

    write_tiny_tokenizer(tmp_path)
    tok = Tokenizer.from_hf_dir(tmp_path)
    compiler = GrammarCompiler(tok, 128, tok.eos_token_ids)  # a model vocabulary padded past the tokenizer's 105
    matcher = compiler.compile(StructuredOutputsParams(regex=" the|th"))
    first = np.flatnonzero(_unpack(compiler.fill_masks([(matcher, 0)], 1), 128)[0])
    assert sorted(tok.backend.id_to_token(int(i)) for i in first) == sorted(["▁", "▁t", "▁th", "▁the", "t", "th"])


_allowed_tokens = jax.jit(allowed_tokens, static_argnums=1)


@settings(max_examples=60)
@given(_masks_and_vocab())
def test_allowed_tokens_matches_numpy(case):
    mask, vocab = case
    got = np.asarray(_allowed_tokens(jnp.asarray(mask), vocab))
    assert got.shape == (mask.shape[0], vocab) and got.dtype == bool
    np.testing.assert_array_equal(got, _unpack(mask, vocab))


def test_allowed_tokens_edge_bits():
    vocab = 70  # 3 words, the last one partial
    mask = np.zeros((2, 3), np.uint32)
    mask[0, 0] = 1 << 31  # token 31: the sign bit of an int32 word
    mask[0, 2] = 1 << 5  # token 69, the last one
    mask[1, :] = 0xFFFFFFFF
    mask = mask.view(np.int32)
    got = np.asarray(allowed_tokens(jnp.asarray(mask), vocab))  # eager
    assert np.flatnonzero(got[0]).tolist() == [31, 69] and got[1].all()
    np.testing.assert_array_equal(got, _unpack(mask, vocab))


B, V, K = 6, 50, 3
_sample = jax.jit(functools.partial(sample_tokens, num_top_logprobs=K))


def _single_token_masks(tokens) -> np.ndarray:
    mask = np.zeros((len(tokens), -(-V // 32)), np.uint32)
    for i, t in enumerate(tokens):
        mask[i, t // 32] |= np.uint32(1 << (t % 32))
    return mask.view(np.int32)


def test_sample_tokens_with_one_allowed_token_per_row():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(B, V)).astype(np.float32) * 3
    # each row's only allowed token is its least likely one (or a word-edge id): never what it would pick
    allowed = np.argmin(logits, axis=1)
    allowed[3], allowed[4] = 31, V - 1  # the sign bit, the last token of the partial word
    logits[3, 31] = logits[3].min() - 1
    logits[4, V - 1] = logits[4].min() - 1
    rows = [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.7, top_k=3),
            dict(temperature=1.0, top_p=0.3), dict(temperature=1.5, min_p=0.5),
            dict(temperature=1.0, repetition_penalty=2.0, frequency_penalty=1.5, presence_penalty=1.0)]
    prompt = np.full((B, 4), -1, np.int32)
    output = np.full((B, 4), -1, np.int32)
    output[5, :2] = allowed[5]  # penalised, still the only choice
    mask = jnp.asarray(_single_token_masks(allowed))
    for seed in range(3):
        params = SamplingTensors.from_rows([{**r, "seed": seed, "step": seed} for r in rows], B)
        out = _sample(jnp.asarray(logits), params, jnp.asarray(prompt), jnp.asarray(output), bitmask=mask)
        np.testing.assert_array_equal(np.asarray(out.tokens), allowed)
        # the constrained distribution puts all its mass on that token
        np.testing.assert_allclose(np.asarray(out.logprobs), 0.0, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(out.top_ids)[:, 0], allowed)
        assert np.all(np.asarray(out.top_logprobs)[:, 1:] == -np.inf)
    # unconstrained, the greedy row picks something else; an all-ones mask changes nothing
    params = SamplingTensors.from_rows([{**r, "seed": 9} for r in rows], B)
    free = _sample(jnp.asarray(logits), params, jnp.asarray(prompt), jnp.asarray(output))
    ones = _sample(jnp.asarray(logits), params, jnp.asarray(prompt), jnp.asarray(output),
                   bitmask=jnp.full((B, 2), -1, jnp.int32))
    assert int(free.tokens[0]) != allowed[0]
    for field in ("tokens", "logprobs", "top_ids", "top_logprobs"):
        np.testing.assert_array_equal(np.asarray(getattr(free, field)), np.asarray(getattr(ones, field)))


def test_sample_tokens_rejects_a_bitmask_of_the_wrong_shape():
    logits = jnp.zeros((B, V))
    params = SamplingTensors.from_rows([], B)
    none = jnp.full((B, 1), -1, jnp.int32)
    for shape in ((B, 1), (B, 3), (B + 1, 2), (B,), (2, B)):
        with pytest.raises(ValueError, match=r"bitmask must be \(6, 2\)"):
            sample_tokens(logits, params, none, none, bitmask=jnp.full(shape, -1, jnp.int32))
