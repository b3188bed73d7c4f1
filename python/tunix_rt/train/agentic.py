"""Agentic rollouts for GRPO and PPO: G multi-turn trajectories per prompt through the embedded engine, each
acting on an environment of its own (tools/environment.py), scored by the run's rewards.

A trajectory grows as token ids, never as re-rendered text: the ids the policy sampled in each turn are
kept verbatim (re-tokenising text after the fact silently trains on ids the policy never sampled), and
between two turns only what the chat template writes there is rendered and tokenised alone: the rest of
the turn's closing, the observations (tool results) and the next assistant header (tools.chat.continuation).
Those spliced tokens carry no loss (Completions.sampled). Every trajectory of the rollout runs concurrently:
each turn is a request to the engine (continuous batching across all of them; a later turn's prompt is
the conversation so far, whose KV the prefix cache still holds), and the environments' steps (tool calls)
run in worker threads while the engine decodes the others.

Limits, each of which ends a trajectory as truncated: `max_completion_length` tokens after the prompt (the
policy's and the spliced ones together), `max_turns` assistant turns (TRL's max_tool_calling_iterations),
and `max_tool_time` seconds in the environment's steps.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Sequence

import numpy as np

from tunix_rt.tools.chat import continuation, render_chat, turn_closing
from tunix_rt.tools.environment import ToolEnvironment, close_environment
from tunix_rt.tools.functions import Tool, as_tool
from tunix_rt.tools.tool_calls import ToolFormat, tool_format_for
from tunix_rt.train.config import RLConfig
from tunix_rt.train.data import DataError, PromptExample, load_prompts
from tunix_rt.train.rewards import RewardScorer
from tunix_rt.train.rollout import Completions, GroupSampler

log = logging.getLogger("tunix_rt.train")
_POLL_SECONDS = 0.5  # how often an idle rollout checks its environment steps' time
_GRACE_SECONDS = 1.0  # past max_tool_time, before a step still running is given up


class Agents:
    """How the run's environments are made and spoken to: the factory, the --tool tools, the chat template's
    tool-call format and the tool-time limit."""

    def __init__(self, factory: Callable[[], object], tools: Sequence[Tool], tokenizer, max_tool_time: float):
        self.factory, self.tools, self.tokenizer, self.max_tool_time = factory, list(tools), tokenizer, max_tool_time
        self.format: ToolFormat = tool_format_for(tokenizer.chat_template)
        self.closing = turn_closing(tokenizer, self.format)  # a template that cannot grow a conversation fails here

    def make(self):
        """A fresh environment, bound to the run's tools (a ToolEnvironment)."""
        env = self.factory()
        if isinstance(env, ToolEnvironment):
            env.bind(self.tools, self.format, self.max_tool_time)
        return env

    @staticmethod
    def schemas(env) -> list[dict]:
        return [as_tool(t).schema() for t in getattr(env, "tools", ()) or ()]

    def opening(self, env, row: dict, where: str) -> tuple[list[dict], list[int]]:
        """The environment's opening messages for `row` and their token ids (the chat template's, with the
        tools and the generation prompt)."""
        try:
            messages = env.reset(row)
        except Exception as e:  # noqa: BLE001 - the environment's problem with this row, named as such
            raise DataError(f"{where}: the environment's reset raised {type(e).__name__}: {e}") from None
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) and "role" in m
                                                                      for m in messages):
            raise DataError(f"{where}: the environment's reset must return a non-empty list of messages, "
                            f"got {messages!r:.200}")
        text = render_chat(self.tokenizer, messages, self.format, self.schemas(env) or None)
        return messages, self.tokenizer.encode(text, add_special_tokens=False)

    def load_prompts(self, path, *, max_prompt_length: int) -> list[PromptExample]:
        """The dataset's rows, each opened by an environment (made for it, then dropped): the prompt ids the
        rollouts start from, checked against max_prompt_length (no truncation: the template's text must stay
        whole). The row's "prompt" (None without one: an environment may open from other columns) is what the
        reward functions get as the prompt."""

        def tokenize(row: dict, tokenizer, *, max_prompt_length: int, where: str) -> PromptExample:
            env = self.make()
            try:
                messages, ids = self.opening(env, row, where)
            finally:
                close_environment(env)
            if len(ids) > max_prompt_length:
                raise DataError(f"{where}: the opening conversation has {len(ids)} tokens, over max_prompt_length "
                                f"({max_prompt_length})")
            return PromptExample(np.asarray(ids, np.int32), row.get("prompt"), {k: v for k, v in row.items() if k != "prompt"})

        return load_prompts(path, self.tokenizer, max_prompt_length=max_prompt_length, tokenize=tokenize)


