"""Writing a Decoder as a GGUF file that llama.cpp (and `loader.load_model`) loads.

The metadata and tensor layout follow llama.cpp's convert_hf_to_gguf.py: its architecture keys, the gguf
package's tensor-name map, Llama Q/K rows permuted to interleaved pairs, Gemma norms stored as 1 + w, experts
stacked per projection, llama3 rope as `rope_freqs.weight`. Weights go out as f32, f16, bf16 or one of the
GGUF block formats this project packs (q8_0, q4_0, q4_1; a matrix whose rows are not whole 32-blocks stays
f32, as llama.cpp's converter leaves it); a layer already packed in that format is written as its blocks are,
others are quantized by our ggml-exact quantizer, so loading the file gives back bitwise the packed weights
written. The tokenizer is the source GGUF's own metadata when the model came from one, else converted from
its tokenizers backend (byte-level BPE: `gpt2`; a ▁-BPE: SentencePiece `llama`), and the file's tokenizer is
read back and checked against the model's on probe texts before the file is put in place.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

import jax
import numpy as np

from tunix_rt.checkpoints.gguf_loader import llama3_rope_factors, open_gguf, permute_rope
from tunix_rt.checkpoints.hf_export import hf_tensors
from tunix_rt.checkpoints.output_dir import staged_output_file
from tunix_rt.checkpoints.tokenizer import BYTE_LEVEL_PRE_NAMES, Tokenizer
from tunix_rt.models.config import ModelConfig
from tunix_rt.models.decoder import Decoder
from tunix_rt.ops.quant import FORMATS, QuantizedTensor, quantize

QUANTS = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1")
# our architecture -> llama.cpp's
_ARCH = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma": "gemma",
         "gemma2": "gemma2", "gemma3_text": "gemma3", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}
_FILE_TYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0",
               "q4_0": "MOSTLY_Q4_0", "q4_1": "MOSTLY_Q4_1"}
# Texts the written tokenizer must cut exactly as the model's own does (spaces, digits, case, punctuation,
# newlines, non-Latin scripts, emoji): a conversion that differs on any of them is refused.
_PROBES = ("Hello world! It's 2026-11-28, and 3.14159 x 12345 = ?", "  two  spaces\n\nnew lines\tand tabs",
           "CamelCase snake_case kebab-case URL https://example.com/a?b=c", "naïve café Straße 東京 Москва 🙂👍",
           "def f(x):\n    return x ** 2  # comment", "'s 't 're 've 'm 'll 'd I'M YOU'RE")


class GGUFExportError(ValueError):
    """The model (or its tokenizer) cannot be written as a GGUF file llama.cpp reads the same way."""


def export_gguf(model: Decoder, tokenizer: Tokenizer, out_file: str | os.PathLike, *, quant: str = "f32",
                name: str | None = None, source: str | os.PathLike | None = None,
                inputs: Sequence[str | os.PathLike] = (), overwrite: bool = False) -> Path:
    """Write `model` (any LoRA merged into it first: merge_lora) and `tokenizer` to `out_file` as GGUF; returns
    its path.

    `source` is the file or directory the weights were loaded from (a .gguf source gives the tokenizer metadata
    verbatim); the output may be neither it nor any of `inputs`, nor (without `overwrite`) an existing file.
    The file is written beside its target and renamed into place when complete and checked.
    """
    import gguf

    if quant not in QUANTS:
        raise GGUFExportError(f"GGUF quant must be one of {', '.join(QUANTS)}, got {quant!r}")
    cfg = model.config
    if cfg.vision is not None:
        raise GGUFExportError("GGUF export of a model with an image encoder is not supported (llama.cpp keeps the "
                              "vision tower in a separate mmproj file); export it as an HF directory")
    arch = _ARCH.get(cfg.architecture)
    if arch is None:
        raise GGUFExportError(f"cannot export architecture {cfg.architecture!r} as GGUF (supported: {', '.join(_ARCH)})")
    _check_llama_cpp_reads_it_the_same(cfg, arch)
    source_gguf = source is not None and Path(source).is_file() and Path(source).suffix.lower() == ".gguf"
    tensors = list(_gguf_tensors(model, arch, quant))  # before writing anything: a bad variable fails first
    sources = [*inputs, *([] if source is None else [source])]
    with staged_output_file(out_file, overwrite=overwrite, sources=sources, what="GGUF export target") as staging:
        writer = gguf.GGUFWriter(str(staging), arch)
        writer.add_name(name or f"{cfg.architecture}-{cfg.num_layers}x{cfg.hidden_size}")
        writer.add_file_type(gguf.LlamaFileType[_FILE_TYPES[quant]])
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        _add_architecture(writer, cfg, arch)
        if source_gguf:
            _copy_tokenizer_fields(writer, Path(source))
        else:
            _add_tokenizer(writer, tokenizer, cfg.vocab_size)
        for tensor_name, data, qtype in tensors:
            writer.add_tensor(tensor_name, data, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        _check_tokenizer(tokenizer, staging)
    return Path(out_file).expanduser().absolute()


# --- architecture -----------------------------------------------------------------------------------------


def _llama_cpp_query_scale(cfg: ModelConfig, arch: str) -> float:
    """The scores scale llama.cpp's Gemma graphs use: head_dim ** -0.5, hidden / heads for the 27B models."""
    big = (arch, cfg.num_layers) in (("gemma2", 46), ("gemma3", 62))
    return (cfg.hidden_size // cfg.num_heads if big else cfg.head_dim) ** -0.5


def _llama_cpp_layer_types(cfg: ModelConfig, arch: str) -> tuple[str, ...] | None:
    """The sliding / full pattern llama.cpp hard-codes for the architecture (None: every layer full)."""
    if arch == "gemma2":
        return tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(cfg.num_layers))
    if arch == "gemma3" and cfg.sliding_window:
        return tuple("sliding_attention" if i % 6 < 5 else "full_attention" for i in range(cfg.num_layers))
    return None


