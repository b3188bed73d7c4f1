"""OpenAI chat messages (dicts) -> the prompt text, through the model's own chat template; shared by the
server and by agentic RL, which grows a conversation turn by turn.

Messages are normalised the way templates expect them (text parts joined, assistant tool calls with
their arguments as objects, "developer" as "system"). A template without tool support gets the
tools as a system prompt in the hermes format, past calls as <tool_call> text and tool results as
<tool_response> user turns, so any chat model can be asked to call tools.
"""

from __future__ import annotations

import json

from tunix_rt.tools.tool_calls import ToolFormat


def message_text(message: dict, index: int) -> str:
    """A message's text: its content, or its text parts joined (ValueError naming any other part)."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type") != "text" or part.get("text") is None:
            raise ValueError(f"messages[{index}].content: only text parts are supported, got a {part.get('type')!r} part")
        parts.append(part["text"])
    return "".join(parts)


def _arguments(text, index: int) -> dict:
    if isinstance(text, dict):
        return text
    try:
        args = json.loads(text)
    except (json.JSONDecodeError, TypeError):
        raise ValueError(f"messages[{index}].tool_calls: arguments must be a JSON object, got {text!r}") from None
    if not isinstance(args, dict):
        raise ValueError(f"messages[{index}].tool_calls: arguments must be a JSON object, got {text!r}")
    return args


def template_messages(messages: list[dict], fmt: ToolFormat, tools: list[dict] | None) -> list[dict]:
    """The messages as the chat template takes them (see the module's docstring); tools: OpenAI tool dicts."""
    out: list[dict] = []
    for i, m in enumerate(messages):
        role = "system" if m["role"] == "developer" else m["role"]
        entry: dict = {"role": role, "content": message_text(m, i)}
        calls = [(c["function"]["name"], _arguments(c["function"].get("arguments", "{}"), i), c.get("id"))
                 for c in m.get("tool_calls") or ()]
        if fmt.native:
            if calls:
                entry["tool_calls"] = [{"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
                                       for name, args, cid in calls]
            for key in ("tool_call_id", "name"):
                if m.get(key) is not None:
                    entry[key] = m[key]
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


def render_chat(tokenizer, messages: list[dict], fmt: ToolFormat, tools: list[dict] | None, *,
                add_generation_prompt: bool = True, template_kwargs: dict | None = None) -> str:
    """The prompt text for `messages` (tools: OpenAI tool dicts; None: the model is not told about any);
    `template_kwargs` are extra template variables (enable_thinking=False for Qwen3's template)."""
    msgs = template_messages(messages, fmt, tools)
    try:
        return tokenizer.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt,
                                             tools=tools if fmt.native else None, **(template_kwargs or {}))
    except ValueError:
        raise
    except Exception as e:  # the template's own checks (e.g. "roles must alternate") are bad input
        raise ValueError(f"messages: the model's chat template rejected them: {e}") from None


_MARK = "\x00tunix-rt-turn-end\x00"


def turn_closing(tokenizer, fmt: ToolFormat) -> str:
    """What the chat template writes after an assistant message's text (ChatML's "<|im_end|>\\n")."""
    text = render_chat(tokenizer, [{"role": "user", "content": "x"}, {"role": "assistant", "content": _MARK}],
                       fmt, None, add_generation_prompt=False)
    if _MARK not in text:
        raise ValueError("the chat template does not render an assistant message's content as given, so a "
                         "conversation cannot grow turn by turn")
    return text[text.index(_MARK) + len(_MARK):]


def continuation(tokenizer, fmt: ToolFormat, tools: list[dict] | None, history: list[dict], observations: list[dict],
                 *, stop_text: str, closing: str | None = None) -> str:
    """The text the chat template puts between an assistant turn the policy wrote and the policy's next turn:
    the rest of the turn's closing after the stop token the policy sampled (`stop_text`, e.g. "<|im_end|>";
    the whole closing when the turn ended on another token, such as a second end token or a stop id), the
    observation messages, and the next assistant header. `history` ends with that assistant turn (its
    content the policy's raw text). Only the template's own text is rendered: what the policy sampled stays
    as it sampled it. `closing`: turn_closing's answer, when the caller keeps it."""
    before = render_chat(tokenizer, history, fmt, tools, add_generation_prompt=False)
    after = render_chat(tokenizer, history + observations, fmt, tools, add_generation_prompt=True)
    if not after.startswith(before):
        raise ValueError("the chat template renders earlier turns differently once later ones follow, so a "
                         "conversation cannot grow turn by turn as token ids")
    closing = turn_closing(tokenizer, fmt) if closing is None else closing
    if stop_text and closing.startswith(stop_text):
        closing = closing[len(stop_text):]
    return closing + after[len(before):]
