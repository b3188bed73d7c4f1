"""Pydantic models of the OpenAI API's requests and responses (the subset tunix-rt serves).

Requests also take vLLM's extra sampling fields (top_k, min_p, repetition_penalty, ...), so clients
that send them through `extra_body` work unchanged. Unknown fields are ignored, as OpenAI does.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tunix_rt.engine.params import MAX_LOGPROBS


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data):
        """OpenAI's schemas allow null for optional fields: null means "the default"."""
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: the usage so far on every chunk (with include_usage)


class StructuredOutputsRequest(_Request):
    """vLLM's `structured_outputs` (its guided decoding): exactly one constraint on the output."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    choice: list[str] | None = Field(None, min_length=1)
    regex: str | None = None
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    grammar: str | None = None
    json_object: bool | None = None


class SamplingFields(_Request):
    """Fields both endpoints share; ranges follow OpenAI's (and vLLM's for the extras)."""

    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int | None = Field(None, ge=0)  # vLLM: tokens generated before a stop may end the reply
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string, as JSON keys are) -> bias in [-100, 100]
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM: the prompt tokens' log-probs, top k
    structured_outputs: StructuredOutputsRequest | None = None
    user: str | None = None


class FunctionDefinition(_Request):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedFunction


class FunctionCall(_Request):
    name: str
    arguments: str


class ToolCall(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ImageURL(_Request):
    url: str
    detail: str | None = None  # accepted as OpenAI's; the model's processor decides the resolution


class ContentPart(_Request):
    type: str
    text: str | None = None
    image_url: ImageURL | None = None


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class JsonSchemaFormat(_Request):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM: extra chat template variables (enable_thinking)
    include_reasoning: bool = True  # vLLM: with a reasoning parser, return the reasoning


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # 0 only with echo: the prompt scored, nothing generated
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)


class TokenizeRequest(_Request):
    """vLLM's /tokenize: a text `prompt`, or chat `messages` rendered by the model's chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (the template adds them)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class ResponsesRequest(_Request):
    """OpenAI's POST /v1/responses, the subset the Agents SDK sends (serving/responses.py reads the items)."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None  # function tools: {"type": "function", "name", "parameters", ...}
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_output_tokens: int | None = Field(None, ge=1)
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    stream: bool = False
    store: bool | None = None  # answered false: nothing is kept
    previous_response_id: str | None = None  # refused: nothing is kept
    background: bool | None = None
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    # vLLM's sampling extras
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)


class ResponseObject(BaseModel):
    """A Responses API response (items as plain objects: message, function_call, reasoning)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: str
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None
    instructions: str | None = None
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    parallel_tool_calls: bool
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    store: bool = False
    text: dict[str, Any]
    truncation: str = "disabled"
    metadata: dict[str, Any]
    user: str | None = None
    reasoning: dict[str, Any] | None = None


class LoadLoRAAdapterRequest(_Request):
    """vLLM's POST /v1/load_lora_adapter."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(_Request):
    """vLLM's POST /v1/unload_lora_adapter."""

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


# -- responses ----------------------------------------------------------------------------------


def now() -> int:
    return int(time.time())


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None  # None when the reply calls no tool
    reasoning: str | None = None  # with a reasoning parser: the reply's <think> block (vLLM's field)
    reasoning_content: str | None = None  # the same, under the name older clients read


class PromptLogprob(BaseModel):
    """vLLM's Logprob, as its `prompt_logprobs` response field holds them (keyed by token id)."""

    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]


class ChatChoice(BaseModel):
    index: int
    message: ResponseMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's extension, with the request's prompt_logprobs


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's extension, with the request's prompt_logprobs


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "tunix-rt"
    root: str  # the model it was loaded from (vLLM's field)
    parent: str | None = None  # the base model of an adapter; None for a base model
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class TokenizerInfo(BaseModel):
    """vLLM's /tokenizer_info: the special tokens and chat template a client needs to tokenize as the server does."""

    tokenizer_class: str = "tunix_rt.Tokenizer"
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    chat_template: str | None
    model_max_length: int
    vocab_size: int
    add_bos_token: bool


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class PoolingRequest(_Request):
    """vLLM's /pooling and /classify: `input` (a text, texts, token ids, or lists of them) or chat `messages`."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]] | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # for texts; default true


class PoolingData(BaseModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: list[float]


class PoolingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[PoolingData]
    usage: Usage


class ClassifyData(BaseModel):
    index: int
    label: str
    probs: list[float]
    num_classes: int


class ClassifyResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ClassifyData]
    usage: Usage