def _check_llama_cpp_reads_it_the_same(cfg: ModelConfig, arch: str) -> None:
    """Refuse what GGUF has no key for and llama.cpp would compute differently (it fixes these per architecture)."""
    if arch.startswith("gemma"):
        scale = cfg.query_scale or cfg.head_dim ** -0.5
        if not math.isclose(scale, _llama_cpp_query_scale(cfg, arch), rel_tol=1e-6):
            raise GGUFExportError(f"query scale {scale:g} differs from the one llama.cpp uses for a {arch} model of "
                                  f"this shape ({_llama_cpp_query_scale(cfg, arch):g}); GGUF cannot record it")
    pattern = _llama_cpp_layer_types(cfg, arch)
    types = tuple(cfg.layer_types) or ("full_attention",) * cfg.num_layers
    if (pattern or ("full_attention",) * cfg.num_layers) != types:
        raise GGUFExportError(f"layer types {types} differ from llama.cpp's fixed pattern for {arch}; GGUF cannot "
                              "record a pattern of its own")
    if "sliding_attention" in types and arch not in ("gemma2", "gemma3"):
        raise GGUFExportError(f"sliding-window layers are not read from a {arch} GGUF by llama.cpp")
    for kind, rope in cfg.rope:
        if rope.rope_type not in ("default", "linear", "yarn", "llama3"):
            raise GGUFExportError(f"rope type {rope.rope_type!r} ({kind} layers) has no GGUF form "
                                  "(supported: default, linear, yarn, llama3)")
        if rope.rope_type == "llama3" and (rope.low_freq_factor, rope.high_freq_factor) != (1.0, 4.0):
            raise GGUFExportError("llama3 rope with frequency factors other than 1 and 4 cannot be read back")


def _full_rope(cfg: ModelConfig):
    """The rope of the global layers: what llama.cpp's `rope.*` keys describe."""
    ropes = dict(cfg.rope)
    return ropes.get("full_attention") or next(iter(ropes.values()))


