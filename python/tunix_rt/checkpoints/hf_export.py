"""Writing a Decoder as an HF-layout model directory that transformers and `loader.load_model` both load.

The directory holds config.json, model.safetensors (HF names, HF (out, in) orientation, float32 or
bfloat16), generation_config.json and the tokenizer files (tokenizer.json, tokenizer_config.json,
chat_template.jinja). Tensor names come from inverting `weights.hf_to_path`, the one name table;
parameters are read from the live module state, so trained values are what gets written.
Quantized layers (QuantLinear / QuantEmbed) are dequantized exactly. LoRA must be merged first:
any variable the table cannot place is an error.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from tunix_rt.checkpoints import hf_dir
from tunix_rt.checkpoints.output_dir import check_output_dir, staged_output_dir
from tunix_rt.checkpoints.tokenizer import Tokenizer
from tunix_rt.checkpoints.weights import _layer_names, expert_names, hf_to_path
from tunix_rt.models.config import ModelConfig
from tunix_rt.models.decoder import Decoder
from tunix_rt.models.quant_layers import dequantize_stacked
from tunix_rt.ops.quant import QuantizedTensor

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",  # with its image encoder (models/vision.py)
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
# sequence classifiers (reward models): transformers' class per model_type
CLASSIFIERS = {t: a.replace("ForCausalLM", "ForSequenceClassification") for t, a in ARCHITECTURES.items()
               if a.endswith("ForCausalLM")} | {"gemma3_text": "Gemma3TextForSequenceClassification"}
_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


def inverse_names(cfg: ModelConfig) -> dict[tuple, list[tuple[str, bool, tuple[int, ...]]]]:
    """Decoder parameter path -> [(HF tensor name, whether to transpose, index in the parameter)], for every tensor
    `cfg` can have: a whole parameter's index is (); a layer's tensor is its entry of the layer-stacked weight
    (and an expert's, its expert slice too)."""
    names = ["model.embed_tokens.weight", "model.norm.weight", "score.weight" if cfg.num_labels else "lm_head.weight"]
    # expert names first: Mixtral's router is block_sparse_moe.gate, not the table's mlp.gate
    layer_rest = [*(expert_names(cfg) if any(cfg.moe_layers) else ()), *_layer_names(cfg)]
    names += [f"model.layers.{i}.{rest}" for i in range(cfg.num_layers) for rest in dict.fromkeys(layer_rest)]
    if cfg.vision is not None:  # transformers 5's Gemma3ForConditionalGeneration names
        names = [n.replace("model.", "model.language_model.", 1) for n in names] + vision_names(cfg)
    if cfg.vision is not None and cfg.num_labels:
        raise ValueError("a sequence classifier with an image encoder is not supported")
    inverse, taken = {}, set()
    for name in names:
        target = hf_to_path(name, cfg)
        if target is None or (target.expert is None and (target.path, target.index) in taken):
            continue
        taken.add((target.path, target.index))
        inverse.setdefault(target.path, []).append((name, target.transpose, target.index))
    return inverse


def vision_names(cfg: ModelConfig) -> list[str]:
    """The HF names of a Gemma 3 image encoder's tensors (SigLIP's pooling head, which Gemma 3 never runs, aside)."""
    tower = "model.vision_tower."
    names = [f"{tower}embeddings.patch_embedding.weight", f"{tower}embeddings.patch_embedding.bias",
             f"{tower}embeddings.position_embedding.weight", f"{tower}post_layernorm.weight",
             f"{tower}post_layernorm.bias", "model.multi_modal_projector.mm_input_projection_weight",
             "model.multi_modal_projector.mm_soft_emb_norm.weight"]
    parts = ("layer_norm1", "layer_norm2", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
             "self_attn.out_proj", "mlp.fc1", "mlp.fc2")
    return names + [f"{tower}encoder.layers.{i}.{part}.{kind}" for i in range(cfg.vision.num_layers) for part in parts
                    for kind in ("weight", "bias")]


def hf_tensors(model: Decoder, dtype: str = "float32", *,
               keep_packed: str | None = None) -> dict[str, np.ndarray | QuantizedTensor]:
    """The model's parameters as HF-named arrays in HF orientation (quantized weights dequantized). With
    `keep_packed` (a format), weights packed in it with 32-blocks stay QuantizedTensors in the decoder's (K, N),
    each layer's sliced out of its stack: the GGUF export writes their blocks as they are."""
    if dtype not in _DTYPES:
        raise ValueError(f"export dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    inverse = inverse_names(model.config)
    tensors, unknown = {}, []
    for path, var in nnx.to_flat_state(nnx.state(model)):
        value = var.get_value()
        key = (*path[:-1], "embedding") if path[-1] == "table_t" else path  # QuantEmbed: the table transposed
        if key not in inverse or not hasattr(value, "shape"):
            unknown.append(".".join(map(str, path)) + f" ({type(var).__name__})")
            continue
        if isinstance(value, QuantizedTensor) and value.fmt == keep_packed and value.group == 32:
            for name, _, index in inverse[key]:
                tensors[name] = jax.tree.map(lambda a, index=index: np.asarray(a)[index], value)
            continue
        if isinstance(value, QuantizedTensor):
            value = dequantize_stacked(value)  # (..., K, N) = (..., in, out): the decoder's kernel orientation
            if path[-1] == "table_t":  # (hidden, vocab) -> the embedding's (vocab, hidden)
                value = value.T
        array = np.asarray(jax.device_get(jnp.asarray(value, jnp.float32)))
        for name, transpose, index in inverse[key]:
            part = array[index]
            if name.endswith("patch_embedding.weight"):  # (C * p * p, D) -> the convolution's (D, C, p, p)
                v = model.config.vision
                part = part.T.reshape(v.hidden_size, v.num_channels, v.patch_size, v.patch_size)
            tensors[name] = np.ascontiguousarray(part.T if transpose else part).astype(_DTYPES[dtype])
    if unknown:
        raise ValueError(f"cannot export {len(unknown)} model variable(s) with no HF tensor name: {', '.join(unknown[:8])}"
                         f"{', ...' if len(unknown) > 8 else ''} (merge LoRA adapters into the base weights first)")
    return tensors


def _config(model: Decoder, tokenizer: Tokenizer, hf_config: dict, dtype: str, eos: int | list[int] | None) -> dict:
    config = {k: v for k, v in hf_config.items() if k != "quantization_config"}
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(f"cannot export model_type {model_type!r} (supported: {', '.join(ARCHITECTURES)})")
    if ModelConfig.from_hf_dict(config) != model.config:
        raise ValueError("hf_config does not describe this model (its parsed ModelConfig differs from model.config)")
    config["architectures"] = [ARCHITECTURES[model_type]]
    if model.config.num_labels:
        if model_type not in CLASSIFIERS:
            raise ValueError(f"cannot export a {model_type!r} sequence classifier (supported: {', '.join(CLASSIFIERS)})")
        config["architectures"] = [CLASSIFIERS[model_type]]
    config["tie_word_embeddings"] = model.config.tie_word_embeddings
    config["dtype"] = config["torch_dtype"] = dtype  # transformers 5 reads dtype, 4.x torch_dtype
    if tokenizer.bos_token_id is not None:
        config["bos_token_id"] = tokenizer.bos_token_id
    if eos is not None:
        config["eos_token_id"] = eos
    if tokenizer.pad_token_id is not None:
        config["pad_token_id"] = tokenizer.pad_token_id
    if model.config.num_labels:  # HF's classifiers read each row at the last token that is not this id
        config["pad_token_id"] = model.config.pad_token_id
    return config


def classifier_config(hf_config: dict, num_labels: int, pad_token_id: int | None) -> dict:
    """A causal LM's HF config as the config of the sequence classifier (a reward model: 1 label) made from it,
    reading its score at the last token that is not `pad_token_id`; a classifier's own labels are kept."""
    model_type = hf_config.get("model_type")
    if model_type not in CLASSIFIERS:
        raise ValueError(f"a {model_type!r} model cannot be made a sequence classifier (supported: "
                         f"{', '.join(CLASSIFIERS)})")
    labels = hf_config.get("id2label") if len(hf_config.get("id2label") or {}) == num_labels else None
    labels = labels or {str(i): f"LABEL_{i}" for i in range(num_labels)}
    return {**hf_config, "architectures": [CLASSIFIERS[model_type]], "num_labels": num_labels, "id2label": labels,
            "label2id": {v: int(k) for k, v in labels.items()}, "pad_token_id": pad_token_id}


def _generation_config(tokenizer: Tokenizer, given: dict | None) -> dict:
    """The given dict (or one with the tokenizer's bos id), its eos_token_id extended to every id that
    ends generation, so that Tokenizer.from_hf_dir gets back the same eos_token_ids."""
    if given is not None:
        gen = dict(given)
    else:
        gen = {} if tokenizer.bos_token_id is None else {"bos_token_id": tokenizer.bos_token_id}
    listed = gen.get("eos_token_id")
    listed = [] if listed is None else list(listed) if isinstance(listed, (list, tuple)) else [listed]
    eos = listed + [i for i in tokenizer.eos_token_ids if i not in listed]
    if eos:
        gen["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    return gen


def _tokenizer_config(tokenizer: Tokenizer, max_length: int) -> dict:
    # No add_bos_token / add_eos_token: given either, transformers rebuilds the post-processor instead of
    # using tokenizer.json's, which already adds exactly what Tokenizer.encode adds.
    pad = None if tokenizer.pad_token_id is None else tokenizer.backend.id_to_token(tokenizer.pad_token_id)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tokenizer.bos_token,
              "eos_token": tokenizer.eos_token, "pad_token": pad, "model_max_length": max_length,
              "clean_up_tokenization_spaces": False}
    return {k: v for k, v in config.items() if v is not None}


def _save_tensors(tensors: dict, path: Path) -> None:
    from safetensors.numpy import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def export_hf(model: Decoder, tokenizer: Tokenizer, hf_config: dict, out_dir: str | os.PathLike, *,
              dtype: str = "float32", generation_config: dict | None = None, overwrite: bool = False,
              sources: Sequence[str | os.PathLike] = ()) -> Path:
    """Write `model` (+ tokenizer) to `out_dir` as an HF checkpoint; returns the directory.

    hf_config is the config.json dict the model was built from (LoadedModel.hf_config). The directory is
    built beside `out_dir` and renamed into place when complete (checkpoints/output_dir.py): a non-empty
    `out_dir` is refused unless `overwrite`, and so is one that is or overlaps a path in `sources` (the model
    it was read from).
    """
    out_dir = check_output_dir(out_dir, overwrite=overwrite, sources=sources, what="export target")
    tensors = hf_tensors(model, dtype)  # before touching out_dir: unknown variables fail first
    gen = _generation_config(tokenizer, generation_config)
    config = _config(model, tokenizer, hf_config, dtype, gen.get("eos_token_id"))
    with staged_output_dir(out_dir, overwrite=overwrite, sources=sources, what="export target") as staging:
        _save_tensors(tensors, staging / hf_dir.SINGLE_FILE)
        del tensors  # the host copy of the weights goes before the tokenizer files are written
        tokenizer.backend.save(str(staging / "tokenizer.json"))
        _write_json(staging / "tokenizer_config.json",
                    _tokenizer_config(tokenizer, model.config.max_position_embeddings))
        if tokenizer.chat_template is not None:
            (staging / "chat_template.jinja").write_bytes(tokenizer.chat_template.encode("utf-8"))
        _write_json(staging / "generation_config.json", gen)
        _write_json(staging / "config.json", config)
    return out_dir
