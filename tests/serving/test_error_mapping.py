"""The server maps the engine's exception types, not their message text, to OpenAI errors."""

from __future__ import annotations

import asyncio

import pytest

from serving import handlers
from serving.errors import APIError
from tunix_rt.engine import errors as E


async def _failing(exc: Exception):
    raise exc
    yield  # an async generator that fails on its first item, as an engine stream does at admission


def _mapped(exc: Exception, param: str = "prompt") -> APIError:
    with pytest.raises(APIError) as info:
        asyncio.run(handlers.first_output(_failing(exc), param))
    return info.value


@pytest.mark.parametrize("exc,status,param,code", [
    (E.ContextLengthExceededError("too long", max_model_len=8, num_tokens=9), 400, "prompt", "context_length_exceeded"),
    (E.InvalidStructuredOutputError("structured outputs: the constraint does not compile: x"), 400, "response_format",
     None),
    (E.RequestTooLargeError("can never fit"), 400, "prompt", None),
    (E.InvalidPromptError("prompt is empty"), 400, "prompt", None),
    (E.EngineShutdownError("the engine has been shut down"), 503, None, None),
    (E.EngineUnavailableError("the engine is asleep"), 503, None, None),
])
def test_engine_errors_map_by_type(exc, status, param, code):
    err = _mapped(exc)
    assert (err.status, err.param, err.code, err.message) == (status, param, code, str(exc))


def test_a_message_that_merely_looks_like_a_known_error_is_not_one():
    """Meaning comes from the type: an untyped error reads as what it is, whatever its text says."""
    with pytest.raises(ValueError, match="maximum context length"):
        asyncio.run(handlers.first_output(_failing(ValueError("maximum context length")), "prompt"))


def test_sampling_params_errors_name_their_field():
    from serving import protocol as p

    req = p.CompletionRequest(model="m", prompt="hi", stop=[""])
    with pytest.raises(APIError) as info:
        handlers.sampling_params(None, req, max_tokens=4, logprobs=None, structured=None)
    assert (info.value.status, info.value.param) == (400, "stop")


def test_logit_bias_error_names_every_bad_key():
    """As vLLM's does: a client learns all its bad keys from one 400, not one per try."""
    from types import SimpleNamespace

    from serving import protocol as p

    config = SimpleNamespace(vocab_size=100)
    state = SimpleNamespace(engine=SimpleNamespace(engine=SimpleNamespace(model=SimpleNamespace(config=config))))
    req = p.CompletionRequest(prompt="x", logit_bias={"5": 1.0, "-1": 2.0, "abc": 3.0, "100": 4.0, "99": -1.0})
    with pytest.raises(APIError) as info:
        handlers._logit_bias(state, req)
    err = info.value
    assert (err.status, err.param) == (400, "logit_bias")
    for key in ("-1", "abc", "100"):
        assert repr(key) in err.message, err.message
    assert "'5'" not in err.message and "'99'" not in err.message
    good = p.CompletionRequest(prompt="x", logit_bias={"5": 1.0, "99": -1.0})
    assert handlers._logit_bias(state, good) == {5: 1.0, 99: -1.0}
