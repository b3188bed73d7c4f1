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
    model = nnx.merge(graphdef, state)
    logp = jax.nn.log_softmax(model(tokens, positions)[:, :-1], axis=-1)
    return jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]


def token_logprobs(model: Decoder, token_ids: list[int]) -> list[float | None]:
    """logprobs[i] = log p(token_i | token_0..i-1); None for the first token, which has no context."""
    n = len(token_ids)
    if n == 0:
        return []
    vocab = model.config.vocab_size
    if min(token_ids) < 0 or max(token_ids) >= vocab:
        raise ValueError(f"token ids must lie in [0, {vocab}) for this model, got {min(token_ids)}..{max(token_ids)}")
    size = bucket(n)
    tokens = np.zeros((1, size), np.int32)
    tokens[0, :n] = token_ids
    positions = np.full((1, size), -1, np.int32)  # padding: never attended to
    positions[0, :n] = np.arange(n)
    graphdef, state = nnx.split(model)
    logp = np.asarray(_token_logprobs(graphdef, state, jnp.asarray(tokens), jnp.asarray(positions)))
    return [None] + [float(x) for x in logp[0, : n - 1]]
