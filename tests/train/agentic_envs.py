"""Environments the agentic RL tests name on the command line (`--env tests.train.agentic_envs:Name`)."""

from __future__ import annotations

from tunix_rt.tools.environment import ToolEnvironment


class Again:
    """Answers every turn with a tool result, so a trajectory lasts max_turns whatever the policy writes; its
    reward is the number of turns it saw. Counts the environments closed."""

    closed = 0

    def reset(self, row):
        self.turns = 0
        return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": row["prompt"]}]

    def step(self, message):
        self.turns += 1
        return [{"role": "tool", "content": f"again {self.turns}"}], False

    def reward(self):
        return float(self.turns)

    def close(self):
        Again.closed += 1


class Sleepy(Again):
    """Takes 3 s to answer: past a short max_tool_time."""

    def step(self, message):
        import time

        time.sleep(3)
        return super().step(message)


def multiply(a: int, b: int) -> str:
    """Multiply two integers.

    Args:
        a: the first.
        b: the second.
    """
    return str(a * b)


class Calculating(ToolEnvironment):
    """The default environment with a tool of its own and an opening of its own: what `--env` plus `--tool` make."""

    tools = [multiply]

    def reset(self, row):
        return [{"role": "user", "content": f"{row['prompt']} Use the calculator."}]


class Broken:
    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, message):
        raise KeyError("no such state")