def _add_architecture(writer, cfg: ModelConfig, arch: str) -> None:
    """llama.cpp's `{arch}.*` keys for `cfg` (convert_hf_to_gguf.py's set_gguf_parameters)."""
    import gguf

    ropes = dict(cfg.rope)
    full = _full_rope(cfg)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_heads)
    writer.add_head_count_kv(cfg.num_kv_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(full.theta)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_vocab_size(cfg.vocab_size)
    if full.rope_type == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(full.factor)
    elif full.rope_type == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(full.factor)
        writer.add_rope_scaling_orig_ctx_len(full.original_max_position_embeddings)
        writer.add_rope_scaling_yarn_beta_fast(full.beta_fast)
        writer.add_rope_scaling_yarn_beta_slow(full.beta_slow)
    if "sliding_attention" in ropes and arch == "gemma3":
        writer.add_rope_freq_base_swa(ropes["sliding_attention"].theta)
    if arch.startswith("gemma"):
        if cfg.attn_logit_softcap:
            writer.add_attn_logit_softcapping(cfg.attn_logit_softcap)
        if cfg.final_logit_softcap:
            writer.add_final_logit_softcapping(cfg.final_logit_softcap)
        if cfg.sliding_window:
            writer.add_sliding_window(cfg.sliding_window)
    if cfg.num_experts:
        writer.add_expert_count(cfg.num_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_expert_weights_norm(cfg.norm_topk_prob)
        if arch != "llama":
            writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if cfg.shared_expert_intermediate_size:
            writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)


# --- tensors ----------------------------------------------------------------------------------------------


def _blocks(qt: QuantizedTensor) -> np.ndarray:
    """A packed (K, N) weight as ggml's rows of blocks: (N, K / 32 * block bytes) uint8, ggml's own layout
    (f16 scale, f16 min for q4_1, then the codes)."""
    f = FORMATS[qt.fmt]
    qs, scales = np.asarray(qt.qs), np.asarray(qt.scales, np.float16)
    n, nb = scales.shape
    code_bytes = 32 * f.bits // 8
    fields = [("d", "<f2"), ("m", "<f2")] if f.has_min else [("d", "<f2")]
    out = np.empty((n, nb), np.dtype([*fields, ("qs", np.uint8, (code_bytes,))]))
    out["d"] = scales
    if f.has_min:
        out["m"] = np.asarray(qt.mins, np.float16)
    out["qs"] = qs.view(np.uint8).reshape(n, nb, code_bytes)
    return out.view(np.uint8).reshape(n, -1)


def _stacked_experts(tensors: dict[str, np.ndarray], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Per-expert HF tensors stacked per layer and projection, as llama.cpp's `ffn_*_exps` hold them."""
    if not cfg.num_experts:
        return tensors
    prefix = "block_sparse_moe.experts" if cfg.architecture == "mixtral" else "mlp.experts"
    out = {}
    for name, data in tensors.items():
        parts = name.split(".")
        if ".".join(parts[3:5]) == prefix and parts[5].isdigit():
            stacked = ".".join([*parts[:5], *parts[6:]])
            if stacked not in out:
                out[stacked] = np.stack([tensors[".".join([*parts[:5], str(e), *parts[6:]])]
                                         for e in range(cfg.num_experts)])
        else:
            out[name] = data
    return out


def _gguf_tensors(model: Decoder, arch: str, quant: str) -> Iterator[tuple[str, np.ndarray, object]]:
    """(GGUF name, data, GGML type) for every tensor llama.cpp reads."""
    import gguf

    cfg = model.config
    names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), cfg.num_layers)
    tensors = _stacked_experts(hf_tensors(model, "float32", keep_packed=quant if quant in FORMATS else None), cfg)
    full = _full_rope(cfg)
    if full.rope_type == "llama3":
        factors = llama3_rope_factors(full.theta, cfg.head_dim, full.factor, full.original_max_position_embeddings)
        yield "rope_freqs.weight", factors.astype(np.float32), gguf.GGMLQuantizationType.F32
    for hf_name, data in tensors.items():
        if hf_name == "lm_head.weight" and (cfg.tie_word_embeddings or arch.startswith("gemma")):
            continue
        base, suffix = hf_name.rsplit(".", 1)
        gguf_base = names.get_name(base)
        if gguf_base is None:
            raise GGUFExportError(f"tensor {hf_name} has no llama.cpp name for architecture {arch}")
        gguf_name = f"{gguf_base}.{suffix}"
        rope_heads = None
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):
            rope_heads = cfg.num_heads if "q_proj" in hf_name else cfg.num_kv_heads
        if isinstance(data, QuantizedTensor):  # packed in the export's format: its blocks as they are
            if rope_heads:
                data = jax.tree.map(lambda a: permute_rope(a, rope_heads), data)
            yield gguf_name, _blocks(data), gguf.GGMLQuantizationType[quant.upper()]
            continue
        if arch.startswith("gemma") and hf_name.endswith("norm.weight"):
            data = data + np.float32(1.0)
        if hf_name.endswith("shared_expert_gate.weight"):
            data = data.reshape(-1)  # llama.cpp's (hidden,)
        if rope_heads:
            data = permute_rope(data, rope_heads)
        yield (gguf_name, *_encode(data, quant, gguf))


