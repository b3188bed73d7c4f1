"""HF tensor names <-> decoder parameter paths, and building a Decoder from named tensors.

HF stores linear weights (out, in); the decoder keeps kernels (in, out), so those are transposed.
GGUF files are first renamed to HF names (gguf_loader.py), so this table is the only mapping.
MoE experts live stacked in the decoder, (experts, in, out): HF's per-expert tensors
(`mlp.experts.{e}.gate_proj.weight`, Mixtral's `block_sparse_moe.experts.{e}.w1.weight`) fill one
slice each; stacked (experts, out, in) tensors (`mlp.experts.gate_proj`, from GGUF) and
transformers 5's fused `mlp.experts.gate_up_proj` fill them whole.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
from collections.abc import Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tunix_rt.checkpoints.errors import CheckpointError
from tunix_rt.models.config import ModelConfig
from tunix_rt.models.decoder import Decoder
from tunix_rt.models.layer_stack import layer_places
from tunix_rt.models.quant_layers import QuantEmbed, QuantLinear, QuantWeight
from tunix_rt.ops.quant import QuantizedTensor, dequantize_reference

log = logging.getLogger(__name__)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_IGNORED = re.compile(r"(rotary_emb\.inv_freq)$")
_PROJ = ("gate_proj", "up_proj", "down_proj")
_MIXTRAL_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_STACKED = re.compile(r"^mlp\.experts\.(gate_proj|up_proj|down_proj)(?:\.weight)?$")
_MIXTRAL_EXPERT = re.compile(r"^block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")
# Gemma3ForConditionalGeneration: transformers 5's names and the 4.x ones of the published checkpoints
_LANGUAGE_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                      ("language_model.lm_head.", "lm_head."))
_VISION = re.compile(r"^(?:model\.)?vision_tower\.(?:vision_model\.)?(.+)$")
_PROJECTOR = re.compile(r"^(?:model\.)?multi_modal_projector\.(mm_input_projection_weight|mm_soft_emb_norm\.weight)$")
_VISION_LAYER = re.compile(r"^encoder\.layers\.(\d+)\.(.+)\.(weight|bias)$")
_VISION_LAYER_PARTS = {"layer_norm1": "layer_norm1", "layer_norm2": "layer_norm2", "self_attn.q_proj": "q_proj",
                       "self_attn.k_proj": "k_proj", "self_attn.v_proj": "v_proj", "self_attn.out_proj": "out_proj",
                       "mlp.fc1": "fc1", "mlp.fc2": "fc2"}


@dataclasses.dataclass(frozen=True)
class Target:
    """Where an HF tensor goes: the decoder parameter path, whether its last two axes swap
    ((out, in) -> (in, out)), for a layer's tensor its entry in the stacked weight (models/layer_stack.py),
    and for a per-expert tensor the expert slice it fills."""

    path: tuple
    transpose: bool
    expert: int | None = None
    entry: int | None = None

    @property
    def index(self) -> tuple[int, ...]:
        """Where the tensor lands in the parameter: (entry[, expert]), or () for a whole parameter."""
        return tuple(i for i in (self.entry, self.expert) if i is not None)


def _canonical(rest: str) -> str:
    """Mixtral's block_sparse_moe / w1 w2 w3 names as the Qwen-MoE names the table holds."""
    m = _MIXTRAL_EXPERT.match(rest)
    if m:
        return f"mlp.experts.{m.group(1)}.{_MIXTRAL_PROJ[m.group(2)]}.weight"
    return "mlp.gate.weight" if rest == "block_sparse_moe.gate.weight" else rest


def expert_names(cfg: ModelConfig) -> list[str]:
    """The per-expert HF names of one layer (its own convention for Mixtral): what export writes."""
    if cfg.architecture == "mixtral":
        return ["block_sparse_moe.gate.weight"] + [f"block_sparse_moe.experts.{e}.{w}.weight"
                                                   for e in range(cfg.num_experts) for w in _MIXTRAL_PROJ]
    names = ["mlp.gate.weight"] + [f"mlp.experts.{e}.{p}.weight" for e in range(cfg.num_experts) for p in _PROJ]
    if cfg.shared_expert_intermediate_size:
        names += [f"mlp.shared_expert.{p}.weight" for p in _PROJ] + ["mlp.shared_expert_gate.weight"]
    return names


