"""vLLM's /pooling and /classify for a sequence classification model (a reward model): the model's scores read
at each input's last token. Such a model has no vocabulary head, so the server holds a Scorer instead of an
engine; the generative endpoints answer 400 on it, and these two answer 400 on a generative model."""

from __future__ import annotations

import time
import uuid

import numpy as np

from serving import protocol as p
from serving.errors import APIError
from tunix_rt.models.decoder import Decoder
from tunix_rt.models.sequence_scores import SequenceScorer
from tunix_rt.tools.chat import render_chat

MAX_INPUTS = 64  # inputs in one request


class Scorer:
    """The server's sequence classifier: its scores (models/sequence_scores.py) and label names."""

    def __init__(self, model: Decoder, tokenizer, hf_config: dict, max_model_len: int):
        self.scores = SequenceScorer(model)
        self.tokenizer, self.max_model_len = tokenizer, max_model_len
        self.vocab_size = min(tokenizer.vocab_size, model.config.vocab_size)
        labels = hf_config.get("id2label") or {}
        self.labels = [str(labels.get(str(i), labels.get(i, f"LABEL_{i}"))) for i in range(model.config.num_labels)]


def inputs(state, req: p.PoolingRequest) -> list[list[int]]:
    """The request's token lists: `input` (a text, texts, token ids or lists of them) or chat `messages`."""
    scorer = state.scorer
    if (req.input is None) == (req.messages is None):
        raise APIError(400, "give exactly one of input and messages", param="input")
    if req.messages is not None:
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        try:
            text = render_chat(state.tokenizer, messages, state.tool_format, None, add_generation_prompt=False)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        prompts = [state.tokenizer.encode(text, add_special_tokens=False)]
    else:
        if req.input in ("", []):
            raise APIError(400, "input is empty", param="input")
        items = req.input if isinstance(req.input, list) and not isinstance(req.input[0], int) else [req.input]
        if len(items) > MAX_INPUTS:  # counted before anything is tokenized
            raise APIError(400, f"at most {MAX_INPUTS} inputs in one request, got {len(items)}", param="input")
        special = req.add_special_tokens is not False
        prompts = [state.tokenizer.encode(x, add_special_tokens=special) if isinstance(x, str) else list(x)
                   for x in items]
    vocab = scorer.vocab_size
    for i, ids in enumerate(prompts):
        if not ids:
            raise APIError(400, f"input {i} is empty", param="input")
        if len(ids) > scorer.max_model_len:
            raise APIError(400, f"input {i} has {len(ids)} tokens, more than max_model_len ({scorer.max_model_len})",
                           param="input")
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"input {i} holds token id {bad}, outside the vocabulary [0, {vocab})", param="input")
    return prompts


def _usage(prompts) -> p.Usage:
    n = sum(len(t) for t in prompts)
    return p.Usage(prompt_tokens=n, completion_tokens=0, total_tokens=n)


def _scores(state, prompts) -> np.ndarray:
    """The scorer's scores; a request the device has no memory for is a 503, not a 500."""
    try:
        return state.scorer.scores(prompts)
    except Exception as e:  # noqa: BLE001 - XLA reports exhaustion as a runtime error of its own
        if "RESOURCE_EXHAUSTED" in str(e):
            raise APIError(503, "the server has no memory for this request now; send fewer or shorter inputs",
                           code="resource_exhausted") from None
        raise


def pooling(state, req: p.PoolingRequest, model: str) -> p.PoolingResponse:
    prompts = inputs(state, req)
    scores = _scores(state, prompts)
    data = [p.PoolingData(index=i, data=[float(v) for v in row]) for i, row in enumerate(scores)]
    return p.PoolingResponse(id=f"pool-{uuid.uuid4().hex}", created=int(time.time()), model=model, data=data,
                             usage=_usage(prompts))


def classify(state, req: p.PoolingRequest, model: str) -> p.ClassifyResponse:
    """Each input's probabilities (a softmax over the labels; one label's score through a sigmoid, as vLLM
    does) and the most probable label."""
    prompts = inputs(state, req)
    scores = _scores(state, prompts).astype(np.float64)
    if scores.shape[1] == 1:
        probs = 1.0 / (1.0 + np.exp(-scores))
    else:
        e = np.exp(scores - scores.max(axis=1, keepdims=True))
        probs = e / e.sum(axis=1, keepdims=True)
    labels = state.scorer.labels
    data = [p.ClassifyData(index=i, label=labels[int(np.argmax(row))], probs=[float(v) for v in row],
                           num_classes=len(row)) for i, row in enumerate(probs)]
    return p.ClassifyResponse(id=f"classify-{uuid.uuid4().hex}", created=int(time.time()), model=model, data=data,
                              usage=_usage(prompts))
