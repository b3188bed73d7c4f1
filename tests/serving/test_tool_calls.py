"""Tool calls without a server: the hermes / llama3_json parsers (streaming == non-streaming), the
format picked from a chat template, check_tools, the forcing grammar (compiled with llguidance
against the default model's tokenizer) and how chat messages reach the template."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serving.protocol import ChatMessage, Tool
from tunix_rt.tools.chat import render_chat, template_messages
from tunix_rt.tools.tool_calls import HermesParser, Llama3JsonParser, ParsedCall, ToolFormat, check_tools, tool_format_for


def tool(function: dict) -> dict:
    """An OpenAI tool dict as the server passes it on: validated by the request model, then dumped."""
    return Tool(function=function).model_dump(exclude_none=True)


ADD = tool({
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]},
})
ECHO = tool({
    "name": "echo", "description": "Repeat a text.",
    "parameters": {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]},
})
PING = tool({"name": "ping"})  # no parameters: any arguments object
SCALE = tool({"name": "scale", "parameters": {"type": "object", "properties": {"x": {"type": "number"}}}})
TOOLS = [ADD, ECHO, PING]

HERMES = ToolFormat("hermes", native=False)
LLAMA3 = ToolFormat("llama3_json", native=True)

PROPERTY = settings(max_examples=150, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def run(parser, chunks) -> tuple[str, list[tuple[str, dict]]]:
    """Feed `chunks` then finish: the joined content and the calls as (name, decoded arguments)."""
    content, calls = [], []
    for chunk in chunks:
        out = parser.feed(chunk)
        content.append(out.content)
        calls += out.calls
    out = parser.finish()
    content.append(out.content)
    calls += out.calls
    for call in calls:
        assert isinstance(call, ParsedCall) and isinstance(call.arguments, str)
    return "".join(content), [(c.name, json.loads(c.arguments)) for c in calls]


def whole(parser_cls, text, tools=TOOLS):
    return run(parser_cls(tools), [text])


def by_char(parser_cls, text, tools=TOOLS):
    return run(parser_cls(tools), list(text))


def chunked(text: str, sizes: list[int]) -> list[str]:
    chunks, pos, k = [], 0, 0
    while pos < len(text):
        n = sizes[k % len(sizes)]
        chunks.append(text[pos:pos + n])
        pos, k = pos + n, k + 1
    return chunks


def hermes_call(obj, before="\n", after="\n", close=True) -> str:
    body = obj if isinstance(obj, str) else json.dumps(obj)
    return f"<tool_call>{before}{body}{after}" + ("</tool_call>" if close else "")


# -- hermes ---------------------------------------------------------------------------------------


def test_hermes_text_then_one_call():
    text = 'Let me add those.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    assert whole(HermesParser, text) == ("Let me add those.", [("add", {"a": 1, "b": 2})])


def test_hermes_two_calls_separated_by_newlines_have_no_content():
    text = (hermes_call({"name": "add", "arguments": {"a": 1, "b": 2}}) + "\n\n"
            + hermes_call({"name": "echo", "arguments": {"s": "hi"}}) + "\n")
    assert whole(HermesParser, text) == ("", [("add", {"a": 1, "b": 2}), ("echo", {"s": "hi"})])


def test_hermes_text_around_a_call_is_kept():
    text = "Before.\n" + hermes_call({"name": "ping", "arguments": {}}) + "\nAfter."
    assert whole(HermesParser, text) == ("Before.\n\nAfter.", [("ping", {})])


def test_hermes_call_without_closing_tag_is_still_a_call():
    text = 'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n'
    assert whole(HermesParser, text) == ("Sure.", [("add", {"a": 3, "b": 4})])
    assert by_char(HermesParser, text) == ("Sure.", [("add", {"a": 3, "b": 4})])


def test_hermes_unclosed_invalid_call_is_content():
    text = 'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 3,'
    assert whole(HermesParser, text) == (text, [])


@pytest.mark.parametrize("body", [
    '{"name": "subtract", "arguments": {"a": 1, "b": 2}}',  # unknown tool
    '{"name": "add", "arguments": {"a": 1, "b": 2}',  # invalid JSON
    'add(a=1, b=2)',  # not JSON at all
    '',  # empty
    '{"name": "add", "arguments": {"a": "one", "b": 2}}',  # fails the schema (type)
    '{"name": "add", "arguments": {"a": 1}}',  # fails the schema (required)
    '{"name": "add"}',  # no arguments: {} fails the schema
    '{"name": "add", "arguments": [1, 2]}',  # arguments not an object
    '{"name": "add", "arguments": "{\\"a\\": 1,"}',  # arguments as a string that is not JSON
    '{"name": "add", "arguments": "[1, 2]"}',  # arguments as a string that is not an object
    '["add", {"a": 1, "b": 2}]',  # not an object
    '{"arguments": {"a": 1, "b": 2}}',  # no name
])
def test_hermes_invalid_call_stays_content_with_its_tags(body):
    text = f"I will call it.\n<tool_call>\n{body}\n</tool_call>"
    assert whole(HermesParser, text) == (text, [])
    assert by_char(HermesParser, text) == (text, [])


def test_hermes_invalid_call_then_valid_call():
    bad = hermes_call({"name": "nope", "arguments": {}})
    good = hermes_call({"name": "add", "arguments": {"a": 1, "b": 2}})
    assert whole(HermesParser, bad + "\n" + good) == (bad, [("add", {"a": 1, "b": 2})])


def test_hermes_arguments_as_json_string_are_accepted():
    text = hermes_call({"name": "add", "arguments": json.dumps({"a": 5, "b": 6})})
    assert whole(HermesParser, text) == ("", [("add", {"a": 5, "b": 6})])


def test_hermes_parameters_key_is_accepted():
    text = hermes_call({"name": "add", "parameters": {"a": 5, "b": 6}})
    assert whole(HermesParser, text) == ("", [("add", {"a": 5, "b": 6})])


def test_hermes_tool_without_parameters_takes_any_object_and_no_arguments():
    assert whole(HermesParser, hermes_call({"name": "ping"})) == ("", [("ping", {})])
    args = {"x": [1, {"y": None}], "z": "é"}
    assert whole(HermesParser, hermes_call({"name": "ping", "arguments": args})) == ("", [("ping", args)])


def test_hermes_arguments_are_json_text_of_the_arguments():
    args = {"s": "héllo \"quoted\" <b> \n ünïcode ☃"}
    parser = HermesParser(TOOLS)
    out = parser.feed(hermes_call({"name": "echo", "arguments": args}, before="", after=""))
    assert parser.finish().calls == []
    [call] = out.calls
    assert call.name == "echo"
    assert isinstance(call.arguments, str) and json.loads(call.arguments) == args
    assert call.arguments == json.dumps(args)  # the arguments exactly as the model wrote them
    assert call.id.startswith("call_")


def test_hermes_call_ids_are_unique():
    text = "\n".join(hermes_call({"name": "ping"}) for _ in range(5))
    parser = HermesParser(TOOLS)
    calls = parser.feed(text).calls + parser.finish().calls
    assert len(calls) == 5 and len({c.id for c in calls}) == 5


def test_hermes_streaming_reports_a_call_as_soon_as_it_closes_and_holds_partial_tags():
    text = "Hi <tool_call>\n" + '{"name": "add", "arguments": {"a": 1, "b": 2}}' + "\n</tool_call>"
    parser = HermesParser(TOOLS)
    seen = []
    for i, ch in enumerate(text):
        out = parser.feed(ch)
        seen.append((i, out.content, [c.name for c in out.calls]))
    # "Hi" comes out before the tag; no bit of "<tool_call>" is ever emitted as content.
    assert "".join(c for _, c, _ in seen) == "Hi"
    assert [i for i, _, calls in seen if calls] == [len(text) - 1]
    assert parser.finish().calls == []


def test_hermes_text_with_angle_brackets_and_tag_prefixes_is_content():
    text = "if a < b and b <tool_ then <tool_call not closed, </tool_call> stray, <<tool"
    assert whole(HermesParser, text) == (text, [])
    assert by_char(HermesParser, text) == (text, [])


def test_hermes_trailing_whitespace_is_dropped_from_content():
    assert whole(HermesParser, "Hello there.\n\n  ") == ("Hello there.", [])
    assert whole(HermesParser, "") == ("", [])
    assert whole(HermesParser, " \n ") == ("", [])


# -- the streaming property (hermes) ----------------------------------------------------------------

_TEXT_PIECES = ["<", "<<", "<tool", "<tool_", "<tool_c", "<tool_call", "</tool", "</tool_call>", "tool_call",
                "{", "}", '{"name": "add"}', "\n", " ", "\n\n", "a < b", "x<y", "é☃"]
# Free text never holds ">" except inside "</tool_call>", so it can never spell "<tool_call>" itself
# (even across pieces): the calls of a reply are exactly the call segments below.
_free_text = st.text(alphabet=st.characters(exclude_characters=">"), max_size=6)
_text = st.lists(st.one_of(st.sampled_from(_TEXT_PIECES), _free_text), max_size=5).map("".join)
_ws = st.text(alphabet=" \n\t", max_size=3)
_int = st.integers(-10**12, 10**12)
_string = st.text(alphabet=st.characters(exclude_characters=">"), max_size=12)


@st.composite
def _valid_call(draw):
    """(name, arguments dict, call object as the model writes it)."""
    name = draw(st.sampled_from(["add", "echo", "ping"]))
    if name == "add":
        args = {"a": draw(_int), "b": draw(_int)}
    elif name == "echo":
        args = {"s": draw(_string)}
    else:
        args = draw(st.dictionaries(st.sampled_from(["x", "y", "z"]), st.one_of(_int, _string, st.none()),
                                    max_size=2))
    key = draw(st.sampled_from(["arguments", "parameters"]))
    written = json.dumps(args, ensure_ascii=False) if draw(st.booleans()) else args
    obj = {"name": name} if name == "ping" and not args and draw(st.booleans()) else {"name": name, key: written}
    return name, args, obj


_invalid_body = st.one_of(
    st.just('{"name": "subtract", "arguments": {"a": 1, "b": 2}}'),
    st.just('{"name": "add", "arguments": {"a": 1, "b": 2}'),
    st.just('{"name": "add", "arguments": {"a": "1", "b": 2}}'),
    st.just('{"name": "add", "arguments": {"b": 2}}'),
    st.just('{"name": "add", "arguments": [1, 2]}'),
    st.just('{"name": "echo", "arguments": "{\\"s\\":"}'),
    st.just('{"name": "echo"}'),
    st.just("[]"),
    _free_text,
)


def _dump(obj, draw) -> str:
    indent = draw(st.sampled_from([None, None, 2]))
    separators = draw(st.sampled_from([None, (",", ":")]))
    return json.dumps(obj, ensure_ascii=draw(st.booleans()), indent=indent, separators=separators)


@st.composite
def hermes_reply(draw):
    """A reply, the calls it holds, and the content the parser must give (the text that is not a valid
    call, its trailing whitespace dropped)."""
    segments: list[tuple[str, tuple[str, dict] | None]] = []
    for _ in range(draw(st.integers(0, 6))):
        kind = draw(st.sampled_from(["text", "ws", "valid", "invalid"]))
        if kind == "text":
            segments.append((draw(_text), None))
        elif kind == "ws":
            segments.append((draw(_ws), None))
        elif kind == "valid":
            name, args, obj = draw(_valid_call())
            segments.append((hermes_call(_dump(obj, draw), draw(_ws), draw(_ws)), (name, args)))
        else:
            segments.append((hermes_call(draw(_invalid_body), draw(_ws), draw(_ws)), None))
    if draw(st.booleans()):  # the reply ends inside a call (no closing tag)
        if draw(st.booleans()):
            name, args, obj = draw(_valid_call())
            segments.append((hermes_call(_dump(obj, draw), draw(_ws), draw(_ws), close=False), (name, args)))
        else:
            segments.append((hermes_call(draw(_invalid_body), draw(_ws), draw(_ws), close=False), None))
    text = "".join(s for s, _ in segments)
    calls = [c for _, c in segments if c is not None]
    content = "".join(s for s, c in segments if c is None).rstrip()
    return text, content, calls


def test_hermes_malformed_call_with_an_unbalanced_quote_ends_at_its_closing_tag():
    """The string-aware scan for the closing tag reads a lone quote as opening a string; when that leaves the call
    unparseable, the call ends at the first closing tag and the next call is still read (found by the property
    below)."""
    bad = '<tool_call>"</tool_call>'
    for arguments in ({"a": 0, "b": 0}, '{"a": 0, "b": 0}'):  # the second: the later quotes close the first one
        text = bad + hermes_call({"name": "add", "arguments": arguments}, before="", after="")
        expected = (bad, [("add", {"a": 0, "b": 0})])
        assert whole(HermesParser, text) == by_char(HermesParser, text) == expected


@PROPERTY
@given(hermes_reply(), st.lists(st.integers(1, 12), min_size=1, max_size=16))
def test_hermes_streaming_matches_whole_text(reply, sizes):
    text, content, calls = reply
    expected = whole(HermesParser, text)
    assert expected == (content, calls)
    assert by_char(HermesParser, text) == expected
    assert run(HermesParser(TOOLS), chunked(text, sizes)) == expected


# -- llama3_json ------------------------------------------------------------------------------------


def test_llama3_single_call():
    text = '{"name": "add", "parameters": {"a": 1, "b": 2}}'
    assert whole(Llama3JsonParser, text) == ("", [("add", {"a": 1, "b": 2})])
    assert by_char(Llama3JsonParser, text) == ("", [("add", {"a": 1, "b": 2})])


def test_llama3_two_calls_separated_by_semicolon():
    text = '{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "echo", "parameters": {"s": "x"}}'
    assert whole(Llama3JsonParser, text) == ("", [("add", {"a": 1, "b": 2}), ("echo", {"s": "x"})])


def test_llama3_arguments_key_and_leading_whitespace():
    text = '\n  {"name": "add", "arguments": {"a": 1, "b": 2}}\n'
    assert whole(Llama3JsonParser, text) == ("", [("add", {"a": 1, "b": 2})])


def test_llama3_plain_text_is_content():
    text = "The answer is 3. {not a call}\n"
    assert whole(Llama3JsonParser, text) == ("The answer is 3. {not a call}", [])
    assert by_char(Llama3JsonParser, text) == ("The answer is 3. {not a call}", [])


@pytest.mark.parametrize("text", [
    '{"a": 1, "b": 2}',
    '{"name": "subtract", "parameters": {"a": 1}}',
    '{"name": "add", "parameters": {"a": "x", "b": 2}}',
    '{"name": "add", "parameters": {"a": 1, "b": 2}} and that is all',
    '{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "nope", "parameters": {}}',
    '{"name": "add", "parameters": {"a": 1, "b": 2}',
    "{ this is just braces }",
    '  {"name": "add", "parameters": [1, 2]}',
])
def test_llama3_text_starting_with_brace_that_is_not_calls_is_content(text):
    assert whole(Llama3JsonParser, text) == (text, [])
    assert by_char(Llama3JsonParser, text) == (text, [])


def test_llama3_plain_text_streams_before_the_end():
    parser = Llama3JsonParser(TOOLS)
    assert parser.feed("  ").content == ""  # undecided: whitespace only
    assert parser.feed("Hi").content == "  Hi"
    assert parser.feed(" there").content == " there"
    assert parser.finish().content == ""


def test_llama3_json_is_held_to_the_end():
    parser = Llama3JsonParser(TOOLS)
    out = parser.feed('{"name": "add", "parameters": {"a": 1, "b": 2}}')
    assert out.content == "" and out.calls == []
    assert [c.name for c in parser.finish().calls] == ["add"]


_llama3_sep = st.sampled_from([";", "; ", " ;\n", "\n", " ", ";\n\n"])


@st.composite
def llama3_reply(draw):
    lead, trail = draw(_ws), draw(_ws)
    kind = draw(st.sampled_from(["calls", "text", "brace"]))
    if kind == "calls":
        calls, parts = [], []
        for _ in range(draw(st.integers(1, 3))):
            name, args, obj = draw(_valid_call())
            calls.append((name, args))
            parts.append(_dump(obj, draw))
        body = parts[0] + "".join(draw(_llama3_sep) + p for p in parts[1:])
        if draw(st.booleans()):
            body += ";"
        return lead + body + trail, "", calls
    if kind == "text":
        text = lead + draw(st.one_of(_text, st.text(max_size=20))) + trail
        if text.lstrip().startswith("{"):
            text = "x" + text
        return text, text.rstrip(), []
    # starts like JSON but is not (only) calls
    name, args, obj = draw(_valid_call())
    good = _dump(obj, draw)
    body = draw(st.sampled_from([
        good + " and more",
        good + "; " + '{"name": "subtract", "parameters": {}}',
        '{"name": "nope"}',
        good[:-1],
        "{" + draw(_free_text),
        good + "; " + "[1]",
    ]))
    text = lead + body + trail
    return text, text.rstrip(), []


@PROPERTY
@given(llama3_reply(), st.lists(st.integers(1, 12), min_size=1, max_size=16))
def test_llama3_streaming_matches_whole_text(reply, sizes):
    text, content, calls = reply
    expected = whole(Llama3JsonParser, text)
    assert expected == (content, calls)
    assert by_char(Llama3JsonParser, text) == expected
    assert run(Llama3JsonParser(TOOLS), chunked(text, sizes)) == expected


# -- edge cases found by these tests ----------------------------------------------------------------------


@pytest.mark.parametrize("parser_cls, text", [
    (HermesParser, '<tool_call>\n{"name": ["add"], "arguments": {"a": 1, "b": 2}}\n</tool_call>'),
    (Llama3JsonParser, '{"name": {"fn": "add"}, "parameters": {"a": 1, "b": 2}}'),
])
def test_non_string_name_is_content_not_a_crash(parser_cls, text):
    assert whole(parser_cls, text) == (text, [])


def test_hermes_close_tag_inside_an_argument_string():
    text = '<tool_call>\n{"name":"echo","arguments":{"s":"</tool_call>"}}\n</tool_call>'
    assert whole(HermesParser, text) == ("", [("echo", {"s": "</tool_call>"})])


def _strict_json(text):
    def reject(constant):
        raise ValueError(f"not JSON: {constant}")
    return json.loads(text, parse_constant=reject)


@pytest.mark.parametrize("value", ["1e999", "-1e999", "NaN", "Infinity"])
def test_call_arguments_are_always_strict_json(value):
    """NaN / Infinity are not JSON: no call. An overflowing number is valid JSON text: the call
    keeps it as the model wrote it (a round trip through float would turn it into Infinity)."""
    text = f'<tool_call>\n{{"name": "scale", "arguments": {{"x": {value}}}}}\n</tool_call>'
    parser = HermesParser([SCALE])
    calls = parser.feed(text).calls + parser.finish().calls
    if value in ("NaN", "Infinity"):
        assert calls == []
    else:
        assert [c.arguments for c in calls] == [f'{{"x": {value}}}']
        _strict_json(calls[0].arguments)


def test_schema_check_tools_accepts_never_crashes_the_parser():
    tools = [tool({"name": "f", "parameters": {"$ref": "#/$defs/missing"}})]
    try:
        check_tools(tools)
    except ValueError:
        return  # rejected up front (a 400): fine
    text = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    whole(HermesParser, text, tools=tools)
    whole(Llama3JsonParser, '{"name": "f", "parameters": {}}', tools=tools)


# -- tool_format_for --------------------------------------------------------------------------------

QWEN25_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n<tools>" }}
    {%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- elif messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {{- '<|im_start|>user\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response><|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

LLAMA31_TEMPLATE = """{%- if custom_tools is defined %}{%- set tools = custom_tools %}{%- endif %}
{%- if not tools_in_user_message is defined %}{%- set tools_in_user_message = true %}{%- endif %}
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "ipython" or message.role == "tool" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
    {%- endif %}
{%- endfor %}
"""

SMOLLM2_TEMPLATE = """{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system
You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>
' }}{% endif %}{{'<|im_start|>' + message['role'] + '
' + message['content'] + '<|im_end|>' + '
'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant
' }}{% endif %}"""


@pytest.mark.parametrize("template, expected", [
    (QWEN25_TEMPLATE, ToolFormat("hermes", native=True)),
    (LLAMA31_TEMPLATE, ToolFormat("llama3_json", native=True)),
    ('{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}{% if m.role == "ipython" %}x{% endif %}'
     '{% endfor %}', ToolFormat("llama3_json", native=True)),  # Llama 3.2 style: ipython turns
    ('{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}',
     ToolFormat("hermes", native=False)),  # tools in a format we do not parse: our own prompt instead
    (SMOLLM2_TEMPLATE, ToolFormat("hermes", native=False)),
    (None, ToolFormat("hermes", native=False)),
    ("", ToolFormat("hermes", native=False)),
])
def test_tool_format_for(template, expected):
    assert tool_format_for(template) == expected


def test_format_parser_and_prompt():
    assert isinstance(HERMES.parser(TOOLS), HermesParser)
    assert isinstance(LLAMA3.parser(TOOLS), Llama3JsonParser)
    prompt = HERMES.tools_prompt([ADD, PING])
    assert "<tools>" in prompt and "<tool_call>" in prompt
    lines = prompt.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    assert [json.loads(line)["function"]["name"] for line in lines] == ["add", "ping"]
    call = HERMES.render_call("add", {"a": 1, "b": 2})
    assert whole(HermesParser, call) == ("", [("add", {"a": 1, "b": 2})])


# -- check_tools ------------------------------------------------------------------------------------


def test_check_tools_accepts_valid_tools():
    check_tools(TOOLS + [SCALE])
    check_tools([])


def test_check_tools_rejects_duplicate_names():
    with pytest.raises(ValueError, match=r"tools\[2\].*'add'"):
        check_tools([ADD, ECHO, tool({"name": "add"})])


@pytest.mark.parametrize("parameters", [
    {"type": "not-a-type"},
    {"type": "object", "properties": {"a": {"type": 5}}},
    {"type": "object", "required": "a"},
])
def test_check_tools_rejects_invalid_schema(parameters):
    with pytest.raises(ValueError, match=r"tools\[1\]\.function\.parameters is not a valid JSON schema"):
        check_tools([ADD, tool({"name": "bad", "parameters": parameters})])


# -- the forcing grammar ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    from tunix_rt.checkpoints.default_model import DefaultModelMissing
    from tunix_rt.checkpoints.loader import load_model

    try:
        return load_model("default").tokenizer
    except DefaultModelMissing as e:
        pytest.skip(f"needs the default model's tokenizer: {e}")


@pytest.fixture(scope="module")
def compiler(tokenizer):
    from tunix_rt.engine.structured import GrammarCompiler

    return GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)


