"""The work behind /v1/chat/completions and /v1/completions: requests -> engine -> OpenAI responses.

Each prompt is one engine request (its n samples share the prompt's KV blocks). Streaming replies
are Server-Sent Events in OpenAI's chunk format; the engine's async generator is always closed
(`aclosing`), so a client that goes away aborts its request and frees its blocks at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import math
import time
import uuid
from collections.abc import AsyncIterator

from serving import protocol as p
from serving.errors import APIError, error_body
from serving.images import place_images, take_images
from serving.metrics import SequenceTimer, ServerMetrics
from serving.pooling import Scorer
from tunix_rt.engine.async_engine import AsyncEngine
from tunix_rt.engine.errors import EngineUnavailableError, InvalidRequestError, UnknownLoRAAdapterError
from tunix_rt.engine.params import RequestOutput, SamplingParams
from tunix_rt.engine.structured import StructuredOutputsParams
from tunix_rt.models.image_processor import ImageProcessor, ImageTokensText
from tunix_rt.tools.chat import render_chat
from tunix_rt.tools.reasoning import ReasoningDelta, ReasoningParser
from tunix_rt.tools.tool_calls import ParsedCall, ParserOutput, ToolFormat, check_json_schema, check_tools

_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "min_tokens")


@dataclasses.dataclass
class ServerState:
    engine: AsyncEngine | None  # None while the model loads
    tokenizer: object
    model_name: str
    max_model_len: int
    tool_format: ToolFormat
    metrics: ServerMetrics | None  # set right after construction (its collector reads this state)
    capacity: int  # sequences running or queued before new requests get 429
    root: str = ""  # the model as given to the server (/v1/models' root)
    active: int = 0
    adapters: dict[str, str] = dataclasses.field(default_factory=dict)  # LoRA adapters served: name -> path
    reasoning_parser: str | None = None  # vLLM's --reasoning-parser: replies' <think> blocks go to `reasoning`
    max_images: int = 4  # image parts in one chat request
    image_processor: ImageProcessor | None = None  # a model with a vision encoder: its images' pixel values
    image_text: ImageTokensText | None = None  # and the token strings that place them in a prompt
    scorer: Scorer | None = None  # a sequence classification (reward) model: /pooling and /classify, no engine

    def lora_for(self, model: str | None) -> str | None:
        """The LoRA adapter a request's `model` names (None: the base model); any other name is OpenAI's 404."""
        if model is None or model == self.model_name:
            return None
        if model in self.adapters:
            return model
        raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")

    @functools.cached_property
    def token_text(self):
        return functools.lru_cache(maxsize=1 << 16)(
            lambda token_id: self.tokenizer.decode([token_id], skip_special_tokens=False))

    @functools.cached_property
    def token_bytes(self):
        return functools.lru_cache(maxsize=1 << 16)(lambda token_id: list(self.tokenizer.token_bytes(token_id)))


def _bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def requested_structure(state: ServerState, req: p.SamplingFields) -> StructuredOutputsParams | None:
    """The request's `structured_outputs` (vLLM's field) as the engine's constraint, compiled here so a regex,
    schema or grammar that does not compile is a 400 naming the field."""
    spec = req.structured_outputs
    if spec is None:
        return None
    given = {name: value for name, value in (("choice", spec.choice), ("regex", spec.regex), ("json", spec.json_),
                                             ("grammar", spec.grammar), ("json_object", spec.json_object or None))
             if value is not None}
    if len(given) != 1:
        raise _bad(f"structured_outputs takes exactly one of choice, regex, json, grammar, json_object; got "
                   f"{', '.join(given) or 'none'}", "structured_outputs")
    (name, value), = given.items()
    try:
        if name == "choice":
            structured = StructuredOutputsParams(
                grammar="start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value))
        elif name == "json":
            if isinstance(value, dict):
                check_json_schema(value, "structured_outputs.json")
            structured = StructuredOutputsParams(json=value)
        else:
            structured = StructuredOutputsParams(**{name: value})
        state.engine.engine.grammars.compile(structured)
    except ValueError as e:  # InvalidStructuredOutputError included
        raise _bad(str(e), "structured_outputs") from None
    return structured


def _logit_bias(state: ServerState, req: p.SamplingFields) -> dict[int, float] | None:
    """OpenAI's logit_bias (JSON keys are strings) as token id -> bias, every key a token of the vocabulary; a 400
    names every bad key (as vLLM's does), so a client fixes them in one go."""
    if not req.logit_bias:
        return None
    vocab = state.engine.engine.model.config.vocab_size
    bias, bad = {}, []
    for key, value in req.logit_bias.items():
        try:
            token = int(key)
        except ValueError:
            token = None
        if token is None or not 0 <= token < vocab:
            bad.append(key)
        else:
            bias[token] = value
    if bad:
        keys = ", ".join(map(repr, bad[:20])) + (f" and {len(bad) - 20} more" if len(bad) > 20 else "")
        what = f"key {keys} is not a token id" if len(bad) == 1 else f"keys {keys} are not token ids"
        raise _bad(f"logit_bias {what} of this model: keys are integer token ids in [0, {vocab}) (the vocabulary "
                   f"has {vocab} tokens)", "logit_bias")
    return bias


def sampling_params(state: ServerState, req: p.SamplingFields, *, max_tokens: int | None, logprobs: int | None,
                    structured: StructuredOutputsParams | None, prompt_logprobs: int | None = None) -> SamplingParams:
    if req.stream_options is not None and not req.stream:
        raise _bad("stream_options can only be given when stream is true", "stream_options")
    if req.prompt_logprobs is not None and req.stream:
        raise _bad("prompt_logprobs is not available with stream: true", "prompt_logprobs")
    kwargs = {name: getattr(req, name) for name in _SAMPLING_FIELDS if getattr(req, name) is not None}
    asked = [k for k in (prompt_logprobs, req.prompt_logprobs) if k is not None]
    try:
        return SamplingParams(n=req.n, max_tokens=max_tokens, stop=req.stop, stop_token_ids=req.stop_token_ids,
                              ignore_eos=req.ignore_eos, skip_special_tokens=req.skip_special_tokens,
                              include_stop_str_in_output=req.include_stop_str_in_output, seed=req.seed,
                              logprobs=logprobs, prompt_logprobs=max(asked) if asked else None,
                              logit_bias=_logit_bias(state, req), structured_outputs=structured, **kwargs)
    except InvalidRequestError as e:
        raise _bad(str(e), e.param) from None


def prompt_logprobs_field(state: ServerState, out: RequestOutput, k: int | None) -> p.PromptLogprobs | None:
    """vLLM's `prompt_logprobs` response field: per prompt position (None for the first), the prompt token's
    entry and the top k, keyed by token id."""
    if k is None:
        return None
    entries: p.PromptLogprobs = [None]
    for pos in range(1, len(out.prompt_token_ids)):
        tid = out.prompt_token_ids[pos]
        entry = {str(tid): p.PromptLogprob(logprob=out.prompt_logprobs[pos], rank=out.prompt_ranks[pos],
                                           decoded_token=state.token_text(tid))}
        for rank, (t, lp) in enumerate(list(out.prompt_top_logprobs[pos].items())[:k] if k else (), 1):
            entry.setdefault(str(t), p.PromptLogprob(logprob=lp, rank=rank, decoded_token=state.token_text(t)))
        entries.append(entry)
    return entries


def admit(state: ServerState, sequences: int):
    """Bounded queue: past `capacity` sequences in flight, new requests get 429 instead of waiting.
    Returns the function that gives the place back (once, however often it is called)."""
    if sequences > state.capacity:  # could never be admitted: retrying would not help
        raise _bad(f"the request needs {sequences} sequences (n x prompts) but the server holds at most "
                   f"{state.capacity} at once", "n")
    if state.active + sequences > state.capacity:
        raise APIError(429, f"the server is at capacity ({state.active} sequences running or queued, limit "
                            f"{state.capacity}); retry later", code="rate_limit_exceeded")
    state.active += sequences
    held = [sequences]

    def release():
        state.active -= held.pop() if held else 0

    return release


async def first_output(gen: AsyncIterator[RequestOutput], param: str) -> RequestOutput:
    """Start a stream: the engine admits the request before its first output, so admission errors
    (context length, vocabulary, constraint compile) surface here, before any byte is sent."""
    try:
        return await anext(gen)
    except UnknownLoRAAdapterError as e:  # unloaded since the request was planned
        raise APIError(404, str(e), param="model", code=e.code) from None
    except InvalidRequestError as e:
        raise _bad(str(e), e.param or param, e.code) from None
    except EngineUnavailableError as e:  # asleep or shut down: the request may succeed elsewhere or later
        raise APIError(503, str(e)) from None


class _Sequence:
    """Per-choice bookkeeping while streaming: latencies, tool-call parsing, what was sent."""

    def __init__(self, state: ServerState, arrival: float, parser=None, calls_only: bool = False,
                 reasoning: ReasoningParser | None = None):
        self.timer = SequenceTimer(state.metrics, arrival)
        self.parser = parser
        self.calls_only = calls_only  # a forced tool choice: text outside calls is a cut-off call, not content
        self.reasoning = reasoning  # splits the reply's reasoning from its answer before tool calls are read
        self.calls: list[ParsedCall] = []
        self.tokens_seen = 0

    def advance(self, out: RequestOutput) -> tuple[list[int], ParserOutput]:
        """The new tokens, and the new text as reasoning, content and complete tool calls."""
        new_ids = out.token_ids[self.tokens_seen:]
        self.tokens_seen = len(out.token_ids)
        self.timer.tokens(len(new_ids), time.monotonic())
        text, reasoning = out.delta_text, ""
        if self.reasoning is not None:
            split = self.reasoning.feed(text)
            if out.finished:
                tail = self.reasoning.finish()
                split = ReasoningDelta(split.reasoning + tail.reasoning, split.content + tail.content)
            text, reasoning = split.content, split.reasoning
        if self.parser is None:
            parsed = ParserOutput(content=text)
        else:
            parsed = self.parser.feed(text)
            if out.finished:
                tail = self.parser.finish()
                parsed = ParserOutput(parsed.content + tail.content, parsed.calls + tail.calls)
            self.calls += parsed.calls
            if self.calls_only:
                parsed.content = ""
        parsed.reasoning = reasoning
        if out.finished:
            self.timer.done(out.finish_reason, time.monotonic())
        return new_ids, parsed

    def finish_reason(self, out: RequestOutput) -> str:
        return "tool_calls" if self.calls else out.finish_reason


def _finite(logprob: float) -> float:
    """A grammar-masked token's logprob is -inf, which JSON cannot carry: -9999.0 as in vLLM."""
    return logprob if math.isfinite(logprob) else -9999.0


def _chat_logprobs(state: ServerState, out: RequestOutput, start: int, stop: int) -> p.ChoiceLogprobs:
    entries = []
    for i in range(start, stop):
        tid = out.token_ids[i]
        top = out.top_logprobs[i] if out.top_logprobs else {}
        entries.append(p.TokenLogprob(
            token=state.token_text(tid), logprob=_finite(out.logprobs[i]), bytes=state.token_bytes(tid),
            top_logprobs=[p.TopLogprob(token=state.token_text(t), logprob=_finite(lp), bytes=state.token_bytes(t))
                          for t, lp in top.items()]))
    return p.ChoiceLogprobs(content=entries)


def _usage(prompt_tokens: int, completion_tokens: int) -> p.Usage:
    return p.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


def _sse(payload) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, allow_nan=False)
    return f"data: {data}\n\n"


