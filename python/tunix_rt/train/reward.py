"""Reward models (TRL's RewardTrainer): the decoder with a scalar score head read at each sequence's last token,
trained on preference pairs with the Bradley-Terry loss -log sigmoid(r_chosen - r_rejected - margin), plus
`center_rewards_coefficient` * mean((r_chosen + r_rejected)^2) to keep rewards centred (TRL's). A causal LM
gets a fresh score head (trained in full under LoRA too); a loaded reward model keeps its own.

A pair trains as its prompt once with both replies behind it (the rejected reply sees the prompt, never the
chosen one: ops/attention's grouped shared prefixes), and a batch's pairs pack end to end into as few rows as the
data-parallel axis and ROW_TOKENS allow: against two padded rows per pair (TRL's), a short-reply dataset runs about half the
tokens, with the same scores."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tunix_rt.models.decoder import Decoder, ScoreHead, last_true
from tunix_rt.ops.attention import prefix_segment
from tunix_rt.train.data import PreferenceExample, packed_length
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


def pair_layout(pair: PreferenceExample, max_length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(prompt, chosen reply, rejected reply) as packed: the prompt at most max_length tokens and each reply what
    fits after it (data.tokenize_preference's cut; the CLI's pairs fit whole, `whole_pairs`)."""
    prompt = pair.prompt_ids[:max_length]
    room = max_length - len(prompt)
    return prompt, pair.chosen_ids[:room], pair.rejected_ids[:room]


def pack_pairs(pairs: Sequence[PreferenceExample], rows: int, length: int, *, max_length: int,
               pad_id: int) -> dict[str, np.ndarray]:
    """B pairs in `rows` rows of `length` tokens (pairs split evenly, in order): pair j of a row is its prompt
    (segment -(j + 1)) then the chosen and rejected replies (segments (j << 16) + 1 and + 2), both at positions
    continuing the prompt's. score_row and score_segment (2B,: chosen first, then rejected) name each
    sequence's row and reply segment, where `packed_rewards` reads its score."""
    if len(pairs) % rows:
        raise ValueError(f"{len(pairs)} pairs do not split evenly into {rows} rows")
    per_row = len(pairs) // rows
    if per_row >= 1 << 15:  # a pair's segment ids (j << 16) + 2 must stay an int32
        raise ValueError(f"{per_row} pairs in one row; at most {(1 << 15) - 1}")
    batch = {"tokens": np.full((rows, length), pad_id, np.int32), "positions": np.full((rows, length), -1, np.int32),
             "segment_ids": np.zeros((rows, length), np.int32)}
    score_row, score_segment = np.zeros((2, len(pairs)), np.int32), np.zeros((2, len(pairs)), np.int32)
    for i, pair in enumerate(pairs):
        row, j = divmod(i, per_row)
        if j == 0:  # pairs fill a row in order, each after the last
            offset = 0
        prompt, *replies = pair_layout(pair, max_length)
        parts = [(prompt, 0, -(j + 1))] + [(ids, len(prompt), (j << 16) + side) for side, ids in enumerate(replies, 1)]
        for ids, start, segment in parts:
            span = slice(offset, offset + len(ids))
            batch["tokens"][row, span], batch["segment_ids"][row, span] = ids, segment
            batch["positions"][row, span] = np.arange(start, start + len(ids))
            offset += len(ids)
        score_row[:, i] = row
        score_segment[:, i] = (j << 16) + 1, (j << 16) + 2
    batch["score_row"], batch["score_segment"] = score_row.reshape(-1), score_segment.reshape(-1)
    return batch


def packed_rewards(model: Decoder, batch: dict) -> jax.Array:
    """(2B,) the reward of each packed sequence: the score head at its last readable token (Decoder.score_readable,
    HF's rule), among its reply's tokens and its prompt's -- the token an unpacked row would be read at (its first
    token where none is readable, as there)."""
    h, _ = model.hidden_states(batch["tokens"], batch["positions"], segment_ids=batch["segment_ids"])
    rows, own = batch["score_row"], batch["score_segment"]
    segments = batch["segment_ids"][rows]
    mine = (segments == own[:, None]) | (segments == prefix_segment(own)[:, None])
    readable = mine & model.score_readable(batch["tokens"][rows], batch["positions"][rows])
    last = jnp.where(readable.any(-1), last_true(readable), jnp.argmax(mine, axis=-1))
    return model.score(h[rows, last])[:, 0]


ROW_TOKENS = 4096  # a packed row's tokens at most (pairs * 2 * max_length): the dense attention off CPU is O(T^2)


def packed_rows(batch_size: int, data_parallel: int, max_length: int) -> int:
    """Rows a batch of pairs packs into: a multiple of the data-parallel axis dividing batch_size, as few as keep
    each row within ROW_TOKENS."""
    per_row = max(1, ROW_TOKENS // (2 * max_length))
    rows = data_parallel
    while batch_size % rows or -(-batch_size // rows) > per_row:
        if rows >= batch_size:
            return batch_size
        rows += data_parallel
    return rows


class RewardObjective:
    """Items are preference pairs; a batch packs B pairs into `rows` rows (`pack_pairs`): rows must divide the
    batch and be a multiple of the data-parallel (fsdp) axis, which splits rows."""

    needs_reference = False
    rollout = None

    def __init__(self, examples: Sequence[PreferenceExample], *, max_length: int, pad_id: int,
                 center_rewards_coefficient: float | None = None, rows: int = 1):
        if rows < 1:
            raise ValueError(f"rows must be >= 1, got {rows}")
        self.examples = list(examples)
        self.num_items = len(self.examples)
        self.max_length, self.pad_id, self.rows = max_length, pad_id, rows
        self.center = center_rewards_coefficient

    def batch_lengths(self, indices: np.ndarray) -> tuple[int]:
        per_row = -(-len(indices) // self.rows)
        totals = [sum(len(ids) for i in indices[r:r + per_row]
                      for ids in pair_layout(self.examples[i], self.max_length))
                  for r in range(0, len(indices), per_row)]
        return (packed_length(max(totals)),)

    def host_batch(self, indices: np.ndarray, valid: np.ndarray, lengths: tuple[int]) -> dict[str, np.ndarray]:
        pairs = [self.examples[i] for i in indices]
        batch = pack_pairs(pairs, self.rows, lengths[0], max_length=self.max_length, pad_id=self.pad_id)
        batch["valid"] = valid.astype(np.float32)
        batch["margin"] = np.asarray([p.margin for p in pairs], np.float32)
        return batch

    def loss(self, ctx: LossContext, batch: dict):
        r = packed_rewards(ctx.policy, batch)
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
