"""The one decoder: Llama 3 / SmolLM2, Mistral, Qwen2/2.5, Qwen3, Gemma 1/2/3 text and the MoE
families (Mixtral, Qwen2-MoE, Qwen3-MoE), from a ModelConfig.

Kernels are stored (in, out) so a layer is x @ W; checkpoints/ maps HF's (out, in) tensors onto
these paths. RMSNorm runs through the FFI op (tunix_rt.ops.rms_norm).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from tunix_rt.models.config import ModelConfig
from tunix_rt.models.kv_cache import DenseKVCache, PagedKVCache
from tunix_rt.models.layer_stack import LayerStack, LayerView
from tunix_rt.models.quant_layers import QuantEmbed, QuantLinear
from tunix_rt.models.remat import recompute_in_backward, saved_value, tie
from tunix_rt.models.rope import apply_rope, attention_scaling, dynamic_inverse_frequencies, inverse_frequencies
from tunix_rt.models.vision import ImageEncoder, ImageTokens, image_attend_until, merge_image_tokens
from tunix_rt.ops import attention, grouped_matmul, permute, rms_norm, router_topk, unpermute
from tunix_rt.ops.attention import SAVED_NAMES as ATTENTION_SAVED
from tunix_rt.ops.fused_head import head_logprobs
from tunix_rt.ops.matmul import invariant_dot_general, matmul
from tunix_rt.ops.quant import dequantize

_ACT = {
    "silu": jax.nn.silu,
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
}


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, *, eps: float, offset: float, dtype):
        self.scale = nnx.Param(jnp.full((dim,), 1.0 - offset, dtype))
        self.eps, self.offset = eps, offset

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.scale[...], eps=self.eps, offset=self.offset)


class Embed(nnx.Embed):
    """nnx.Embed whose `attend` (the tied output head) takes its product from `dot_general`, as
    nnx.Linear does, so bf16 training sends it to the same matmul kernel as the linear layers.
    With `fake_quant` (models/qat.py) both read the table as the export will quantize it."""

    fake_quant = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.dot_general = jax.lax.dot_general

    def table(self) -> jax.Array:
        table = self.embedding[...]
        return table if self.fake_quant is None else self.fake_quant.rows(table)

    def __call__(self, inputs: jax.Array, out_sharding=None) -> jax.Array:
        if self.fake_quant is None:
            return super().__call__(inputs, out_sharding=out_sharding)
        (table,) = self.promote_dtype((self.table(),), dtype=self.dtype, inexact=False)
        return jnp.take(table, inputs, axis=0)

    def attend(self, query: jax.Array, out_sharding=None) -> jax.Array:
        query, embedding = self.promote_dtype((query, self.table()), dtype=self.dtype)
        return self.dot_general(query, embedding, (((query.ndim - 1,), (1,)), ((), ())), out_sharding=out_sharding)


class Linear(nnx.Linear):
    """nnx.Linear whose kernel may be a LayerView (one layer of a stacked weight, read in place): the engine's
    row-invariant GEMM indexes the stack itself; any other product reads the layer's slice. With `fake_quant`
    (models/qat.py) the product takes the kernel as the export will quantize it."""

    fake_quant = None

    def __call__(self, inputs: jax.Array, out_sharding=None) -> jax.Array:
        if self.fake_quant is not None:
            bias = None if self.bias is None else self.bias[...]
            inputs, kernel, bias = self.promote_dtype((inputs, self.fake_quant(self.kernel[...]), bias),
                                                      dtype=self.dtype)
            y = self.dot_general(inputs, kernel, (((inputs.ndim - 1,), (0,)), ((), ())))
            return y if bias is None else y + bias
        w = self.kernel.get_value()
        if not (isinstance(w, LayerView) and self.dot_general is invariant_dot_general and out_sharding is None
                and inputs.dtype == w.dtype == jnp.dtype(self.dtype or w.dtype)):
            return super().__call__(inputs, out_sharding)
        y = matmul(inputs, w.stack, layer=w.index)
        return y if self.bias is None else y + self.bias[...].astype(y.dtype)


class HeadParam(nnx.Param):
    """The weights of a head trained in full even under LoRA: PPO's value head, a reward model's score head."""


class ScoreHead(nnx.Module):
    """HF *ForSequenceClassification's `score`: hidden states (..., D) -> (..., num_labels) f32, no bias."""

    def __init__(self, hidden_size: int, num_labels: int, *, rngs: nnx.Rngs):
        self.kernel = HeadParam(nnx.initializers.normal(0.02)(rngs.params(), (hidden_size, num_labels), jnp.float32))

    def __call__(self, h: jax.Array) -> jax.Array:
        return jnp.matmul(h.astype(jnp.float32), self.kernel[...].astype(jnp.float32),
                          precision=jax.lax.Precision.HIGHEST)