def _usage_field(req: p.SamplingFields):
    """A chunk's usage: absent without include_usage; null, or the usage so far with continuous_usage_stats."""
    options = req.stream_options
    if not (options and options.include_usage):
        return lambda prompt_tokens, completion_tokens: {}
    if not options.continuous_usage_stats:
        return lambda prompt_tokens, completion_tokens: {"usage": None}
    return lambda prompt_tokens, completion_tokens: {"usage": _usage(prompt_tokens, completion_tokens).model_dump()}


def _stream_end(head: dict, include_usage: bool, usage: p.Usage, error: Exception | None) -> list[str]:
    """A stream's last events: an error event (a failed engine step) or the usage chunk when asked, then [DONE]."""
    if error is not None:
        events = [_sse(error_body(500, f"generation failed: {type(error).__name__}: {error}"))]
    else:
        events = [_sse({**head, "choices": [], "usage": usage.model_dump()})] if include_usage else []
    return [*events, _sse("[DONE]")]


def _tool_call_deltas(calls: list[ParsedCall], first_index: int) -> list[dict]:
    """OpenAI's streamed shape: per call, one delta with id, type and name, then its arguments."""
    deltas = []
    for i, call in enumerate(calls, first_index):
        deltas.append({"index": i, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}})
        deltas.append({"index": i, "function": {"arguments": call.arguments}})
    return deltas


