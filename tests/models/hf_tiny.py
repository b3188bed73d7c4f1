"""Tiny random HF transformers models of every family (dense and MoE), saved as HF directories, and a tiny
HF-style tokenizer with a chat template to go with them (what loading, export and training need)."""

from __future__ import annotations

import json
from pathlib import Path

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)

FAMILIES = {
    "llama": dict(tie_word_embeddings=False, rope_theta=5000.0,
                  rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                    original_max_position_embeddings=64)),
    "qwen2": dict(tie_word_embeddings=True, rope_theta=10000.0),
    # Qwen3's long-context rope (YaRN): the pretraining length 64 of the 256 positions, so every region of
    # the ramp (kept, interpolated, blended frequencies) and the attention factor (1.139) are exercised
    "qwen3": dict(tie_word_embeddings=False, head_dim=32, rope_theta=10000.0,
                  rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64)),
    "gemma2": dict(num_hidden_layers=3, head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
                   attn_logit_softcapping=5.0, final_logit_softcapping=3.0, hidden_activation="gelu_pytorch_tanh"),
    "gemma3_text": dict(num_hidden_layers=6, head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                        rope_theta=100000.0, rope_local_base_freq=1000.0),
    # MoE: more experts than chosen, so routing matters; Qwen2-MoE mixes a dense layer and a shared expert
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, rope_theta=10000.0),
    "qwen2_moe": dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                      mlp_only_layers=[1], rope_theta=10000.0),
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=24, head_dim=32, norm_topk_prob=True,
                      rope_theta=10000.0),
}
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")


def make_hf_model(family: str, out_dir: Path, seed: int = 0, **overrides):
    """Build, randomise (every parameter, norms and biases included) and save a tiny model; `overrides`
    change the config (say vocab_size)."""
    import torch
    import transformers

    cfg_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
               "qwen3": transformers.Qwen3Config, "gemma2": transformers.Gemma2Config,
               "gemma3_text": transformers.Gemma3TextConfig, "mixtral": transformers.MixtralConfig,
               "qwen2_moe": transformers.Qwen2MoeConfig, "qwen3_moe": transformers.Qwen3MoeConfig}[family]
    model_cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
                 "qwen3": transformers.Qwen3ForCausalLM, "gemma2": transformers.Gemma2ForCausalLM,
                 "gemma3_text": transformers.Gemma3ForCausalLM, "mixtral": transformers.MixtralForCausalLM,
                 "qwen2_moe": transformers.Qwen2MoeForCausalLM, "qwen3_moe": transformers.Qwen3MoeForCausalLM}[family]
    config = cfg_cls(**{**COMMON, **FAMILIES[family], **overrides}, attn_implementation="eager")
    torch.manual_seed(seed)
    model = model_cls(config).eval().to(torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out_dir)
    return model


# A chat template whose render of a conversation's first turns is a prefix of its render of the whole
# (what assistant-only and completion-only losses need).
TEMPLATE = ("{% for m in messages %}{{ bos_token }}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}\n{% endfor %}"
            "{% if add_generation_prompt %}{{ bos_token }}assistant:{% endif %}")


def write_tiny_tokenizer(model_dir: Path, extra_special: tuple[str, ...] = ()) -> None:
    """An HF-style tokenizer with ids < 105: characters, a few merges, <s> added in front by the post-processor,
    and TEMPLATE as its chat template; `extra_special` tokens take ids 105, 106, ..."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as Backend

    vocab = ["<unk>", "<s>", "</s>", "<pad>", "▁", *map(chr, range(33, 127)),
             "▁t", "▁th", "▁the", "th", "he", "the"]
    merges = [("▁", "t"), ("▁t", "h"), ("▁th", "e"), ("t", "h"), ("h", "e"), ("th", "e")]
    backend = Backend(models.BPE({t: i for i, t in enumerate(vocab)}, merges, unk_token="<unk>", fuse_unk=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t in ("<unk>", "<s>", "</s>", "<pad>", *extra_special)])
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    backend.save(str(Path(model_dir) / "tokenizer.json"))
    (Path(model_dir) / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>", "chat_template": TEMPLATE}))


def make_tiny_model_dir(out_dir: Path, family: str = "llama", seed: int = 0, **overrides):
    """make_hf_model plus write_tiny_tokenizer: a directory `load_model` and transformers both load."""
    model = make_hf_model(family, out_dir, seed, **overrides)
    write_tiny_tokenizer(out_dir)
    return model


# Gemma3ForConditionalGeneration: the gemma3_text decoder above (one full layer among sliding ones) with a
# 2-layer SigLIP tower of 32x32 images in 8x8 patches (16 patches), pooled 2x2 into 4 soft tokens. Image
# tokens 105 <start_of_image> 106 <end_of_image> 107 <image_soft_token>: the tiny tokenizer's specials after its
# 0..104.
IMAGE_TOKENS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")
VISION = dict(
    text_config=dict(COMMON, vocab_size=128, num_hidden_layers=3, head_dim=16, sliding_window=6, query_pre_attn_scalar=16,
                     layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
    vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32,
                       patch_size=8, vision_use_head=False),
    mm_tokens_per_image=4, boi_token_index=105, eoi_token_index=106, image_token_index=107)


def make_hf_gemma3_vision(out_dir: Path, seed: int = 0):
    """A tiny random Gemma3ForConditionalGeneration (every parameter randomised) and the tiny tokenizer, saved."""
    import torch
    import transformers

    config = transformers.Gemma3Config(**VISION, attn_implementation="eager")
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).eval().to(torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out_dir)
    write_tiny_tokenizer(out_dir, IMAGE_TOKENS)
    return model