def _linear(cfg_dtype, rngs, din, dout, bias):
    return Linear(din, dout, use_bias=bias, dtype=cfg_dtype, param_dtype=cfg_dtype, rngs=rngs,
                      kernel_init=nnx.initializers.normal(0.02))


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, dtype, rngs: nnx.Rngs):
        h, kv, d, hid = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
        self.q_proj = _linear(dtype, rngs, hid, h * d, cfg.qkv_bias)
        self.k_proj = _linear(dtype, rngs, hid, kv * d, cfg.qkv_bias)
        self.v_proj = _linear(dtype, rngs, hid, kv * d, cfg.qkv_bias)
        self.o_proj = _linear(dtype, rngs, h * d, hid, cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, eps=cfg.rms_norm_eps, offset=cfg.norm_offset, dtype=dtype)
            self.k_norm = RMSNorm(d, eps=cfg.rms_norm_eps, offset=cfg.norm_offset, dtype=dtype)
        self.window = cfg.window(layer)
        self.rope = cfg.rope_for(layer)
        self.shape = (h, kv, d)
        self.scale, self.softcap, self.qk_norm = cfg.query_scale, cfg.attn_logit_softcap, cfg.qk_norm

    def __call__(self, x, positions, cache: DenseKVCache | PagedKVCache | None, segment_ids=None, layer=None,
                 attend_until=None):
        b, t, _ = x.shape
        h, kv, d = self.shape
        q = self.q_proj(x).reshape(b, t, h, d)
        k = self.k_proj(x).reshape(b, t, kv, d)
        v = self.v_proj(x).reshape(b, t, kv, d)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope.rope_type == "dynamic":
            inv_freq = dynamic_inverse_frequencies(self.rope, d, positions)
        else:
            inv_freq = inverse_frequencies(self.rope, d)
        scaling = attention_scaling(self.rope)
        q = apply_rope(q, positions, inv_freq, scaling)
        k = apply_rope(k, positions, inv_freq, scaling)
        if cache is None:
            q, k, v = (saved_value(a, name) for a, name in zip((q, k, v), ("attention_q", "attention_k", "attention_v")))
            out = attention(q, k, v, positions, segment_ids, scale=self.scale, window=self.window, softcap=self.softcap,
                            attend_until=attend_until)
        else:
            cache, out = cache.attend(layer, q, k, v, positions, window=self.window, scale=self.scale,
                                      softcap=self.softcap, attend_until=attend_until)
        return self.o_proj(out.reshape(b, t, h * d)), cache


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs, intermediate_size: int | None = None):
        inter = intermediate_size or cfg.intermediate_size
        self.gate_proj = _linear(dtype, rngs, cfg.hidden_size, inter, False)
        self.up_proj = _linear(dtype, rngs, cfg.hidden_size, inter, False)
        self.down_proj = _linear(dtype, rngs, inter, cfg.hidden_size, False)
        self.act = _ACT[cfg.activation]

    def __call__(self, x):
        gate, up = saved_value(self.gate_proj(x), "mlp_gate"), saved_value(self.up_proj(x), "mlp_up")
        return self.down_proj(self.act(gate) * up)