def _layer_names(cfg: ModelConfig) -> dict[str, tuple[str, ...]]:
    names = {
        "input_layernorm.weight": ("input_norm", "scale"),
        "self_attn.q_norm.weight": ("attn", "q_norm", "scale"),
        "self_attn.k_norm.weight": ("attn", "k_norm", "scale"),
    }
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        names[f"self_attn.{proj}.weight"] = ("attn", proj, "kernel")
        names[f"self_attn.{proj}.bias"] = ("attn", proj, "bias")
    for proj in _PROJ:
        names[f"mlp.{proj}.weight"] = ("mlp", proj, "kernel")
        names[f"mlp.shared_expert.{proj}.weight"] = ("mlp", "shared_expert", proj, "kernel")
    names["mlp.gate.weight"] = ("mlp", "router", "kernel")
    names["mlp.shared_expert_gate.weight"] = ("mlp", "shared_expert_gate", "kernel")
    if cfg.sandwich_norms:
        names["post_attention_layernorm.weight"] = ("post_attn_norm", "scale")
        names["pre_feedforward_layernorm.weight"] = ("pre_mlp_norm", "scale")
        names["post_feedforward_layernorm.weight"] = ("post_mlp_norm", "scale")
    else:  # Llama's "post attention" norm is the one in front of the MLP
        names["post_attention_layernorm.weight"] = ("pre_mlp_norm", "scale")
    return names


@functools.lru_cache(maxsize=64)
def _places(cfg: ModelConfig) -> tuple[tuple[int, int], ...]:
    return layer_places([cfg.layer_kind(i) for i in range(cfg.num_layers)])


def _vision_target(name: str, cfg: ModelConfig) -> Target | None:
    """A Gemma 3 image encoder tensor's Target (models/vision.ImageEncoder); None for SigLIP's pooling head, which
    Gemma 3 never runs."""
    if m := _PROJECTOR.match(name):
        return Target(("vision", "mm_input_projection" if m.group(1) == "mm_input_projection_weight"
                       else "mm_soft_emb_norm"), False)
    rest = _VISION.match(name).group(1)
    if rest.startswith("head."):
        return None
    if rest == "embeddings.patch_embedding.weight":  # flattened to (C * p * p, D) by _flatten_patch_conv
        return Target(("vision", "patch_embedding", "kernel"), False)
    if rest == "embeddings.patch_embedding.bias":
        return Target(("vision", "patch_embedding", "bias"), False)
    if rest == "embeddings.position_embedding.weight":
        return Target(("vision", "position_embedding"), False)
    if rest in ("post_layernorm.weight", "post_layernorm.bias"):
        return Target(("vision", "post_layernorm", "scale" if rest.endswith("weight") else "bias"), False)
    m = _VISION_LAYER.match(rest)
    if m and int(m.group(1)) < cfg.vision.num_layers and m.group(2) in _VISION_LAYER_PARTS:
        part = _VISION_LAYER_PARTS[m.group(2)]
        kind = "bias" if m.group(3) == "bias" else ("scale" if part.startswith("layer_norm") else "kernel")
        return Target(("vision", "layers", int(m.group(1)), part, kind), kind == "kernel")
    raise CheckpointError(f"unexpected vision tensor {name!r}")


def hf_to_path(name: str, cfg: ModelConfig) -> Target | None:
    """HF tensor name -> its Target; None for tensors to skip."""
    if _IGNORED.search(name):
        return None
    if cfg.vision is not None:
        if _VISION.match(name) or _PROJECTOR.match(name):
            return _vision_target(name, cfg)
        for prefix, canonical in _LANGUAGE_PREFIXES:
            if name.startswith(prefix):
                name = canonical + name[len(prefix):]
                break
    if name == "model.embed_tokens.weight":
        return Target(("embed", "embedding"), False)
    if name == "model.norm.weight":
        return Target(("final_norm", "scale"), False)
    if name == "lm_head.weight":
        return None if cfg.tie_word_embeddings or cfg.num_labels else Target(("lm_head", "kernel"), True)
    if name == "score.weight" and cfg.num_labels:  # *ForSequenceClassification's head
        return Target(("score", "kernel"), True)
    m = _LAYER.match(name)
    if m and int(m.group(1)) < cfg.num_layers:
        kind, entry = _places(cfg)[int(m.group(1))]
        layer, rest = ("layers", "kinds", kind), _canonical(m.group(2))
        if (e := _EXPERT.match(rest)) and int(e.group(1)) < cfg.num_experts:
            return Target((*layer, "mlp", "experts", e.group(2)), True, int(e.group(1)), entry)
        if s := _STACKED.match(rest):
            return Target((*layer, "mlp", "experts", s.group(1)), True, None, entry)
        path = _layer_names(cfg).get(rest)
        if path is not None:
            return Target((*layer, *path), path[-1] == "kernel", None, entry)
    raise CheckpointError(f"unexpected tensor {name!r} for a {cfg.architecture} model")


