"""Rotary position embeddings (HF's rotate-half layout) for default, linear and llama3 rope types."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from tunix_rt.models.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """Per-pair inverse frequencies in float32, computed as transformers does."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (1.0 / (np.float32(rope.theta) ** exponents)).astype(np.float32)
    if rope.rope_type == "linear":
        return (inv_freq / np.float32(rope.factor)).astype(np.float32)
    if rope.rope_type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)
    return inv_freq


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate x of shape (B, T, H, D) by angle positions * inv_freq (positions: (B, T)).

    The angles, their cos/sin and the two products sit behind optimization barriers: XLA:CPU contracts a
    multiply feeding an add into an FMA wherever the two land in one fusion, and fusion follows the program
    around them, so without the barriers a token's rotation could round differently in the engine's step and
    in the trainer's (the exact mode needs them equal)."""
    angles = jax.lax.optimization_barrier(positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq))
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]  # (B, T, 1, D)
    cos, sin = jax.lax.optimization_barrier((jnp.cos(angles), jnp.sin(angles)))
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    a, b = jax.lax.optimization_barrier((xf * cos, rotated * sin))
    return (a + b).astype(x.dtype)