def matcher(compiler, grammar: str):
    from tunix_rt.engine.structured import StructuredOutputsParams

    return compiler.compile(StructuredOutputsParams(grammar=grammar))


def compact_call(fmt: ToolFormat, name: str, args) -> str:
    key = "arguments" if fmt.name == "hermes" else "parameters"
    body = json.dumps({"name": name, key: args}, separators=(",", ":"), ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>" if fmt.name == "hermes" else body


def separator(fmt: ToolFormat) -> str:
    return "\n" if fmt.name == "hermes" else "; "


def consume(compiler, tokenizer, grammar, text):
    m = matcher(compiler, grammar)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return m.try_consume_tokens(ids), len(ids), m


FORMATS = [ToolFormat("hermes", native=False), ToolFormat("hermes", native=True),
           ToolFormat("llama3_json", native=True)]


def test_compact_call_example_matches_the_brief():
    assert compact_call(HERMES, "add", {"a": 1, "b": 2}) == \
        '<tool_call>\n{"name":"add","arguments":{"a":1,"b":2}}\n</tool_call>'


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"{f.name}-{'native' if f.native else 'prompt'}")
@pytest.mark.parametrize("tools", [[ADD], [ADD, ECHO]], ids=["one-tool", "two-tools"])
@pytest.mark.parametrize("parallel", [False, True], ids=["single", "parallel"])
def test_grammar_accepts_valid_calls_and_rejects_others(compiler, tokenizer, fmt, tools, parallel):
    grammar = fmt.grammar(tools, parallel)
    good = compact_call(fmt, "add", {"a": 1, "b": 2})
    n, total, m = consume(compiler, tokenizer, grammar, good)
    assert n == total and m.is_accepting() and not m.is_error()
    assert whole(type(fmt.parser(tools)), good, tools) == ("", [("add", {"a": 1, "b": 2})])

    if len(tools) == 2:
        other = compact_call(fmt, "echo", {"s": "hi there"})
        n, total, m = consume(compiler, tokenizer, grammar, other)
        assert n == total and m.is_accepting()
        assert whole(type(fmt.parser(tools)), other, tools) == ("", [("echo", {"s": "hi there"})])
    else:  # a real tool that is not among these
        n, total, m = consume(compiler, tokenizer, grammar, compact_call(fmt, "echo", {"s": "hi"}))
        assert n < total

    rejected = [
        compact_call(fmt, "subtract", {"a": 1, "b": 2}),  # unknown tool
        compact_call(fmt, "add", {"a": "1", "b": 2}),  # wrong type
        compact_call(fmt, "add", {"a": 1}),  # missing required
        compact_call(fmt, "add", {"a": 1, "b": 2}).replace('{"a":1', '{ "a": 1'),  # not compact
        "Sure! " + good,  # text before the call
    ]
    for text in rejected:
        n, total, m = consume(compiler, tokenizer, grammar, text)
        assert n < total, text

    two = good + separator(fmt) + compact_call(fmt, "add", {"a": 3, "b": 4})
    n, total, m = consume(compiler, tokenizer, grammar, two)
    if parallel:
        assert n == total and m.is_accepting()
        expected = [("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})]
        assert whole(type(fmt.parser(tools)), two, tools) == ("", expected)
    else:
        assert n < total


def test_grammar_for_a_tool_without_parameters(compiler, tokenizer):
    for fmt in (HERMES, LLAMA3):
        grammar = fmt.grammar([PING], parallel=False)
        text = compact_call(fmt, "ping", {"anything": [1, "x"]})
        n, total, m = consume(compiler, tokenizer, grammar, text)
        assert n == total and m.is_accepting()
        assert whole(type(fmt.parser([PING])), text, [PING]) == ("", [("ping", {"anything": [1, "x"]})])
        n, total, _ = consume(compiler, tokenizer, grammar, compact_call(fmt, "ping", [1]))
        assert n < total


def test_grammar_allows_close_tag_inside_a_string(compiler, tokenizer):
    """What makes test_hermes_close_tag_inside_an_argument_string matter: the forced grammar lets it through."""
    text = compact_call(HERMES, "echo", {"s": "</tool_call>"})
    n, total, m = consume(compiler, tokenizer, HERMES.grammar([ECHO], parallel=False), text)
    assert n == total and m.is_accepting()


def test_grammar_keeps_the_tools_references(compiler, tokenizer):
    """Parameters sit one level down in a call: $defs move to the root, other local refs are rebased."""
    book = tool({"name": "book", "parameters": {
        "$defs": {"City": {"enum": ["Paris", "Rome"]}}, "type": "object",
        "properties": {"city": {"$ref": "#/$defs/City"}, "again": {"$ref": "#/properties/city"}},
        "required": ["city", "again"], "additionalProperties": False}})
    for fmt in (HERMES, LLAMA3):
        grammar = fmt.grammar([book, ADD], parallel=False)
        good = compact_call(fmt, "book", {"city": "Rome", "again": "Paris"})
        n, total, m = consume(compiler, tokenizer, grammar, good)
        assert n == total and m.is_accepting()
        assert whole(type(fmt.parser([book])), good, [book]) == ("", [("book", {"city": "Rome", "again": "Paris"})])
        for bad in ({"city": "Oslo", "again": "Rome"}, {"city": "Rome", "again": "Oslo"}):
            n, total, _ = consume(compiler, tokenizer, grammar, compact_call(fmt, "book", bad))
            assert n < total, bad


@pytest.fixture(scope="module")
def ascii_token_ids(tokenizer):
    ids = [i for i in range(tokenizer.vocab_size)
           if len(s := tokenizer.decode([i], skip_special_tokens=False)) == 1 and s.isascii() and s.isprintable()]
    ids += tokenizer.encode("\n", add_special_tokens=False)
    return np.array(sorted(set(ids)))


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3], ids=lambda f: f.name)
@pytest.mark.parametrize("parallel", [False, True], ids=["single", "parallel"])
def test_every_grammar_sentence_parses_to_calls(compiler, tokenizer, ascii_token_ids, fmt, parallel):
    """Random walks through the grammar (random allowed tokens, mostly single characters so strings end):
    whatever the mask lets a model write, the format's parser reads as calls and no content, streamed or not."""
    tools = [ADD, ECHO]
    grammar = fmt.grammar(tools, parallel)
    rng = np.random.default_rng(1234)
    closers = np.array([i for i in ascii_token_ids if tokenizer.decode([int(i)]) in '"}],'])
    finished = 0
    for _ in range(12):
        m = matcher(compiler, grammar)
        ids = []
        for _ in range(400):
            if m.is_accepting() and rng.random() < 0.3:
                break
            mask = np.unpackbits(np.frombuffer(m.compute_bitmask(), np.uint8), bitorder="little")
            pool = closers[mask[closers] == 1] if rng.random() < 0.3 else closers[:0]
            if not len(pool):
                pool = ascii_token_ids[mask[ascii_token_ids] == 1]
            if not len(pool):  # llguidance only allows the canonical tokens of a forced string
                pool = np.flatnonzero(mask[:tokenizer.vocab_size])
                pool = pool[~np.isin(pool, tokenizer.eos_token_ids)]
            if not len(pool):  # only end-of-sequence is left
                assert m.is_accepting()
                break
            token = int(rng.choice(pool))
            assert m.consume_token(token)
            ids.append(token)
        else:
            continue  # ran long (a long string): not a finished sentence
        finished += 1
        text = tokenizer.decode(ids, skip_special_tokens=False)
        content, calls = whole(type(fmt.parser(tools)), text, tools)
        assert content == "", text
        assert calls and {name for name, _ in calls} <= {"add", "echo"}, text
        if not parallel:
            assert len(calls) == 1, text
        elif fmt.name == "hermes":
            assert len(calls) == text.count("<tool_call>"), text
        assert by_char(type(fmt.parser(tools)), text, tools) == (content, calls)
    assert finished >= 6


