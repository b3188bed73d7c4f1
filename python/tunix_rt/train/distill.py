"""Knowledge distillation: alpha * T^2 * KL(teacher || student) + (1 - alpha) * CE on the trained
targets only, from the teacher's full distribution or its top-k logits, on the dataset's completions
or (on-policy) on completions the student samples itself. The teacher runs inside the same jitted
step (frozen, its weights passed in as arrays)."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx

from tunix_rt.engine.params import SamplingParams
from tunix_rt.ops.fused_head import head_distill
from tunix_rt.train.data import SFTExample, bucket_length
from tunix_rt.train.rollout_engine import RolloutEngine, rollout_config
from tunix_rt.train.sft import SFTObjective, window_hidden
from tunix_rt.train.trainer import LossContext


def distill_terms(student, teacher, batch: dict, *, temperature: float, top_k: int) -> tuple[jax.Array, jax.Array]:
    """(KL(teacher_T || student_T), student log p(target)) per head-window slot, through the fused head: the
    teacher's logits are formed chunk by chunk beside the student's, never for the whole batch."""
    w, transpose_w = student.head_weight()
    teacher_w, teacher_transpose_w = teacher.head_weight()
    return head_distill(window_hidden(student, batch), w, jax.lax.stop_gradient(window_hidden(teacher, batch)),
                        jax.lax.stop_gradient(teacher_w), batch["head_targets"], temperature=temperature, top_k=top_k,
                        transpose_w=transpose_w, teacher_transpose_w=teacher_transpose_w,
                        softcap=student.config.final_logit_softcap, teacher_softcap=teacher.config.final_logit_softcap)


class DistillObjective(SFTObjective):
    def __init__(self, items, teacher: nnx.Module, *, max_length: int, pad_id: int, temperature: float, alpha: float,
                 top_k: int = 0):
        super().__init__(items, max_length=max_length, pad_id=pad_id)
        self.teacher_graphdef, self.teacher_state = nnx.split(teacher)
        self.temperature, self.alpha, self.top_k = temperature, alpha, top_k
        if top_k and not top_k <= teacher.config.vocab_size:
            raise ValueError(f"top_k must be in [1, {teacher.config.vocab_size}] (the vocab size), got {top_k}")

    def loss(self, ctx: LossContext, batch: dict):
        """alpha * T^2 * KL + (1 - alpha) * CE, as sums over the trained tokens (the trainer divides by their
        count, so accumulation weighs tokens)."""
        teacher = nnx.merge(self.teacher_graphdef, ctx.aux["teacher"])
        kl, logp = distill_terms(ctx.policy, teacher, batch, temperature=self.temperature, top_k=self.top_k)
        mask = batch["head_mask"]
        kd = self.temperature**2 * (kl * mask).sum()
        ce = -(logp * mask).sum()
        return self.alpha * kd + (1 - self.alpha) * ce, mask.sum(), {"kd": kd, "ce": ce}

    def aux(self):
        return {"teacher": self.teacher_state}


def check_teacher(student_vocab: int, teacher_vocab: int) -> None:
    if student_vocab != teacher_vocab:
        raise ValueError(f"the teacher's vocabulary ({teacher_vocab} tokens) differs from the student's "
                         f"({student_vocab}); logit distillation needs the same tokenizer")



def prompt_part(example: SFTExample) -> np.ndarray:
    """The tokens before the first trained one: the prompt of an SFT row (in any of its formats)."""
    trained = np.flatnonzero(example.loss_mask)
    return example.input_ids[: trained[0]] if len(trained) else example.input_ids[:0]


class OnPolicyDistillObjective(DistillObjective):
    """The student writes the completions, sampled through its RolloutEngine from its current weights (the
    trainer binds them; each step's first batch takes them in place, no recompile), one per prompt, seeded by
    the step and the prompt; the teacher scores them: distillation on the student's own distribution (GKD
    with lambda = 1), so it learns from the states it will actually reach.
    """

    def __init__(self, examples: Sequence[SFTExample], teacher: nnx.Module, tokenizer, *, max_length: int,
                 pad_id: int, temperature: float, alpha: float, top_k: int, max_new_tokens: int, seed: int,
                 batch_size: int, rollout: dict | None = None, sleep_engine: bool = False):
        prompts = [prompt_part(e) for e in examples]
        self.prompts = [p for p in prompts if 0 < len(p) < max_length]
        if not self.prompts:
            raise ValueError(f"on-policy distillation needs rows with a prompt shorter than max_length ({max_length})")
        super().__init__([], teacher, max_length=max_length, pad_id=pad_id, temperature=temperature, alpha=alpha,
                         top_k=top_k)
        self.num_items = len(self.prompts)
        self.max_new_tokens = max_new_tokens
        # One micro-batch of prompts at a time; each prompt is new, so no prefix to share.
        self.rollout = RolloutEngine(tokenizer, rollout_config(
            rollout, max_model_len=max_length, max_num_seqs=batch_size, kv_cache_memory=64 << 20,
            enable_prefix_caching=False, seed=seed), seed=seed, sleep=sleep_engine)

    def _sample(self, indices: np.ndarray) -> list[np.ndarray]:
        prompts = [self.prompts[i] for i in indices]
        params = [SamplingParams(temperature=1.0, max_tokens=min(self.max_new_tokens, self.max_length - len(p)),
                                 seed=self.rollout.seed(int(i))) for i, p in zip(indices, prompts)]
        outputs = self.rollout.generate([p.tolist() for p in prompts], params)
        return [np.asarray(o.token_ids, np.int32) for o in outputs]

    def batch_lengths(self, indices: np.ndarray) -> tuple[int, int]:
        """Upper bounds (completions are sampled in host_batch): the longest prompt plus max_new_tokens, and
        max_new_tokens per row."""
        longest = max(len(self.prompts[i]) for i in indices)
        return (bucket_length(min(longest + self.max_new_tokens, self.max_length), self.max_length),
                bucket_length(len(indices) * self.max_new_tokens))

    def rows(self, indices: np.ndarray) -> list[SFTExample]:
        prompts = [self.prompts[i] for i in indices]
        return [SFTExample(np.concatenate([p, c]), np.concatenate([np.zeros(len(p), bool), np.ones(len(c), bool)]))
                for p, c in zip(prompts, self._sample(indices))]
