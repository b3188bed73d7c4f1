"""Reading a GGUF file: metadata -> an HF config dict, tensors -> HF-named arrays.

Q8_0 / Q4_0 / Q4_1 weights stay quantized: their blocks are split into a QuantizedTensor without
touching a value. Other types (F16, BF16, K-quants, ...) are dequantized with the gguf package's
own quants module, so values are exactly ggml's; `keep_quantized=False` dequantizes all. Two
conversions of llama.cpp's converter are undone: Llama-family Q/K weights are permuted back to
HF's rotate-half layout, and Gemma norm weights lose the +1 it folded in. MoE files (qwen2moe,
qwen3moe, and llama files with experts: Mixtral) hold each layer's experts stacked in
ffn_{gate,up,down}_exps (experts, out, in), always dequantized; layers without ffn_gate_inp are dense.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import numpy as np

from tunix_rt.checkpoints.errors import CheckpointError
from tunix_rt.ops.quant import FORMATS, QuantizedTensor

if TYPE_CHECKING:
    from tunix_rt.checkpoints.gguf_file import GGUFFile, GGUFTensor

# GGML type name -> the format whose blocks we keep as they are
_KEPT = {f.ggml_type: f for f in FORMATS.values() if f.ggml_type}

# GGUF architecture -> HF model_type
_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma": "gemma", "gemma2": "gemma2", "gemma3": "gemma3_text",
         "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
# Whether llama.cpp renormalises the chosen experts' weights, per architecture, when the file has no
# expert_weights_norm key (its qwen3moe graph always does; qwen2moe never; Mixtral always).
_NORM_TOPK = {"qwen2moe": False, "qwen3moe": True, "llama": True}
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def open_gguf(path: Path) -> GGUFFile:
    from tunix_rt.checkpoints.gguf_file import GGUFFile  # imports gguf: only when a GGUF file is read

    try:
        return GGUFFile(path)
    except ValueError as e:  # OSError (unreadable, a directory) passes through: its message says it
        raise CheckpointError(f"{path} is not a readable GGUF file (corrupt or truncated): {e}") from None


def field(reader: GGUFFile, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def hf_config(reader: GGUFFile) -> dict:
    """The HF config.json dictionary this GGUF file describes."""
    arch = field(reader, "general.architecture")
    if arch not in _ARCH:
        raise CheckpointError(f"unsupported GGUF architecture {arch!r} (supported: {', '.join(_ARCH)})")
    get = lambda key, default=None: field(reader, f"{arch}.{key}", default)
    names = {t.name for t in reader.tensors}
    heads = get("attention.head_count")
    hidden = get("embedding_length")
    if heads is None or hidden is None:
        raise CheckpointError(f"GGUF metadata lacks {arch}.attention.head_count or {arch}.embedding_length")
    head_dim = get("attention.key_length", hidden // heads)
    vocab = get("vocab_size") or len(field(reader, "tokenizer.ggml.tokens", []))
    config = {
        "model_type": _ARCH[arch],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": get("rope.freq_base", 10000.0),
        "max_position_embeddings": get("context_length", 8192),
        "tie_word_embeddings": "output.weight" not in names,
    }
    scaling = get("rope.scaling.type")
    if "rope_freqs.weight" in names:
        if scaling not in (None, "none"):
            raise CheckpointError(f"GGUF file has both a rope_freqs tensor and rope scaling {scaling!r}")
        t = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        if t.tensor_type.name != "F32" or len(t.shape) != 1:
            raise CheckpointError(f"GGUF rope_freqs tensor must be a 1-D F32 vector, got {t.tensor_type.name} of shape "
                                  f"{tuple(int(d) for d in t.shape)}")
        if (rope := llama3_rope_scaling(np.asarray(t.data, np.float32), config["rope_theta"], head_dim)) is not None:
            config["rope_scaling"] = rope
    elif scaling == "yarn":
        config["rope_scaling"] = _yarn_rope_scaling(get)
    elif scaling not in (None, "none"):
        if scaling != "linear":
            raise CheckpointError(f"unsupported GGUF rope scaling {scaling!r} (supported: linear, yarn)")
        config["rope_scaling"] = {"rope_type": "linear", "factor": get("rope.scaling.factor", 1.0)}
    if arch.startswith("gemma"):
        # GGUF has no key for it: llama.cpp scales queries by head_dim ** -0.5, except for the 27B models
        # (Gemma 2: 46 layers, Gemma 3: 62), whose query_pre_attn_scalar is hidden_size / num_heads.
        big = (arch, config["num_hidden_layers"]) in (("gemma2", 46), ("gemma3", 62))
        config["query_pre_attn_scalar"] = hidden // heads if big else head_dim
        config["attn_logit_softcapping"] = get("attn_logit_softcapping")
        config["final_logit_softcapping"] = get("final_logit_softcapping")
        config["sliding_window"] = get("attention.sliding_window")
    if arch == "gemma3":
        # The local (sliding) layers' rope base: newer converters record it, Gemma 3 always used 10000.
        config["rope_local_base_freq"] = get("rope.freq_base_swa", 10000.0)
        if config["sliding_window"] is None:  # converted without sliding window: llama.cpp runs every layer full
            config["layer_types"] = ["full_attention"] * config["num_hidden_layers"]
    if arch == "qwen2":
        config["attention_bias"] = True
    config.update(_moe_config(reader, arch, get, names, config["num_hidden_layers"]))
    return {k: v for k, v in config.items() if v is not None}


def _yarn_rope_scaling(get) -> dict:
    """HF's yarn rope_scaling from llama.cpp's keys (what its converter writes for Qwen2.5 / Qwen3). llama.cpp's
    attention-factor keys (DeepSeek's mscale) scale differently from transformers' attention_factor: refused."""
    for key in ("attn_factor", "yarn_attn_factor", "yarn_log_multiplier", "yarn_ext_factor"):
        if get(f"rope.scaling.{key}") is not None:
            raise CheckpointError(f"GGUF yarn rope with rope.scaling.{key} is not supported")
    factor, original = get("rope.scaling.factor"), get("rope.scaling.original_context_length")
    if factor is None or original is None:
        raise CheckpointError("GGUF yarn rope needs rope.scaling.factor and rope.scaling.original_context_length")
    scaling = {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": int(original)}
    for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
        if (value := get(f"rope.scaling.{key}")) is not None:
            scaling[name] = float(value)
    return scaling


# Llama 3.x's rope scaling, as transformers names it: every Llama 3.1 / 3.2 / 3.3 checkpoint uses these two
# band edges; llama.cpp's converter keeps only the per-frequency factors they give (`rope_freqs.weight`).
_LLAMA3_LOW_FREQ_FACTOR, _LLAMA3_HIGH_FREQ_FACTOR = 1.0, 4.0


def _rope_wavelengths(theta: float, head_dim: int) -> np.ndarray:
    """Each rotary pair's wavelength in positions, from float32 frequencies as llama.cpp's converter has them."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    return 2 * math.pi / freqs.astype(np.float64)


def llama3_rope_factors(theta: float, head_dim: int, factor: float, original: float) -> np.ndarray:
    """llama.cpp's `rope_freqs.weight` for HF's llama3 rope: 1 above the high band edge, `factor` below the
    low one, the smoothed inverse between (its converter's arithmetic, float32 frequencies)."""
    low, high = _LLAMA3_LOW_FREQ_FACTOR, _LLAMA3_HIGH_FREQ_FACTOR
    wavelen = _rope_wavelengths(theta, head_dim)
    smooth = (original / wavelen - low) / (high - low)
    medium = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, medium))


