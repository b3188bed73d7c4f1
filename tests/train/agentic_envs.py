"""Environments the agentic RL tests name on the command line (`--env tests.train.agentic_envs:Name`)."""

from __future__ import annotations

from tunix_rt.tools.environment import ToolEnvironment


class Again:
    """Answers every turn with a tool result, so a trajectory lasts max_turns whatever the policy writes; its
    reward is the number of turns it saw."""

    def reset(self, row):
        self.turns = 0
        return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": row["prompt"]}]

    def step(self, message):
        self.turns += 1
        return [{"role": "tool", "content": f"again {self.turns}"}], False

    def reward(self):
        return float(self.turns)


class Calculating(ToolEnvironment):
    """The default environment with a tool of its own: what `--env` plus `--tool` make."""

    def reset(self, row):
        return [{"role": "user", "content": f"{row['prompt']} Use the calculator."}]


class Broken:
    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, message):
        raise KeyError("no such state")
