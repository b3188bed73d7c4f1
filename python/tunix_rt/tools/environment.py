"""Environments of agentic RL: what a policy's turns act on.

An environment is made fresh for every trajectory by a factory (a class or function of no arguments, TRL's
environment_factory shape; `--env module:Factory`) and follows a small protocol:
- `reset(row) -> messages`: the opening conversation for a dataset row (a function of the row: the G
  trajectories of a group share it);
- `step(message) -> (observations, done)`: the policy's assistant message (OpenAI's shape: content and
  tool_calls) in, the messages it gets back and whether the episode is over;
- optional `tools` (callables or Tools): what the chat template tells the policy it may call;
- optional `reward() -> float | None`: a reward at the episode's end, beside the run's reward functions;
- optional `close()`: called once the episode is scored (or the rollout fails), to free what it holds.

ToolEnvironment is the default (`--tool` alone) and a base class: the row's prompt opens, every call the
policy makes runs (tools.functions.call_tool: nothing a tool or the model does raises), a turn without calls
ends the episode. Subclass it to open differently, keep state or judge the last turn.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from tunix_rt.tools.functions import Tool, ToolResult, as_tool, call_tool, import_object, resolve_tool
from tunix_rt.tools.tool_calls import ToolFormat


class ToolEnvironment:
    """Runs the policy's tool calls; the episode ends on a turn that makes none."""

    tools: Sequence = ()

    def bind(self, tools: Sequence[Tool], fmt: ToolFormat, max_tool_time: float = math.inf) -> None:
        """Called by the rollout before reset: the run's --tool tools join the environment's own (one tool per
        name: the environment's win), the tool-call format tells a malformed call from text, and `max_tool_time`
        caps the tool seconds of the episode."""
        own = [as_tool(t) for t in vars(self).get("tools", type(self).tools)]
        names = {t.name for t in own}
        self.tools = [*own, *(t for t in tools if t.name not in names)]
        self.format = fmt
        self.tool_time_left = max_tool_time
        self.results: list[ToolResult] = []

    def reset(self, row: dict) -> list[dict]:
        prompt = row.get("prompt")
        if isinstance(prompt, str):
            return [{"role": "user", "content": prompt}]
        if isinstance(prompt, list):
            return list(prompt)
        raise ValueError(f'the row\'s "prompt" must be a string or a list of messages, got {type(prompt).__name__}')

    def step(self, message: dict) -> tuple[list[dict], bool]:
        calls = message.get("tool_calls") or []
        if not calls:
            if self.format.attempted_call(message.get("content") or ""):
                result = ToolResult("Error: the tool call could not be read: write one JSON object with \"name\" and "
                                    "\"arguments\" inside <tool_call></tool_call>" if self.format.name == "hermes" else
                                    "Error: the tool call could not be read: write one JSON object with \"name\" and "
                                    "\"parameters\"", error=True)
                self.results.append(result)
                return [{"role": "tool", "content": result.content}], False
            return [], True
        by_name = {t.name: t for t in self.tools}
        out = []
        for call in calls:
            name = call["function"]["name"]
            if self.tool_time_left <= 0:
                result = ToolResult(f"Error: {name} was not run: the episode's tool time is used up", True, True)
            else:
                result = call_tool(by_name, name, call["function"].get("arguments", "{}"),
                                   timeout=min(self.tool_time_left, 3600.0))
                self.tool_time_left -= result.seconds
            self.results.append(result)
            out.append({"role": "tool", "tool_call_id": call.get("id"), "name": name, "content": result.content})
        return out, False


def close_environment(env) -> None:
    """The environment's close(), when it has one; what it raises is the run's error, named as such."""
    close = getattr(env, "close", None)
    if callable(close):
        try:
            close()
        except Exception as e:  # noqa: BLE001
            raise RuntimeError(f"the environment's close raised {type(e).__name__}: {e}") from e


def resolve_environment(spec: str) -> Callable[[], object]:
    """The factory `--env module:Factory` (or `file.py:Factory`) names, checked to make an environment with
    reset and step; a bad spec is a ValueError whose one line names it."""
    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError(f"--env {spec!r}: give module:Factory (a class or function making an environment)")
    factory = import_object(spec, "--env")
    if not callable(factory):
        raise ValueError(f"--env {spec!r}: {type(factory).__name__} is not a class or function")
    try:
        env = factory()
    except Exception as e:  # noqa: BLE001 - whatever the factory raises is the spec's problem
        raise ValueError(f"--env {spec!r}: calling it raised {type(e).__name__}: {e}") from None
    missing = [m for m in ("reset", "step") if not callable(getattr(env, m, None))]
    close_environment(env)
    if missing:
        raise ValueError(f"--env {spec!r}: what it makes has no {' and no '.join(missing)} method")
    return factory


def environment_factory(env: str | None, tools: Sequence[str]) -> tuple[Callable[[], object], list[Tool]]:
    """The run's factory (`--env`'s, else ToolEnvironment) and its --tool tools, resolved here so a bad spec
    fails before any model loads. With --tool, the environments must be ToolEnvironments (they run the calls)."""
    resolved = [resolve_tool(spec) for spec in tools]
    factory = ToolEnvironment if env is None else resolve_environment(env)
    probe = factory()
    runs_calls = isinstance(probe, ToolEnvironment)
    close_environment(probe)
    if resolved and not runs_calls:
        raise ValueError(f"--tool with --env {env!r}: its environment must subclass "
                         "tunix_rt.tools.environment.ToolEnvironment to run the tools' calls")
    return factory, resolved