# -- chat ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class ChatPlan:
    prompt: str
    params: SamplingParams
    parse_tools: bool  # read tool calls out of the reply
    tools: list[dict]  # OpenAI tool dicts (tools/tool_calls.py)
    forced: bool  # required / named tool_choice: the grammar makes every token part of a call
    model: str  # the name replies carry: the base model's or the adapter's
    lora: str | None  # the LoRA adapter it runs with
    reasoning: bool = False  # read the reply's reasoning apart (a reasoning parser, include_reasoning)
    images: tuple = ()  # pixel values of the prompt's images (and crops), in order


def plan_chat(state: ServerState, req: p.ChatCompletionRequest) -> ChatPlan:
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    if choice != "none" and not tools:
        raise _bad(f"tool_choice {choice if isinstance(choice, str) else 'with a function'} needs tools",
                   "tool_choice")
    try:
        check_tools(tools)
    except ValueError as e:
        raise _bad(str(e), "tools") from None
    forced = choice == "required" or isinstance(choice, p.NamedToolChoice)
    if isinstance(choice, p.NamedToolChoice):  # the model may only call this one
        tools = [t for t in tools if t["function"]["name"] == choice.function.name]
        if not tools:
            raise _bad(f"tool_choice names {choice.function.name!r}, which is not among the tools", "tool_choice")
    fmt = state.tool_format
    structured = None
    if forced:
        if req.response_format is not None and req.response_format.type != "text":
            raise _bad("response_format cannot be combined with a required or named tool_choice", "response_format")
        parallel = req.parallel_tool_calls and choice == "required"
        structured = StructuredOutputsParams(grammar=fmt.grammar(tools, parallel))
    elif req.response_format is not None and req.response_format.type == "json_object":
        structured = StructuredOutputsParams(json_object=True)
    elif req.response_format is not None and req.response_format.type == "json_schema":
        spec = req.response_format.json_schema
        if spec is None or spec.schema_ is None:
            raise _bad("response_format json_schema needs json_schema.schema", "response_format")
        try:
            check_json_schema(spec.schema_, "response_format.json_schema.schema")
        except ValueError as e:
            raise _bad(str(e), "response_format") from None
        structured = StructuredOutputsParams(json=spec.schema_)
    requested = requested_structure(state, req)
    if requested is not None:
        if structured is not None:
            raise _bad("structured_outputs cannot be combined with response_format or a required or named "
                       "tool_choice", "structured_outputs")
        structured = requested
    if req.logprobs is False and req.top_logprobs:
        raise _bad("top_logprobs needs logprobs: true", "top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = req.max_completion_tokens or req.max_tokens
    params = sampling_params(state, req, max_tokens=max_tokens, logprobs=logprobs, structured=structured)
    try:
        all_tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        chat = take_images(messages, state.max_images,
                           model=state.model_name if state.image_processor is None else None)
        prompt = render_chat(state.tokenizer, chat.messages, fmt, all_tools if choice != "none" else None,
                             template_kwargs=template_kwargs(req.chat_template_kwargs))
        images = ()
        if chat.images:
            prompt, pixels = place_images(prompt, chat, state.image_processor, state.image_text)
            images = tuple(pixels)
    except ValueError as e:
        raise _bad(str(e), "messages") from None
    lora = state.lora_for(req.model)
    return ChatPlan(prompt, params, parse_tools=choice != "none", tools=tools, forced=forced,
                    model=lora or state.model_name, lora=lora, reasoning=state.reasoning_parser is not None,
                    images=images)


def template_kwargs(given: dict | None) -> dict:
    """The request's chat_template_kwargs (enable_thinking, ...): extra variables for the chat template, never
    the ones the server sets."""
    reserved = sorted(set(given or {}) & {"messages", "tools", "add_generation_prompt"})
    if reserved:
        raise _bad(f"chat_template_kwargs cannot set {', '.join(reserved)}", "chat_template_kwargs")
    return dict(given or {})


def chat_sequence(state: ServerState, plan: ChatPlan, arrival: float) -> _Sequence:
    parser = state.tool_format.parser(plan.tools) if plan.parse_tools else None
    reasoning = ReasoningParser(plan.prompt) if plan.reasoning else None
    return _Sequence(state, arrival, parser, calls_only=plan.forced, reasoning=reasoning)


async def chat_full(state: ServerState, req: p.ChatCompletionRequest, plan: ChatPlan) -> p.ChatCompletion:
    arrival, rid = time.monotonic(), f"chatcmpl-{uuid.uuid4().hex}"
    seqs = [chat_sequence(state, plan, arrival) for _ in range(plan.params.n)]
    final: list[RequestOutput | None] = [None] * plan.params.n
    content = [""] * plan.params.n
    reasoning = [""] * plan.params.n
    gen, out = await started(state, plan, rid, "messages")
    async with contextlib.aclosing(gen):
        while out is not None:
            _, parsed = seqs[out.index].advance(out)
            content[out.index] += parsed.content
            reasoning[out.index] += parsed.reasoning
            if out.finished:
                final[out.index] = out
            out = await anext(gen, None)
    choices = []
    for i, (out, seq) in enumerate(zip(final, seqs)):
        calls = [p.ToolCall(id=c.id, function=p.FunctionCall(name=c.name, arguments=c.arguments)) for c in seq.calls]
        logprobs = _chat_logprobs(state, out, 0, len(out.token_ids)) if plan.params.logprobs is not None else None
        thought = (reasoning[i] or None) if req.include_reasoning else None
        message = p.ResponseMessage(content=content[i] or None, tool_calls=calls or None, reasoning=thought,
                                    reasoning_content=thought)
        choices.append(p.ChatChoice(index=i, message=message, logprobs=logprobs, finish_reason=seq.finish_reason(out)))
    completion = sum(len(o.token_ids) for o in final)
    return p.ChatCompletion(id=rid, model=plan.model, choices=choices,
                            usage=_usage(len(final[0].prompt_token_ids), completion),
                            prompt_logprobs=await asyncio.to_thread(prompt_logprobs_field, state, final[0],
                                                                    req.prompt_logprobs))


async def started(state: ServerState, plan: ChatPlan, rid: str, param: str):
    """A chat plan's engine stream and its first output, the stream closed if admission fails: admission errors
    are plain 400s (`param` names the field at fault), and a stream raises them before it sends a byte."""
    gen = state.engine.generate(plan.prompt, plan.params, rid, lora_request=plan.lora, images=plan.images)
    try:
        return gen, await first_output(gen, param)
    except BaseException:
        await gen.aclose()
        raise


async def chat_stream(state: ServerState, req: p.ChatCompletionRequest, plan: ChatPlan) -> AsyncIterator[str]:
    arrival, rid = time.monotonic(), f"chatcmpl-{uuid.uuid4().hex}"
    gen, first = await started(state, plan, rid, "messages")
    return _chat_events(state, req, plan, rid, arrival, gen, first)


async def _chat_events(state, req, plan, rid, arrival, gen, out) -> AsyncIterator[str]:
    created = p.now()
    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": plan.model}
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    usage = _usage_field(req)
    seqs = [chat_sequence(state, plan, arrival) for _ in range(plan.params.n)]
    prompt_length = len(out.prompt_token_ids)

    def chunk(index, delta, finish_reason=None, logprobs=None):
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return _sse({**head, "choices": [choice], **usage(prompt_length, sum(s.tokens_seen for s in seqs))})

    async with contextlib.aclosing(gen):
        for i in range(plan.params.n):
            yield chunk(i, {"role": "assistant", "content": ""})
        prompt_tokens, completion_tokens, error = 0, 0, None
        try:
            while out is not None:
                seq = seqs[out.index]
                start = seq.tokens_seen
                new_ids, parsed = seq.advance(out)
                logprobs = None
                if plan.params.logprobs is not None and new_ids:
                    logprobs = _chat_logprobs(state, out, start, seq.tokens_seen).model_dump()
                if parsed.reasoning and req.include_reasoning:
                    yield chunk(out.index, {"reasoning": parsed.reasoning, "reasoning_content": parsed.reasoning})
                if parsed.content or logprobs:
                    yield chunk(out.index, {"content": parsed.content}, logprobs=logprobs)
                if parsed.calls:
                    first_index = len(seq.calls) - len(parsed.calls)
                    yield chunk(out.index, {"tool_calls": _tool_call_deltas(parsed.calls, first_index)})
                if out.finished:
                    yield chunk(out.index, {}, finish_reason=seq.finish_reason(out))
                    prompt_tokens = len(out.prompt_token_ids)
                    completion_tokens += len(out.token_ids)
                out = await anext(gen, None)
        except Exception as e:  # noqa: BLE001 - a failed engine step ends the stream with an error event
            error = e
        for event in _stream_end(head, include_usage, _usage(prompt_tokens, completion_tokens), error):
            yield event


# -- completions --------------------------------------------------------------------------------


@dataclasses.dataclass
class CompletionPlan:
    prompts: list  # text or token-id lists
    params: SamplingParams
    model: str  # the name replies carry: the base model's or the adapter's
    lora: str | None  # the LoRA adapter it runs with


def plan_completion(state: ServerState, req: p.CompletionRequest) -> CompletionPlan:
    if req.suffix is not None:
        raise _bad("suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise _bad("best_of other than n is not supported", "best_of")
    if req.max_tokens == 0 and not req.echo:
        raise _bad("max_tokens 0 generates nothing: it is only allowed with echo (the prompt scored)", "max_tokens")
    prompt = req.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts or any(len(x) == 0 for x in prompts):
        raise _bad("prompt must not be empty", "prompt")
    params = sampling_params(state, req, max_tokens=req.max_tokens, logprobs=req.logprobs,
                             structured=requested_structure(state, req),
                             prompt_logprobs=req.logprobs if req.echo else None)
    lora = state.lora_for(req.model)
    return CompletionPlan(prompts, params, model=lora or state.model_name, lora=lora)


def _legacy_logprobs(state: ServerState, ids, logprobs, tops, k: int, offset: int) -> p.CompletionLogprobs:
    """OpenAI's legacy layout for `ids` (a None logprob: the prompt's first token): per token its text, log p,
    text offset, and the top k with the token itself (vLLM's rule: k + 1 entries when it is not among them;
    logprobs=0 gives it alone)."""
    tokens, offsets, top = [], [], []
    for tid, lp, entries in zip(ids, logprobs, tops):
        text = state.token_text(tid)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if lp is None:
            top.append(None)
            continue
        entry = {state.token_text(t): _finite(v) for t, v in list((entries or {}).items())[:k]}
        entry.setdefault(text, _finite(lp))
        top.append(entry)
    return p.CompletionLogprobs(tokens=tokens, token_logprobs=[lp if lp is None else _finite(lp) for lp in logprobs],
                                top_logprobs=top, text_offset=offsets)


def _completion_logprobs(state: ServerState, out: RequestOutput, start: int, stop: int, offset: int, k: int
                         ) -> p.CompletionLogprobs:
    tops = out.top_logprobs[start:stop] if out.top_logprobs else [None] * (stop - start)
    return _legacy_logprobs(state, out.token_ids[start:stop], out.logprobs[start:stop], tops, k, offset)


def _echo_logprobs(state: ServerState, out: RequestOutput, k: int) -> p.CompletionLogprobs:
    """The prompt's tokens in the legacy layout (echo with logprobs): the first one's log-prob is null."""
    tops = out.prompt_top_logprobs or [None] * len(out.prompt_token_ids)
    return _legacy_logprobs(state, out.prompt_token_ids, out.prompt_logprobs, tops, k, 0)


def _joined(a: p.CompletionLogprobs, b: p.CompletionLogprobs) -> p.CompletionLogprobs:
    return p.CompletionLogprobs(**{name: getattr(a, name) + getattr(b, name) for name in p.CompletionLogprobs.model_fields})


def _echo(state: ServerState, prompt) -> str:
    return prompt if isinstance(prompt, str) else state.tokenizer.decode(prompt, skip_special_tokens=False)


async def _open_all(state: ServerState, plan: CompletionPlan, rid: str):
    """One engine stream per prompt, all submitted at once (their prefills share steps) and each
    started, so prompt errors raise before any output."""
    gens = [state.engine.generate(prompt, plan.params, f"{rid}-{k}", lora_request=plan.lora)
            for k, prompt in enumerate(plan.prompts)]
    try:
        firsts = await asyncio.gather(*(first_output(gen, "prompt") for gen in gens), return_exceptions=True)
        failed = [e for e in firsts if isinstance(e, BaseException)]
        if failed:
            raise next((e for e in failed if isinstance(e, APIError)), failed[0])
    except BaseException:
        for gen in gens:
            await gen.aclose()
        raise
    return list(zip(gens, firsts))


async def _merged(opened) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from every prompt's stream as they come."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(k, gen, out):
        async with contextlib.aclosing(gen):
            while out is not None:
                await queue.put((k, out))
                out = await anext(gen, None)

    tasks = [asyncio.ensure_future(pump(k, gen, out)) for k, (gen, out) in enumerate(opened)]
    done = asyncio.ensure_future(asyncio.gather(*tasks))
    getter = None
    try:
        while not (done.done() and queue.empty()):
            getter = asyncio.ensure_future(queue.get())
            await asyncio.wait({getter, done}, return_when=asyncio.FIRST_COMPLETED)
            if getter.done():
                yield getter.result()
            getter.cancel()
        done.result()  # a failed stream raises here
    finally:
        if getter is not None:
            getter.cancel()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(done, return_exceptions=True)  # its outcome is read: no "never retrieved" warning


async def completion_full(state: ServerState, req: p.CompletionRequest, plan: CompletionPlan) -> p.Completion:
    arrival, rid = time.monotonic(), f"cmpl-{uuid.uuid4().hex}"
    n = plan.params.n
    seqs = [_Sequence(state, arrival) for _ in range(len(plan.prompts) * n)]
    final: list[RequestOutput | None] = [None] * len(seqs)
    opened = await _open_all(state, plan, rid)
    async with contextlib.aclosing(_merged(opened)) as merged:
        async for k, out in merged:
            seqs[k * n + out.index].advance(out)
            if out.finished:
                final[k * n + out.index] = out
    choices = []
    for i, out in enumerate(final):
        prefix = _echo(state, plan.prompts[i // n]) if req.echo else ""
        logprobs = None
        if req.logprobs is not None:
            logprobs = _completion_logprobs(state, out, 0, len(out.token_ids), len(prefix), req.logprobs)
            if req.echo:
                logprobs = _joined(_echo_logprobs(state, out, req.logprobs), logprobs)
        choices.append(p.CompletionChoice(index=i, text=prefix + out.text, logprobs=logprobs,
                                          finish_reason=out.finish_reason,
                                          prompt_logprobs=await asyncio.to_thread(prompt_logprobs_field, state, out,
                                                                                  req.prompt_logprobs)))
    prompt_tokens = sum(len(final[k * n].prompt_token_ids) for k in range(len(plan.prompts)))
    return p.Completion(id=rid, model=plan.model, choices=choices,
                        usage=_usage(prompt_tokens, sum(len(o.token_ids) for o in final)))


async def completion_stream(state: ServerState, req: p.CompletionRequest, plan: CompletionPlan
                            ) -> AsyncIterator[str]:
    arrival, rid = time.monotonic(), f"cmpl-{uuid.uuid4().hex}"
    opened = await _open_all(state, plan, rid)
    return _completion_events(state, req, plan, rid, arrival, opened)


async def _completion_events(state, req, plan, rid, arrival, opened) -> AsyncIterator[str]:
    n = plan.params.n
    head = {"id": rid, "object": "text_completion", "created": p.now(), "model": plan.model}
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    usage = _usage_field(req)
    seqs = [_Sequence(state, arrival) for _ in range(len(plan.prompts) * n)]
    offsets = [0] * len(seqs)
    prompt_tokens, completion_tokens, error = 0, 0, None
    prompt_total = sum(len(first.prompt_token_ids) for _, first in opened)

    def chunk(index, text, finish_reason=None, logprobs=None):
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        return _sse({**head, "choices": [choice], **usage(prompt_total, sum(s.tokens_seen for s in seqs))})

    if req.echo:
        for i in range(len(seqs)):
            text = _echo(state, plan.prompts[i // n])
            offsets[i] = len(text)
            first = opened[i // n][1]  # the prompt is computed before a request's first output
            logprobs = None if req.logprobs is None else _echo_logprobs(state, first, req.logprobs).model_dump()
            yield chunk(i, text, logprobs=logprobs)
    async with contextlib.aclosing(_merged(opened)) as merged:
        try:
            async for k, out in merged:
                i = k * n + out.index
                start = seqs[i].tokens_seen
                new_ids, parsed = seqs[i].advance(out)
                logprobs = None
                if req.logprobs is not None and new_ids:
                    logprobs = _completion_logprobs(state, out, start, seqs[i].tokens_seen, offsets[i],
                                                    req.logprobs).model_dump()
                offsets[i] += len(parsed.content)
                if parsed.content or logprobs or out.finished:
                    yield chunk(i, parsed.content, out.finish_reason, logprobs)
                if out.finished:
                    completion_tokens += len(out.token_ids)
                    if out.index == 0:
                        prompt_tokens += len(out.prompt_token_ids)
        except Exception as e:  # noqa: BLE001 - a failed engine step ends the stream with an error event
            error = e
    for event in _stream_end(head, include_usage, _usage(prompt_tokens, completion_tokens), error):
        yield event
