"""KTO on unpaired preferences (TRL's KTOTrainer, loss_type "kto"): rows of a prompt, one completion and a
desirable/undesirable label. Each example's completion log-ratio (policy - reference) is compared with z0, a
KL estimate from mismatched pairs: every example is also scored with another example's completion (a partner
fixed at load, so the reference's log-probs of both rows can be computed once up front, as DPO's are).
train/losses.kto_losses holds the formula."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx

from tunix_rt.train.data import SFTExample, UnpairedExample
from tunix_rt.train.dpo import completion_logps
from tunix_rt.train.losses import kto_losses
from tunix_rt.train.sft import RowsObjective
from tunix_rt.train.trainer import LossContext


class KTOObjective(RowsObjective):
    """A batch of B examples is 2B rows: the examples, then each prompt with its partner's completion."""

    def __init__(self, examples: Sequence[UnpairedExample], cfg, *, max_length: int, pad_id: int,
                 ref_model: nnx.Module | None = None, precompute_ref_log_probs: bool = True, seed: int = 0):
        super().__init__(max_length=max_length, pad_id=pad_id)
        self.examples, self.cfg = list(examples), cfg
        self.num_items = len(self.examples)
        if self.num_items < 2:
            raise ValueError("KTO needs at least 2 examples: the KL estimate pairs each prompt with another's "
                             "completion")
        order = np.random.default_rng(seed).permutation(self.num_items)
        self.partner = np.empty(self.num_items, np.int64)
        self.partner[order] = np.roll(order, -1)  # a fixed derangement: nobody is their own partner
        self.ref = nnx.split(ref_model) if ref_model is not None else None
        self.precompute_ref = precompute_ref_log_probs
        self.ref_logps: np.ndarray | None = None  # (examples, 2): the example's row, its mismatched row

    @property
    def needs_reference(self) -> bool:
        return self.ref is None and self.ref_logps is None

    def precompute(self, score) -> None:
        if not self.precompute_ref or self.ref_logps is not None:
            return
        batches = score(self._reference_logps, self)
        self.ref_logps = np.concatenate([sums.reshape(2, -1).T for sums in batches])[: self.num_items]

    def rows(self, indices: np.ndarray) -> list[SFTExample]:
        matched = [self._row(i, i) for i in indices]
        return matched + [self._row(i, self.partner[i]) for i in indices]

    def _row(self, prompt_of: int, completion_of: int) -> SFTExample:
        prompt, completion = self.examples[prompt_of].prompt_ids, self.examples[completion_of].completion_ids
        ids = np.concatenate([prompt, completion])[: self.max_length]
        return SFTExample(ids, np.arange(len(ids)) >= len(prompt))

    def host_batch(self, indices: np.ndarray, valid: np.ndarray, lengths: tuple[int, int]) -> dict[str, np.ndarray]:
        batch = super().host_batch(indices, valid, lengths)
        batch["valid"] = valid.astype(np.float32)
        batch["desirable"] = np.asarray([self.examples[i].desirable for i in indices], np.float32)
        if self.ref_logps is not None:
            batch["ref_logps"] = self.ref_logps[indices].T.reshape(-1)  # matched rows, then mismatched rows
        return batch

    def _reference_logps(self, ctx: LossContext, batch: dict):
        model = nnx.merge(self.ref[0], ctx.aux["ref_model"]) if self.ref is not None else ctx.reference()
        return jax.lax.stop_gradient(completion_logps(model, batch)[0])

    def loss(self, ctx: LossContext, batch: dict):
        logps, _ = completion_logps(ctx.policy, batch)
        ref = batch["ref_logps"] if "ref_logps" in batch else self._reference_logps(ctx, batch)
        b = logps.shape[0] // 2
        ratios = logps - ref
        valid = batch["valid"]
        losses, metrics = kto_losses(ratios[:b], ratios[b:], batch["desirable"], valid, beta=self.cfg.beta,
                                     desirable_weight=self.cfg.desirable_weight,
                                     undesirable_weight=self.cfg.undesirable_weight)
        weight = valid.sum()
        sums = {k: (v * valid).sum() for k, v in metrics.items()}
        # The trainer divides every metric by the batch's weight: each class's mean reward is rescaled so that what
        # it logs is that class's own mean (TRL's rewards/chosen and rewards/rejected), not a share of all rows.
        for name, count in (("rewards/chosen", "count/chosen"), ("rewards/rejected", "count/rejected")):
            sums[name] = sums[name] * weight / jax.numpy.maximum(sums[count], 1.0)
        return (losses * valid).sum(), weight, sums

    def aux(self):
        return {"ref_model": self.ref[1]} if self.ref is not None else None
