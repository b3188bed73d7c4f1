"""tunix_rt.tools.environment and the turn-by-turn rendering agentic RL relies on (tools.chat.continuation):
the default ToolEnvironment runs calls and turns every failure into an error observation, environments and
tools named on the command line resolve or fail in one line, and a conversation grows by exactly the text
the chat template writes between two turns."""

from __future__ import annotations

import json

import pytest

from tests.models.hf_tiny import TEMPLATE, write_tiny_tokenizer
from tunix_rt.checkpoints.tokenizer import Tokenizer
from tunix_rt.tools.chat import continuation, render_chat, turn_closing
from tunix_rt.tools.environment import ToolEnvironment, environment_factory, resolve_environment
from tunix_rt.tools.functions import calculator, tool_from_callable
from tunix_rt.tools.tool_calls import ToolFormat

HERMES = ToolFormat("hermes", native=False)
LLAMA3 = ToolFormat("llama3_json", native=True)


def call(name, arguments, call_id="c1"):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def fails(x: int) -> str:
    """Always raises.

    Args:
        x: ignored.
    """
    raise RuntimeError(f"boom {x}")


def not_text(x: int) -> str:
    """Returns a number, not a string.

    Args:
        x: returned.
    """
    return x


def env(*tools, fmt=HERMES, max_tool_time=30.0) -> ToolEnvironment:
    e = ToolEnvironment()
    e.bind([tool_from_callable(t) for t in tools], fmt, max_tool_time)
    return e


def test_calls_run_and_a_turn_without_calls_ends_the_episode():
    e = env(calculator)
    assert e.reset({"prompt": "What is 2 * 3?"}) == [{"role": "user", "content": "What is 2 * 3?"}]
    out, done = e.step({"role": "assistant", "content": "", "tool_calls": [
        call("calculator", '{"expression": "123 * 456"}'), call("calculator", '{"expression": "1 / 0"}', "c2")]})
    assert not done
    assert out[0] == {"role": "tool", "tool_call_id": "c1", "name": "calculator", "content": "56088"}
    assert out[1]["tool_call_id"] == "c2" and out[1]["content"].startswith("Error: calculator raised ValueError")
    assert [r.error for r in e.results] == [False, True]
    assert e.step({"role": "assistant", "content": "56088"}) == ([], True)


@pytest.mark.parametrize("message, error", [
    ({"tool_calls": [call("fails", '{"x": 1}')]}, "Error: fails raised RuntimeError: boom 1"),
    ({"tool_calls": [call("not_text", '{"x": 1}')]}, "Error: not_text returned int, not a string"),
    ({"tool_calls": [call("nonesuch", "{}")]}, "Error: unknown tool 'nonesuch'"),
    ({"tool_calls": [call("fails", '{"y": 1}')]}, "Error: calling fails: missing required argument"),
    ({"tool_calls": [call("fails", "{not json")]}, "Error: calling fails: the arguments are not valid JSON"),
    ({"content": '<tool_call>\n{"name": "fails", "arguments": {"x": 1}\n</tool_call>'}, "could not be read"),
])
def test_every_failure_is_an_error_observation_and_the_episode_goes_on(message, error):
    e = env(fails, not_text)
    out, done = e.step({"role": "assistant", "content": "", **message})
    assert not done and len(out) == 1 and out[0]["content"].startswith("Error") and error in out[0]["content"]
    assert e.results[-1].error


def test_a_malformed_llama3_call_is_an_error_observation():
    out, done = env(calculator, fmt=LLAMA3).step({"role": "assistant", "content": '{"name": "calculator", '})
    assert not done and "could not be read" in out[0]["content"]


def test_the_tool_time_budget_times_out_a_call_then_refuses_more():
    import time

    def slow(seconds: float) -> str:
        """Sleeps.

        Args:
            seconds: how long.
        """
        time.sleep(seconds)
        return "done"

    e = env(slow, max_tool_time=0.3)
    out, _ = e.step({"role": "assistant", "tool_calls": [call("slow", '{"seconds": 5}')]})
    assert "did not finish within 0.3 s" in out[0]["content"] and e.results[-1].timed_out
    out, _ = e.step({"role": "assistant", "tool_calls": [call("slow", '{"seconds": 0}')]})
    assert "tool time is used up" in out[0]["content"]