def llama3_rope_scaling(factors: np.ndarray, theta: float, head_dim: int) -> dict | None:
    """HF's llama3 rope_scaling that gives a GGUF file's rope_freqs factors (Llama 3.1 and later), None for
    factors all 1 (plain rope). factor is the largest (the low band's); the pretraining length comes from a
    factor between the bands, else it is any length the band edges allow (Meta's 8192 where it fits); the
    parameters must reproduce every factor."""
    if factors.shape != (head_dim // 2,):
        raise CheckpointError(f"GGUF rope_freqs tensor must hold head_dim / 2 = {head_dim // 2} factors, got "
                              f"{factors.shape[0]}")
    if not np.isfinite(factors).all() or not (factors > 0).all():
        raise CheckpointError("GGUF rope_freqs tensor holds non-finite or non-positive factors")
    factor, low, high = float(factors.max()), _LLAMA3_LOW_FREQ_FACTOR, _LLAMA3_HIGH_FREQ_FACTOR
    if factor == 1.0 and (factors == 1.0).all():
        return None
    wavelen = _rope_wavelengths(theta, head_dim)
    between = (factors > 1) & (factors < factor)
    if between.any():
        i = int(np.argmax(between))
        smooth = (1 / float(factors[i]) - 1 / factor) / (1 - 1 / factor)
        candidates = [float(round(wavelen[i] * (low + smooth * (high - low))))]
    else:  # kept frequencies need wavelen < original / high, scaled ones wavelen > original / low
        shortest = high * float(wavelen[factors == 1.0].max(initial=0.0))
        longest = low * float(wavelen[factors == factor].min(initial=np.inf))
        candidates = [8192.0] + ([float(math.floor((shortest + longest) / 2))] if np.isfinite(longest) else [])
    for original in candidates:
        if original > 0 and np.allclose(llama3_rope_factors(theta, head_dim, factor, original), factors, rtol=1e-5, atol=0):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                    "original_max_position_embeddings": int(original)}
    raise CheckpointError(f"GGUF rope_freqs tensor is not Llama 3's rope scaling (low/high frequency factors "
                          f"{low:g}/{high:g}): unsupported")


