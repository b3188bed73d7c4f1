"""OpenAI chat messages -> the prompt text, through the model's own chat template.

Messages are normalised the way templates expect them (text parts joined, assistant tool calls with
their arguments as objects, "developer" as "system"). A template without tool support gets the
tools as a system prompt in the hermes format, past calls as <tool_call> text and tool results as
<tool_response> user turns, so any chat model can be asked to call tools.
"""

from __future__ import annotations

import json

from serving.protocol import ChatMessage
from tunix_rt.tools.tool_calls import ToolFormat


def _text(message: ChatMessage, index: int) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    parts = []
    for part in message.content:
        if part.type != "text" or part.text is None:
            raise ValueError(f"messages[{index}].content: only text parts are supported, got a {part.type!r} part")
        parts.append(part.text)
    return "".join(parts)


def _arguments(text: str, index: int) -> dict:
    try:
        args = json.loads(text)
    except json.JSONDecodeError:
        raise ValueError(f"messages[{index}].tool_calls: arguments must be a JSON object, got {text!r}") from None
    if not isinstance(args, dict):
        raise ValueError(f"messages[{index}].tool_calls: arguments must be a JSON object, got {text!r}")
    return args


def template_messages(messages: list[ChatMessage], fmt: ToolFormat, tools: list[dict] | None) -> list[dict]:
    out: list[dict] = []
    for i, m in enumerate(messages):
        role = "system" if m.role == "developer" else m.role
        entry: dict = {"role": role, "content": _text(m, i)}
        calls = [(c.function.name, _arguments(c.function.arguments, i), c.id) for c in m.tool_calls or ()]
        if fmt.native:
            if calls:
                entry["tool_calls"] = [{"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
                                       for name, args, cid in calls]
            if m.tool_call_id is not None:
                entry["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                entry["name"] = m.name
        else:
            if calls:
                entry["content"] = "\n".join([entry["content"]] * bool(entry["content"])
                                             + [fmt.render_call(name, args) for name, args, _ in calls])
            if role == "tool":
                entry = {"role": "user", "content": f"<tool_response>\n{entry['content']}\n</tool_response>"}
        out.append(entry)
    if tools and not fmt.native:
        prompt = fmt.tools_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def render_chat(tokenizer, messages: list[ChatMessage], fmt: ToolFormat, tools: list[dict] | None) -> str:
    """The prompt text for `messages` (tools: OpenAI tool dicts; None: the model is not told about any)."""
    msgs = template_messages(messages, fmt, tools)
    try:
        return tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tools=tools if fmt.native else None)
    except ValueError:
        raise
    except Exception as e:  # the template's own checks (e.g. "roles must alternate") are bad input
        raise ValueError(f"messages: the model's chat template rejected them: {e}") from None
