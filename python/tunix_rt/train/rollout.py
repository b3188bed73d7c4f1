"""Rollouts for GRPO and PPO: prompts -> G completions each through the embedded engine -> rewards ->
fixed-shape training rows.

The engine samples every prompt's G completions as one request with n = G, so they share the prompt's
KV blocks (prefix caching). The model reads rows laid out as the SFT batches are (prompt + completion,
right-padded to one length); every per-token array (targets, masks, the engine's log-probs, later the
reference's, values, advantages) lives in a completion window of max_completion_length entries per row,
so the output head and the losses run on completion positions only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from tunix_rt.engine.params import SamplingParams
from tunix_rt.train.config import RLConfig
from tunix_rt.train.data import PromptExample, SFTExample, sft_batch
from tunix_rt.train.rewards import RewardFn, score


@dataclasses.dataclass
class Completions:
    """G completions per prompt, adjacent: row i belongs to prompt i // G."""

    prompts: list[PromptExample]  # one per row (repeated G times)
    token_ids: list[np.ndarray]
    logprobs: list[np.ndarray]  # the engine's log p of each sampled token (raw distribution)
    texts: list[str]
    truncated: np.ndarray  # (N,) bool: cut at max_completion_length, no EOS
    rewards: np.ndarray  # (N,) weighted total
    rewards_per_fn: np.ndarray  # (F, N), NaN where a function returned None

    def __len__(self) -> int:
        return len(self.token_ids)

    def select(self, rows: np.ndarray) -> Completions:
        take = lambda xs: [xs[i] for i in rows]
        return Completions(take(self.prompts), take(self.token_ids), take(self.logprobs), take(self.texts),
                           self.truncated[rows], self.rewards[rows], self.rewards_per_fn[:, rows])

    @staticmethod
    def concat(parts: Sequence[Completions]) -> Completions:
        cat = lambda name: [x for p in parts for x in getattr(p, name)]
        return Completions(cat("prompts"), cat("token_ids"), cat("logprobs"), cat("texts"),
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
        self.seq_len = -(-(longest + cfg.max_completion_length) // 8) * 8  # one row length for every batch

    def sample(self, engine, prompt_indices: np.ndarray, seed: int) -> Completions:
        cfg, g = self.cfg, self.cfg.num_generations
        prompts = [self.examples[i] for i in prompt_indices]
        params = [SamplingParams(n=g, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, min_p=cfg.min_p,
                                 max_tokens=cfg.max_completion_length, seed=(seed * 1_000_003 + i * g) % 2**31,
                                 logprobs=0) for i in range(len(prompts))]
        outputs = engine.generate([p.prompt_ids.tolist() for p in prompts], params)
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
                           [o.text for o in rows], np.array([o.finish_reason == "length" for o in rows]),
                           total, per_fn)

    def batch(self, c: Completions, pad_id: int) -> dict[str, np.ndarray]:
        """The model's inputs as SFT-layout rows (tokens, positions, segment_ids: (N, seq_len)) and every
        per-token array in the completion window (N, max_completion_length): `completion_start` (N,) is the
        row index whose output predicts the first completion token, and window entry j belongs to completion
        token j (targets, loss_mask, and old_logps, the engine's log-probs). Truncated completions lose their
        loss mask when mask_truncated_completions is set."""
        width = self.cfg.max_completion_length
        examples = [SFTExample(np.concatenate([p.prompt_ids, ids]),
                               np.arange(len(p.prompt_ids) + len(ids)) >= len(p.prompt_ids))
                    for p, ids in zip(c.prompts, c.token_ids)]
        rows = sft_batch(examples, self.seq_len, pad_id=pad_id)
        n = len(c)
        batch = {k: rows[k] for k in ("tokens", "positions", "segment_ids")}
        batch["completion_start"] = np.array([len(p.prompt_ids) - 1 for p in c.prompts], np.int32)
        batch["targets"] = np.zeros((n, width), np.int32)
        batch["loss_mask"] = np.zeros((n, width), np.float32)
        batch["old_logps"] = np.zeros((n, width), np.float32)
        for r, (ids, lp) in enumerate(zip(c.token_ids, c.logprobs)):
            batch["targets"][r, :len(ids)] = ids
            batch["loss_mask"][r, :len(ids)] = 1.0
            batch["old_logps"][r, :len(lp)] = lp
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