class Experts(nnx.Module):
    """The experts' gated MLP weights stacked on a leading expert axis, kernels (in, out)."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        init = nnx.initializers.normal(0.02)
        self.gate_proj = nnx.Param(init(rngs.params(), (e, h, i), dtype))
        self.up_proj = nnx.Param(init(rngs.params(), (e, h, i), dtype))
        self.down_proj = nnx.Param(init(rngs.params(), (e, i, h), dtype))


class MoEMLP(nnx.Module):
    """Routed MLP: each token runs through its top-k experts, combined by the router's weights.

    Tokens are permuted into expert-sorted rows so each expert multiplies only its own rows
    (tunix_rt.ops' grouped matmul): a decode step reads just the routed experts' weights.
    Qwen2-MoE adds a shared expert every token takes, scaled by sigmoid(shared_expert_gate(x)).
    """

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        self.router = _linear(dtype, rngs, cfg.hidden_size, cfg.num_experts, False)
        self.experts = Experts(cfg, dtype=dtype, rngs=rngs)
        self.shared = cfg.shared_expert_intermediate_size > 0
        if self.shared:
            self.shared_expert = MLP(cfg, dtype=dtype, rngs=rngs, intermediate_size=cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = _linear(dtype, rngs, cfg.hidden_size, 1, False)
        self.act = _ACT[cfg.activation]
        self.num_experts, self.top_k, self.renormalize = cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.record_router_logits = False  # training's auxiliary losses turn it on (record_router_logits)

    def __call__(self, x):
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        logits = self.router(flat)
        if self.record_router_logits:
            self.sow(nnx.Intermediate, "router_logits", logits)
        weights, ids = router_topk(logits, self.top_k, renormalize=self.renormalize)
        rows, row_of, group_sizes = permute(flat, ids, self.num_experts)
        ex = self.experts
        gate = saved_value(_experts_matmul(rows, ex.gate_proj.get_value(), group_sizes), "mlp_gate")
        up = saved_value(_experts_matmul(rows, ex.up_proj.get_value(), group_sizes), "mlp_up")
        out = unpermute(_experts_matmul(self.act(gate) * up, ex.down_proj.get_value(), group_sizes), row_of, weights)
        if self.shared:  # the product behind a barrier: no FMA with the add, whatever the fusion
            out = out + jax.lax.optimization_barrier(jax.nn.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat))
        return out.reshape(shape)


def _experts_matmul(rows, w, group_sizes):
    """grouped_matmul over one layer's experts; a LayerView's stack (layers, experts, in, out) is read in place as
    layers x experts groups, the other layers' groups empty."""
    if not isinstance(w, LayerView):
        return grouped_matmul(rows, w, group_sizes)
    layers, experts = w.stack.shape[:2]
    sizes = jax.lax.dynamic_update_slice(jnp.zeros((layers * experts,), group_sizes.dtype), group_sizes,
                                         (w.index * experts,))
    return grouped_matmul(rows, w.stack.reshape(layers * experts, *w.stack.shape[2:]), sizes)


# What a training layer keeps for its backward (named by remat.saved_value; LayerStack recomputes the rest): its
# input, the products and the attention kernel's results, not the norms, activations and LoRA products made
# from them.
SAVED_IN_TRAINING = ("layer_input", "attention_q", "attention_k", "attention_v", *ATTENTION_SAVED, "residual",
                     "mlp_gate", "mlp_up")


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, dtype, rngs: nnx.Rngs):
        norm = lambda: RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, offset=cfg.norm_offset, dtype=dtype)
        self.input_norm = norm()
        self.attn = Attention(cfg, layer, dtype=dtype, rngs=rngs)
        self.pre_mlp_norm = norm()
        self.mlp = MoEMLP(cfg, dtype=dtype, rngs=rngs) if cfg.is_moe_layer(layer) else MLP(cfg, dtype=dtype, rngs=rngs)
        self.sandwich = cfg.sandwich_norms
        if cfg.sandwich_norms:
            self.post_attn_norm = norm()
            self.post_mlp_norm = norm()

    def __call__(self, x, positions, cache, segment_ids=None, layer=None, attend_until=None):
        """`layer`: the layer's index in the decoder (a traced int32 in a scanned segment), which the cache needs;
        `attend_until`: the last key position each query sees, where images' tokens see their whole image."""
        attn, cache = self.attn(self.input_norm(x), positions, cache, segment_ids, layer, attend_until)
        x = saved_value(x + (self.post_attn_norm(attn) if self.sandwich else attn), "residual")
        mlp = self.mlp(self.pre_mlp_norm(x))
        return x + (self.post_mlp_norm(mlp) if self.sandwich else mlp), cache