def _encode(data: np.ndarray, quant: str, gguf) -> tuple[np.ndarray, object]:
    """A float tensor in the export's type: vectors and matrices whose rows are not whole 32-blocks stay f32."""
    types = gguf.GGMLQuantizationType
    if data.ndim < 2 or quant == "f32":
        return np.ascontiguousarray(data, np.float32), types.F32
    if quant == "f16":
        return data.astype(np.float16), types.F16
    if quant == "bf16":
        return gguf.quants.quantize(data, types.BF16), types.BF16
    if data.shape[-1] % 32:
        return np.ascontiguousarray(data, np.float32), types.F32
    rows = data.reshape(-1, data.shape[-1])  # (out rows, in): ours quantizes (K, N) along K
    blocks = _blocks(jax.tree.map(np.asarray, quantize(rows.T, quant)))
    return blocks.reshape(*data.shape[:-1], -1), types[quant.upper()]


# --- tokenizer --------------------------------------------------------------------------------------------


def _copy_tokenizer_fields(writer, source: Path) -> None:
    """The source GGUF's `tokenizer.*` metadata, value for value."""
    from gguf import GGUFValueType

    reader = open_gguf(source)
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        if field.value_type == GGUFValueType.ARRAY:
            writer.add_key_value(key, field.contents(), GGUFValueType.ARRAY, sub_type=field.item_type)
        else:
            writer.add_key_value(key, field.contents(), field.value_type)


