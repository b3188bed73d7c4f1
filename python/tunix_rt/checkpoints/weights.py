"""HF tensor names <-> decoder parameter paths, and building a Decoder from named tensors.

HF stores linear weights (out, in); the decoder keeps kernels (in, out), so those are transposed.
GGUF files are first renamed to HF names (gguf_loader.py), so this table is the only mapping.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tunix_rt.checkpoints.errors import CheckpointError
from tunix_rt.models.config import ModelConfig
from tunix_rt.models.decoder import Decoder
from tunix_rt.models.quant_layers import QuantEmbed, QuantLinear, QuantWeight
from tunix_rt.ops.quant import QuantizedTensor

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_IGNORED = re.compile(r"(rotary_emb\.inv_freq)$")


def _layer_names(cfg: ModelConfig) -> dict[str, tuple[str, ...]]:
    names = {
        "input_layernorm.weight": ("input_norm", "scale"),
        "self_attn.q_norm.weight": ("attn", "q_norm", "scale"),
        "self_attn.k_norm.weight": ("attn", "k_norm", "scale"),
    }
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        names[f"self_attn.{proj}.weight"] = ("attn", proj, "kernel")
        names[f"self_attn.{proj}.bias"] = ("attn", proj, "bias")
    for proj in ("gate_proj", "up_proj", "down_proj"):
        names[f"mlp.{proj}.weight"] = ("mlp", proj, "kernel")
    if cfg.sandwich_norms:
        names["post_attention_layernorm.weight"] = ("post_attn_norm", "scale")
        names["pre_feedforward_layernorm.weight"] = ("pre_mlp_norm", "scale")
        names["post_feedforward_layernorm.weight"] = ("post_mlp_norm", "scale")
    else:  # Llama's "post attention" norm is the one in front of the MLP
        names["post_attention_layernorm.weight"] = ("pre_mlp_norm", "scale")
    return names


def hf_to_path(name: str, cfg: ModelConfig) -> tuple[tuple, bool] | None:
    """HF tensor name -> (decoder parameter path, whether to transpose); None for tensors to skip."""
    if _IGNORED.search(name):
        return None
    if name == "model.embed_tokens.weight":
        return ("embed", "embedding"), False
    if name == "model.norm.weight":
        return ("final_norm", "scale"), False
    if name == "lm_head.weight":
        return (None if cfg.tie_word_embeddings else (("lm_head", "kernel"), True))
    m = _LAYER.match(name)
    if m:
        layer, rest = int(m.group(1)), m.group(2)
        path = _layer_names(cfg).get(rest)
        if path is not None and layer < cfg.num_layers:
            return ("layers", layer, *path), path[-1] == "kernel"
    raise CheckpointError(f"unexpected tensor {name!r} for a {cfg.architecture} model")


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
        new = QuantLinear(qt, bias, exact=path[0] == "lm_head")
    setattr(owner, attr, new)


def build_decoder(cfg: ModelConfig, tensors: Iterable[tuple[str, np.ndarray | QuantizedTensor]], *,
                  dtype=jnp.float32) -> Decoder:
    """Decoder whose parameters come from (HF name, array) pairs; every parameter must be given.

    A QuantizedTensor value (a GGUF weight kept quantized) replaces its layer by a QuantLinear (or
    the embedding by a QuantEmbed); it is given in the decoder's (in, out) orientation already.
    """
    model = nnx.eval_shape(lambda: Decoder(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    expected = dict(nnx.to_flat_state(nnx.state(model)))
    loaded = {}
    for name, array in tensors:
        target = hf_to_path(name, cfg)
        if target is None:
            continue
        path, transpose = target
        if path not in expected:
            raise CheckpointError(f"tensor {name!r} has no place in a {cfg.architecture} model with this config")
        want = tuple(expected[path].get_value().shape)
        if isinstance(array, QuantizedTensor):
            value_shape = array.shape if path[-1] == "kernel" else array.shape[::-1]
            if value_shape != want:
                raise CheckpointError(f"tensor {name!r} has shape {array.shape[::-1]}, the config implies {want[::-1]}")
            _swap_in_quantized(model, path, jax.tree.map(jnp.asarray, array), dtype)  # to device once
            continue
        value = array.T if transpose else array
        if tuple(value.shape) != want:
            raise CheckpointError(f"tensor {name!r} has shape {tuple(array.shape)}, the config implies {want if not transpose else want[::-1]}")
        loaded[path] = jnp.asarray(value, dtype=dtype)
    graphdef, state = nnx.split(model)
    flat = list(nnx.to_flat_state(state))
    missing = [".".join(map(str, p)) for p, var in flat if p not in loaded and not isinstance(var, QuantWeight)]
    if missing:
        raise CheckpointError(f"checkpoint is missing {len(missing)} tensor(s), e.g. {missing[:3]}")
    filled = [(p, var if isinstance(var, QuantWeight) else var.replace(loaded[p])) for p, var in flat]
    return nnx.merge(graphdef, nnx.from_flat_state(filled))