class Opening(ToolEnvironment):
    tools = [calculator]

    def reset(self, row):
        return [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": row["question"]}]


class NoStep:
    def reset(self, row):
        return []


def test_environment_specs_resolve_or_fail_in_one_line():
    assert resolve_environment(f"{__name__}:Opening") is Opening
    factory, tools = environment_factory(f"{__name__}:Opening", ["calculator"])
    assert factory is Opening and [t.name for t in tools] == ["calculator"]
    e = factory()
    e.bind(tools, HERMES)
    assert [t.name for t in e.tools] == ["calculator"]  # one per name: its own
    e = factory()
    e.tools = [fails]  # set on the instance
    e.bind(tools, HERMES)
    assert [t.name for t in e.tools] == ["fails", "calculator"]  # its own, then the run's
    for spec, message in [("nonesuch", "give module:Factory"), ("no_such_module_xyz:F", "cannot import"),
                          (f"{__name__}:Missing", "has no attribute 'Missing'"),
                          (f"{__name__}:HERMES", "is not a class or function"),
                          (f"{__name__}:NoStep", "has no step method"),
                          (f"{__name__}:fails", "calling it raised TypeError")]:
        with pytest.raises(ValueError, match=message) as info:
            resolve_environment(spec)
        assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="must subclass tunix_rt.tools.environment.ToolEnvironment"):
        environment_factory(f"{__name__}:NoStepButReset", ["calculator"])
    with pytest.raises(ValueError, match="--tool 'nonesuch'"):
        environment_factory(None, ["nonesuch"])


class NoStepButReset:
    def reset(self, row):
        return [{"role": "user", "content": "hi"}]

    def step(self, message):
        return [], True


# --- growing a conversation turn by turn ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer(d)
    return Tokenizer.from_hf_dir(d)


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


# the tiny template with a generation prompt that ends as its assistant messages begin ("assistant: ")
SPACED = TEMPLATE.replace("}}assistant:{%", "}}assistant: {%")


@pytest.mark.parametrize("template, stop", [(SPACED, "</s>"), (CHATML, "<|im_end|>")])
def test_continuation_is_exactly_what_the_template_writes_between_turns(tiny_tokenizer, template, stop):
    tok = Tokenizer(tiny_tokenizer.backend, bos_token="<s>", eos_token="</s>", chat_template=template)
    tools = [tool_from_callable(calculator).schema()]
    opening = [{"role": "user", "content": "What is 2 * 3?"}]
    reply = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 * 3"}}\n</tool_call>'
    observations = [{"role": "tool", "tool_call_id": "c1", "content": "6"}]
    history = opening + [{"role": "assistant", "content": reply}]
    text = continuation(tok, HERMES, tools, history, observations, stop_text=stop)
    # the prompt, then the reply and the stop token as sampled, then the continuation: the whole conversation
    # rendered at once
    whole = render_chat(tok, history + observations, HERMES, tools)
    assert render_chat(tok, opening, HERMES, tools) + reply + stop + text == whole
    assert "<tool_response>\n6\n</tool_response>" in text
    closing = turn_closing(tok, HERMES)
    assert closing.startswith(stop)
    # a turn that ended on another token (a second end token, a stop id) gets the whole closing
    assert continuation(tok, HERMES, tools, history, observations, stop_text="<pad>") == closing + text[
        len(closing) - len(stop):]


def test_continuation_refuses_a_template_that_rewrites_earlier_turns(tiny_tokenizer):
    # only the last message is shown: a later render is no extension of an earlier one
    tok = Tokenizer(tiny_tokenizer.backend, bos_token="<s>", eos_token="</s>",
                    chat_template="{{ messages[-1]['role'] }}: {{ messages[-1]['content'] }}</s>")
    history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    with pytest.raises(ValueError, match="cannot grow turn by turn"):
        continuation(tok, HERMES, None, history, [{"role": "user", "content": "c"}], stop_text="</s>")


def test_parse_reads_calls_of_any_name_when_not_strict():
    text = 'ok <tool_call>\n{"name": "nonesuch", "arguments": {"a": 1}}\n</tool_call>'
    strict, loose = HERMES.parse(text, []), HERMES.parse(text, [], strict=False)
    assert strict.calls == [] and HERMES.attempted_call(strict.content)
    assert [(c.name, json.loads(c.arguments)) for c in loose.calls] == [("nonesuch", {"a": 1})]
    assert loose.content == "ok"
