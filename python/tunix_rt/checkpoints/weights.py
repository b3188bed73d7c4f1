"""HF tensor names <-> decoder parameter paths, and building a Decoder from named tensors.

HF stores linear weights (out, in); the decoder keeps kernels (in, out), so those are transposed.
GGUF files are first renamed to HF names (gguf_loader.py), so this table is the only mapping.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import jax.numpy as jnp
import numpy as np
from flax import nnx

from tunix_rt.checkpoints.errors import CheckpointError
from tunix_rt.models.config import ModelConfig
from tunix_rt.models.decoder import Decoder

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


def build_decoder(cfg: ModelConfig, tensors: Iterable[tuple[str, np.ndarray]], *, dtype=jnp.float32) -> Decoder:
    """Decoder whose parameters come from (HF name, array) pairs; every parameter must be given."""
    abstract = nnx.eval_shape(lambda: Decoder(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    expected = dict(nnx.to_flat_state(state))
    loaded = {}
    for name, array in tensors:
        target = hf_to_path(name, cfg)
        if target is None:
            continue
        path, transpose = target
        if path not in expected:
            raise CheckpointError(f"tensor {name!r} has no place in a {cfg.architecture} model with this config")
        value = array.T if transpose else array
        want = expected[path].get_value().shape
        if tuple(value.shape) != tuple(want):
            raise CheckpointError(f"tensor {name!r} has shape {tuple(array.shape)}, the config implies {want if not transpose else want[::-1]}")
        loaded[path] = jnp.asarray(value, dtype=dtype)
    missing = [".".join(map(str, p)) for p in expected if p not in loaded]
    if missing:
        raise CheckpointError(f"checkpoint is missing {len(missing)} tensor(s), e.g. {missing[:3]}")
    flat = [(path, expected[path].replace(loaded[path])) for path in expected]
    return nnx.merge(graphdef, nnx.from_flat_state(flat))
