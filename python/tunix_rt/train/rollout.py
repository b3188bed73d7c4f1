"""Rollouts for GRPO and PPO: prompts -> G completions each through the embedded engine, scored by the
run's rewards (rewards.RewardScorer); group_packing.py turns them into fixed-shape training rows.

The engine samples every prompt's G completions as one request with n = G, so they share the prompt's
KV blocks (prefix caching).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from tunix_rt.engine.params import SamplingParams
from tunix_rt.train.config import RLConfig
from tunix_rt.train.data import PromptExample
from tunix_rt.train.rewards import RewardScorer


@dataclasses.dataclass
class Completions:
    """G completions per prompt, adjacent: row i belongs to prompt i // G."""

    prompts: list[PromptExample]  # one per row (repeated G times)
    token_ids: list[np.ndarray]
    logprobs: list[np.ndarray]  # the engine's log p of each sampled token (as its logprobs_mode reports)
    truncated: np.ndarray  # (N,) bool: cut by a limit before it ended (max_completion_length; agentic: max_turns...)
    rewards: np.ndarray  # (N,) weighted total
    rewards_per_fn: np.ndarray  # (F, N), NaN where a function returned None
    # Per token, 1 where the policy sampled it and 0 where it was spliced in (an agentic trajectory's tool
    # results and template text, train/agentic.py); None: every token was sampled.
    sampled: list[np.ndarray] | None = None
    stats: dict[str, np.ndarray] | None = None  # per-row figures of the sampler's own (N,) each, e.g. turns

    def __len__(self) -> int:
        return len(self.token_ids)

    def sampled_mask(self, i: int) -> np.ndarray:
        """Completion i's per-token mask of sampled tokens (float32 ones without splices)."""
        if self.sampled is None:
            return np.ones(len(self.token_ids[i]), np.float32)
        return self.sampled[i].astype(np.float32)

    def select(self, rows: np.ndarray) -> Completions:
        take = lambda xs: [xs[i] for i in rows]
        return Completions(take(self.prompts), take(self.token_ids), take(self.logprobs),
                           self.truncated[rows], self.rewards[rows], self.rewards_per_fn[:, rows],
                           None if self.sampled is None else take(self.sampled),
                           None if self.stats is None else {k: v[rows] for k, v in self.stats.items()})

    @staticmethod
    def concat(parts: Sequence[Completions]) -> Completions:
        cat = lambda name: [x for p in parts for x in getattr(p, name)]
        sampled = None
        if any(p.sampled is not None for p in parts):
            sampled = [p.sampled_mask(i) for p in parts for i in range(len(p))]
        stats = None
        if all(p.stats is not None for p in parts):
            stats = {k: np.concatenate([p.stats[k] for p in parts]) for k in parts[0].stats}
        return Completions(cat("prompts"), cat("token_ids"), cat("logprobs"),
                           np.concatenate([p.truncated for p in parts]), np.concatenate([p.rewards for p in parts]),
                           np.concatenate([p.rewards_per_fn for p in parts], axis=1), sampled, stats)


class GroupSampler:
    """Samples a group of G completions per prompt of the run's prompts, and scores them."""

    def __init__(self, cfg: RLConfig, examples: Sequence[PromptExample], scorer: RewardScorer):
        self.cfg, self.examples, self.scorer = cfg, list(examples), scorer
        longest = max(len(e.prompt_ids) for e in self.examples)
        # One row length for every batch: a prompt and its group's completions.
        self.seq_len = -(-(longest + cfg.num_generations * cfg.max_completion_length) // 8) * 8
        self.max_model_len = longest + cfg.max_completion_length  # what the engine holds per sequence

    def _params(self, n: int, max_tokens: int, seed: int) -> SamplingParams:
        """A request's sampling: the run's temperature and truncation, the sampled tokens' log-probs."""
        cfg = self.cfg
        return SamplingParams(n=n, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, min_p=cfg.min_p,
                              max_tokens=max_tokens, seed=seed, logprobs=0)

    @staticmethod
    def _columns(prompts: Sequence[PromptExample], token_ids: Sequence) -> dict[str, list]:
        """What the reward functions get besides prompts and completions: each dataset column aligned with the
        completions, and the sampled ids (completion_ids)."""
        columns = {name: [p.columns[name] for p in prompts] for name in prompts[0].columns}
        columns["completion_ids"] = [list(map(int, ids)) for ids in token_ids]
        return columns

    def sample(self, rollout, prompt_indices: np.ndarray, stream: int = 0) -> Completions:
        """G completions of each prompt through the rollout engine (one request with n = G per prompt, seeded
        by the prompt's position in the rollout and `stream`), scored by the reward functions."""
        cfg, g = self.cfg, self.cfg.num_generations
        prompts = [self.examples[i] for i in prompt_indices]
        params = [self._params(g, cfg.max_completion_length, rollout.seed(i, stream)) for i in range(len(prompts))]
        outputs = rollout.generate([p.prompt_ids.tolist() for p in prompts], params)
        outputs = [o if isinstance(o, list) else [o] for o in outputs]
        rows = [o for group in outputs for o in group]
        repeated = [p for p in prompts for _ in range(g)]
        completions = [[{"role": "assistant", "content": o.text}] if isinstance(p.prompt, list) else o.text
                       for p, o in zip(repeated, rows)]
        token_ids = [np.asarray(o.token_ids, np.int32) for o in rows]
        total, per_fn = self.scorer([p.prompt for p in repeated], completions, self._columns(repeated, token_ids))
        return Completions(repeated, token_ids, [np.asarray(o.logprobs, np.float32) for o in rows],
                           np.array([o.finish_reason == "length" for o in rows]), total, per_fn)

    def metrics(self, c: Completions) -> dict[str, float]:
        """Reward statistics (total and per function), completion lengths and the truncated fraction."""
        lengths = np.array([len(ids) for ids in c.token_ids], np.float64)
        return {**self.scorer.metrics(c.rewards, c.rewards_per_fn),
                "completions/mean_length": float(lengths.mean()), "completions/min_length": float(lengths.min()),
                "completions/max_length": float(lengths.max()), "completions/clipped_ratio": float(c.truncated.mean())}
