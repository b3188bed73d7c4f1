"""Gemma 3's image encoder: a SigLIP vision tower and the multimodal projector that turn one image into
`mm_tokens_per_image` soft tokens of the decoder's width (HF Gemma3ForConditionalGeneration).

The decoder (models/decoder.py) owns an ImageEncoder when its config has a VisionConfig: the soft tokens
replace the embeddings of the prompt's image placeholder tokens, and the tokens of one image attend to
each other both ways (`image_attend_until`), as HF's Gemma 3 mask does. Linear kernels are (in, out) as in
the decoder; the patch convolution (kernel = stride = patch) is a product over flattened patches.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from tunix_rt.models.config import VisionConfig
from tunix_rt.ops.attention import dot_product_attention
from tunix_rt.ops.rms_norm import rms_norm


def _act(name: str):
    return (lambda x: jax.nn.gelu(x, approximate=True)) if name == "gelu_tanh" else (
        lambda x: jax.nn.gelu(x, approximate=False))


def _linear(din: int, dout: int, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(din, dout, use_bias=True, dtype=jnp.float32, param_dtype=jnp.float32, rngs=rngs)


def _layer_norm(dim: int, eps: float, rngs: nnx.Rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(dim, epsilon=eps, dtype=jnp.float32, param_dtype=jnp.float32, rngs=rngs)


class VisionLayer(nnx.Module):
    """A SigLIP encoder layer: pre-LayerNorm attention over all patches, then a pre-LayerNorm MLP."""

    def __init__(self, cfg: VisionConfig, *, rngs: nnx.Rngs):
        d = cfg.hidden_size
        self.layer_norm1 = _layer_norm(d, cfg.layer_norm_eps, rngs)
        self.q_proj, self.k_proj, self.v_proj = (_linear(d, d, rngs) for _ in range(3))
        self.out_proj = _linear(d, d, rngs)
        self.layer_norm2 = _layer_norm(d, cfg.layer_norm_eps, rngs)
        self.fc1 = _linear(d, cfg.intermediate_size, rngs)
        self.fc2 = _linear(cfg.intermediate_size, d, rngs)
        self.heads, self.act = cfg.num_heads, _act(cfg.activation)

    def __call__(self, x: jax.Array) -> jax.Array:
        n, p, d = x.shape
        hd = d // self.heads
        h = self.layer_norm1(x)
        q, k, v = (proj(h).reshape(n, p, self.heads, hd) for proj in (self.q_proj, self.k_proj, self.v_proj))
        everything = jnp.ones((n, p, p), bool)  # every patch sees every patch
        attn = dot_product_attention(q, k, v, everything, scale=hd ** -0.5).reshape(n, p, d)
        x = x + self.out_proj(attn)
        return x + self.fc2(self.act(self.fc1(self.layer_norm2(x))))


class ImageEncoder(nnx.Module):
    """pixel_values (N, C, H, W) f32, normalised -> soft tokens (N, mm_tokens_per_image, text_hidden) f32."""

    def __init__(self, cfg: VisionConfig, text_hidden: int, *, rngs: nnx.Rngs):
        d, c, p = cfg.hidden_size, cfg.num_channels, cfg.patch_size
        self.config = cfg
        self.patch_embedding = _linear(c * p * p, d, rngs)  # HF's Conv2d (d, c, p, p), flattened to (c*p*p, d)
        self.position_embedding = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (cfg.patches_per_side ** 2, d)))
        self.layers = nnx.List([VisionLayer(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        self.post_layernorm = _layer_norm(d, cfg.layer_norm_eps, rngs)
        # the projector: average pooling, Gemma's RMSNorm (1 + w), then (vision hidden -> text hidden)
        self.mm_soft_emb_norm = nnx.Param(jnp.zeros((d,), jnp.float32))
        self.mm_input_projection = nnx.Param(jnp.zeros((d, text_hidden), jnp.float32))

    def patches(self, pixel_values: jax.Array) -> jax.Array:
        """(N, C, H, W) -> (N, patches, C * p * p), patches row-major and each flattened as (C, p, p)."""
        cfg = self.config
        n, s, p = pixel_values.shape[0], cfg.patches_per_side, cfg.patch_size
        x = pixel_values.reshape(n, cfg.num_channels, s, p, s, p).transpose(0, 2, 4, 1, 3, 5)
        return x.reshape(n, s * s, cfg.num_channels * p * p)

    def __call__(self, pixel_values: jax.Array) -> jax.Array:
        cfg = self.config
        expected = (cfg.num_channels, cfg.image_size, cfg.image_size)
        if pixel_values.ndim != 4 or tuple(pixel_values.shape[1:]) != expected:
            raise ValueError(f"pixel_values must be (images, {', '.join(map(str, expected))}), got "
                             f"{tuple(pixel_values.shape)}")
        x = self.patch_embedding(self.patches(pixel_values.astype(jnp.float32))) + self.position_embedding[...]
        for layer in self.layers:
            x = layer(x)
        x = self.post_layernorm(x)
        n, t, k, d = x.shape[0], cfg.tokens_per_side, cfg.pool, cfg.hidden_size
        pooled = x.reshape(n, t, k, t, k, d).mean(axis=(2, 4)).reshape(n, t * t, d)
        normed = rms_norm(pooled, self.mm_soft_emb_norm[...], eps=cfg.layer_norm_eps, offset=1.0)
        return jnp.matmul(normed, self.mm_input_projection[...], precision=jax.lax.Precision.HIGHEST)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ImageTokens:
    """Images already encoded, laid on a step's tokens (the engine's form: its chunks cut images nowhere but the
    prompt's tokens arrive a chunk at a time). `is_image` (B, T): the tokens an image's soft token replaces (a
    placeholder id the model sampled is a token like any other); `embeds` (B, T, D): those soft tokens (anything
    elsewhere); `attend_until` (B, T): the last position each token sees (image_attend_until's rule)."""

    is_image: jax.Array
    embeds: jax.Array
    attend_until: jax.Array


def image_spans(tokens, image_token_id: int) -> list[tuple[int, int]]:
    """[start, end) of each run of image placeholders in a host token list, in order."""
    spans, start = [], None
    for i, t in enumerate([*tokens, None]):
        if t == image_token_id and start is None:
            start = i
        elif t != image_token_id and start is not None:
            spans.append((start, i))
            start = None
    return spans


def merge_image_tokens(embeddings: jax.Array, tokens: jax.Array, soft_tokens: jax.Array,
                       image_token_id: int) -> jax.Array:
    """The token embeddings (B, T, D) with the image placeholders' replaced by the soft tokens (N, M, D), taken
    in order: the i-th placeholder of the flattened batch gets soft token i (HF's masked_scatter)."""
    is_image = tokens == image_token_id
    flat = soft_tokens.reshape(-1, soft_tokens.shape[-1]).astype(embeddings.dtype)
    index = jnp.cumsum(is_image.reshape(-1)).reshape(is_image.shape) - 1
    return jnp.where(is_image[..., None], flat[jnp.clip(index, 0, flat.shape[0] - 1)], embeddings)


def image_attend_until(tokens: jax.Array, positions: jax.Array, image_token_id: int) -> jax.Array:
    """(B, T): the last key position each query sees. A text token sees up to itself; an image placeholder up
    to the last placeholder of its run, so one image's tokens attend to each other both ways and never to a
    later image (HF Gemma 3's OR(causal, same image block) mask)."""
    b, t = tokens.shape
    is_image = tokens == image_token_id
    starts = is_image & ~jnp.pad(is_image, ((0, 0), (1, 0)))[:, :-1]
    run = jnp.cumsum(starts, axis=1) - 1  # a row's image runs 0, 1, ...
    segment = jnp.where(is_image, jnp.arange(b)[:, None] * t + run, b * t)  # text in a dump segment
    last = jax.ops.segment_max(jnp.where(is_image, positions, -1).reshape(-1), segment.reshape(-1),
                               num_segments=b * t + 1)
    return jnp.where(is_image, last[jnp.clip(segment, 0, b * t - 1)], positions)