class Decoder(nnx.Module):
    """tokens (B, T) + positions (B, T) [+ dense cache] [+ images] -> f32 logits (B, T, vocab) [, cache].

    Training on packed rows passes `segment_ids` (B, T) instead of a cache: attention stays
    within each packed example. Training takes `hidden_states` and `token_logprobs` instead of logits,
    so no (tokens, vocab) logits exist; `remat` (gradient checkpointing) recomputes each layer's
    activations in the backward pass instead of keeping them. A Gemma 3 multimodal config adds `vision`
    (models/vision.py): `pixel_values` (N, C, H, W) become the soft tokens of the prompt's N runs of image
    placeholders, in order.
    """

    fake_quant = None  # models/qat.py: the output head as the export will quantize it

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = cfg
        self.dtype = jnp.dtype(dtype)
        self.embed = Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=dtype, rngs=rngs,
                               embedding_init=nnx.initializers.normal(0.02))
        self.layers = LayerStack(lambda i, rngs: DecoderLayer(cfg, i, dtype=dtype, rngs=rngs),
                                 [cfg.layer_kind(i) for i in range(cfg.num_layers)], rngs=rngs, saved=SAVED_IN_TRAINING)
        self.final_norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, offset=cfg.norm_offset, dtype=dtype)
        if cfg.num_labels:  # a sequence classifier (a reward model): a score head, no vocabulary head
            self.score = ScoreHead(cfg.hidden_size, cfg.num_labels, rngs=rngs)
        elif not cfg.tie_word_embeddings:
            self.lm_head = _linear(dtype, rngs, cfg.hidden_size, cfg.vocab_size, False)
        if cfg.vision is not None:
            self.vision = ImageEncoder(cfg.vision, cfg.hidden_size, rngs=rngs)
        self.remat = False

    def hidden_states(self, tokens, positions, cache: DenseKVCache | PagedKVCache | None = None, segment_ids=None,
                      pixel_values=None, image_tokens: ImageTokens | None = None):
        """`pixel_values` (N, C, H, W): images for the tokens' N runs of placeholders, encoded here; or
        `image_tokens`: images encoded already, laid on the tokens (the engine's steps)."""
        x, attend_until = self._embed(tokens, positions, pixel_values, image_tokens)
        if cache is not None:
            cache = cache.begin(positions)
        if cache is not None and segment_ids is not None:
            raise ValueError("segment_ids are for training on packed rows, not for decoding with a cache")

        def run(layer: DecoderLayer, carry, index):
            x, cache = carry
            if self.remat and cache is None:
                return _remat_layer(layer, x, positions, segment_ids, attend_until, self.dtype), cache
            if cache is None:
                if self.dtype != jnp.float32:  # a layer's f32 params, cast in the scan
                    nnx.update(layer, _f32_as(nnx.state(layer, nnx.Param), self.dtype))
                # what a scanned layer's recomputation starts from, named for its dtype (not inside _remat_layer,
                # which keeps its input itself: named twice, the scan would stack it twice)
                x = saved_value(x, "layer_input")
            return layer(x, positions, cache, segment_ids, index, attend_until)

        x, cache = self.layers((x, cache), run, recomputes=self.remat and cache is None)
        if cache is not None:
            cache = cache.end(tokens.shape[1])
        return self.final_norm(x), cache

    def _embed(self, tokens, positions, pixel_values, image_tokens):
        """The scaled token embeddings with the images' soft tokens in their placeholders, and the attention's
        `attend_until` (None without images)."""
        vision = self.config.vision
        if (pixel_values is not None or image_tokens is not None) and vision is None:
            raise ValueError(f"images given to a text-only {self.config.architecture} model")
        if pixel_values is not None and image_tokens is not None:
            raise ValueError("give images as pixel_values or as image_tokens, not both")
        ids = tokens
        if vision is not None and vision.image_token_id >= self.config.vocab_size:
            ids = jnp.where(tokens == vision.image_token_id, 0, tokens)  # a placeholder outside the vocabulary: HF embeds 0
        x = self.embed(ids)
        if self.config.embed_scale is not None:  # HF rounds the scale to the weights' dtype first
            x = x * jnp.asarray(self.config.embed_scale, self.dtype)
        if image_tokens is not None:
            is_image = image_tokens.is_image[..., None]
            return jnp.where(is_image, image_tokens.embeds.astype(x.dtype), x), image_tokens.attend_until
        if pixel_values is None:
            return x, None
        if not isinstance(tokens, jax.core.Tracer):
            placeholders = int((tokens == vision.image_token_id).sum())
            if placeholders != pixel_values.shape[0] * vision.mm_tokens_per_image:
                raise ValueError(f"{pixel_values.shape[0]} image(s) need {vision.mm_tokens_per_image} placeholder "
                                 f"tokens (id {vision.image_token_id}) each, the tokens hold {placeholders}")
        x = merge_image_tokens(x, tokens, self.vision(pixel_values), vision.image_token_id)
        return x, image_attend_until(tokens, positions, vision.image_token_id)

    def output_head(self) -> nnx.Module:
        """The module mapping hidden states to vocabulary scores: the tied embedding or lm_head."""
        if self.config.num_labels:
            raise ValueError(f"a sequence classification model ({self.config.num_labels} label(s)) has no vocabulary "
                             "head: it scores sequences (sequence_scores), it does not generate")
        return self.embed if self.config.tie_word_embeddings else self.lm_head

    def sequence_scores(self, h: jax.Array, tokens: jax.Array, positions: jax.Array) -> jax.Array:
        """(B, num_labels) f32: the score head at each row's last token that is real (position >= 0) and, where the
        config has a pad_token_id, not that id: where HF's sequence classifiers read it (TRL's reward models pad
        with EOS, so a row ending with EOS is read before it)."""
        last = last_true(self.score_readable(tokens, positions))
        return self.score(jnp.take_along_axis(h, last[:, None, None], axis=1)[:, 0])

    def score_readable(self, tokens: jax.Array, positions: jax.Array) -> jax.Array:
        """Where a score may be read: real tokens (position >= 0) that are not the config's pad_token_id."""
        real = positions >= 0
        if self.config.pad_token_id is not None:
            real &= tokens != self.config.pad_token_id
        return real

    def logits(self, h: jax.Array) -> jax.Array:
        return head_logits(self.config, self.output_head(), h)

    def head_weight(self) -> tuple[jax.Array, bool]:
        """The output head as one float matrix and whether it is (V, D) (a tied embedding) rather than (D, V);
        a quantized head is dequantized (at the compute dtype) for the fused head's chunked products."""
        head = self.output_head()
        if isinstance(head, QuantEmbed):
            w, transposed = dequantize(head.table_t.get_value(), self.dtype), False
        elif isinstance(head, QuantLinear):
            w, transposed = dequantize(head.kernel.get_value(), self.dtype), False
        elif self.config.tie_word_embeddings:
            w, transposed = head.embedding[...], True
        else:
            w, transposed = head.kernel[...], False
        if self.fake_quant is not None:  # models/qat.py: the head as the export will quantize it
            w = self.fake_quant.rows(w) if transposed else self.fake_quant(w)
        return w, transposed

    def token_logprobs(self, h: jax.Array, targets: jax.Array, *, temperature: float = 1.0,
                       entropy: bool = False) -> tuple[jax.Array, jax.Array | None]:
        """log p(targets) (and the entropy) under softmax(logits / temperature) from hidden states (..., D),
        through the fused chunked head (ops/fused_head.py): what every training loss reads."""
        w, transpose_w = self.head_weight()
        return head_logprobs(h, w, targets, transpose_w=transpose_w, temperature=temperature,
                             softcap=self.config.final_logit_softcap, entropy=entropy)

    def __call__(self, tokens, positions, cache: DenseKVCache | PagedKVCache | None = None, segment_ids=None,
                 pixel_values=None):
        h, cache = self.hidden_states(tokens, positions, cache, segment_ids, pixel_values)
        logits = self.logits(h)
        return logits if cache is None else (logits, cache)

    def new_cache(self, batch: int, max_len: int) -> DenseKVCache:
        c = self.config
        return DenseKVCache.create(c.num_layers, batch, max_len, c.num_kv_heads, c.head_dim, self.dtype)


