"""Selection at test time (sample many, verify, keep the best): of N samples of one prompt, the one a reward model
scores highest (best-of-N), or one giving the answer most samples agree on (self-consistency: majority vote over
the final answers the math reward extracts, numbers compared as numbers)."""

from __future__ import annotations

import dataclasses
from collections import Counter

from tunix_rt.train.rewards import _as_number, extract_answer


@dataclasses.dataclass(frozen=True)
class Selection:
    index: int  # the chosen sample
    scores: list[float]  # per sample: the reward model's score, or the votes its answer got


def by_reward(prompt, completions: list[str], reward) -> Selection:
    """The sample `reward` (train/reward_model_reward.RewardModelReward, or any TRL-style reward function) scores
    highest; `prompt` is the text or the messages the samples answer (the first of equal scores wins)."""
    if not completions:
        raise ValueError("no samples to select from")
    scores = [float(s) for s in reward([prompt] * len(completions), completions)]
    return Selection(max(range(len(scores)), key=lambda i: (scores[i], -i)), scores)


def _key(answer: str | None):
    if answer is None:
        return None
    number = _as_number(answer)
    return ("number", number) if number is not None else ("text", answer.strip())


def by_majority(completions: list[str]) -> Selection:
    """The first sample whose final answer most samples give (samples with no answer vote for nothing; with no
    answer at all, the first sample)."""
    if not completions:
        raise ValueError("no samples to select from")
    keys = [_key(extract_answer(c)) for c in completions]
    votes = Counter(k for k in keys if k is not None)
    scores = [float(votes[k]) if k is not None else 0.0 for k in keys]
    return Selection(max(range(len(scores)), key=lambda i: (scores[i], -i)), scores)
