"""One config for every decoder family, parsed from an HF config.json dictionary.

Each family differs from Llama only in switches held here (biases, q/k norms, sandwich norms,
soft-capping, sliding-window layers, embedding scaling, rope per layer type, a Mixture-of-Experts
MLP on some layers), so one decoder implementation serves all of them. The MoE families reuse
their dense base's switches: Mixtral is Mistral's, Qwen2-MoE Qwen2's, Qwen3-MoE Qwen3's. Both the
transformers 4.x keys (rope_theta, rope_scaling, rope_local_base_freq) and the 5.x `rope_parameters`
layout are read. A Gemma 3 multimodal config is its text config plus a VisionConfig (models/vision.py).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

FULL = "full_attention"
SLIDING = "sliding_attention"
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text",
                           "mixtral", "qwen2_moe", "qwen3_moe")
_DENSE_BASE = {"mixtral": "mistral", "qwen2_moe": "qwen2", "qwen3_moe": "qwen3"}
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "gelu_new": "gelu_tanh"}


class UnsupportedArchitecture(ValueError):
    """The checkpoint's model_type (or a feature of it) is not one the decoder implements."""


ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """The SigLIP tower, the projector and the prompt's image tokens of a Gemma 3 multimodal checkpoint."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    mm_tokens_per_image: int
    image_token_id: int
    boi_token_id: int
    eoi_token_id: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-6
    activation: str = "gelu_tanh"

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens_per_side(self) -> int:
        return math.isqrt(self.mm_tokens_per_image)

    @property
    def pool(self) -> int:
        """The side of the square of patches averaged into one soft token."""
        return self.patches_per_side // self.tokens_per_side

    def __post_init__(self):
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "image_size", "patch_size",
                     "mm_tokens_per_image", "num_channels"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"vision config: {name} must be a positive integer, got {getattr(self, name)!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"vision config: hidden_size ({self.hidden_size}) is not a multiple of num_attention_heads "
                             f"({self.num_heads})")
        if self.image_size % self.patch_size:
            raise ValueError(f"vision config: image_size ({self.image_size}) is not a multiple of patch_size "
                             f"({self.patch_size})")
        if self.tokens_per_side ** 2 != self.mm_tokens_per_image or self.patches_per_side % self.tokens_per_side:
            raise ValueError(f"mm_tokens_per_image ({self.mm_tokens_per_image}) must be the square of a divisor of "
                             f"the {self.patches_per_side} patches per side")

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "VisionConfig":
        """From a Gemma3ForConditionalGeneration config.json (its vision_config and image token fields)."""
        v = d["vision_config"]
        if v.get("model_type", "siglip_vision_model") != "siglip_vision_model":
            raise ValueError(f"vision_config: unsupported vision tower {v.get('model_type')!r} (Gemma 3's is "
                             "siglip_vision_model)")
        act = _ACTIVATIONS.get(v.get("hidden_act", "gelu_pytorch_tanh"))
        if act not in ("gelu_tanh", "gelu"):
            raise ValueError(f"vision_config: unsupported hidden_act {v.get('hidden_act')!r}")
        return cls(hidden_size=v["hidden_size"], intermediate_size=v["intermediate_size"],
                   num_layers=v["num_hidden_layers"], num_heads=v["num_attention_heads"], image_size=v["image_size"],
                   patch_size=v["patch_size"], num_channels=v.get("num_channels", 3),
                   layer_norm_eps=float(v.get("layer_norm_eps", 1e-6)), activation=act,
                   mm_tokens_per_image=d.get("mm_tokens_per_image", 256),
                   image_token_id=d.get("image_token_index", d.get("image_token_id", 262144)),
                   boi_token_id=d.get("boi_token_index", 255999), eoi_token_id=d.get("eoi_token_index", 256000))


@dataclasses.dataclass(kw_only=True, frozen=True)
class RopeConfig:
    """Rotary embedding of one layer type: HF's default, linear, llama3, yarn and dynamic (NTK) rope types (HF's
    names and defaults; yarn's attention_factor None means HF's, derived from factor and mscale /
    mscale_all_dim). For dynamic, original_max_position_embeddings holds the model's max_position_embeddings,
    the length past which transformers grows the base."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise UnsupportedArchitecture(f"unsupported rope_type {self.rope_type!r} (supported: {', '.join(ROPE_TYPES)})")
        if not self.theta > 0:
            raise ValueError(f"rope theta must be positive, got {self.theta}")
        if not self.factor > 0:
            raise ValueError(f"rope scaling factor must be positive, got {self.factor}")
        if not self.original_max_position_embeddings > 0:
            raise ValueError(f"rope original_max_position_embeddings must be positive, got "
                             f"{self.original_max_position_embeddings}")
        if self.rope_type == "yarn" and not self.beta_fast > self.beta_slow > 0:
            raise ValueError(f"yarn rope needs beta_fast > beta_slow > 0, got {self.beta_fast} and {self.beta_slow}")
        if self.attention_factor is not None and not self.attention_factor > 0:
            raise ValueError(f"rope attention_factor must be positive, got {self.attention_factor}")


