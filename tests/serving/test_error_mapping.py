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