def _split_fused(
        tensors: Iterable[tuple[str, np.ndarray | QuantizedTensor]]) -> Iterator[tuple[str, np.ndarray | QuantizedTensor]]:
    """transformers 5's fused experts (experts, 2 * inter, hidden) as stacked gate and up tensors."""
    for name, array in tensors:
        if name.endswith(".mlp.experts.gate_up_proj") and not isinstance(array, QuantizedTensor):
            half = array.shape[1] // 2
            base = name[: -len("gate_up_proj")]
            yield base + "gate_proj", array[:, :half]
            yield base + "up_proj", array[:, half:]
        else:
            yield name, array


def _flatten_patch_conv(
        tensors: Iterable[tuple[str, np.ndarray | QuantizedTensor]]) -> Iterator[tuple[str, np.ndarray | QuantizedTensor]]:
    """SigLIP's patch convolution (D, C, p, p) as the (C * p * p, D) product over flattened patches."""
    for name, array in tensors:
        if name.endswith("patch_embedding.weight") and getattr(array, "ndim", 0) == 4:
            yield name, np.asarray(array).reshape(array.shape[0], -1).T
        else:
            yield name, array


def _swap_in_quantized(model: Decoder, path: tuple, qt: QuantizedTensor, dtype) -> None:
    """Replace the float layer owning `path` by its quantized twin, holding `qt`."""
    *parents, attr, _ = path
    owner = model
    for p in parents:
        owner = owner[p] if isinstance(p, int) else getattr(owner, p)
    old = getattr(owner, attr)
    if path == ("embed", "embedding"):
        new = QuantEmbed(qt, dtype)
    else:
        bias = jnp.zeros(old.bias.shape, dtype) if getattr(old, "bias", None) is not None else None
        new = QuantLinear(qt, bias, exact=path[0] == "lm_head" or attr == "router")  # int8 activations flip choices
    setattr(owner, attr, new)


def _stack_quantized(name: str, parts: list[QuantizedTensor]) -> QuantizedTensor | np.ndarray:
    """One layer-stacked weight from its layers' quantized tensors: stacked as they are if they share a format,
    else every layer dequantized (a stack holds one format; the values stay ggml's exactly)."""
    first = parts[0]
    if all((q.fmt, q.group, q.shape) == (first.fmt, first.group, first.shape) for q in parts):
        return jax.tree.map(lambda *a: np.stack(a), *parts)
    log.warning("%s: its layers mix quantization formats (%s); loading them dequantized", name,
                ", ".join(sorted({q.fmt for q in parts})))
    return np.stack([np.asarray(dequantize_reference(jax.tree.map(jnp.asarray, q))) for q in parts])


