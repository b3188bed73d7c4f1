"""Supervised fine-tuning: next-token cross-entropy on the trained tokens (assistant turns or
completions), optionally on packed rows whose attention stays within each example."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from tunix_rt.train.data import PackedRow, SFTExample, sft_batch
from tunix_rt.train.losses import token_logprobs
from tunix_rt.train.trainer import LossContext


def token_loss_sum(logits: jax.Array, batch: dict) -> tuple[jax.Array, jax.Array]:
    """(summed NLL over the batch's trained targets, their count)."""
    mask = batch["loss_mask"]
    return -(token_logprobs(logits, batch["targets"]) * mask).sum(), mask.sum()


def policy_logits(ctx_model, batch: dict) -> jax.Array:
    return ctx_model(batch["tokens"], batch["positions"], segment_ids=batch["segment_ids"])


class SFTObjective:
    """Items are examples, or packed rows when packing (each row one sequence of the batch)."""

    needs_reference = False

    def __init__(self, items: Sequence[SFTExample | PackedRow], *, seq_len: int, pad_id: int):
        self.items, self.seq_len, self.pad_id = list(items), seq_len, pad_id
        self.num_items = len(self.items)

    def host_batch(self, indices: np.ndarray, valid: np.ndarray) -> dict[str, np.ndarray]:
        batch = sft_batch([self.items[i] for i in indices], self.seq_len, pad_id=self.pad_id)
        batch["loss_mask"] *= valid[:, None]
        return batch

    def loss(self, ctx: LossContext, batch: dict):
        loss_sum, count = token_loss_sum(policy_logits(ctx.policy, batch), batch)
        return loss_sum, count, {}

    def aux(self):
        return None
