"""GRPO/PPO training rows from a rollout's completions: one packed row per group.

The trainer reads one row per group (the prompt once, its completions behind it, attention kept apart by
segment ids), so the prompt is computed once; every per-token array (targets, masks, the engine's
log-probs, later the reference's, values, advantages) lives in a completion window of
max_completion_length entries per completion, so the output head and the losses run on completion
positions only.
"""

from __future__ import annotations

import numpy as np

from tunix_rt.train.config import RLConfig
from tunix_rt.train.rollout import Completions


def pack_groups(c: Completions, cfg: RLConfig, seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
    """One row per group: the prompt once (segment -1, a shared prefix) and behind it each of its G
    completions (segments 1..G, positions continuing the prompt's), so the prompt's tokens run through
    the model once, not G times. Per completion, in the window (N, max_completion_length):
    `completion_index` (the row position whose output predicts completion token j: the prompt's last
    token for j = 0, else the completion's token j - 1), targets, loss_mask, and sampler_logps (the
    engine's, of the distribution it drew from). Truncated completions lose their loss mask when
    mask_truncated_completions is set."""
    g, width = cfg.num_generations, cfg.max_completion_length
    n = len(c)
    groups = n // g
    batch = {"tokens": np.full((groups, seq_len), pad_id, np.int32),
             "positions": np.full((groups, seq_len), -1, np.int32),
             "segment_ids": np.zeros((groups, seq_len), np.int32),
             "completion_index": np.zeros((n, width), np.int32),
             "targets": np.zeros((n, width), np.int32),
             "loss_mask": np.zeros((n, width), np.float32),
             "sampler_logps": np.zeros((n, width), np.float32)}
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
            batch["sampler_logps"][i, :len(lp)] = lp
            offset += m
    if cfg.mask_truncated_completions:
        batch["loss_mask"] *= ~c.truncated[:, None]
    return batch
