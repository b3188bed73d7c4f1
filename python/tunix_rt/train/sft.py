"""Supervised fine-tuning: next-token cross-entropy on the trained tokens (assistant turns or
completions), optionally on packed rows whose attention stays within each example.

Batches are as long as their longest row needs (a bucket of data.bucket_length), and the output head runs
only on the trained positions (data.head_window), through the fused chunked head."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from tunix_rt.train.data import (
    PackedRow,
    SFTExample,
    bucket_length,
    examples_of,
    head_window,
    image_count,
    image_shape,
    row_length,
    sft_batch,
    trained_tokens,
)
from tunix_rt.train.trainer import LossContext


def window_hidden(model, batch: dict) -> jax.Array:
    """(K, D) final hidden states at the batch's head window (data.head_window); a batch of a dataset with images
    carries their pixel values."""
    h, _ = model.hidden_states(batch["tokens"], batch["positions"], segment_ids=batch["segment_ids"],
                               pixel_values=batch.get("pixel_values"))
    return h.reshape(-1, h.shape[-1])[batch["head_index"]]


def window_logprobs(model, batch: dict) -> jax.Array:
    """(K,) log-probs of the head window's targets (0-weight slots included)."""
    return model.token_logprobs(window_hidden(model, batch), batch["head_targets"])[0]


def image_slots(n: int) -> int:
    """A batch's image slots: at least one, then powers of two (one program per bucket, not per count)."""
    return 1 << max(n - 1, 0).bit_length()


class RowsObjective:
    """What SFT, DPO and distillation share: items become token rows, batched at a bucketed length with
    their trained targets gathered into a bucketed head window."""

    needs_reference = False
    rollout = None  # batches come from the dataset, not from sampling

    def __init__(self, *, max_length: int, pad_id: int):
        self.max_length, self.pad_id = max_length, pad_id

    def rows(self, indices: np.ndarray) -> list[PackedRow | SFTExample]:
        raise NotImplementedError

    image_shape: tuple[int, ...] | None = None  # a dataset with images: its (C, H, W); batches carry pixel values

    def batch_lengths(self, indices: np.ndarray) -> tuple[int, ...]:
        """(row length, head window[, image slots]) these items need, bucketed: the trainer takes the largest over
        its micro-batches, so one step's micro-batches share a shape."""
        rows = self.rows(indices)
        lengths = (bucket_length(max(row_length(r) for r in rows), self.max_length), bucket_length(trained_tokens(rows)))
        return (*lengths, image_slots(image_count(rows))) if self.image_shape else lengths

    def host_batch(self, indices: np.ndarray, valid: np.ndarray, lengths: tuple[int, ...]) -> dict[str, np.ndarray]:
        """tokens, positions, segment_ids (rows, length) and the head window (and the images); rows with valid False
        train on nothing."""
        seq_len, head = lengths[:2]
        rows = self.rows(indices)
        images = (lengths[2], self.image_shape) if self.image_shape else None
        batch = sft_batch(rows, seq_len, pad_id=self.pad_id, images=images)
        mask = batch.pop("loss_mask") * np.tile(valid, len(rows) // len(valid))[:, None]  # DPO: B pairs, 2B rows
        batch.update(head_window(mask, batch.pop("targets"), head))
        return batch

    def aux(self):
        return None

    def precompute(self, score) -> None:
        pass


class SFTObjective(RowsObjective):
    """Items are examples, or packed rows when packing (each row one sequence of the batch)."""

    def __init__(self, items: Sequence[SFTExample | PackedRow], *, max_length: int, pad_id: int):
        super().__init__(max_length=max_length, pad_id=pad_id)
        self.items = list(items)
        self.num_items = len(self.items)
        self.image_shape = image_shape(examples_of(self.items))

    def rows(self, indices: np.ndarray) -> list[PackedRow | SFTExample]:
        return [self.items[i] for i in indices]

    def loss(self, ctx: LossContext, batch: dict):
        mask = batch["head_mask"]
        return -(window_logprobs(ctx.policy, batch) * mask).sum(), mask.sum(), {}