# -- chat messages ----------------------------------------------------------------------------------


def msg(**kw) -> dict:
    """A message as the server passes it on: validated by its protocol, then as a dict."""
    return ChatMessage.model_validate(kw).model_dump(exclude_none=True)


def assistant_call(content=None, arguments='{"a": 1, "b": 2}', call_id="call_1"):
    return msg(role="assistant", content=content,
               tool_calls=[{"id": call_id, "type": "function", "function": {"name": "add", "arguments": arguments}}])


def test_template_messages_developer_becomes_system_and_parts_are_joined():
    messages = [msg(role="developer", content="Be brief."),
                msg(role="user", content=[{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]),
                msg(role="assistant", content=None)]
    assert template_messages(messages, HERMES, None) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello, world"},
        {"role": "assistant", "content": ""},
    ]


def test_template_messages_rejects_non_text_parts():
    messages = [msg(role="user", content="hi"),
                msg(role="user", content=[{"type": "text", "text": "look"},
                                          {"type": "image_url", "image_url": {"url": "http://x/y.png"}}])]
    with pytest.raises(ValueError, match=r"messages\[1\]\.content.*'image_url'"):
        template_messages(messages, HERMES, None)


def test_template_messages_native_format_keeps_tool_calls_with_object_arguments():
    fmt = ToolFormat("hermes", native=True)
    messages = [msg(role="user", content="1+2?"), assistant_call(),
                msg(role="tool", content="3", tool_call_id="call_1", name="add")]
    out = template_messages(messages, fmt, [ADD])
    assert out == [
        {"role": "user", "content": "1+2?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]},
        {"role": "tool", "content": "3", "tool_call_id": "call_1", "name": "add"},
    ]  # and no tools prompt: the template renders the tools itself


def test_template_messages_non_native_format_renders_calls_and_results_as_text():
    messages = [msg(role="user", content="1+2?"), assistant_call(content="Let me add."),
                msg(role="tool", content="3", tool_call_id="call_1"), assistant_call(content=None, call_id="c2")]
    out = template_messages(messages, HERMES, None)
    call_text = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    assert out == [
        {"role": "user", "content": "1+2?"},
        {"role": "assistant", "content": "Let me add.\n" + call_text},
        {"role": "user", "content": "<tool_response>\n3\n</tool_response>"},
        {"role": "assistant", "content": call_text},
    ]
    # the past call reads back as the same call
    assert whole(HermesParser, out[1]["content"]) == ("Let me add.", [("add", {"a": 1, "b": 2})])


def test_template_messages_non_native_tools_add_a_system_prompt():
    out = template_messages([msg(role="user", content="hi")], HERMES, [ADD, ECHO])
    assert out[0] == {"role": "system", "content": HERMES.tools_prompt([ADD, ECHO])}
    assert out[1:] == [{"role": "user", "content": "hi"}]
    assert '"name": "add"' in out[0]["content"] and '"name": "echo"' in out[0]["content"]


@pytest.mark.parametrize("role", ["system", "developer"])
def test_template_messages_tools_prompt_merges_into_the_system_message(role):
    out = template_messages([msg(role=role, content="Be brief."), msg(role="user", content="hi")], HERMES, [ADD])
    assert out == [{"role": "system", "content": "Be brief.\n\n" + HERMES.tools_prompt([ADD])},
                   {"role": "user", "content": "hi"}]


def test_template_messages_native_format_adds_no_tools_prompt():
    out = template_messages([msg(role="system", content="S"), msg(role="user", content="hi")],
                            ToolFormat("hermes", native=True), [ADD])
    assert out == [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3], ids=lambda f: f.name)
