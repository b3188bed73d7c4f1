"""vLLM's /pooling and /classify on `tunix-rt serve --model RM_DIR` (a tiny random reward model): scores equal the
model's own sequence_scores, texts and chat messages and token ids are accepted, the generative endpoints
refuse the classifier and these refuse a generative model, each with OpenAI's envelope."""

from __future__ import annotations

import math

import httpx2 as httpx
import jax.numpy as jnp
import numpy as np
import pytest

from tests.models.test_sequence_classification import _hf_classifier
from tests.serving.conftest import running_server
from tunix_rt.checkpoints.loader import load_model

pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def reward_server(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("rm")
    _hf_classifier("llama", model_dir)
    log_path = str(tmp_path_factory.mktemp("serve_rm") / "serve.log")
    with running_server(["--model", model_dir, "--max-model-len", "64"], log_path) as (base, _):
        yield base, model_dir


def _scores(model_dir, texts):
    loaded = load_model(model_dir)
    out = []
    for text in texts:
        ids = loaded.tokenizer.encode(text)
        h, _ = loaded.model.hidden_states(jnp.asarray([ids]), jnp.arange(len(ids))[None])
        out.append(float(loaded.model.sequence_scores(h, jnp.asarray([ids]), jnp.arange(len(ids))[None])[0, 0]))
    return out


def test_pooling_and_classify(reward_server):
    base, model_dir = reward_server
    texts = ["the cat sat", "a much longer text than the first one"]
    want = _scores(model_dir, texts)
    r = httpx.post(f"{base}/pooling", json={"model": str(model_dir), "input": texts}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and [d["index"] for d in body["data"]] == [0, 1]
    np.testing.assert_allclose([d["data"][0] for d in body["data"]], want, atol=1e-5)
    r = httpx.post(f"{base}/classify", json={"model": str(model_dir), "input": texts[0]}, timeout=60)
    data = r.json()["data"][0]
    assert data["num_classes"] == 1 and data["label"] == "LABEL_0"
    assert data["probs"][0] == pytest.approx(1 / (1 + math.exp(-want[0])), abs=1e-5)
    assert r.json()["usage"]["prompt_tokens"] > 0
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    r = httpx.post(f"{base}/pooling", json={"messages": messages}, timeout=60)
    assert r.status_code == 200 and len(r.json()["data"]) == 1
    r = httpx.post(f"{base}/pooling", json={"input": [[1, 40, 41, 42]]}, timeout=60)
    assert r.status_code == 200


@pytest.mark.parametrize("body,fault", [
    ({"input": []}, "input is empty"),
    ({"input": [[1, 9999]]}, "outside the vocabulary"),
    ({"input": "x", "messages": [{"role": "user", "content": "y"}]}, "exactly one of input and messages"),
    ({"input": ["x"] * 65}, "at most 64 inputs"),
    ({"input": "x " * 200}, "more than max_model_len"),
])
def test_bad_pooling_requests(reward_server, body, fault):
    base, _ = reward_server
    r = httpx.post(f"{base}/classify", json=body, timeout=60)
    assert r.status_code == 400 and fault in r.json()["error"]["message"], r.text


def test_generative_endpoints_refuse_a_classifier(reward_server):
    base, model_dir = reward_server
    r = httpx.post(f"{base}/v1/chat/completions", json={"model": str(model_dir), "messages": [
        {"role": "user", "content": "hi"}]}, timeout=60)
    assert r.status_code == 400 and "answers /pooling and /classify" in r.json()["error"]["message"]
    assert httpx.get(f"{base}/health", timeout=10).status_code == 200


def test_pooling_refuses_a_generative_model(server):
    r = httpx.post(f"{server.base_url}/classify", headers=server.headers(), json={"input": "hi"}, timeout=60)
    assert r.status_code == 400 and "is a generative model" in r.json()["error"]["message"]
