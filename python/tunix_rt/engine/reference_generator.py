"""The reference generator: dense KV cache, jitted prefill and decode steps with a donated cache.

Simple on purpose: the rollout engine (paged cache, continuous batching) is checked against it, so it runs the
engine's batch-invariant kernels (models/batch_invariant.py) and differs from it only in its cache and batching.
Prompts are left-padded into one batch; prompt and cache lengths are bucketed to powers of two so
repeated calls reuse compiled programs.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tunix_rt.engine.sampler import sample
from tunix_rt.models.batch_invariant import use_batch_invariant_kernels
from tunix_rt.models.decoder import Decoder
from tunix_rt.models.scoring import bucket

log = logging.getLogger(__name__)


@dataclasses.dataclass(kw_only=True, frozen=True)
class GenerationConfig:
    max_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be a non-negative integer (0 = off), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")


@dataclasses.dataclass(frozen=True)
class Generation:
    prompt_token_ids: list[int]
    token_ids: list[int]  # includes the stop token when one ended the sequence
    finish_reason: str  # "stop" | "length"


@functools.partial(jax.jit, static_argnums=0, donate_argnames="cache")
def _prefill(graphdef, state, tokens, positions, cache, pixel_values):
    model = use_batch_invariant_kernels(nnx.merge(graphdef, state))
    h, cache = model.hidden_states(tokens, positions, cache, pixel_values=pixel_values)
    return model.logits(h[:, -1]), cache


@functools.partial(jax.jit, static_argnums=0, donate_argnames="cache")
def _decode(graphdef, state, logits, positions, cache, key, temperature, top_k, top_p):
    """Sample from `logits`, then run the sampled tokens through the model."""
    tokens = sample(logits, key, temperature, top_k, top_p)
    model = use_batch_invariant_kernels(nnx.merge(graphdef, state))
    h, cache = model.hidden_states(tokens[:, None], positions[:, None], cache)
    return tokens, model.logits(h[:, -1]), cache


def generate(model: Decoder, prompts: Sequence[Sequence[int]], config: GenerationConfig,
             pixel_values: np.ndarray | None = None) -> list[Generation]:
    """`pixel_values` (N, C, H, W): the images of the prompts' N runs of image placeholders, in order."""
    if not prompts:
        return []
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompts[{i}] is empty: give at least one token")
        vocab = model.config.vocab_size
        if min(p) < 0 or max(p) >= vocab:
            raise ValueError(f"prompts[{i}] holds token ids outside [0, {vocab})")
    batch, longest = len(prompts), max(len(p) for p in prompts)
    prompt_len = bucket(longest)
    cache_len = bucket(prompt_len + config.max_tokens, 64)
    tokens = np.zeros((batch, prompt_len), np.int32)
    positions = np.full((batch, prompt_len), -1, np.int32)
    for i, p in enumerate(prompts):
        tokens[i, prompt_len - len(p):] = p
        positions[i, prompt_len - len(p):] = np.arange(len(p))
    next_pos = np.array([len(p) for p in prompts], np.int32)

    graphdef, state = nnx.split(model)
    cache = model.new_cache(batch, cache_len)
    vision = model.config.vision
    if pixel_values is not None and vision is not None:  # counted here, where the tokens are concrete
        held = sum(int(np.sum(np.asarray(p) == vision.image_token_id)) for p in prompts)
        if held != len(pixel_values) * vision.mm_tokens_per_image:
            raise ValueError(f"{len(pixel_values)} image(s) need {vision.mm_tokens_per_image} placeholder tokens each, "
                             f"the prompts hold {held}")
    logits, cache = _prefill(graphdef, state, jnp.asarray(tokens), jnp.asarray(positions), cache,
                             None if pixel_values is None else jnp.asarray(pixel_values, jnp.float32))
    temperature = jnp.full((batch,), config.temperature, jnp.float32)
    top_k = jnp.full((batch,), config.top_k, jnp.int32)
    top_p = jnp.full((batch,), config.top_p, jnp.float32)
    key = jax.random.key(config.seed)
    stop = set(config.stop_token_ids)

    outputs: list[list[int]] = [[] for _ in prompts]
    finish: list[str | None] = [None] * batch
    for step in range(config.max_tokens):
        sampled, logits, cache = _decode(graphdef, state, logits, jnp.asarray(next_pos), cache,
                                         jax.random.fold_in(key, step), temperature, top_k, top_p)
        next_pos = next_pos + 1
        for i, tok in enumerate(np.asarray(sampled).tolist()):
            if finish[i] is not None:
                continue
            outputs[i].append(tok)
            if tok in stop:
                finish[i] = "stop"
            elif len(outputs[i]) >= config.max_tokens:
                finish[i] = "length"
        if all(f is not None for f in finish):
            break
    return [Generation(list(p), out, f or "length") for p, out, f in zip(prompts, outputs, finish)]
