"""A sequence classifier's (a reward model's) scores of token lists: what the server's /pooling and /classify
answer and what GRPO/PPO's --reward-model rewards read. Rows are right-padded to a bucketed length, a jitted
forward per (rows, length) bucket, one batch at a time (the lock bounds the memory of concurrent callers)."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tunix_rt.models.batch_invariant import use_batch_invariant_kernels
from tunix_rt.models.decoder import Decoder
from tunix_rt.models.scoring import bucket


class SequenceScorer:
    """(n, num_labels) f32 scores of token lists under a sequence classification model."""

    def __init__(self, model: Decoder, *, batch_size: int = 16, max_batch_tokens: int = 16384):
        if not model.config.num_labels:
            raise ValueError("a sequence scorer needs a sequence classification (reward) model; this is a causal LM")
        self.graphdef, self.state = nnx.split(model)
        self.num_labels = model.config.num_labels
        self.batch_size, self.max_batch_tokens = batch_size, max_batch_tokens
        self._lock = threading.Lock()
        graphdef = self.graphdef

        @jax.jit
        def forward(state, tokens, positions):
            m = use_batch_invariant_kernels(nnx.merge(graphdef, state))
            h, _ = m.hidden_states(tokens, positions)
            return m.sequence_scores(h, tokens, positions)

        self._forward = forward

    def __call__(self, sequences: list[list[int]]) -> np.ndarray:
        """Scores in the given order; computed shortest first in batches of at most batch_size rows and
        max_batch_tokens padded tokens (one long sequence never pads many short ones)."""
        out = np.zeros((len(sequences), self.num_labels), np.float32)
        order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
        start = 0
        while start < len(order):
            end = start + 1
            while (end < len(order) and end - start < self.batch_size
                   and (end - start + 1) * bucket(len(sequences[order[end]]), 16) <= self.max_batch_tokens):
                end += 1
            rows = order[start:end]
            out[rows] = self._batch([sequences[i] for i in rows])
            start = end
        return out

    def _batch(self, sequences: list[list[int]]) -> np.ndarray:
        rows, length = bucket(len(sequences), 1), bucket(max(len(t) for t in sequences), 16)
        tokens = np.zeros((rows, length), np.int32)
        positions = np.full((rows, length), -1, np.int32)
        for i, ids in enumerate(sequences):
            tokens[i, :len(ids)] = ids
            positions[i, :len(ids)] = np.arange(len(ids))
        positions[len(sequences):, 0] = 0  # filler rows: one token each, never read
        with self._lock:
            out = self._forward(self.state, jnp.asarray(tokens), jnp.asarray(positions))
        return np.asarray(out)[:len(sequences)]
