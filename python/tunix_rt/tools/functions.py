"""Tools a policy can call: Python callables (or OpenAI tool dicts with a callable), their JSON schemas, and
calling them so that nothing a tool or a model does can crash the run.

A callable's schema comes from its signature and docstring, as TRL (transformers' get_json_schema) and the
OpenAI Agents SDK derive it: the docstring's text before `Args:` is the description, each `name: text` line
under `Args:` a parameter's, and the type hints give the JSON types (int integer, float number, str string,
bool boolean, list[T] array of T, dict object, Literal[...] enum, `T | None` a nullable T); a parameter
without a default is required. A parameter without a type hint is a ValueError naming it.

`call_tool` never raises for what the tool or the model did: an unknown tool, arguments that are not a JSON
object or do not fit the schema, a tool that raises, returns something other than a string, or runs past
its time limit each come back as an error observation (TRL and Tunix do the same), which the policy reads.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import inspect
import json
import math
import operator
import re
import threading
import time
import types
import typing
from collections.abc import Callable
from typing import Any

from tunix_rt.tools.sandbox import run_python


@dataclasses.dataclass(frozen=True)
class Tool:
    """A callable with the OpenAI function schema a chat template renders for the model."""

    name: str
    description: str
    parameters: dict
    fn: Callable[..., Any]

    def schema(self) -> dict:
        """The OpenAI tool dict: {"type": "function", "function": {name, description, parameters}}."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclasses.dataclass(frozen=True)
class ToolResult:
    """One call's observation text and what became of it."""

    content: str
    error: bool = False
    timed_out: bool = False
    seconds: float = 0.0


_SIMPLE = {int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null", dict: "object",
           list: "array"}


