"""Reward models (TRL's RewardTrainer): the decoder with a scalar score head read at each sequence's last token,
trained on preference pairs with the Bradley-Terry loss -log sigmoid(r_chosen - r_rejected - margin), plus
`center_rewards_coefficient` * mean((r_chosen + r_rejected)^2) to keep rewards centred (TRL's). A causal LM
gets a fresh score head (trained in full under LoRA too); a loaded reward model keeps its own."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tunix_rt.models.decoder import Decoder, ScoreHead
from tunix_rt.train.data import PreferenceExample, bucket_length, preference_rows, row_length, sft_batch
from tunix_rt.train.trainer import LossContext

log = logging.getLogger(__name__)


def attach_score_head(model: Decoder, pad_token_id: int | None, seed: int = 0) -> Decoder:
    """Make a causal LM a reward model (in place; a reward model is left as it is): a one-output score head
    (normal, std 0.02, as transformers initialises it) replaces the vocabulary head, read at each row's last
    token that is not `pad_token_id` (TRL pads with EOS where a tokenizer has no pad: a row ending with EOS is
    read before it, in training as in transformers after export)."""
    if model.config.vision is not None:
        raise ValueError("a reward model with an image encoder is not supported")
    if model.config.num_labels:
        if model.config.num_labels != 1:
            raise ValueError(f"a reward model has one output; this classifier has {model.config.num_labels}")
        return model
    model.score = ScoreHead(model.config.hidden_size, 1, rngs=nnx.Rngs(seed))
    if hasattr(model, "lm_head"):
        del model.lm_head
    model.config = dataclasses.replace(model.config, num_labels=1, pad_token_id=pad_token_id)
    return model


def reward_pad_id(tokenizer) -> int | None:
    """TRL's padding for a reward model: the tokenizer's pad token, else its EOS."""
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    return min(tokenizer.eos_token_ids) if tokenizer.eos_token_ids else None


def whole_pairs(examples: Sequence[PreferenceExample], max_length: int) -> list[PreferenceExample]:
    """The pairs whose prompt and both completions fit max_length uncut (TRL drops the others: a cut completion
    would be scored mid-reply); logged when any are dropped."""
    kept = [e for e in examples if len(e.prompt_ids) + max(len(e.chosen_ids), len(e.rejected_ids)) < max_length]
    if len(kept) < len(examples):
        log.warning("dropped %d of %d pairs longer than max_length=%d (a reward is read at the reply's end)",
                    len(examples) - len(kept), len(examples), max_length)
    if not kept:
        raise ValueError(f"no pair fits max_length={max_length}; raise it")
    return kept


def rewards(model: Decoder, batch: dict) -> jax.Array:
    """(rows,) the reward of each row: the score head at its last real token."""
    h, _ = model.hidden_states(batch["tokens"], batch["positions"], segment_ids=batch["segment_ids"])
    return model.sequence_scores(h, batch["tokens"], batch["positions"])[:, 0]


class RewardObjective:
    """Items are preference pairs; a batch holds B pairs as 2B rows (chosen first), bucketed like SFT's."""

    needs_reference = False
    rollout = None

    def __init__(self, examples: Sequence[PreferenceExample], *, max_length: int, pad_id: int,
                 center_rewards_coefficient: float | None = None):
        self.examples = list(examples)
        self.num_items = len(self.examples)
        self.max_length, self.pad_id = max_length, pad_id
        self.center = center_rewards_coefficient

    def batch_lengths(self, indices: np.ndarray) -> tuple[int]:
        rows = preference_rows([self.examples[i] for i in indices])
        return (bucket_length(max(row_length(r) for r in rows), self.max_length),)

    def host_batch(self, indices: np.ndarray, valid: np.ndarray, lengths: tuple[int]) -> dict[str, np.ndarray]:
        pairs = [self.examples[i] for i in indices]
        batch = sft_batch(preference_rows(pairs), lengths[0], pad_id=self.pad_id)
        del batch["targets"], batch["loss_mask"]
        batch["valid"] = valid.astype(np.float32)
        batch["margin"] = np.asarray([p.margin for p in pairs], np.float32)
        return batch

    def loss(self, ctx: LossContext, batch: dict):
        r = rewards(ctx.policy, batch)
        b = r.shape[0] // 2
        chosen, rejected, valid = r[:b], r[b:], batch["valid"]
        losses = -jax.nn.log_sigmoid(chosen - rejected - batch["margin"])
        if self.center:
            losses = losses + self.center * (chosen + rejected) ** 2
        metrics = {"accuracy": (chosen > rejected).astype(jnp.float32), "margin": chosen - rejected,
                   "rewards/chosen": chosen, "rewards/rejected": rejected}
        return (losses * valid).sum(), valid.sum(), {k: (v * valid).sum() for k, v in metrics.items()}

    def aux(self):
        return None

    def precompute(self, score) -> None:
        pass