def _moe_config(reader: GGUFFile, arch: str, get, names: set[str], num_layers: int) -> dict:
    """The HF MoE keys of a file with experts (none for a dense one)."""
    experts = get("expert_count") or 0
    if not experts:
        if arch in ("qwen2moe", "qwen3moe"):
            raise CheckpointError(f"GGUF {arch} file lacks {arch}.expert_count")
        return {}
    moe = {"num_experts_per_tok": get("expert_used_count"),
           "norm_topk_prob": bool(get("expert_weights_norm", _NORM_TOPK.get(arch, False)))}
    if arch == "llama":  # Mixtral: feed_forward_length is the experts' size, every layer routed
        return {**moe, "model_type": "mixtral", "num_local_experts": experts}
    dense = [i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in names]
    moe.update(num_experts=experts, moe_intermediate_size=get("expert_feed_forward_length"), mlp_only_layers=dense)
    if arch == "qwen2moe":
        moe["shared_expert_intermediate_size"] = get("expert_shared_feed_forward_length")
    return moe


def hf_name(gguf_name: str) -> str | None:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    m = _BLOCK.match(gguf_name)
    if m:
        layer, rest = m.group(1), m.group(2)
        base, _, kind = rest.rpartition(".")
        if base == "ffn_norm":  # the norm in front of the MLP: Gemma 2/3 call it pre_feedforward
            return f"model.layers.{layer}.{{ffn_norm}}.{kind}"
        if base in _LAYER_TENSORS:
            return f"model.layers.{layer}.{_LAYER_TENSORS[base]}.{kind}"
    return None


def kept_quantized(t: GGUFTensor) -> bool:
    """Whether a GGUF tensor loads as a QuantizedTensor (a 2-D Q8_0/Q4_0/Q4_1 matrix) unless dequantized."""
    return t.tensor_type.name in _KEPT and len(t.shape) == 2