@pytest.mark.parametrize("arguments", ["[1, 2]", '"a"', "3", "null", "{not json", ""])
def test_template_messages_rejects_arguments_that_are_not_an_object(fmt, arguments):
    messages = [msg(role="user", content="hi"), assistant_call(arguments=arguments)]
    with pytest.raises(ValueError, match=r"messages\[1\]\.tool_calls: arguments must be a JSON object"):
        template_messages(messages, fmt, [ADD])


def _conversation():
    return [msg(role="user", content="What is 1+2?"), assistant_call(),
            msg(role="tool", content="3", tool_call_id="call_1")]


def test_render_chat_default_model_with_tools(tokenizer):
    fmt = tool_format_for(tokenizer.chat_template)
    assert fmt == ToolFormat("hermes", native=False)  # SmolLM2's template knows no tools
    prompt = render_chat(tokenizer, _conversation(), fmt, [ADD])
    assert isinstance(prompt, str)
    assert '"name": "add"' in prompt and "Add two integers." in prompt  # the tools prompt
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>' in prompt
    assert "<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>" in prompt
    assert prompt.startswith("<|im_start|>system\n# Tools")
    assert prompt.endswith("<|im_start|>assistant\n")


def test_render_chat_default_model_without_tools(tokenizer):
    fmt = tool_format_for(tokenizer.chat_template)
    prompt = render_chat(tokenizer, [msg(role="user", content="Hi")], fmt, None)
    assert "<tools>" not in prompt and "<|im_start|>user\nHi<|im_end|>" in prompt


def test_render_chat_native_template_gets_tools_and_object_arguments(tokenizer):
    from tunix_rt.checkpoints.tokenizer import Tokenizer

    qwen = Tokenizer(tokenizer.backend, eos_token=tokenizer.eos_token, chat_template=QWEN25_TEMPLATE)
    fmt = tool_format_for(qwen.chat_template)
    assert fmt == ToolFormat("hermes", native=True)
    prompt = render_chat(qwen, _conversation(), fmt, [ADD])
    assert '"name": "add"' in prompt and "# Tools" in prompt
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>' in prompt
    assert "<tool_response>\n3\n</tool_response>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("template, error", [
    ("{{ raise_exception('roles must alternate') }}", "^roles must alternate$"),  # the template's own message
    ("{{ messages[0].content.no_such_method() }}", "^messages: the model's chat template rejected them: "),
])
def test_render_chat_template_errors_are_value_errors(tokenizer, template, error):
    from tunix_rt.checkpoints.tokenizer import Tokenizer

    strict = Tokenizer(tokenizer.backend, eos_token=tokenizer.eos_token, chat_template=template)
    with pytest.raises(ValueError, match=error):
        render_chat(strict, [msg(role="user", content="hi")], HERMES, None)
