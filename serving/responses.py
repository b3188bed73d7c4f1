"""OpenAI's Responses API (/v1/responses): the subset the OpenAI Agents SDK and `client.responses.create` use.

A request becomes a chat request (instructions and input items as chat messages, function tools, tool_choice,
text.format as a response format) planned and run as /v1/chat/completions runs one, so tool calls, grammars,
adapters and reasoning behave the same. The reply is output items: a reasoning item (with a reasoning parser),
message items of output_text, function_call items. Streamed, it is OpenAI's event sequence: response.created,
response.in_progress, then per item output_item.added, its deltas (output_text or function-call arguments) and
its done events, one item closed before the next opens, then response.completed (or response.incomplete at
max_output_tokens) with usage. The server keeps no responses: `store` is answered false and
`previous_response_id` is refused; a client sends the whole conversation (the Agents SDK does).
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pydantic

from serving import protocol as p
from serving.errors import APIError
from serving.handlers import ChatPlan, ServerState, chat_sequence, plan_chat, started

_SAMPLING_EXTRAS = ("seed", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param)


def _text(content, where: str) -> str:
    """A message's content: a string, or a list of input_text / output_text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where}.content must be a string or a list of text parts", "input")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise _bad(f"{where}.content[{j}] is {kind!r}: only input_text and output_text parts are supported",
                       "input")
        texts.append(part["text"])
    return "".join(texts)


def chat_messages(req: p.ResponsesRequest) -> list[dict]:
    """instructions and input items as chat messages: function_call items join the assistant turn before them as
    its tool_calls, function_call_output items become tool messages; reasoning items are dropped."""
    messages: list[dict] = [{"role": "system", "content": req.instructions}] if req.instructions else []
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(f"{where} must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _bad(f"{where}.role must be user, system, developer or assistant, got {role!r}", "input")
            messages.append({"role": role, "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise _bad(f"{where}: a function_call item needs call_id, name and arguments strings", "input")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if not (messages and messages[-1]["role"] == "assistant"):
                messages.append({"role": "assistant", "content": None})
            messages[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str) or not isinstance(output, (str, list)):
                raise _bad(f"{where}: a function_call_output item needs a call_id and an output", "input")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": _text(output, where)})
        elif kind != "reasoning":
            raise _bad(f"{where} is a {kind!r} item: supported are message, function_call, function_call_output "
                       "and reasoning", "input")
    if not messages:
        raise _bad("input holds no message", "input")
    return messages


def _chat_tools(req: p.ResponsesRequest) -> tuple[list[dict] | None, Any]:
    tools = []
    for i, tool in enumerate(req.tools or []):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise _bad(f"tools[{i}] is a {kind!r} tool: only function tools are supported", "tools")
        tools.append({"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters",
                                                                             "strict") if tool.get(k) is not None}})
    choice = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise _bad("tool_choice must be none, auto, required or {\"type\": \"function\", \"name\": ...}",
                       "tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return tools or None, choice


def _response_format(req: p.ResponsesRequest) -> dict | None:
    fmt = (req.text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise _bad("text.format must be an object with a type", "text")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "description", "strict")
                                                       if k in fmt}}
    raise _bad(f"text.format.type must be text, json_object or json_schema, got {fmt.get('type')!r}", "text")


def plan(state: ServerState, req: p.ResponsesRequest) -> ChatPlan:
    if req.previous_response_id is not None:
        raise _bad("previous_response_id is not supported: this server stores no responses (store is always "
                   "false); send the whole conversation as input", "previous_response_id")
    if req.background:
        raise _bad("background responses are not supported", "background")
    tools, choice = _chat_tools(req)
    body = {"model": req.model, "messages": chat_messages(req), "tools": tools, "tool_choice": choice,
            "parallel_tool_calls": req.parallel_tool_calls, "temperature": req.temperature, "top_p": req.top_p,
            "max_tokens": req.max_output_tokens, "response_format": _response_format(req), "stream": req.stream,
            **{k: getattr(req, k) for k in _SAMPLING_EXTRAS if getattr(req, k) is not None}}
    try:
        chat = p.ChatCompletionRequest.model_validate(body)
    except pydantic.ValidationError as e:  # a converted field out of range, named as the Responses API names it
        first = e.errors()[0]
        field = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text"}.get(
            str(first["loc"][0]), str(first["loc"][0]))
        raise _bad(f"{field}: {first['msg']} (at {'.'.join(map(str, first['loc'][1:])) or field})", field) from None
    return plan_chat(state, chat)


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _response(req: p.ResponsesRequest, rid: str, created: int, plan_: ChatPlan, status: str, output: list[dict],
              usage: dict | None, incomplete: str | None) -> dict:
    return {
        "id": rid, "object": "response", "created_at": created, "status": status, "model": plan_.model,
        "output": output, "usage": usage, "error": None,
        "incomplete_details": None if incomplete is None else {"reason": incomplete},
        "instructions": req.instructions, "tools": req.tools or [], "tool_choice": req.tool_choice or "auto",
        "parallel_tool_calls": req.parallel_tool_calls, "temperature": req.temperature, "top_p": req.top_p,
        "max_output_tokens": req.max_output_tokens, "previous_response_id": None, "store": False,
        "text": req.text or {"format": {"type": "text"}}, "truncation": "disabled", "metadata": req.metadata or {},
        "user": req.user, "reasoning": req.reasoning,
    }


def _usage(out) -> dict:
    return {"input_tokens": len(out.prompt_token_ids), "output_tokens": len(out.token_ids),
            "total_tokens": len(out.prompt_token_ids) + len(out.token_ids),
            "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
            "output_tokens_details": {"reasoning_tokens": 0}}


