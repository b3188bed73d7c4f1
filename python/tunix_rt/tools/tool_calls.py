"""Tool calls: how a model writes them (its format), how to read them back, and how to force one.

Two formats, chosen from the chat template:
- hermes (Qwen2/2.5/3, Hermes, and any template without tool support, to which the server adds its
  own tools prompt): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one per call;
- llama3_json (Llama 3.1+ templates): the whole reply is `{"name": ..., "parameters": {...}}`, calls
  separated by ";".

A parser reads the model's text incrementally (`feed` each delta, then `finish`), so streaming and
non-streaming replies come from the same code: the non-streaming path feeds the whole text at once.
A call is only reported once complete and valid (a known tool, arguments that pass its JSON schema);
anything else stays text. `required` and named tool_choice are enforced with a Lark grammar for the
format (one JSON schema per tool) applied as a token mask, so those replies are always valid calls.

Tools are OpenAI tool dicts ({"type": "function", "function": {"name", "description", "parameters"}}):
the server passes its requests' tools, agentic RL its tools' schemas. Both import this module, which
sits below them.
"""

from __future__ import annotations

import dataclasses
import json
import uuid

import jsonschema
import referencing
import referencing.exceptions
import referencing.jsonschema

from tunix_rt.engine.detokenizer import held_prefix_length


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


# Strict JSON: NaN / Infinity are not valid arguments.
_DECODER = json.JSONDecoder(parse_constant=_no_constant)


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _decode_object(text: str, pos: int) -> tuple[object, dict[str, str], int]:
    """The JSON value at text[pos:] (after whitespace), the raw text of each member's value when it
    is an object, and where it ends. Arguments are passed on as the model wrote them, so a number
    like 1e999 stays valid JSON text instead of becoming inf on a round trip. Raises ValueError."""
    pos = _skip_ws(text, pos)
    value, end = _DECODER.raw_decode(text, pos)
    raws: dict[str, str] = {}
    if isinstance(value, dict):
        i = _skip_ws(text, pos + 1)
        while text[i] != "}":
            key, i = _DECODER.raw_decode(text, i)
            i = _skip_ws(text, _skip_ws(text, i) + 1)  # past ':'
            _, j = _DECODER.raw_decode(text, i)
            raws[key] = text[i:j]
            i = _skip_ws(text, j)
            if text[i] == ",":
                i = _skip_ws(text, i + 1)
    return value, raws, end


def _refs(node):
    if isinstance(node, dict):
        if isinstance(node.get("$ref"), str):
            yield node["$ref"]
        for value in node.values():
            yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


@dataclasses.dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text, as OpenAI's API carries it
    id: str = dataclasses.field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


def check_tools(tools: list[dict]) -> None:
    """Reject duplicate names and parameter schemas that are not valid JSON schemas (400s upstream)."""
    seen = set()
    for i, tool in enumerate(tools):
        name = tool["function"]["name"]
        if name in seen:
            raise ValueError(f"tools[{i}]: two tools are named {name!r}")
        seen.add(name)
        if tool["function"].get("parameters") is not None:
            check_json_schema(tool["function"]["parameters"], f"tools[{i}].function.parameters")


def check_json_schema(schema: dict, where: str) -> None:
    """A JSON schema clients send (tool parameters, response formats): valid, and every $ref resolves
    inside it (nothing is fetched). Raises ValueError naming `where`."""
    dialect = schema.get("$schema", "")
    if not isinstance(dialect, str):
        raise ValueError(f"{where}: $schema must be a string (a dialect URI), got {dialect!r}")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        raise ValueError(f"{where} is not a valid JSON schema: {e.message}") from None
    spec = referencing.jsonschema.specification_with(dialect, default=referencing.jsonschema.DRAFT202012)
    resolver = referencing.Registry().with_resource("", spec.create_resource(schema)).resolver()
    for ref in _refs(schema):
        try:
            resolver.lookup(ref)
        except referencing.exceptions.Unresolvable:
            raise ValueError(f"{where}: $ref {ref!r} does not resolve within the schema") from None


class _Validator:
    """Turns a decoded call object into a ParsedCall when it names a known tool with valid arguments (or, not
    `strict`, any name with object arguments: agentic RL answers a wrong call with an error observation)."""

    def __init__(self, tools: list[dict], args_keys: tuple[str, ...], strict: bool = True):
        self._schemas = {t["function"]["name"]: t["function"].get("parameters") for t in tools}
        self._args_keys = args_keys
        self._strict = strict

    def call(self, obj, raws: dict[str, str]) -> ParsedCall | None:
        """obj: the decoded call; raws: the raw JSON text of its members (see _decode_object)."""
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        if self._strict and obj["name"] not in self._schemas:
            return None
        key = next((k for k in self._args_keys if k in obj), None)
        args, raw = ({}, "{}") if key is None else (obj[key], raws[key])
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args, _, end = _decode_object(args, 0)
            except ValueError:  # JSONDecodeError included
                return None
            raw = obj[key].strip()
            if _skip_ws(raw, end) != len(raw):
                return None
        if not isinstance(args, dict):
            return None
        schema = self._schemas.get(obj["name"]) if self._strict else None
        if schema is not None:
            try:
                jsonschema.validate(args, schema)
            except (jsonschema.ValidationError, referencing.exceptions.Unresolvable):
                return None
        return ParsedCall(obj["name"], raw)


