"""What the engine raises, by kind, so callers (the server) act on the type rather than the message.

Request errors subclass ValueError and state errors RuntimeError, so `except ValueError` code keeps working.
`param` names the request field at fault where one is (OpenAI's error `param`); `code` is OpenAI's error code
where it has one.
"""

from __future__ import annotations


class EngineError(Exception):
    """Anything the engine raises on purpose."""


class InvalidRequestError(EngineError, ValueError):
    """A request the engine will not run as given; retrying it unchanged gives the same error."""

    param: str | None = None
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        if param is not None:
            self.param = param


class InvalidSamplingParamError(InvalidRequestError):
    """A SamplingParams field out of range; `param` is the field's name."""


class InvalidPromptError(InvalidRequestError):
    """An empty prompt, a token id outside the vocabulary, text without a tokenizer."""


class ContextLengthExceededError(InvalidRequestError):
    """The prompt leaves no room below max_model_len."""

    code = "context_length_exceeded"

    def __init__(self, message: str, *, max_model_len: int, num_tokens: int):
        super().__init__(message)
        self.max_model_len, self.num_tokens = max_model_len, num_tokens


class RequestTooLargeError(InvalidRequestError):
    """Prompt plus max_tokens need more KV blocks than the whole cache holds: it could never be scheduled."""


class DuplicateRequestIdError(InvalidRequestError):
    """The request id names a request still in the engine."""

    param = "request_id"


class InvalidStructuredOutputError(InvalidRequestError):
    """A structured-output constraint (JSON schema, regex, grammar) that is malformed or does not compile."""

    param = "response_format"


class LoRAAdapterError(InvalidRequestError):
    """A LoRA adapter that cannot be loaded: unreadable, of another base model, over max_lora_rank, a name in use."""

    def __init__(self, message: str, *, code: str | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code


class UnknownLoRAAdapterError(InvalidRequestError):
    """A request or an unload names an adapter the engine does not hold (the server's 404)."""

    code = "model_not_found"
    param = "model"


class EngineUnavailableError(EngineError, RuntimeError):
    """The engine cannot take work now (asleep); the request itself may be fine."""


class EngineShutdownError(EngineUnavailableError):
    """The engine has been shut down."""
