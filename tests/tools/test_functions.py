"""Tools from callables and OpenAI dicts (tools/functions.py): derived schemas, the built-in calculator, and
calls that turn every failure of the tool or of the model's arguments into an error observation."""

from __future__ import annotations

import time
from typing import Literal

import pytest

from tunix_rt.tools.functions import (
    ToolResult,
    calculator,
    call_tool,
    resolve_tool,
    tool_from_callable,
    tool_from_dict,
)


def get_weather(city: str, unit: Literal["c", "f"] = "c", days: list[int] | None = None, exact: bool = False) -> str:
    """Get the weather for a city.

    Args:
        city: the city's name.
        unit: temperature unit,
            c or f.
        days: which days ahead.
        exact (bool): whether to round.

    Returns:
        a sentence.
    """
    return f"{city}: 21{unit} {days} {exact}"


def test_schema_from_signature_and_docstring():
    tool = tool_from_callable(get_weather)
    fn = tool.schema()["function"]
    assert fn["name"] == "get_weather" and fn["description"] == "Get the weather for a city."
    props = fn["parameters"]["properties"]
    assert props["city"] == {"type": "string", "description": "the city's name."}
    assert props["unit"] == {"type": "string", "enum": ["c", "f"], "description": "temperature unit, c or f."}
    assert props["days"]["anyOf"] == [{"type": "array", "items": {"type": "integer"}}, {"type": "null"}]
    assert props["exact"] == {"type": "boolean", "description": "whether to round."}
    assert fn["parameters"]["required"] == ["city"]


def test_bad_callables():
    def untyped(x):
        return str(x)

    def star(*args: int) -> str:
        return ""

    def odd(x: set) -> str:
        return ""

    with pytest.raises(ValueError, match="parameter 'x' has no type hint"):
        tool_from_callable(untyped)
    with pytest.raises(ValueError, match=r"\*args"):
        tool_from_callable(star)
    with pytest.raises(ValueError, match="no JSON schema"):
        tool_from_callable(odd)
    with pytest.raises(ValueError, match="callable"):
        tool_from_callable(3)
    with pytest.raises(ValueError, match="tool name"):
        tool_from_callable(get_weather, name="no spaces allowed")


def test_tool_from_dict():
    spec = {"type": "function", "function": {"name": "echo", "description": "Echo.",
                                             "parameters": {"type": "object", "properties": {"text": {"type": "string"}},
                                                            "required": ["text"]}}}
    tool = tool_from_dict(spec, lambda text: text)
    assert tool.schema() == spec
    assert call_tool({"echo": tool}, "echo", '{"text": "hi"}') == ToolResult("hi", seconds=pytest.approx(0, abs=1))
    with pytest.raises(ValueError, match="function name"):
        tool_from_dict({"function": {}}, print)
    with pytest.raises(ValueError, match="callable"):
        tool_from_dict(spec, None)


@pytest.mark.parametrize("expression,want", [("123 * 456", "56088"), ("(2 + 3) * -4", "-20"), ("7 / 2", "3.5"),
                                             ("10 / 5", "2"), ("2 ** 100", str(2**100)), ("17 // 5 + 17 % 5", "5"),
                                             ("0.1 + 0.2", "0.30000000000000004")])
def test_calculator(expression, want):
    assert calculator(expression) == want


@pytest.mark.parametrize("expression,match", [("1 / 0", "division by zero"), ("__import__('os')", "unsupported"),
                                              ("9 ** 9 ** 9", "exponent"), ("10 ** 99 * 10 ** 99", "out of range"),
                                              ("1 +", "not an arithmetic"), ("'a' * 3", "unsupported"),
                                              ("(-8) ** 0.5", "out of range")])
def test_calculator_refuses(expression, match):
    with pytest.raises(ValueError, match=match):
        calculator(expression)


def test_every_failure_is_an_error_observation():
    def raises(x: int) -> str:
        raise RuntimeError("tool broke")

    def returns_int(x: int) -> str:
        return x

    def slow(x: int) -> str:
        time.sleep(5)
        return "late"

    tools = {f.__name__: tool_from_callable(f) for f in (raises, returns_int, slow, get_weather)}
    cases = [("raises", {"x": 1}, "raised RuntimeError: tool broke"), ("returns_int", {"x": 1}, "returned int, not a string"),
             ("missing", {}, "unknown tool 'missing'"), ("get_weather", "{not json", "not valid JSON"),
             ("get_weather", "[1, 2]", "must be a JSON object"), ("get_weather", {}, "missing required argument(s) city"),
             ("get_weather", {"city": "x", "colour": 1}, "unexpected keyword argument 'colour'")]
    for name, args, message in cases:
        result = call_tool(tools, name, args)
        assert result.error and message in result.content, (name, result)
    start = time.monotonic()
    result = call_tool(tools, "slow", {"x": 1}, timeout=0.2)
    assert result.error and result.timed_out and "within 0.2 s" in result.content and time.monotonic() - start < 2
    ok = call_tool(tools, "get_weather", '{"city": "Paris", "unit": "f"}')
    assert not ok.error and ok.content == "Paris: 21f None False"


def test_resolve_tool_specs():
    assert resolve_tool("calculator").name == "calculator"
    assert resolve_tool("tests.tools.test_functions:get_weather").name == "get_weather"
    for spec, match in [("", "built-in name"), ("nonsense", "not a built-in"), ("os:nothere", "no attribute 'nothere'"),
                        ("no_such_module_xyz:f", "cannot import no_such_module_xyz"), ("json:dumps", "no type hint")]:
        with pytest.raises(ValueError, match=match) as info:
            resolve_tool(spec)
        assert "\n" not in str(info.value)
