"""Rollouts for GRPO and PPO: prompts -> G completions each through the embedded engine -> rewards ->
fixed-shape training rows.

The engine samples every prompt's G completions as one request with n = G, so they share the prompt's
KV blocks (prefix caching). The trainer reads one packed row per group (the prompt once, its completions
behind it, attention kept apart by segment ids), so the prompt is computed once there too; every
per-token array (targets, masks, the engine's log-probs, later the reference's, values, advantages) lives
in a completion window of max_completion_length entries per completion, so the output head and the
losses run on completion positions only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from tunix_rt.engine.params import SamplingParams
from tunix_rt.train.config import RLConfig
from tunix_rt.train.data import PromptExample
from tunix_rt.train.rewards import RewardFn, score


@dataclasses.dataclass
class Completions:
    """G completions per prompt, adjacent: row i belongs to prompt i // G."""

    prompts: list[PromptExample]  # one per row (repeated G times)
    token_ids: list[np.ndarray]
    logprobs: list[np.ndarray]  # the engine's log p of each sampled token (raw distribution)
    truncated: np.ndarray  # (N,) bool: cut at max_completion_length, no EOS
    rewards: np.ndarray  # (N,) weighted total
    rewards_per_fn: np.ndarray  # (F, N), NaN where a function returned None

    def __len__(self) -> int:
        return len(self.token_ids)

    def select(self, rows: np.ndarray) -> Completions:
        take = lambda xs: [xs[i] for i in rows]
        return Completions(take(self.prompts), take(self.token_ids), take(self.logprobs),
                           self.truncated[rows], self.rewards[rows], self.rewards_per_fn[:, rows])

    @staticmethod
    def concat(parts: Sequence[Completions]) -> Completions:
        cat = lambda name: [x for p in parts for x in getattr(p, name)]
        return Completions(cat("prompts"), cat("token_ids"), cat("logprobs"),
                           np.concatenate([p.truncated for p in parts]), np.concatenate([p.rewards for p in parts]),
                           np.concatenate([p.rewards_per_fn for p in parts], axis=1))


class Sampler:
    """Samples and scores completions for a config's prompts and rewards."""

    def __init__(self, cfg: RLConfig, examples: Sequence[PromptExample], rewards: Sequence[tuple[str, RewardFn]]):
        if not rewards:
            raise ValueError("GRPO/PPO need at least one reward: give --reward NAME or module:function")
        self.cfg, self.examples, self.rewards = cfg, list(examples), list(rewards)
        self.weights = cfg.reward_weights or (1.0,) * len(rewards)
        longest = max(len(e.prompt_ids) for e in self.examples)
        # One row length for every batch: a prompt and its group's completions.
        self.seq_len = -(-(longest + cfg.num_generations * cfg.max_completion_length) // 8) * 8
        self.max_model_len = longest + cfg.max_completion_length  # what the engine holds per sequence

    def sample(self, rollout, prompt_indices: np.ndarray, stream: int = 0) -> Completions:
        """G completions of each prompt through the rollout engine (one request with n = G per prompt, seeded
        by the prompt's position in the rollout and `stream`), scored by the reward functions."""
        cfg, g = self.cfg, self.cfg.num_generations
        prompts = [self.examples[i] for i in prompt_indices]
        params = [SamplingParams(n=g, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, min_p=cfg.min_p,
                                 max_tokens=cfg.max_completion_length, seed=rollout.seed(i, stream), logprobs=0)
                  for i in range(len(prompts))]
        outputs = rollout.generate([p.prompt_ids.tolist() for p in prompts], params)
        outputs = [o if isinstance(o, list) else [o] for o in outputs]
        rows = [o for group in outputs for o in group]
        repeated = [p for p in prompts for _ in range(g)]
        completions = [[{"role": "assistant", "content": o.text}] if isinstance(p.prompt, list) else o.text
                       for p, o in zip(repeated, rows)]
        token_ids = [np.asarray(o.token_ids, np.int32) for o in rows]
        columns = {name: [p.columns[name] for p in repeated] for name in repeated[0].columns}
        columns["completion_ids"] = [ids.tolist() for ids in token_ids]
        total, per_fn = score(self.rewards, self.weights, [p.prompt for p in repeated], completions, columns)
        return Completions(repeated, token_ids, [np.asarray(o.logprobs, np.float32) for o in rows],
                           np.array([o.finish_reason == "length" for o in rows]), total, per_fn)

    def batch(self, c: Completions, pad_id: int) -> dict[str, np.ndarray]:
        """One row per group: the prompt once (segment -1, a shared prefix) and behind it each of its G
        completions (segments 1..G, positions continuing the prompt's), so the prompt's tokens run through
        the model once, not G times. Per completion, in the window (N, max_completion_length):
        `completion_index` (the row position whose output predicts completion token j: the prompt's last
        token for j = 0, else the completion's token j - 1), targets, loss_mask, and old_logps (the
        engine's). Truncated completions lose their loss mask when mask_truncated_completions is set."""
        g, width = self.cfg.num_generations, self.cfg.max_completion_length
        n = len(c)
        groups = n // g
        batch = {"tokens": np.full((groups, self.seq_len), pad_id, np.int32),
                 "positions": np.full((groups, self.seq_len), -1, np.int32),
                 "segment_ids": np.zeros((groups, self.seq_len), np.int32),
                 "completion_index": np.zeros((n, width), np.int32),
                 "targets": np.zeros((n, width), np.int32),
                 "loss_mask": np.zeros((n, width), np.float32),
                 "old_logps": np.zeros((n, width), np.float32)}
        for row in range(groups):
            prompt = c.prompts[row * g].prompt_ids
            p = len(prompt)
            batch["tokens"][row, :p] = prompt
            batch["positions"][row, :p] = np.arange(p)
            batch["segment_ids"][row, :p] = -1
            offset = p
            for k in range(g):
                i = row * g + k
                ids, lp = c.token_ids[i], c.logprobs[i]
                m = len(ids)
                batch["tokens"][row, offset:offset + m] = ids
                batch["positions"][row, offset:offset + m] = np.arange(p, p + m)
                batch["segment_ids"][row, offset:offset + m] = k + 1
                batch["completion_index"][i, 0] = p - 1
                batch["completion_index"][i, 1:m] = np.arange(offset, offset + m - 1)
                batch["targets"][i, :m] = ids
                batch["loss_mask"][i, :m] = 1.0
                batch["old_logps"][i, :len(lp)] = lp
                offset += m
        if self.cfg.mask_truncated_completions:
            batch["loss_mask"] *= ~c.truncated[:, None]
        return batch

    def metrics(self, c: Completions) -> dict[str, float]:
        """Reward statistics (total and per function), completion lengths and the truncated fraction."""
        lengths = np.array([len(ids) for ids in c.token_ids], np.float64)
        out = {"reward": float(c.rewards.mean()), "reward_std": float(c.rewards.std()),
               "completions/mean_length": float(lengths.mean()), "completions/min_length": float(lengths.min()),
               "completions/max_length": float(lengths.max()), "completions/clipped_ratio": float(c.truncated.mean())}
        for (name, _), values in zip(self.rewards, c.rewards_per_fn):
            seen = values[~np.isnan(values)]
            if len(seen):
                out[f"rewards/{name}/mean"] = float(seen.mean())
                out[f"rewards/{name}/std"] = float(seen.std())
        return out
