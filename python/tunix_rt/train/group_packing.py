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


def pack_groups(c: Completions, cfg: RLConfig, seq_len: int, pad_id: int, *,
                block_size: int | None = None) -> dict[str, np.ndarray]:
    """One row per group: the prompt once (segment -1, a shared prefix) and behind it each of its G
    completions (segments 1..G, positions continuing the prompt's), so the prompt's tokens run through
    the model once, not G times. Per completion, in the window (N, max_completion_length):
    `completion_index` (the row position whose output predicts completion token j: the prompt's last
    token for j = 0, else the completion's token j - 1), targets, loss_mask (0 on tokens the policy did not
    sample: an agentic trajectory's tool results), and sampler_logps (the engine's, of the distribution it
    drew from). Truncated completions lose their loss mask when
    mask_truncated_completions is set. With `block_size`, the paged layout of the rows (paged_layout) too."""
    g, width = cfg.num_generations, cfg.max_completion_length
    if g >= 1 << 16:  # segment ids 1..G see the prefix -1 only below 2**16 (ops/attention.prefix_segment)
        raise ValueError(f"num_generations={g}: at most {(1 << 16) - 1} completions share a prompt")
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
            batch["loss_mask"][i, :m] = c.sampled_mask(i)
            batch["sampler_logps"][i, :len(lp)] = lp
            offset += m
    if cfg.mask_truncated_completions:
        batch["loss_mask"] *= ~c.truncated[:, None]
    if block_size is not None:
        batch.update(paged_layout(batch["segment_ids"], batch["positions"], g, block_size))
    return batch


def paged_layout(segment_ids: np.ndarray, positions: np.ndarray, g: int, block_size: int) -> dict[str, np.ndarray]:
    """The packed rows as the engine's paged KV cache holds them, for the trainer's exact mode: completion k of a
    row is sequence k, whose block table points at the prompt's full blocks (shared, as prefix caching shares
    them) and then at blocks of its own, the first holding its copy of the prompt's partly filled last block.
    Every index is local to its row (a row owns (1 + G) * ceil(L / block_size) blocks: the prompt's, then each
    sequence's), so micro-batches split the arrays by rows:
    paged_slots / paged_seq (rows, L): each token's slot and sequence (-1: padding; prompt tokens belong to
    sequence 0); paged_tables (rows * G, ceil(L / block_size)); paged_copy_src / paged_copy_slots
    (rows, (G - 1) * (block_size - 1)): the prompt tokens of the partly filled block, written again into
    sequences 1..G-1's copies (-1: unused)."""
    rows, length = segment_ids.shape
    bs = block_size
    width = -(-length // bs)
    slots = np.full((rows, length), -1, np.int32)
    seq = np.full((rows, length), -1, np.int32)
    tables = np.zeros((rows * g, width), np.int32)
    copies = max(1, (g - 1) * (bs - 1))
    copy_src = np.zeros((rows, copies), np.int32)
    copy_slots = np.full((rows, copies), -1, np.int32)
    for r in range(rows):
        p = int((segment_ids[r] == -1).sum())
        full = p // bs  # the prompt's full blocks: blocks [0, full) of the row, shared

        def own(k, b):  # sequence k's block for position block b >= full
            return (1 + k) * width + b

        for k in range(g):
            tables[r * g + k] = [b if b < full else own(k, b) for b in range(width)]
        n_copy = 0
        for t in range(length):
            pos, segment = int(positions[r, t]), int(segment_ids[r, t])
            if pos < 0:
                continue
            k = 0 if segment == -1 else segment - 1
            b = pos // bs
            slots[r, t] = (b if b < full else own(k, b)) * bs + pos % bs
            seq[r, t] = k
            if segment == -1 and b >= full:
                for other in range(1, g):
                    copy_src[r, n_copy], copy_slots[r, n_copy] = t, own(other, b) * bs + pos % bs
                    n_copy += 1
    return {"paged_slots": slots, "paged_seq": seq, "paged_tables": tables, "paged_copy_src": copy_src,
            "paged_copy_slots": copy_slots}
