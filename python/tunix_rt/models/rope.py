"""Rotary position embeddings (HF's rotate-half layout) for default, linear, llama3, yarn and dynamic rope types."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from tunix_rt.models.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """Per-pair inverse frequencies in float32, computed as transformers does (dynamic: those of positions within
    max_position_embeddings; dynamic_inverse_frequencies gives every position's)."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    pos_freqs = (np.float32(rope.theta) ** exponents).astype(np.float32)
    inv_freq = (1.0 / pos_freqs).astype(np.float32)
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
    if rope.rope_type == "yarn":
        return _yarn_inverse_frequencies(rope, head_dim, pos_freqs)
    return inv_freq


def dynamic_inverse_frequencies(rope: RopeConfig, head_dim: int, positions: jax.Array) -> jax.Array:
    """Dynamic NTK scaling (transformers' "dynamic"): once a sequence runs past the model's
    max_position_embeddings, the base grows to theta * (factor * L / max - (factor - 1)) ** (d / (d - 2)), in
    float32 as transformers computes it. L is the token's own position plus one: the length transformers uses
    for each token as it generates one at a time with its cache, so a key keeps the rotation it was written with
    whether its sequence was prefilled in chunks, decoded, cached as a prefix or trained on. (A single
    transformers forward over a whole sequence longer than max_position_embeddings instead rotates every token
    by the whole sequence's length, which its own generation does not reproduce.) positions (B, T) -> (B, T,
    head_dim / 2)."""
    max_len = np.float32(rope.original_max_position_embeddings)
    factor = np.float32(rope.factor)
    length = jnp.maximum(positions.astype(jnp.float32) + 1, max_len)
    base = np.float32(rope.theta) * ((factor * length / max_len) - (factor - 1)) ** np.float32(head_dim / (head_dim - 2))
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    return 1.0 / (base[..., None] ** exponents)


def _yarn_inverse_frequencies(rope: RopeConfig, dim: int, pos_freqs: np.ndarray) -> np.ndarray:
    """YaRN (arXiv 2309.00071) as transformers computes it: the original frequencies above the fast boundary
    (beta_fast rotations over the pretraining length), frequencies divided by `factor` below the slow one, a
    linear ramp over the dimensions between; float32 where transformers uses float32."""
    base, length = rope.theta, rope.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(length / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation = (np.float32(1) - ramp).astype(np.float32)
    interpolation = (np.float32(1) / (np.float32(rope.factor) * pos_freqs)).astype(np.float32)
    extrapolated = (np.float32(1) / pos_freqs).astype(np.float32)
    return (interpolation * (np.float32(1) - extrapolation) + extrapolated * extrapolation).astype(np.float32)


def attention_scaling(rope: RopeConfig) -> float:
    """The factor transformers multiplies cos and sin by: yarn's attention_factor (given, or derived from
    factor and mscale / mscale_all_dim as transformers derives it); 1 for every other rope type."""
    if rope.rope_type != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return float(rope.attention_factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if rope.mscale and rope.mscale_all_dim:
        return mscale(rope.factor, rope.mscale) / mscale(rope.factor, rope.mscale_all_dim)
    return mscale(rope.factor)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray | jax.Array, scaling: float = 1.0) -> jax.Array:
    """Rotate x of shape (B, T, H, D) by angle positions * inv_freq (positions: (B, T); inv_freq: (D / 2,), or
    (B, T, D / 2) per token for dynamic ropes), cos and sin times `scaling` (attention_scaling: yarn's, else 1).

    The angles, their cos/sin and the two products sit behind optimization barriers: XLA:CPU contracts a
    multiply feeding an add into an FMA wherever the two land in one fusion, and fusion follows the program
    around them, so without the barriers a token's rotation could round differently in the engine's step and
    in the trainer's (the exact mode needs them equal).

    The halves are rotated apart, (x1 c - x2 s, x2 c + x1 s), and joined once at the end: the rotate-half form
    x * cos + concat(-x2, x1) * sin (the same bits) had XLA:CPU read through a concatenate inside every
    elementwise loop: 1.6x the time of this one forward, 1.3x forward and backward."""
    angles = jax.lax.optimization_barrier(positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq))
    angles = angles[:, :, None, :]  # (B, T, 1, D / 2)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if scaling != 1.0:
        cos, sin = cos * np.float32(scaling), sin * np.float32(scaling)
    cos, sin = jax.lax.optimization_barrier((cos, sin))
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    x1, x2 = xf[..., :half], xf[..., half:]
    a1, b1, a2, b2 = jax.lax.optimization_barrier((x1 * cos, x2 * sin, x2 * cos, x1 * sin))
    return jnp.concatenate([a1 - b1, a2 + b2], axis=-1).astype(x.dtype)