def _message(item_id: str, text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if text else []}


def _function_call(call, status: str = "completed", arguments: str | None = None) -> dict:
    return {"type": "function_call", "id": _new_id("fc"), "call_id": call.id, "name": call.name,
            "arguments": call.arguments if arguments is None else arguments, "status": status}


def _reasoning(item_id: str, text: str) -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def _ending(out) -> tuple[str, str | None]:
    """(status, incomplete reason) from how the sequence ended."""
    return ("incomplete", "max_output_tokens") if out.finish_reason == "length" else ("completed", None)


async def full(state: ServerState, req: p.ResponsesRequest, plan_: ChatPlan) -> dict:
    """The whole response: the items the streamed events would carry, in the order they would."""
    rid, created, arrival = _new_id("resp"), p.now(), time.monotonic()
    seq, items = chat_sequence(state, plan_, arrival), _Events()
    gen, out = await started(state, plan_, rid, "input")
    async with contextlib.aclosing(gen):
        while out is not None:
            items.parsed(seq.advance(out)[1])
            if out.finished:
                break
            out = await anext(gen, None)
    if out is None or not out.finished:
        raise RuntimeError("the engine ended the request before it finished")
    items.close()
    status, incomplete = _ending(out)
    return _response(req, rid, created, plan_, status, items.output, _usage(out), incomplete)


async def stream(state: ServerState, req: p.ResponsesRequest, plan_: ChatPlan) -> AsyncIterator[str]:
    rid, arrival = _new_id("resp"), time.monotonic()
    gen, first = await started(state, plan_, rid, "input")
    return _events(state, req, plan_, rid, arrival, gen, first)


class _Events:
    """The items of one response as they are generated, opened and closed in order, and the numbered events of
    that (a whole response keeps the items and drops the events)."""

    def __init__(self):
        self.number = 0
        self.output: list[dict] = []
        self.open: dict | None = None  # the item receiving deltas: a message or a reasoning item

    def event(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": self.number, **fields}
        self.number += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def text(self, kind: str, delta: str) -> list[str]:
        """Deltas of a message ("message") or reasoning ("reasoning") item, opening one if needed."""
        events = []
        if self.open is not None and self.open["type"] != kind:
            events += self.close()
        index = len(self.output)
        if self.open is None:
            item = _message(_new_id("msg"), "", "in_progress") if kind == "message" else _reasoning(_new_id("rs"), "")
            self.open = {**item, "text": ""}
            events.append(self.event("response.output_item.added", output_index=index, item=item))
            part = {"type": "output_text", "text": "", "annotations": []} if kind == "message" else \
                {"type": "reasoning_text", "text": ""}
            events.append(self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                     content_index=0, part=part))
        self.open["text"] += delta
        if kind == "message":
            events.append(self.event("response.output_text.delta", item_id=self.open["id"], output_index=index,
                                     content_index=0, delta=delta, logprobs=[]))
        else:
            events.append(self.event("response.reasoning_text.delta", item_id=self.open["id"], output_index=index,
                                     content_index=0, delta=delta))
        return events

    def close(self) -> list[str]:
        if self.open is None:
            return []
        opened, self.open = self.open, None
        index, text = len(self.output), opened["text"]
        if opened["type"] == "message":
            item = _message(opened["id"], text)
            part = item["content"][0]
            events = [self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                 content_index=0, text=text, logprobs=[])]
        else:
            item = _reasoning(opened["id"], text)
            part = item["content"][0]
            events = [self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                 content_index=0, text=text)]
        events.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                 content_index=0, part=part))
        events.append(self.event("response.output_item.done", output_index=index, item=item))
        self.output.append(item)
        return events

    def parsed(self, parsed) -> list[str]:
        """The events of a step's parsed text: reasoning, then content, then complete tool calls."""
        events = []
        for kind, delta in (("reasoning", parsed.reasoning), ("message", parsed.content)):
            if delta:
                events += self.text(kind, delta)
        for call in parsed.calls:
            events += self.call(call)
        return events

    def call(self, call) -> list[str]:
        events = self.close()
        index = len(self.output)
        item = _function_call(call)
        events.append(self.event("response.output_item.added", output_index=index,
                                 item={**item, "arguments": "", "status": "in_progress"}))
        events.append(self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                 delta=call.arguments))
        events.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                 name=call.name, arguments=call.arguments))
        events.append(self.event("response.output_item.done", output_index=index, item=item))
        self.output.append(item)
        return events


async def _events(state, req, plan_, rid, arrival, gen, out) -> AsyncIterator[str]:
    created = p.now()
    events = _Events()
    seq = chat_sequence(state, plan_, arrival)
    started = _response(req, rid, created, plan_, "in_progress", [], None, None)
    yield events.event("response.created", response=started)
    yield events.event("response.in_progress", response=started)
    async with contextlib.aclosing(gen):
        try:
            while out is not None:
                for event in events.parsed(seq.advance(out)[1]):
                    yield event
                if out.finished:
                    break
                out = await anext(gen, None)
            if out is None or not out.finished:
                raise RuntimeError("the engine ended the request before it finished")
        except Exception as e:  # noqa: BLE001 - a failed engine step ends the stream with an error event
            yield events.event("error", message=f"generation failed: {type(e).__name__}: {e}", code="server_error",
                               param=None)
            return
    for event in events.close():
        yield event
    status, incomplete = _ending(out)
    done = _response(req, rid, created, plan_, status, events.output, _usage(out), incomplete)
    yield events.event("response.completed" if status == "completed" else "response.incomplete", response=done)
