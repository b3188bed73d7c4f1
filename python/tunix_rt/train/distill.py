"""Knowledge distillation: alpha * T^2 * KL(teacher || student) + (1 - alpha) * CE on the trained
targets only, from the teacher's full distribution or its top-k logits, on the dataset's completions
or (on-policy) on completions the student samples itself. The teacher runs inside the same jitted
step (frozen, its weights passed in as arrays)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import numpy as np
from flax import nnx

from tunix_rt.train.data import PackedRow, SFTExample, sft_batch
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



def prompt_part(example: SFTExample) -> np.ndarray:
    """The tokens before the first trained one: the prompt of an SFT row (in any of its formats)."""
    trained = np.flatnonzero(example.loss_mask)
    return example.input_ids[: trained[0]] if len(trained) else example.input_ids[:0]


class OnPolicyDistillObjective(DistillObjective):
    """The student writes the completions, sampled through the rollout engine from its current
    weights, and the teacher scores them: distillation on the student's own distribution (GKD with
    lambda = 1), so it learns from the states it will actually reach.

    `attach(current_model)` gives it the trainer's model; before each batch the engine takes the
    new weights in place (no recompile) and samples one completion per prompt.
    """

    def __init__(self, examples: Sequence[SFTExample], teacher: nnx.Module, tokenizer, *, seq_len: int, pad_id: int,
                 temperature: float, alpha: float, top_k: int, max_new_tokens: int, seed: int):
        prompts = [prompt_part(e) for e in examples]
        self.prompts = [p for p in prompts if 0 < len(p) < seq_len]
        if not self.prompts:
            raise ValueError(f"on-policy distillation needs rows with a prompt shorter than max_length ({seq_len})")
        super().__init__([], teacher, seq_len=seq_len, pad_id=pad_id, temperature=temperature, alpha=alpha,
                         top_k=top_k)
        self.num_items = len(self.prompts)
        self.tokenizer, self.max_new_tokens, self.seed = tokenizer, max_new_tokens, seed
        self.current_model: Callable[[], nnx.Module] | None = None
        self.engine = None
        self.batches = 0

    def attach(self, current_model: Callable[[], nnx.Module]) -> None:
        self.current_model = current_model

    def _sample(self, prompts: list[np.ndarray]) -> list[np.ndarray]:
        from tunix_rt.engine.engine import Engine
        from tunix_rt.engine.params import SamplingParams

        model = self.current_model()
        if self.engine is None:
            self.engine = Engine(model, self.tokenizer, max_model_len=self.seq_len, max_num_seqs=len(prompts),
                                 kv_cache_memory=64 << 20, enable_prefix_caching=False)
        else:
            self.engine.update_weights(model)
        self.batches += 1
        params = [SamplingParams(temperature=1.0, max_tokens=min(self.max_new_tokens, self.seq_len - len(p)),
                                 seed=self.seed * 1_000_003 + self.batches * 1009 + i) for i, p in enumerate(prompts)]
        outputs = self.engine.generate([p.tolist() for p in prompts], params)
        return [np.asarray(o.token_ids, np.int32) for o in outputs]

    def host_batch(self, indices: np.ndarray, valid: np.ndarray) -> dict[str, np.ndarray]:
        if self.current_model is None:
            raise RuntimeError("OnPolicyDistillObjective.attach(current_model) must be called before training")
        prompts = [self.prompts[i] for i in indices]
        examples = [SFTExample(np.concatenate([p, c]), np.concatenate([np.zeros(len(p), bool), np.ones(len(c), bool)]))
                    for p, c in zip(prompts, self._sample(prompts))]
        batch = sft_batch(examples, self.seq_len, pad_id=self.pad_id)
        batch["loss_mask"] *= valid[:, None]
        return batch