@dataclasses.dataclass
class ParserOutput:
    content: str = ""
    calls: list[ParsedCall] = dataclasses.field(default_factory=list)
    reasoning: str = ""  # set by the server's reasoning parser, which reads the text before the tool parser


class _ContentGate:
    """Trailing whitespace is held until more text follows, so a reply made only of calls (with
    newlines between them) has no content, and the output never depends on how text was chunked."""

    def __init__(self):
        self._held = ""

    def __call__(self, text: str) -> str:
        text = self._held + text
        kept = text.rstrip()
        self._held = text[len(kept):]
        return kept


class HermesParser:
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, tools: list[dict], strict: bool = True):
        self._validator = _Validator(tools, ("arguments", "parameters"), strict)
        self._buf = ""
        self._in_call = False
        self._gate = _ContentGate()
        self._scan = 0  # inside a call: how far the closing-tag scan has read, and its JSON string state
        self._in_string = self._escaped = False

    def feed(self, text: str) -> ParserOutput:
        self._buf += text
        out = ParserOutput()
        while True:
            if not self._in_call:
                i = self._buf.find(self.OPEN)
                if i >= 0:
                    out.content += self._gate(self._buf[:i])
                    self._buf, self._in_call = self._buf[i + len(self.OPEN):], True
                    self._scan, self._in_string, self._escaped = 0, False, False
                    continue
                keep = held_prefix_length(self._buf, (self.OPEN,))  # may be the start of a tag: wait for more
                out.content += self._gate(self._buf[:len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                return out
            j = self._close_index()
            if j < 0:
                return out
            self._end_call(j, out)

    def _end_call(self, j: int, out: ParserOutput) -> None:
        """The call's closing tag is at j: emit the call (or its text) and read on after the tag. An unbalanced
        quote in a malformed call hides a closing tag from the string-aware scan; a body that does not parse
        therefore ends at its first closing tag, and what follows is read again."""
        body = self._buf[:j]
        first = body.find(self.CLOSE)
        if first >= 0 and self._parse(body) is None:
            j, body = first, body[:first]
        self._buf, self._in_call = self._buf[j + len(self.CLOSE):], False
        self._emit(body, self.OPEN + body + self.CLOSE, out)

    def _close_index(self) -> int:
        """Where the call's closing tag starts, or -1: a tag inside a JSON string (an argument that
        mentions it) does not count. Scanning resumes where it stopped, so chunking cannot matter."""
        buf, i = self._buf, self._scan
        while i < len(buf):
            c = buf[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c == "<":
                if buf.startswith(self.CLOSE, i):
                    return i
                if self.CLOSE.startswith(buf[i:]):  # maybe the tag's beginning: wait for more text
                    break
            i += 1
        self._scan = i
        return -1

    def finish(self) -> ParserOutput:
        out = ParserOutput()
        if self._in_call:
            j = self._buf.find(self.CLOSE)
            if j >= 0 and self._parse(self._buf) is None:  # a closing tag the string-aware scan did not see
                self._end_call(j, out)
                more, tail = self.feed(""), self.finish()
                return ParserOutput(out.content + more.content + tail.content, out.calls + more.calls + tail.calls)
            self._emit(self._buf, self.OPEN + self._buf, out)  # the reply ended inside a call: a call if it parses
        else:
            out.content += self._gate(self._buf)
        self._buf, self._in_call = "", False
        return out

    def _parse(self, body: str) -> ParsedCall | None:
        try:
            obj, raws, end = _decode_object(body, 0)
            return self._validator.call(obj, raws) if _skip_ws(body, end) == len(body) else None
        except ValueError:  # JSONDecodeError included
            return None

    def _emit(self, body: str, raw: str, out: ParserOutput) -> None:
        call = self._parse(body)
        if call is None:
            out.content += self._gate(raw)
        else:
            out.calls.append(call)


class Llama3JsonParser:
    """A reply that starts with "{" is held whole and read as calls at the end; any other is text."""

    def __init__(self, tools: list[dict], strict: bool = True):
        self._validator = _Validator(tools, ("parameters", "arguments"), strict)
        self._buf = ""
        self._json: bool | None = None
        self._gate = _ContentGate()

    def feed(self, text: str) -> ParserOutput:
        if self._json is None:
            self._buf += text
            start = self._buf.lstrip()
            if not start:
                return ParserOutput()
            self._json = start.startswith("{")
            text, self._buf = (self._buf, "") if not self._json else ("", self._buf)
        elif self._json:
            self._buf += text
            text = ""
        return ParserOutput(content=self._gate(text))

    def finish(self) -> ParserOutput:
        text, self._buf = self._buf, ""
        if not self._json:
            return ParserOutput(content=self._gate(text))
        calls = self._calls(text)
        return ParserOutput(calls=calls) if calls else ParserOutput(content=self._gate(text))

    def _calls(self, text: str) -> list[ParsedCall] | None:
        calls, pos = [], 0
        while True:
            while pos < len(text) and (text[pos].isspace() or (calls and text[pos] == ";")):
                pos += 1
            if pos == len(text):
                return calls or None
            try:
                obj, raws, pos = _decode_object(text, pos)
            except ValueError:  # JSONDecodeError included
                return None
            call = self._validator.call(obj, raws)
            if call is None:
                return None
            calls.append(call)


@dataclasses.dataclass(frozen=True)
class ToolFormat:
    name: str  # "hermes" | "llama3_json"
    native: bool  # the chat template renders `tools` itself; else the server adds a tools prompt

    def parser(self, tools: list[dict], strict: bool = True):
        """A streaming parser of replies. `strict`: only calls of these tools with arguments their schemas
        accept are calls (the rest is text); else any well-formed call is."""
        return (HermesParser if self.name == "hermes" else Llama3JsonParser)(tools, strict)

    def parse(self, text: str, tools: list[dict], strict: bool = True) -> ParserOutput:
        """A whole reply's content and calls."""
        parser = self.parser(tools, strict)
        out, end = parser.feed(text), parser.finish()
        return ParserOutput(out.content + end.content, out.calls + end.calls)

    def attempted_call(self, content: str) -> bool:
        """Whether text left over by the parser looks like a call it could not read (a malformed one)."""
        return HermesParser.OPEN in content if self.name == "hermes" else content.lstrip().startswith("{")

    def grammar(self, tools: list[dict], parallel: bool) -> str:
        """A Lark grammar (llguidance dialect) whose every sentence is one or more valid calls."""
        key = "arguments" if self.name == "hermes" else "parameters"
        rules = [f"tool{i}: %json {json.dumps(_call_schema(t, key))}" for i, t in enumerate(tools)]
        if self.name == "hermes":
            call, separator = '"<tool_call>\\n" body "\\n</tool_call>"', '"\\n"'
        else:
            call, separator = "body", '"; "'
        start = f"start: call ({separator} call)*" if parallel else "start: call"
        body = " | ".join(f"tool{i}" for i in range(len(tools)))
        return "\n".join([start, f"call: {call}", f"body: {body}", *rules]) + "\n"

    def tools_prompt(self, tools: list[dict]) -> str:
        """The system text that teaches a template without tool support to call tools (hermes)."""
        signatures = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return ("# Tools\n\nYou may call one or more functions to assist with the user query. The functions "
                f"available are described in JSON within <tools></tools> tags:\n<tools>\n{signatures}\n</tools>\n\n"
                "To call a function, write a JSON object with its name and arguments within <tool_call></tool_call> "
                'tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')

    def render_call(self, name: str, arguments: dict) -> str:
        """A past call as the model would have written it (for templates without tool support)."""
        return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n</tool_call>"


def _call_schema(tool: dict, key: str) -> dict:
    """The schema of one call object {"name": const, key: arguments}. The tool's parameters sit one
    level down, so its definitions move to the root (where "#/$defs/..." resolves) and its other
    local references gain the path to the arguments."""
    params = dict(tool["function"].get("parameters") or {"type": "object"})
    hoisted = {name: params.pop(name) for name in ("$defs", "definitions") if name in params}
    params.pop("$schema", None)

    def rebase(node):
        if isinstance(node, dict):
            out = {k: rebase(v) for k, v in node.items()}
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#") and not ref.startswith(("#/$defs/", "#/definitions/")):
                out["$ref"] = f"#/properties/{key}{ref[1:]}"
            return out
        return [rebase(v) for v in node] if isinstance(node, list) else node

    return {"type": "object", "additionalProperties": False, "required": ["name", key],
            "properties": {"name": {"const": tool["function"]["name"]}, key: rebase(params)},
            **rebase(hoisted), "x-guidance": {"whitespace_flexible": False}}


def tool_format_for(chat_template: str | None) -> ToolFormat:
    template = chat_template or ""
    native = "tools" in template
    if native and "<tool_call>" not in template and ('"parameters"' in template or "ipython" in template):
        return ToolFormat("llama3_json", native=True)
    return ToolFormat("hermes", native=native and "<tool_call>" in template)
