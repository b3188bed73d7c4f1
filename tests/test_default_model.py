"""The embedded default model (SmolLM2-135M-Instruct Q4_1 GGUF) against HF transformers and the CLI contract."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from tunix_rt.checkpoints.default_model import DefaultModelMissing, default_model_path

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fast_compiles")]  # compile-bound (conftest.fast_compiles says when)

try:
    MODEL_PATH = default_model_path()
except DefaultModelMissing as e:  # the README's test command installs it; say so rather than fail obscurely
    pytest.skip(f"default model not installed: {e}", allow_module_level=True)

TEXT = "The quick brown fox jumps over the lazy dog. Paris is the capital of France, and 12345 is a number."


@pytest.fixture(scope="module")
def ours():
    from tunix_rt.checkpoints.loader import load_model

    return load_model("default")


@pytest.fixture(scope="module")
def hf():
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    kwargs = dict(gguf_file=MODEL_PATH.name)
    tok = transformers.AutoTokenizer.from_pretrained(MODEL_PATH.parent, **kwargs)
    model = transformers.AutoModelForCausalLM.from_pretrained(MODEL_PATH.parent, dtype="float32", **kwargs).eval()
    return model, tok


def test_score_matches_hf_transformers(ours, hf):
    import torch

    from tunix_rt.models.scoring import token_logprobs

    model, tok = hf
    ids = ours.tokenizer.encode(TEXT)
    assert ids == tok(TEXT)["input_ids"]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits.float(), -1)[0].numpy()
    ref = logp[np.arange(len(ids) - 1), ids[1:]]
    got = token_logprobs(ours.model, ids)
    assert got[0] is None
    delta = np.abs(np.asarray(got[1:]) - ref)
    print(f"default model score vs HF: mean |d| = {delta.mean():.2e}, max |d| = {delta.max():.2e}")
    assert delta.mean() <= 1e-3


def test_chat_prompt_ids_match_hf(ours, hf):
    _, tok = hf
    for messages in ([{"role": "user", "content": "What is the capital of France?"}],
                     [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}]):
        want = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(want, dict) or hasattr(want, "input_ids"):
            want = want["input_ids"]
        assert ours.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True) == list(want)


def test_greedy_generation_says_paris(ours):
    from tunix_rt.engine.reference_generator import GenerationConfig, generate

    ids = ours.tokenizer.encode("The capital of France is")
    (out,) = generate(ours.model, [ids], GenerationConfig(max_tokens=4, stop_token_ids=tuple(ours.tokenizer.eos_token_ids)))
    assert ours.tokenizer.decode(out.token_ids).startswith(" Paris.")


def _cli(*args, check=True):
    proc = subprocess.run([sys.executable, "-m", "tunix_rt.cli", *args], capture_output=True, text=True, timeout=600)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def test_cli_generate_json_contract():
    proc = _cli("generate", "--prompt", "The capital of France is", "--max-tokens", "4", "--json")
    out = json.loads(proc.stdout)  # stdout holds exactly one JSON object
    assert set(out) == {"text", "token_ids", "prompt_token_ids", "finish_reason"}
    assert out["text"].startswith(" Paris.")
    assert out["finish_reason"] in ("stop", "length")
    assert len(out["token_ids"]) <= 4


def test_cli_generate_with_drafts_gives_the_same_text():
    """Greedy speculative decoding through the CLI, n-gram lookup and a draft model loaded from a path ('default':
    the model drafting for its f32 copy): the same tokens as plain decoding."""
    args = ("generate", "--prompt", "one two three four, one two three four, one two three four, one two",
            "--max-tokens", "16", "--json")
    plain = json.loads(_cli(*args).stdout)
    spec = json.loads(_cli(*args, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}').stdout)
    assert spec == plain
    f32 = json.loads(_cli(*args, "--dequantize").stdout)
    drafted = json.loads(_cli(*args, "--dequantize", "--speculative-config",
                              '{"model": "default", "num_speculative_tokens": 3}').stdout)
    assert drafted == f32


@pytest.mark.parametrize("value,message", [
    ("{not json", "argument --speculative-config: not valid JSON"),
    ("[1, 2]", "argument --speculative-config: must be a JSON object"),
    ('{"method": "eagle"}', "speculative_config: method must be one of ngram, draft_model, got 'eagle'"),
    ('{"model": "/no/such/dir"}', "/no/such/dir"),
])
def test_cli_bad_speculative_config_is_one_clear_error(value, message):
    proc = _cli("generate", "--prompt", "hi", "--speculative-config", value, check=False)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_cli_chat_and_score_json_contract(ours):
    chat = json.loads(_cli("generate", "--chat", "--prompt", "What is the capital of France?", "--max-tokens", "12",
                           "--json").stdout)
    want = ours.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                              add_generation_prompt=True, tokenize=True)
    assert chat["prompt_token_ids"] == want
    # the greedy reply itself is not pinned: its first token is a near tie on this flat distribution ('L' -2.00,
    # 'The' -2.10 nats with int8 activations on every row), which the non-chat test above covers with a clear one
    assert chat["text"].strip() and chat["finish_reason"] in ("stop", "length")

    score = json.loads(_cli("score", "--text", "Paris is nice", "--json").stdout)
    assert set(score) == {"token_ids", "logprobs"}
    assert score["logprobs"][0] is None
    assert len(score["logprobs"]) == len(score["token_ids"]) == len(ours.tokenizer.encode("Paris is nice"))
    assert all(lp <= 0 for lp in score["logprobs"][1:])