def _json_type(hint, where: str) -> dict:
    """The JSON schema of one type hint."""
    if hint is Any:
        return {}
    if hint in _SIMPLE:
        return {"type": _SIMPLE[hint]}
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        kinds = {_SIMPLE.get(type(a)) for a in args}
        return {"type": kinds.pop(), "enum": list(args)} if len(kinds) == 1 else {"enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        subs = [_json_type(a, where) for a in args]
        if all(set(s) == {"type"} for s in subs):
            kinds = [s["type"] for s in subs]
            return {"type": kinds[0] if len(kinds) == 1 else kinds}
        return {"anyOf": subs}
    if origin is list:
        return {"type": "array", "items": _json_type(args[0], where)} if args else {"type": "array"}
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return {"type": "array", "items": _json_type(args[0], where)}
        return {"type": "array", "prefixItems": [_json_type(a, where) for a in args]}
    if origin is dict:
        return {"type": "object", "additionalProperties": _json_type(args[1], where)} if args else {"type": "object"}
    raise ValueError(f"{where}: type hint {hint!r} has no JSON schema (use int, float, str, bool, list, dict, "
                     "Literal or a union of them)")


def _docstring_parts(doc: str) -> tuple[str, dict[str, str]]:
    """(description, {parameter: description}) from a Google-style docstring."""
    doc = inspect.cleandoc(doc or "")
    match = re.search(r"^\s*(Args|Arguments|Parameters):\s*$", doc, re.MULTILINE)
    if not match:
        return re.split(r"^\s*Returns?:\s*$", doc, flags=re.MULTILINE)[0].strip(), {}
    description, rest = doc[:match.start()].strip(), doc[match.end():]
    rest = re.split(r"^\S.*:\s*$", rest, flags=re.MULTILINE)[0]  # up to the next section (Returns:, ...)
    params: dict[str, str] = {}
    current = None
    for line in rest.splitlines():
        m = re.match(r"^\s+(\*{0,2}\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$", line)
        if m:
            current = m.group(1).lstrip("*")
            params[current] = m.group(2).strip()
        elif current and line.strip():
            params[current] = f"{params[current]} {line.strip()}".strip()
    return description, params


def tool_from_callable(fn: Callable[..., Any], name: str | None = None) -> Tool:
    """A Tool whose schema is derived from fn's signature, type hints and docstring (see the module)."""
    if not callable(fn):
        raise ValueError(f"a tool must be callable, got {type(fn).__name__}")
    tool_name = name or getattr(fn, "__name__", None)
    if not tool_name or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", tool_name):
        raise ValueError(f"tool name must be 1-64 letters, digits, _ or -, got {tool_name!r}")
    try:
        hints = typing.get_type_hints(fn)
    except Exception as e:
        raise ValueError(f"tool {tool_name}: cannot read its type hints: {e}") from e
    description, param_docs = _docstring_parts(inspect.getdoc(fn) or "")
    properties, required = {}, []
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise ValueError(f"tool {tool_name}: *{p.name} / **{p.name} parameters have no JSON schema")
        if p.name not in hints:
            raise ValueError(f"tool {tool_name}: parameter {p.name!r} has no type hint")
        prop = _json_type(hints[p.name], f"tool {tool_name}, parameter {p.name!r}")
        if p.name in param_docs:
            prop["description"] = param_docs[p.name]
        properties[p.name] = prop
        if p.default is p.empty:
            required.append(p.name)
    return Tool(tool_name, description, {"type": "object", "properties": properties, "required": required}, fn)


def tool_from_dict(spec: dict, fn: Callable[..., Any]) -> Tool:
    """A Tool from an explicit OpenAI tool dict ({"type": "function", "function": {...}} or the inner
    function object) and the callable that runs it."""
    function = spec.get("function", spec) if isinstance(spec, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValueError(f"a tool dict needs a function name, got {spec!r}")
    if not callable(fn):
        raise ValueError(f"tool {function['name']}: its function must be callable, got {type(fn).__name__}")
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise ValueError(f"tool {function['name']}: parameters must be a JSON schema object")
    return Tool(function["name"], str(function.get("description", "")), parameters, fn)


def _check_arguments(tool: Tool, arguments) -> dict:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"the arguments are not valid JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(arguments, dict):
        raise ValueError(f"the arguments must be a JSON object, got {type(arguments).__name__}")
    missing = [p for p in tool.parameters.get("required", []) if p not in arguments]
    if missing:
        raise ValueError(f"missing required argument(s) {', '.join(missing)}")
    try:
        inspect.signature(tool.fn).bind(**arguments)
    except TypeError as e:
        takes = ", ".join(tool.parameters.get("properties", {})) or "none"
        raise ValueError(f"{e} ({tool.name} takes: {takes})") from None
    except ValueError:  # a builtin without a signature: let the call decide
        pass
    return arguments


def call_tool(tools: dict[str, Tool], name: str, arguments, *, timeout: float = 10.0) -> ToolResult:
    """Run tool `name` on `arguments` (a dict or its JSON text) in a worker thread, at most `timeout`
    seconds (a thread cannot be killed: one that runs on is left behind, and its result dropped)."""
    if name not in tools:
        return ToolResult(f"Error: unknown tool {name!r}; the tools are: {', '.join(sorted(tools)) or 'none'}", True)
    tool = tools[name]
    try:
        kwargs = _check_arguments(tool, arguments)
    except ValueError as e:
        return ToolResult(f"Error: calling {name}: {e}", True)
    box: dict[str, Any] = {}

    def work():
        try:
            box["value"] = tool.fn(**kwargs)
        except BaseException as e:  # noqa: BLE001 - whatever the tool raises becomes its observation
            box["error"] = e

    start = time.monotonic()
    worker = threading.Thread(target=work, name=f"tool-{name}", daemon=True)
    worker.start()
    worker.join(timeout)
    seconds = time.monotonic() - start
    if worker.is_alive():
        return ToolResult(f"Error: {name} did not finish within {timeout:g} s", True, True, seconds)
    if "error" in box:
        e = box["error"]
        return ToolResult(f"Error: {name} raised {type(e).__name__}: {e}", True, seconds=seconds)
    value = box.get("value")
    if not isinstance(value, str):
        return ToolResult(f"Error: {name} returned {type(value).__name__}, not a string", True, seconds=seconds)
    return ToolResult(value, seconds=seconds)


# --- built-in tools -----------------------------------------------------------------------------

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_MAGNITUDE = 10**100


def _evaluate(node):
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 1000:
            raise ValueError("exponent larger than 1000")
        value = _BINARY[type(node.op)](left, right)
        if isinstance(value, complex) or abs(value) > _MAX_MAGNITUDE:
            raise ValueError("result out of range")
        return value
    raise ValueError(f"unsupported expression: {ast.unparse(node)!r} (numbers, + - * / // % ** and parentheses)")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly (integers stay exact).

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "(123 * 456) - 7".
    """
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    try:
        value = _evaluate(tree)
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("result out of range")
        return str(int(value)) if value.is_integer() and abs(value) < 2**53 else repr(value)
    return str(value)


def python(code: str) -> str:
    """Run a Python script (standard library only) in a sandbox: no network, no subprocesses, 5 s of CPU,
    1 GB of memory, files only in its own scratch directory. Returns its exit status, stdout and stderr.

    Args:
        code: the script; print what you want to see.
    """
    return run_python(code).observation()


BUILTIN_TOOLS: dict[str, Callable[..., str]] = {"calculator": calculator, "python": python}


def import_object(spec: str, flag: str):
    """The object `module:name` (or `path/to/file.py:name`) names; a ValueError whose one line names `flag`
    and the spec when it cannot be found."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{flag} {spec!r}: not module:name")
    try:
        if module_name.endswith(".py"):
            where = importlib.util.spec_from_file_location(f"_tunix_rt_{abs(hash(module_name))}", module_name)
            if where is None:
                raise ImportError(f"cannot load {module_name}")
            module = importlib.util.module_from_spec(where)
            where.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - an import error of any kind is the spec's problem
        raise ValueError(f"{flag} {spec!r}: cannot import {module_name}: {type(e).__name__}: {e}") from None
    if not hasattr(module, attr):
        raise ValueError(f"{flag} {spec!r}: {module_name} has no attribute {attr!r}")
    return getattr(module, attr)


def resolve_tool(spec: str) -> Tool:
    """A tool named on the command line: a built-in (calculator, python) or `module:function` (or
    `file.py:function`). A bad spec is a ValueError whose one line names it."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"--tool needs a built-in name ({', '.join(BUILTIN_TOOLS)}) or module:function, got {spec!r}")
    if spec in BUILTIN_TOOLS:
        return tool_from_callable(BUILTIN_TOOLS[spec])
    if ":" not in spec:
        raise ValueError(f"--tool {spec!r}: not a built-in ({', '.join(BUILTIN_TOOLS)}) nor module:function")
    fn = import_object(spec, "--tool")
    try:
        return tool_from_callable(fn)
    except ValueError as e:
        raise ValueError(f"--tool {spec!r}: {e}") from None


def as_tool(tool) -> Tool:
    """A Tool as given, or one made from a callable."""
    return tool if isinstance(tool, Tool) else tool_from_callable(tool)
