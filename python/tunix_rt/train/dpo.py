"""Preference optimisation (DPO, IPO, hinge, robust, ORPO, SimPO) on chosen/rejected pairs.

A batch holds B pairs as 2B rows (chosen first), bucketed like SFT's, the output head on completion
tokens only. The reference log-probs come from a frozen model: the LoRA-disabled base (no second copy),
the initial weights, or a separate `ref_model`. By default (TRL's precompute_ref_log_probs) they are
computed once per pair before training, so a step runs no reference forward; otherwise inside each step,
without gradient. Reference-free losses (ORPO, SimPO) need none.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx

from tunix_rt.train.data import PreferenceExample, image_shape, preference_rows
from tunix_rt.train.losses import PREFERENCE_LOSSES, PreferenceConfig, PreferenceStats
from tunix_rt.train.sft import RowsObjective, window_logprobs
from tunix_rt.train.trainer import LossContext


def completion_logps(model, batch: dict) -> tuple[jax.Array, jax.Array]:
    """Per row: summed log-probs of the completion tokens and their count."""
    mask, rows, n = batch["head_mask"], batch["head_row"], batch["tokens"].shape[0]
    logps = window_logprobs(model, batch) * mask
    return jax.ops.segment_sum(logps, rows, n), jax.ops.segment_sum(mask, rows, n)


class DPOObjective(RowsObjective):
    def __init__(self, examples: Sequence[PreferenceExample], cfg: PreferenceConfig, *, max_length: int, pad_id: int,
                 ref_model: nnx.Module | None = None, precompute_ref_log_probs: bool = True):
        super().__init__(max_length=max_length, pad_id=pad_id)
        self.examples, self.cfg = list(examples), cfg
        self.num_items = len(self.examples)
        self.image_shape = image_shape(self.examples)
        self.ref = nnx.split(ref_model) if ref_model is not None else None
        self.precompute_ref = precompute_ref_log_probs and not cfg.reference_free
        self.ref_logps: np.ndarray | None = None  # (pairs, 2): chosen, rejected, once precomputed

    @property
    def needs_reference(self) -> bool:
        """The step reads the initial weights' log-probs: not once they are precomputed."""
        return not self.cfg.reference_free and self.ref is None and self.ref_logps is None

    def precompute(self, score) -> None:
        """The reference's summed completion log-probs of every pair, once (TRL's precompute_ref_log_probs)."""
        if not self.precompute_ref or self.ref_logps is not None:
            return
        batches = score(self._reference_logps, self)  # (2B,) per batch: chosen rows, then rejected rows
        self.ref_logps = np.concatenate([sums.reshape(2, -1).T for sums in batches])[: self.num_items]

    def rows(self, indices: np.ndarray):
        return preference_rows([self.examples[i] for i in indices])

    def host_batch(self, indices: np.ndarray, valid: np.ndarray, lengths: tuple[int, int]) -> dict[str, np.ndarray]:
        batch = super().host_batch(indices, valid, lengths)
        batch["valid"] = valid.astype(np.float32)
        if self.ref_logps is not None:
            batch["ref_logps"] = self.ref_logps[indices].T.reshape(-1)  # chosen rows, then rejected rows
        return batch

    def _reference_logps(self, ctx: LossContext, batch: dict):
        if self.ref is not None:
            model = nnx.merge(self.ref[0], ctx.aux["ref_model"])
        else:
            model = ctx.reference()
        return jax.lax.stop_gradient(completion_logps(model, batch)[0])

    def loss(self, ctx: LossContext, batch: dict):
        logps, lengths = completion_logps(ctx.policy, batch)
        b = logps.shape[0] // 2
        if self.cfg.reference_free:
            ref = jax.numpy.zeros_like(logps)
        elif "ref_logps" in batch:
            ref = batch["ref_logps"]
        else:
            ref = self._reference_logps(ctx, batch)
        stats = PreferenceStats(logps[:b], logps[b:], lengths[:b], lengths[b:], ref[:b], ref[b:])
        losses, metrics = PREFERENCE_LOSSES[self.cfg.loss_type](stats, self.cfg)
        valid = batch["valid"]
        return (losses * valid).sum(), valid.sum(), {k: (v * valid).sum() for k, v in metrics.items()}

    def aux(self):
        return {"ref_model": self.ref[1]} if self.ref is not None else None