def _add_tokenizer(writer, tokenizer: Tokenizer, vocab_size: int) -> None:
    """The tokenizer as llama.cpp's vocabulary keys: byte-level BPE as `gpt2` with the pre-tokenizer name whose
    split matches the model's, a ▁-BPE as SentencePiece `llama` (merges ranked into scores). Ids the tokenizer
    leaves empty up to the model's vocabulary size are `[PADn]` tokens of type UNUSED, as llama.cpp's converter
    writes them (llama.cpp wants one token per embedding row)."""
    import json

    import gguf

    spec = json.loads(tokenizer.backend.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise GGUFExportError(f"cannot write a {model.get('type')!r} tokenizer as GGUF (supported: BPE)")
    vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
    size = max(max(vocab.values()) + 1, vocab_size)
    tokens = [f"[PAD{i}]" for i in range(size)]
    for token, i in vocab.items():
        tokens[i] = token
    added = {t["id"]: t for t in spec.get("added_tokens", [])}
    byte_piece = re.compile(r"<0x[0-9A-F]{2}>")  # SentencePiece's byte fallback: llama.cpp decodes them as bytes
    byte_fallback = bool(model.get("byte_fallback"))
    types = [gguf.TokenType.CONTROL if added.get(i, {}).get("special") else
             gguf.TokenType.USER_DEFINED if i in added else
             gguf.TokenType.UNUSED if tokens[i] == f"[PAD{i}]" else
             gguf.TokenType.BYTE if byte_fallback and byte_piece.fullmatch(tokens[i]) else
             gguf.TokenType.NORMAL for i in range(size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    if tokenizer.byte_level:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(_byte_level_pre(tokenizer, tokens, types, merges))
        writer.add_token_merges(merges)
    else:
        writer.add_tokenizer_model("llama")
        rank: dict[str, float] = {}
        for r, merge in enumerate(merges):  # a piece scores by the first merge that forms it
            rank.setdefault(merge.replace(" ", ""), -float(r + 1))
        writer.add_token_scores([rank.get(t, 0.0) for t in tokens])
        writer.add_token_merges(merges)
        writer.add_add_space_prefix('"prepend_scheme": "first"' in json.dumps(spec) or
                                    '"add_prefix_space": true' in json.dumps(spec))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    unknown = vocab.get(model["unk_token"]) if model.get("unk_token") else None
    eos = vocab.get(tokenizer.eos_token) if tokenizer.eos_token else None
    ends = [i for i in tokenizer.eos_token_ids if i != eos]  # a turn's end (Llama 3's <|eot_id|>): llama.cpp's eot
    if eos is None and ends:
        eos, ends = ends[0], ends[1:]
    for key, token_id in (("bos", tokenizer.bos_token_id), ("eos", eos), ("eot", ends[0] if ends else None),
                          ("eom", ends[1] if len(ends) > 1 else None), ("padding", tokenizer.pad_token_id),
                          ("unknown", unknown)):
        if token_id is not None:
            writer.add_uint32(f"tokenizer.ggml.{key}_token_id", token_id)
    writer.add_add_bos_token(tokenizer.add_bos_token)
    writer.add_add_eos_token(eos is not None and tokenizer.encode("a")[-1:] == [eos])
    if tokenizer.chat_template is not None:
        writer.add_chat_template(tokenizer.chat_template)


def _pieces(tokenizer: Tokenizer, text: str) -> list[str]:
    """What the tokenizer's normalizer and pre-tokenizer cut `text` into before BPE."""
    backend = tokenizer.backend
    if backend.normalizer is not None:
        text = backend.normalizer.normalize_str(text)
    return [piece for piece, _ in backend.pre_tokenizer.pre_tokenize_str(text)] if backend.pre_tokenizer else [text]


def _byte_level_pre(tokenizer: Tokenizer, tokens, types, merges) -> str:
    """llama.cpp's name for the split that cuts the probe texts into the same pieces, and so the same tokens, as
    `tokenizer` (its converter picks the name by a hash of such encodings). Pieces, not only tokens: a vocabulary
    with no multi-digit token encodes digits alike under GPT-2's split and SmolLM's digit-by-digit one."""
    for pre in BYTE_LEVEL_PRE_NAMES:
        candidate = Tokenizer.from_gguf_metadata({
            "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [int(t) for t in types], "tokenizer.ggml.merges": merges})
        if all(_pieces(candidate, text) == _pieces(tokenizer, text) and
               candidate.encode(text, add_special_tokens=False) == tokenizer.encode(text, add_special_tokens=False)
               for text in _PROBES):
            return pre
    raise GGUFExportError("the tokenizer's pre-tokenizer matches none llama.cpp names "
                          f"({', '.join(BYTE_LEVEL_PRE_NAMES)}); it cannot be written as GGUF")


def _check_tokenizer(tokenizer: Tokenizer, path: Path) -> None:
    """The written file's tokenizer must encode the probes (and the special tokens) as the model's does."""
    written = Tokenizer.from_gguf(open_gguf(path))
    for text in _PROBES:
        if written.encode(text) != tokenizer.encode(text):
            raise GGUFExportError(f"the GGUF tokenizer cuts {text!r} differently from the model's: "
                                  f"{written.encode(text)[:12]} vs {tokenizer.encode(text)[:12]}")