def _quantized(t: GGUFTensor) -> QuantizedTensor:
    """A 2-D GGUF tensor of a kept type as a QuantizedTensor: ggml rows are our columns."""
    f = _KEPT[t.tensor_type.name]
    k, n = (int(d) for d in t.shape)  # ggml order: ne0 = K (contiguous), ne1 = N
    header = 4 if f.has_min else 2
    block_bytes = header + 32 * f.bits // 8
    raw = np.asarray(t.data, dtype=np.uint8)
    # Blocks read as records (scale, [min,] codes): numpy copies each field out with one fixed-size move per
    # block, 2.2x faster than strided copies of 2- or 4-byte words (the GGUF's blocks are ~100 MB to split).
    fields = [("d", "<f2"), ("m", "<f2")] if f.has_min else [("d", "<f2")]
    blocks = raw.view(np.dtype([*fields, ("qs", f"V{block_bytes - header}")])).reshape(n, k // 32)
    scales = np.ascontiguousarray(blocks["d"])
    mins = np.ascontiguousarray(blocks["m"]) if f.has_min else None
    qs = np.ascontiguousarray(blocks["qs"]).view(np.uint8).reshape(n, -1)
    if f.bits == 8:
        qs = qs.view(np.int8)
    for what, arr in (("scales", scales), ("mins", mins)):
        if arr is not None and not np.isfinite(arr).all():
            raise CheckpointError(f"GGUF tensor {t.name} ({t.tensor_type.name}) has non-finite {what}: the file is corrupt")
    return QuantizedTensor(qs, scales, mins, f.name, (k, n), 32)


def _unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved pairs -> HF's halves), per head."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter's Q/K row permutation (HF's halves -> interleaved pairs), per head: what
    _unpermute_rope undoes."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def iter_tensors(
    reader: GGUFFile, config: dict, *, keep_quantized: bool = True
) -> Iterator[tuple[str, np.ndarray | QuantizedTensor]]:
    """(HF name, value) for every tensor: a float32 array in HF layout, or, for Q8_0/Q4_0/Q4_1
    2-D weights with keep_quantized, a QuantizedTensor in the decoder's (in, out) orientation."""
    from gguf.quants import dequantize

    arch = config["model_type"]
    ffn_norm = "pre_feedforward_layernorm" if arch in ("gemma2", "gemma3_text") else "post_attention_layernorm"
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":  # read into the config's rope_scaling (hf_config)
            continue
        name = hf_name(t.name)
        if name is None:
            raise CheckpointError(f"unexpected GGUF tensor {t.name!r} for architecture {arch}")
        name = name.replace("{ffn_norm}", ffn_norm)
        rope_heads = None
        if arch in ("llama", "mixtral") and name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias",
                                                           "k_proj.bias")):  # llama.cpp's converter permutes both
            rope_heads = config["num_attention_heads"] if "q_proj" in name else config["num_key_value_heads"]
        if keep_quantized and kept_quantized(t):
            qt = _quantized(t)
            if rope_heads:  # the permutation moves whole output rows: apply it to every array
                qt = jax.tree.map(lambda a: _unpermute_rope(a, rope_heads), qt)
            yield name, qt
            continue
        try:
            array = dequantize(t.data, t.tensor_type)
        except (NotImplementedError, ValueError) as e:
            raise CheckpointError(f"cannot dequantize GGUF tensor {t.name} ({t.tensor_type.name}): {e}") from None
        array = np.asarray(array, dtype=np.float32)
        if not array.flags.owndata:  # a view of the mapped file (F32 tensors) would keep all of it resident
            array = array.copy()
        array = array.reshape(tuple(int(d) for d in reversed(t.shape)))
        if not np.isfinite(array).all():
            raise CheckpointError(f"GGUF tensor {t.name} ({t.tensor_type.name}) holds non-finite values: the file is corrupt")
        if rope_heads:
            array = _unpermute_rope(array, rope_heads)
        if name.endswith("shared_expert_gate.weight") and array.ndim == 1:  # stored as (hidden,)
            array = array[None, :]
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            array = array - np.float32(1.0)
        yield name, array