def last_true(mask: jax.Array) -> jax.Array:
    """The index of each row's last True along the last axis (0 where a row has none)."""
    return jnp.argmax(jnp.where(mask, jnp.arange(mask.shape[-1]), -1), axis=-1)


def _f32_as(tree, dtype):
    """tree's f32 leaves at `dtype` (a layer's params at the compute dtype), the others as they are."""
    return jax.tree.map(lambda v: v.astype(dtype) if v.dtype == jnp.float32 else v, tree)


def _remat_layer(layer: DecoderLayer, x, positions, segment_ids, attend_until, dtype):
    """The layer with its activations recomputed in the backward (models/remat.py). Its f32 params are
    cast to the compute `dtype` inside, so the backward recasts them instead of keeping a bf16 copy
    of every layer from the forward. A layer whose call changes its own state (dropout's RNG counters,
    sown router logits) goes through nnx.remat, which carries those changes out but saves no memory
    on XLA:CPU."""
    if nnx.state(layer, nnx.RngState) or any(isinstance(m, MoEMLP) and m.record_router_logits
                                             for _, m in nnx.iter_modules(layer)):
        return _nnx_remat_layer(layer, x, positions, segment_ids, attend_until)
    graphdef, state = nnx.split(layer)

    def run(state, x, positions, segment_ids, attend_until):
        if dtype != jnp.float32:  # the cast waits for x: one layer's bf16 copy at a time, forward and backward
            state = _f32_as(tie(state, x), dtype)
        return nnx.merge(graphdef, state)(x, positions, None, segment_ids, None, attend_until)[0]

    return recompute_in_backward(run, state, x, (positions, segment_ids, attend_until))


@nnx.remat
def _nnx_remat_layer(layer: DecoderLayer, x, positions, segment_ids, attend_until):
    return layer(x, positions, None, segment_ids, None, attend_until)[0]


def record_router_logits(model: nnx.Module, on: bool = True) -> None:
    """Make every MoE layer sow its router logits (tokens, experts) as nnx.Intermediate on each call,
    for an nnx.capture around the forward to collect."""
    for _, module in nnx.iter_modules(model):
        if isinstance(module, MoEMLP):
            module.record_router_logits = on


def head_logits(cfg: ModelConfig, head: nnx.Module, h: jax.Array) -> jax.Array:
    """f32 logits from the output head alone (the engine's sampler needs no other weights)."""
    out = head.attend(h) if cfg.tie_word_embeddings else head(h)
    out = out.astype(jnp.float32)
    if cfg.final_logit_softcap is not None:
        cap = cfg.final_logit_softcap
        # behind a barrier: the product must not fuse into an FMA with what the caller subtracts next
        out = jax.lax.optimization_barrier(jnp.tanh(out / cap) * cap)
    return out