@dataclasses.dataclass(kw_only=True, frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    norm_offset: float = 0.0  # Gemma stores RMSNorm scales as (w - 1)
    activation: str = "silu"  # silu | gelu_tanh | gelu; the MLP is gated (SwiGLU / GeGLU)
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    sandwich_norms: bool = False  # Gemma 2/3: norms after attention and around the MLP too
    embed_scale: float | None = None  # Gemma multiplies embeddings by sqrt(hidden_size)
    query_scale: float = 0.0  # attention scores scale; 0 means head_dim ** -0.5
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    rope: tuple[tuple[str, RopeConfig], ...] = ()  # (layer type, rope) pairs: hashable, as jit needs
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 8192
    # Mixture of Experts: layers whose moe_layers entry is True replace the MLP by a routed one
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the chosen experts' weights to sum 1
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: an always-on expert behind a sigmoid gate
    moe_layers: tuple[bool, ...] = ()
    # Gemma 3 multimodal: the image encoder and the prompt's image tokens (models/vision.py); None: text only
    vision: VisionConfig | None = None
    # HF's *ForSequenceClassification (a reward model: 1): a `score` head of this many outputs read at each
    # sequence's last token, in place of the vocabulary head; 0: a causal LM
    num_labels: int = 0
    # a sequence classifier's padding id: its score is read at the last token that is not it (HF's rule)
    pad_token_id: int | None = None

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"model config: {name} must be a positive integer, got {value!r}")
        if self.head_dim % 2:
            raise ValueError(f"model config: head_dim must be even (rope rotates pairs of dimensions), got {self.head_dim}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model config: num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        if self.activation not in ("silu", "gelu_tanh", "gelu"):
            raise UnsupportedArchitecture(f"unsupported activation {self.activation!r}")
        if not self.layer_types:
            object.__setattr__(self, "layer_types", (FULL,) * self.num_layers)
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"model config: layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        for kind in set(self.layer_types):
            if kind not in (FULL, SLIDING):
                raise UnsupportedArchitecture(f"unsupported layer type {kind!r}")
            if kind not in dict(self.rope):
                raise ValueError(f"model config: no rope parameters for layer type {kind!r}")
        if SLIDING in self.layer_types and not self.sliding_window:
            raise ValueError("model config: sliding_attention layers need a positive sliding_window")
        if self.query_scale == 0.0:
            object.__setattr__(self, "query_scale", self.head_dim**-0.5)
        self._check_moe()

    def _check_moe(self) -> None:
        if not self.moe_layers:
            object.__setattr__(self, "moe_layers", (self.num_experts > 0,) * self.num_layers)
        if len(self.moe_layers) != self.num_layers:
            raise ValueError(f"model config: moe_layers has {len(self.moe_layers)} entries for {self.num_layers} layers")
        if not any(self.moe_layers):
            return
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"model config: {name} must be a positive integer for a MoE model, got {value!r}")
        if not isinstance(self.num_labels, int) or self.num_labels < 0:
            raise ValueError(f"model config: num_labels must be a non-negative integer, got {self.num_labels!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"model config: num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_experts "
                             f"({self.num_experts})")

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe_layers[layer]

    def layer_kind(self, layer: int) -> tuple[str, bool]:
        """What makes a layer's program differ from another's: its attention type and whether its MLP is routed."""
        return self.layer_types[layer], self.moe_layers[layer]

    def rope_for(self, layer: int) -> RopeConfig:
        return dict(self.rope)[self.layer_types[layer]]

    def window(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == SLIDING else None

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """Parse an HF config.json dictionary."""
        arch = d.get("model_type")
        if arch == "gemma3" and isinstance(d.get("text_config"), dict):  # Gemma3ForConditionalGeneration
            text = {"model_type": "gemma3_text", **d["text_config"]}
            text.setdefault("tie_word_embeddings", d.get("tie_word_embeddings", True))
            try:
                vision = VisionConfig.from_hf_dict(d)
            except KeyError as e:
                raise ValueError(f"config.json for gemma3 is missing the vision key {e.args[0]!r}") from None
            return dataclasses.replace(cls.from_hf_dict(text), vision=vision)
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedArchitecture(
                f"unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        try:
            cfg = _parse(arch, d)
        except KeyError as e:
            raise ValueError(f"config.json for {arch} is missing the key {e.args[0]!r}") from None
        if any(str(a).endswith("ForSequenceClassification") for a in d.get("architectures") or ()):
            labels = d.get("num_labels") or len(d.get("id2label") or {}) or 2  # transformers' default is 2
            if not isinstance(labels, int) or labels < 1:
                raise ValueError(f"config.json: num_labels must be a positive integer, got {labels!r}")
            pad = d.get("pad_token_id")
            cfg = dataclasses.replace(cfg, num_labels=labels, pad_token_id=pad if isinstance(pad, int) else None)
        return cfg


def _moe_fields(arch: str, d: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """The MoE switches of a Mixtral / Qwen2-MoE / Qwen3-MoE config (empty for dense families)."""
    if arch not in _DENSE_BASE:
        return {}
    experts = d.get("num_experts") or d.get("num_local_experts")  # transformers 5 writes the latter for Qwen3-MoE
    if arch == "mixtral":
        return dict(num_experts=experts, num_experts_per_tok=d["num_experts_per_tok"],
                    moe_intermediate_size=d["intermediate_size"], norm_topk_prob=True)
    step = d.get("decoder_sparse_step", 1) or 1
    dense = set(d.get("mlp_only_layers") or ())
    layers = tuple(bool(experts) and i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    return dict(num_experts=experts or 0, num_experts_per_tok=d.get("num_experts_per_tok", 0),
                moe_intermediate_size=d.get("moe_intermediate_size", 0), norm_topk_prob=bool(d.get("norm_topk_prob", False)),
                shared_expert_intermediate_size=d.get("shared_expert_intermediate_size", 0) if arch == "qwen2_moe" else 0,
                moe_layers=layers)


def _parse(model_type: str, d: dict[str, Any]) -> ModelConfig:
    arch = _DENSE_BASE.get(model_type, model_type)  # the dense family whose switches apply
    gemma = arch.startswith("gemma")
    hidden, heads = d["hidden_size"], d["num_attention_heads"]
    head_dim = d.get("head_dim") or hidden // heads
    num_layers = d["num_hidden_layers"]
    act_name = d.get("hidden_activation") or d.get("hidden_act") or ("gelu_pytorch_tanh" if gemma else "silu")
    if arch == "gemma":  # HF runs Gemma 1 with the tanh approximation whatever hidden_act says
        act_name = d.get("hidden_activation") or "gelu_pytorch_tanh"
    if act_name not in _ACTIVATIONS:
        raise UnsupportedArchitecture(f"unsupported activation {act_name!r}")
    attention_bias = bool(d.get("attention_bias", False))

    sliding_window = d.get("sliding_window")
    layer_types = d.get("layer_types")
    if layer_types is None:
        if arch == "gemma2":
            layer_types = [SLIDING if (i + 1) % 2 else FULL for i in range(num_layers)]
        elif arch == "gemma3_text":
            pattern = d.get("sliding_window_pattern", 6)
            layer_types = [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
        elif arch in ("qwen2", "qwen3"):
            use = d.get("use_sliding_window", False) and sliding_window
            first = d.get("max_window_layers", num_layers)
            layer_types = [SLIDING if use and i >= first else FULL for i in range(num_layers)]
        elif arch == "mistral" and sliding_window:
            layer_types = [SLIDING] * num_layers
        else:
            layer_types = [FULL] * num_layers
    if arch in ("qwen2", "qwen3") and not d.get("use_sliding_window", False):
        layer_types = [FULL] * num_layers  # HF ignores sliding_window unless use_sliding_window
    if SLIDING not in layer_types:
        sliding_window = None

    query_scale = d["query_pre_attn_scalar"] ** -0.5 if gemma and d.get("query_pre_attn_scalar") else 0.0
    return ModelConfig(
        architecture=model_type,
        vocab_size=d["vocab_size"],
        hidden_size=hidden,
        intermediate_size=d["intermediate_size"],
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=d.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        norm_offset=1.0 if gemma else 0.0,
        activation=_ACTIVATIONS[act_name],
        qkv_bias=True if arch == "qwen2" else attention_bias,
        o_bias=False if arch == "qwen2" else attention_bias,
        qk_norm=arch in ("qwen3", "gemma3_text"),
        sandwich_norms=arch in ("gemma2", "gemma3_text"),
        embed_scale=math.sqrt(hidden) if gemma else None,
        query_scale=query_scale,
        attn_logit_softcap=d.get("attn_logit_softcapping") if arch == "gemma2" or arch == "gemma3_text" else None,
        final_logit_softcap=d.get("final_logit_softcapping") if arch in ("gemma2", "gemma3_text") else None,
        layer_types=tuple(layer_types),
        sliding_window=sliding_window,
        rope=_rope_by_layer_type(arch, d, set(layer_types)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", gemma)),
        max_position_embeddings=int(d.get("max_position_embeddings", 8192)),
        **_moe_fields(model_type, d, num_layers),
    )


_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings", "beta_fast",
              "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "truncate")


def _rope_from(params: dict[str, Any] | None, theta: float, max_positions: int,
               top_level_original: int | None = None) -> RopeConfig:
    """A layer type's rope from its HF parameters, with transformers' rules for the pretraining length of the
    scaled types: a top-level original_max_position_embeddings (Phi-3 style) wins, else the rope's own, else the
    model's max_position_embeddings; yarn's factor defaults to the ratio of the two lengths."""
    params = dict(params or {})
    rope_type = params.get("rope_type") or params.get("type") or "default"
    kw = {k: params[k] for k in _ROPE_KEYS if params.get(k) is not None}
    if rope_type in ("llama3", "yarn"):
        if top_level_original is not None:
            kw["original_max_position_embeddings"] = top_level_original
        kw.setdefault("original_max_position_embeddings", max_positions)
    if rope_type == "dynamic":  # transformers scales from the model's length, whatever the rope's own says
        kw["original_max_position_embeddings"] = max_positions
    if rope_type == "yarn":
        kw.setdefault("factor", max_positions / kw["original_max_position_embeddings"])
        kw["beta_fast"] = kw.get("beta_fast") or 32.0  # transformers reads a 0 as "unset" too
        kw["beta_slow"] = kw.get("beta_slow") or 1.0
    return RopeConfig(theta=float(params.get("rope_theta", theta)), rope_type=rope_type, **kw)


def _rope_by_layer_type(arch: str, d: dict[str, Any], kinds: set[str]) -> tuple[tuple[str, RopeConfig], ...]:
    params = d.get("rope_parameters")
    max_positions = int(d.get("max_position_embeddings", 8192))
    if isinstance(params, dict) and (FULL in params or SLIDING in params):  # transformers 5, per layer type
        global_theta = params.get(FULL, {}).get("rope_theta", d.get("rope_theta", 10000.0))
        return tuple((kind, _rope_from(params.get(kind), global_theta, max_positions)) for kind in sorted(kinds))
    theta = float(d.get("rope_theta", 1_000_000.0 if arch == "gemma3_text" else 10000.0))
    scaling = params if isinstance(params, dict) else d.get("rope_scaling")
    rope = {FULL: _rope_from(scaling, theta, max_positions, d.get("original_max_position_embeddings"))}
    if SLIDING in kinds:
        if arch == "gemma3_text":  # local layers: their own base, never scaled
            rope[SLIDING] = RopeConfig(theta=float(d.get("rope_local_base_freq", 10000.0)))
        else:
            rope[SLIDING] = rope[FULL]
    return tuple((kind, rope[kind]) for kind in sorted(kinds))