def build_decoder(cfg: ModelConfig, tensors: Iterable[tuple[str, np.ndarray | QuantizedTensor]], *,
                  dtype=jnp.float32) -> Decoder:
    """Decoder whose parameters come from (HF name, array) pairs; every parameter must be given.

    A QuantizedTensor value (a GGUF weight kept quantized) replaces its layer by a QuantLinear (or
    the embedding by a QuantEmbed); it is given in the decoder's (in, out) orientation already. A layer's
    tensors fill their entries of the layer-stacked weights (and an expert's its slice of the experts').
    """
    model = nnx.eval_shape(lambda: Decoder(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    expected = dict(nnx.to_flat_state(nnx.state(model)))
    loaded = {}
    stacks: dict[tuple, tuple[dict, str]] = {}  # path -> ({index: host array or QuantizedTensor}, a tensor's name)
    for name, array in _flatten_patch_conv(_split_fused(tensors)):
        target = hf_to_path(name, cfg)
        if target is None:
            continue
        path = target.path
        if path not in expected:
            raise CheckpointError(f"tensor {name!r} has no place in a {cfg.architecture} model with this config")
        want = tuple(expected[path].get_value().shape)
        index = target.index
        if isinstance(array, QuantizedTensor):
            if "experts" in path:
                raise CheckpointError(f"tensor {name!r}: quantized expert weights are not supported; load the "
                                      "model dequantized")
            value_shape = array.shape if path[-1] == "kernel" else array.shape[::-1]
            if value_shape != want[len(index):]:
                raise CheckpointError(f"tensor {name!r} has shape {array.shape[::-1]}, the config implies "
                                      f"{want[len(index):][::-1]}")
            value = array
        else:
            value = np.swapaxes(array, -1, -2) if target.transpose else array
            if tuple(value.shape) != want[len(index):]:
                part = want[len(index):]
                shown = part[:-2] + part[-2:][::-1] if target.transpose else part
                raise CheckpointError(f"tensor {name!r} has shape {tuple(array.shape)}, the config implies {shown}")
        if path in loaded:
            raise CheckpointError(f"tensor {name!r} is given twice (or with per-expert tensors of the same weight)")
        if not index:
            if isinstance(value, QuantizedTensor):
                _swap_in_quantized(model, path, jax.device_put(value), dtype)  # to device once
            else:
                loaded[path] = _to_device(value, dtype)
            continue
        parts, _ = stacks.setdefault(path, ({}, name))
        if index in parts or (target.expert is None and any(i[0] == index[0] for i in parts)):
            raise CheckpointError(f"tensor {name!r} is given twice (or with per-expert tensors of the same weight)")
        if target.expert is not None and (index[0],) in parts:
            raise CheckpointError(f"tensor {name!r}: the experts of {'.'.join(map(str, path))} were given already")
        parts[index] = value
        if set(parts) == _expected_indices(parts, want):  # to the device in the target dtype, host copies freed
            loaded_value = _assemble(stacks.pop(path), want, dtype)
            if isinstance(loaded_value, QuantizedTensor):
                _swap_in_quantized(model, path, jax.device_put(loaded_value), dtype)
            else:
                loaded[path] = _to_device(loaded_value, dtype)
    for path, (parts, _) in stacks.items():  # only incomplete stacks are left
        raise CheckpointError(f"checkpoint is missing {_absent(cfg, path, parts, expected[path].get_value().shape)}")
    graphdef, state = nnx.split(model)
    flat = list(nnx.to_flat_state(state))
    missing = [".".join(map(str, p)) for p, var in flat if p not in loaded and not isinstance(var, QuantWeight)]
    if missing:
        raise CheckpointError(f"checkpoint is missing {len(missing)} tensor(s), e.g. {missing[:3]}")
    filled = [(p, var if isinstance(var, QuantWeight) else var.replace(loaded[p])) for p, var in flat]
    return nnx.merge(graphdef, nnx.from_flat_state(filled))


def _to_device(value: np.ndarray, dtype) -> jax.Array:
    """A host array on the device in `dtype`, cast on the host: jnp.asarray would compile a program per shape."""
    return jax.device_put(np.asarray(value, np.dtype(dtype)))


def _expected_indices(parts: dict, want: tuple) -> set[tuple]:
    """Every index a layer-stacked weight needs: per layer, and per expert where the given tensors are per expert."""
    per_expert = any(len(i) == 2 for i in parts)
    layers = range(want[0])
    return {(i, e) for i in layers for e in range(want[1])} if per_expert else {(i,) for i in layers}


def _absent(cfg: ModelConfig, path: tuple, parts: dict, want: tuple) -> str:
    """What a layer-stacked weight lacks, named by layer: "expert(s) [5] of layers.1.mlp.experts.up_proj"."""
    kind, rest = path[2], ".".join(map(str, path[3:]))
    layer_of = {entry: i for i, (k, entry) in enumerate(_places(cfg)) if k == kind}
    absent = sorted(_expected_indices(parts, want) - set(parts))
    layer = layer_of[absent[0][0]]
    if len(absent[0]) == 2:
        experts = [e for entry, e in absent if entry == absent[0][0]]
        return f"expert(s) {experts[:8]} of layers.{layer}.{rest}"
    return f"layers.{layer}.{rest}" + (f" (and {len(absent) - 1} more layers)" if len(absent) > 1 else "")


def _assemble(stack: tuple[dict, str], want: tuple, dtype) -> np.ndarray | QuantizedTensor:
    parts, name = stack
    if any(isinstance(v, QuantizedTensor) for v in parts.values()):
        if not all(isinstance(v, QuantizedTensor) for v in parts.values()):
            raise CheckpointError(f"tensor {name!r}: some layers' weights are quantized, others not")
        return _stack_quantized(name, [parts[(i,)] for i in range(want[0])])
    buffer = np.zeros(want, np.dtype(dtype))
    for index, value in parts.items():
        buffer[index] = value
    return buffer