@dataclasses.dataclass
class _Trajectory:
    example: PromptExample
    position: int  # its prompt's position in the rollout (seeds)
    sample: int  # its number in the group
    env: object
    tools: list[dict]
    history: list[dict]  # the conversation as the template renders it: assistant turns as the policy wrote them
    messages: list[dict] = dataclasses.field(default_factory=list)  # the completion as reward functions see it
    ids: list[int] = dataclasses.field(default_factory=list)
    sampled: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    stop_text: str = ""
    turns: int = 0
    tool_calls: int = 0
    tool_seconds: float = 0.0
    truncated: bool = False


def environment_reward(prompts, completions, environment_reward, **columns) -> list[float | None]:
    """The environments' own rewards (their reward() at the episode's end), as a reward function."""
    return list(environment_reward)


class AgenticSampler(GroupSampler):
    """GroupSampler's interface (sample, metrics, seq_len) over multi-turn trajectories."""

    def __init__(self, cfg: RLConfig, examples: Sequence[PromptExample], scorer: RewardScorer, agents: Agents):
        super().__init__(cfg, examples, scorer)
        self.agents = agents
        self.tokenizer = agents.tokenizer
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="environment")
        self._rollout_stats: dict[str, float] = {}

    @functools.cached_property
    def _eos(self) -> frozenset[int]:
        return frozenset(self.tokenizer.eos_token_ids)

    def _start(self, example: PromptExample, position: int, sample: int) -> _Trajectory:
        env = self.agents.make()
        row = {"prompt": example.prompt, **example.columns}
        messages, ids = self.agents.opening(env, row, f"rollout row {position}")
        if ids != example.prompt_ids.tolist():
            raise ValueError("the environment's reset returned another opening for a row than it did at load time: "
                             "reset(row) must be a function of the row (the G trajectories of a group share it)")
        return _Trajectory(example, position, sample, env, self.agents.schemas(env), list(messages))

    def _timed_step(self, traj: _Trajectory, message: dict):
        start = time.perf_counter()
        try:
            out = traj.env.step(message)
        except Exception as e:  # an environment's bug is the run's error, named as such
            raise RuntimeError(f"the environment's step raised {type(e).__name__}: {e}") from e
        return out, time.perf_counter() - start

    def _end_turn(self, traj: _Trajectory, out) -> dict | None:
        """Record a finished turn; returns the message to step the environment with, or None when the
        trajectory ends here."""
        traj.turns += 1
        traj.ids += out.token_ids
        traj.sampled += [1] * len(out.token_ids)
        traj.logprobs += list(out.logprobs or [0.0] * len(out.token_ids))
        parsed = self.agents.format.parse(out.text, traj.tools, strict=False)
        message: dict = {"role": "assistant", "content": parsed.content}
        if parsed.calls:
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name,
                                                                                   "arguments": c.arguments}}
                                     for c in parsed.calls]
        traj.tool_calls += len(parsed.calls)
        traj.messages.append(message)
        traj.history.append({"role": "assistant", "content": out.text})
        if out.finish_reason != "stop":  # the token budget ran out (or the request was aborted)
            traj.truncated = True
            return None
        last = out.token_ids[-1] if out.token_ids else None
        traj.stop_text = self.tokenizer.decode([last], skip_special_tokens=False) if last in self._eos else ""
        if parsed.calls and traj.turns >= self.cfg.max_turns:  # it wants another turn it may not have
            traj.truncated = True
            return None
        return message

    def _observe(self, traj: _Trajectory, result) -> bool:
        """Splice the environment's answer into the trajectory; True when the policy takes another turn."""
        (observations, done), seconds = result
        traj.tool_seconds += seconds
        if not isinstance(observations, list) or not all(isinstance(m, dict) and "role" in m for m in observations):
            raise RuntimeError(f"the environment's step must return (a list of messages, done), got {observations!r:.200}")
        traj.messages += observations
        if done:
            return False
        if traj.turns >= self.cfg.max_turns or traj.tool_seconds > self.cfg.max_tool_time or not observations:
            traj.truncated = True
            return False
        try:
            text = continuation(self.tokenizer, self.agents.format, traj.tools or None, traj.history, observations,
                                stop_text=traj.stop_text, closing=self.agents.closing)
        except ValueError as e:  # the template re-renders what the policy wrote: the trajectory cannot go on as ids
            log.warning("a trajectory ends early: %s", e)
            traj.truncated = True
            return False
        traj.history += observations
        spliced = self.tokenizer.encode(text, add_special_tokens=False)
        if len(traj.ids) + len(spliced) >= self.cfg.max_completion_length:  # no room left for a sampled token
            traj.truncated = True
            return False
        traj.ids += spliced
        traj.sampled += [0] * len(spliced)
        traj.logprobs += [0.0] * len(spliced)
        return True

    def _drop_overdue(self, steps: dict, ready: list) -> int:
        """Give up on environment steps running past their trajectory's tool time (a thread cannot be killed: its
        result is dropped), each trajectory truncated; returns how many ended."""
        now, ended = time.perf_counter(), 0
        for future in [f for f in steps if f not in ready]:
            traj, started = steps[future]
            if now - started > self.cfg.max_tool_time - traj.tool_seconds + _GRACE_SECONDS:
                del steps[future]
                traj.tool_seconds += now - started
                traj.truncated = True
                log.warning("an environment step ran past max_tool_time (%.0f s): its trajectory ends",
                            self.cfg.max_tool_time)
                ended += 1
        return ended

    def sample(self, rollout, prompt_indices: np.ndarray, stream: int = 0) -> Completions:
        """G trajectories of each prompt, all running at once (see the module), scored by the reward functions."""
        cfg, g = self.cfg, self.cfg.num_generations
        engine = rollout.live()
        start, before = time.perf_counter(), engine.stats()
        waiting: dict[str, list[_Trajectory]] = {}
        trajectories: list[_Trajectory] = []
        steps: dict[concurrent.futures.Future, tuple[_Trajectory, float]] = {}  # -> (trajectory, started)
        try:
            for position, index in enumerate(prompt_indices):
                example = self.examples[index]
                for k in range(g):
                    trajectories.append(self._start(example, position, k))
                rid = engine.add_request(example.prompt_ids.tolist(),
                                         self._params(g, cfg.max_completion_length, rollout.seed(position, stream)))
                waiting[rid] = trajectories[-g:]
            active = len(trajectories)
            while active:
                if engine.has_unfinished_requests():
                    for out in engine.step():
                        if not out.finished:
                            continue
                        group = waiting.get(out.request_id)
                        if group is None:  # another caller's request on the engine
                            continue
                        traj = group[out.index]
                        message = self._end_turn(traj, out)
                        if message is None:
                            active -= 1
                        else:
                            steps[self._pool.submit(self._timed_step, traj, message)] = (traj, time.perf_counter())
                ready = [f for f in steps if f.done()]
                if not ready and steps and not engine.has_unfinished_requests():
                    ready = list(concurrent.futures.wait(steps, timeout=_POLL_SECONDS,
                                                         return_when=concurrent.futures.FIRST_COMPLETED).done)
                active -= self._drop_overdue(steps, ready)
                for future in ready:
                    traj, _ = steps.pop(future)
                    if not self._observe(traj, future.result()):
                        active -= 1
                        continue
                    prompt = traj.example.prompt_ids.tolist() + traj.ids
                    seed = rollout.seed(traj.position, stream, traj.sample, traj.turns)
                    rid = engine.add_request(prompt, self._params(1, cfg.max_completion_length - len(traj.ids), seed))
                    waiting[rid] = [traj]
        except BaseException:
            for rid in waiting:
                engine.abort(rid)
            for future in steps:
                future.cancel()
            for traj in trajectories:
                with contextlib.suppress(Exception):  # the error being raised is the one to report
                    close_environment(traj.env)
            raise
        after = engine.stats()
        queries = after.prefix_cache_queries - before.prefix_cache_queries
        tool_time = sum(t.tool_seconds for t in trajectories)
        self._rollout_stats = {
            "agentic/prefix_cache_hit_rate": (after.prefix_cache_hits - before.prefix_cache_hits) / max(queries, 1),
            "time/tools": tool_time}
        rollout.times["time/rollout"] += time.perf_counter() - start
        try:
            return self._completions(trajectories)
        finally:
            for traj in trajectories:
                close_environment(traj.env)

    @staticmethod
    def _env_reward(env) -> float | None:
        if not callable(getattr(env, "reward", None)):
            return None
        try:
            return env.reward()
        except Exception as e:  # an environment's bug is the run's error, named as such
            raise RuntimeError(f"the environment's reward raised {type(e).__name__}: {e}") from e

    def _completions(self, trajectories: list[_Trajectory]) -> Completions:
        prompts = [t.example for t in trajectories]
        token_ids = [np.asarray(t.ids, np.int32) for t in trajectories]
        columns = self._columns(prompts, [t.ids for t in trajectories])
        if any(callable(getattr(t.env, "reward", None)) for t in trajectories):
            columns["environment_reward"] = [self._env_reward(t.env) for t in trajectories]
        total, per_fn = self.scorer([p.prompt for p in prompts], [t.messages for t in trajectories], columns)
        results = [t.env.results if isinstance(t.env, ToolEnvironment) else [] for t in trajectories]
        stats = {"turns": [t.turns for t in trajectories], "tool_calls": [t.tool_calls for t in trajectories],
                 "tool_errors": [sum(r.error for r in rs) for rs in results],
                 "tool_timeouts": [sum(r.timed_out for r in rs) for rs in results],
                 "tool_seconds": [t.tool_seconds for t in trajectories]}
        return Completions(prompts, token_ids, [np.asarray(t.logprobs, np.float32) for t in trajectories],
                           np.array([t.truncated for t in trajectories]), total, per_fn,
                           [np.asarray(t.sampled, np.int8) for t in trajectories],
                           {k: np.asarray(v, np.float64) for k, v in stats.items()})

    def metrics(self, c: Completions) -> dict[str, float]:
        """GroupSampler's (completions/clipped_ratio: the truncated fraction), and per trajectory: turns, tool
        calls (and the fraction that makes any), tool errors and timeouts, tool seconds and the mean reward by
        turn count; the rollout's prefix-cache hit rate and its seconds in environment steps, summed over the
        trajectories (time/tools: they overlap each other and the engine's decoding)."""
        out = super().metrics(c)
        s = c.stats
        out.update({f"agentic/{name}": float(s[name].mean()) for name in s})
        out["agentic/tool_call_rate"] = float((s["tool_calls"] > 0).mean())
        for turns in np.unique(s["turns"]).astype(int):
            out[f"agentic/reward_turns_{turns}"] = float(c.rewards[s["turns"] == turns].mean())
        out.update(self._rollout_stats)
        return out


def agentic_sampler(cfg: RLConfig, tokenizer, data: str, rewards: list, factory: Callable[[], object],
                    tools: Sequence[Tool]) -> AgenticSampler:
    """The run's sampler: its prompts opened by the environments, the environments' own rewards (when they
    give one) scored beside the run's reward functions."""
    agents = Agents(factory, tools, tokenizer, cfg.max_tool_time)
    probe = agents.make()
    if callable(getattr(probe, "reward", None)):
        rewards = [*rewards, ("environment", environment_reward)]
    close_environment(probe)
    weights = None if cfg.reward_weights is None else (*cfg.reward_weights, 1.0)[:len(rewards)]
    scorer = RewardScorer(rewards, weights)
    return AgenticSampler(cfg, agents.load_prompts(data, max_prompt_length=cfg.max_prompt_length), scorer, agents)

