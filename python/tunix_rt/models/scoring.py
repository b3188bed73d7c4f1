"""Teacher-forced log-probabilities: log p(token_t | tokens before t) under a decoder."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tunix_rt.models.decoder import Decoder


def bucket(n: int, minimum: int = 32) -> int:
    """Round n up to a power of two (>= minimum) so nearby lengths share one compiled program."""
    size = minimum
    while size < n:
        size *= 2
    return size


@functools.partial(jax.jit, static_argnums=0)
def _token_logprobs(graphdef, state, tokens, positions):
    """log p(token t+1 | tokens to t) through the fused chunked head: no (batch, length, vocab) logits."""
    model = nnx.merge(graphdef, state)
    h, _ = model.hidden_states(tokens, positions)
    return model.token_logprobs(h[:, :-1], tokens[:, 1:])[0]


def token_logprobs(model: Decoder, token_ids: list[int]) -> list[float | None]:
    """logprobs[i] = log p(token_i | token_0..i-1); None for the first token, which has no context."""
    if not token_ids:
        return []
    [logp] = batch_token_logprobs(model, [list(token_ids)], batch_size=1)
    return [None] + [float(x) for x in logp]


def batch_token_logprobs(model: Decoder, sequences: list[list[int]], *, batch_size: int = 8,
                         progress=None) -> list[np.ndarray]:
    """token_logprobs of many sequences: logprobs[i][t] = log p(token_t+1 | tokens 0..t) (one entry fewer than the
    sequence has tokens). Sequences of one bucketed length go together, `batch_size` at a time (a last short
    batch padded with empty rows), so a file's rows compile a handful of programs; `progress(n)` is called with
    the tokens of each batch done. A sequence longer than the model's positions is refused."""
    vocab, longest = model.config.vocab_size, model.config.max_position_embeddings
    for i, ids in enumerate(sequences):
        if ids and (min(ids) < 0 or max(ids) >= vocab):
            raise ValueError(f"token ids must lie in [0, {vocab}) for this model, got {min(ids)}..{max(ids)}"
                             f"{f' in sequence {i}' if len(sequences) > 1 else ''}")
        if len(ids) > longest:
            raise ValueError(f"a sequence of {len(ids)} tokens is longer than the model's {longest} positions"
                             f"{f' (sequence {i})' if len(sequences) > 1 else ''}")
    graphdef, state = nnx.split(model)
    out: list[np.ndarray | None] = [None] * len(sequences)
    by_size: dict[int, list[int]] = {}
    for i, ids in enumerate(sequences):
        if len(ids) < 2:
            out[i] = np.zeros(0, np.float32)
        else:
            by_size.setdefault(bucket(len(ids)), []).append(i)
    for size, members in sorted(by_size.items()):
        for start in range(0, len(members), batch_size):
            rows = members[start:start + batch_size]
            tokens = np.zeros((batch_size, size), np.int32)
            positions = np.full((batch_size, size), -1, np.int32)  # padding: never attended to
            for r, i in enumerate(rows):
                n = len(sequences[i])
                tokens[r, :n] = sequences[i]
                positions[r, :n] = np.arange(n)
            logp = np.asarray(_token_logprobs(graphdef, state, jnp.asarray(tokens), jnp.asarray(positions)))
            for r, i in enumerate(rows):
                out[i] = logp[r, : len(sequences[i]) - 1].astype(np.float32)
            if progress is not None:
                progress(sum(len(sequences[i]) for i in rows))
    return out
