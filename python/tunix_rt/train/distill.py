"""Knowledge distillation: alpha * T^2 * KL(teacher || student) + (1 - alpha) * CE on the trained
targets only, from the teacher's full distribution or its top-k logits. The teacher runs inside the
same jitted step (frozen, its weights passed in as arrays)."""

from __future__ import annotations

from collections.abc import Sequence

import jax
from flax import nnx

from tunix_rt.train.data import PackedRow, SFTExample
from tunix_rt.train.losses import distillation_loss, teacher_topk, topk_distillation_loss
from tunix_rt.train.sft import SFTObjective, policy_logits
from tunix_rt.train.trainer import LossContext


class DistillObjective(SFTObjective):
    def __init__(self, items: Sequence[SFTExample | PackedRow], teacher: nnx.Module, *, seq_len: int, pad_id: int,
                 temperature: float, alpha: float, top_k: int = 0):
        super().__init__(items, seq_len=seq_len, pad_id=pad_id)
        self.teacher_graphdef, self.teacher_state = nnx.split(teacher)
        self.temperature, self.alpha, self.top_k = temperature, alpha, top_k

    def loss(self, ctx: LossContext, batch: dict):
        student = policy_logits(ctx.policy, batch)
        teacher = jax.lax.stop_gradient(policy_logits(nnx.merge(self.teacher_graphdef, ctx.aux["teacher"]), batch))
        targets, mask = batch["targets"], batch["loss_mask"]
        kw = dict(temperature=self.temperature, alpha=self.alpha)
        if self.top_k:
            loss, metrics = topk_distillation_loss(student, *teacher_topk(teacher, self.top_k), targets, mask, **kw)
        else:
            loss, metrics = distillation_loss(student, teacher, targets, mask, **kw)
        count = mask.sum()  # the losses are token means: back to sums so accumulation weighs tokens
        return loss * count, count, {k: v * count for k, v in metrics.items()}

    def aux(self):
        return {"teacher": self.teacher_state}


def check_teacher(student_vocab: int, teacher_vocab: int) -> None:
    if student_vocab != teacher_vocab:
        raise ValueError(f"the teacher's vocabulary ({teacher_vocab} tokens) differs from the student's "
                         f"({student_vocab}); logit distillation needs the same tokenizer")

