"""Reward functions for GRPO/PPO: TRL's convention, `f(prompts, completions, **columns) -> list[float | None]`.

`prompts` and `completions` hold one entry per completion (a prompt repeats for each of its G samples);
conversational rows get message lists (the completion as [{"role": "assistant", "content": text}]),
plain rows strings. `columns` are the dataset's other fields, each a list aligned the same way, plus
`completion_ids` (the sampled token ids). None means "does not apply to this row": a row's rewards are
summed with per-function weights over the functions that apply (NaN-sum, as TRL does).

Built-ins are registered by name (REWARDS); anything else is given as `module:function`.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Sequence
from fractions import Fraction

import numpy as np

from tunix_rt.tools.functions import import_object

log = logging.getLogger(__name__)

RewardFn = Callable[..., Sequence[float | None]]


def _text(completion) -> str:
    """The completion's text: a string as is; of a list of messages, what the assistant wrote (an agentic
    trajectory's tool results are not the policy's answer)."""
    if isinstance(completion, str):
        return completion
    return "\n".join(m.get("content") or "" for m in completion if m.get("role", "assistant") == "assistant")


_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_HASHES = re.compile(r"####\s*([^\n]+)")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def extract_answer(text: str) -> str | None:
    """The final answer a completion gives: the last \\boxed{...}, else the text after '####', else the
    last <answer>...</answer>, else its last number; None when it gives none."""
    for pattern in (_BOXED, _HASHES, _ANSWER_TAG):
        found = pattern.findall(text)
        if found:
            return found[-1].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _as_number(text: str) -> Fraction | None:
    cleaned = text.strip().rstrip(".").replace(",", "").replace("$", "").replace(" ", "")
    try:
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def answers_match(given: str, expected: str) -> bool:
    """Equal as numbers when both read as one (0.5 == 1/2 == .50, 1,000 == 1000), else as normalised text."""
    a, b = _as_number(given), _as_number(expected)
    if a is not None and b is not None:
        return a == b
    norm = lambda s: " ".join(s.strip().strip(".").lower().split())
    return norm(given) == norm(expected)


ANSWER_COLUMNS = ("answer", "solution", "ground_truth")


def accuracy_reward(prompts, completions, **columns) -> list[float | None]:
    """1.0 when the completion's final answer (extract_answer) equals the row's reference answer, exactly or
    as a number, else 0.0. The reference is the column "answer", "solution" or "ground_truth" (its own
    final answer is extracted the same way, so GSM8K's '#### 42' works); None for rows without one."""
    column = next((c for c in ANSWER_COLUMNS if c in columns), None)
    if column is None:
        raise ValueError(f"the accuracy reward needs a reference column: one of {', '.join(ANSWER_COLUMNS)}")
    out: list[float | None] = []
    for completion, reference in zip(completions, columns[column]):
        if reference is None:
            out.append(None)
            continue
        reference = str(reference)
        expected = extract_answer(reference) if ("####" in reference or "\\boxed" in reference) else reference
        given = extract_answer(_text(completion))
        out.append(float(given is not None and expected is not None and answers_match(given, expected)))
    return out


_THINK_FORMAT = re.compile(r"^\s*<think>(?:(?!<think>).)*?</think>\s*<answer>.*?</answer>\s*$", re.S)


def format_reward(prompts, completions, **columns) -> list[float]:
    """1.0 for completions of the form <think>...</think><answer>...</answer> (DeepSeek-R1's), else 0.0."""
    return [float(bool(_THINK_FORMAT.match(_text(c)))) for c in completions]


def brevity_reward(prompts, completions, completion_ids, **columns) -> list[float]:
    """-len(completion_ids) / 100: shorter is better (a reward any model can learn; for tests and demos)."""
    return [-len(ids) / 100.0 for ids in completion_ids]


REWARDS: dict[str, RewardFn] = {
    "accuracy": accuracy_reward,
    "math": accuracy_reward,
    "format": format_reward,
    "brevity": brevity_reward,
}


def resolve_reward(spec: str) -> tuple[str, RewardFn]:
    """(name, function) for a built-in name or `module:function` (or `path/to/file.py:function`)."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"a reward must be a built-in name ({', '.join(REWARDS)}) or module:function, got {spec!r}")
    if spec in REWARDS:
        return spec, REWARDS[spec]
    if ":" not in spec:
        raise ValueError(f"unknown reward {spec!r}: use a built-in ({', '.join(REWARDS)}) or module:function")
    fn = import_object(spec, "reward")
    if not callable(fn):
        raise ValueError(f"reward {spec!r}: {type(fn).__name__} is not a function")
    return spec, fn


class RewardError(ValueError):
    """A reward function raised, or returned something other than one number (or None) per completion."""


def score(rewards: Sequence[tuple[str, RewardFn]], weights: Sequence[float], prompts: list, completions: list,
          columns: dict[str, list]) -> tuple[np.ndarray, np.ndarray]:
    """(total (N,), per-function (F, N) with NaN where a function returned None): each function called once on
    the whole batch, its output checked, the total the weighted NaN-sum over the functions (0 where none
    applies)."""
    n = len(completions)
    per_fn = np.full((len(rewards), n), np.nan, np.float64)
    for f, (name, fn) in enumerate(rewards):
        try:
            values = fn(prompts, completions, **columns)
        except Exception as e:
            raise RewardError(f"reward function {name!r} raised {type(e).__name__}: {e}") from e
        try:
            values = list(values)
        except TypeError:
            raise RewardError(f"reward function {name!r} must return a list of {n} floats (or None), "
                              f"got {type(values).__name__}") from None
        if len(values) != n:
            raise RewardError(f"reward function {name!r} returned {len(values)} values for {n} completions")
        for i, v in enumerate(values):
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not math.isfinite(v):
                raise RewardError(f"reward function {name!r} returned {v!r} for completion {i}: "
                                  "rewards must be finite numbers or None")
            per_fn[f, i] = float(v)
    weighted = per_fn * np.asarray(weights, np.float64)[:, None]
    unscored = np.isnan(per_fn).all(axis=0)
    if unscored.any():  # TRL's rule: such a completion's reward is 0, and the user is told
        log.warning("%d of %d completions got None from every reward function; their reward is 0",
                    int(unscored.sum()), n)
    return np.nansum(weighted, axis=0), per_fn


class RewardScorer:
    """The run's reward functions and their weights: scores a rollout's completions and reports the rewards'
    statistics (total and per function)."""

    def __init__(self, rewards: Sequence[tuple[str, RewardFn]], weights: Sequence[float] | None = None):
        if not rewards:
            raise ValueError("GRPO/PPO need at least one reward: give --reward NAME or module:function, or --reward-model PATH")
        self.rewards = list(rewards)
        self.weights = tuple(weights) if weights is not None else (1.0,) * len(self.rewards)
        if len(self.weights) != len(self.rewards):
            raise ValueError(f"reward_weights has {len(self.weights)} weights for {len(self.rewards)} reward functions")

    def __call__(self, prompts: list, completions: list, columns: dict[str, list]) -> tuple[np.ndarray, np.ndarray]:
        """(total (N,), per-function (F, N)): see `score`."""
        return score(self.rewards, self.weights, prompts, completions, columns)

    def metrics(self, total: np.ndarray, per_fn: np.ndarray) -> dict[str, float]:
        out = {"reward": float(total.mean()), "reward_std": float(total.std())}
        for (name, _), values in zip(self.rewards, per_fn):
            seen = values[~np.isnan(values)]
            if len(seen):
                out[f"rewards/{name}/mean"] = float(seen.mean())
                out[f"rewards/{name}/std"] = float(seen.std())
        return out
