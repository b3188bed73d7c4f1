"""Tiny random HF transformers models of every dense family, saved as HF directories."""

from __future__ import annotations

from pathlib import Path

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)

FAMILIES = {
    "llama": dict(tie_word_embeddings=False, rope_theta=5000.0,
                  rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                    original_max_position_embeddings=64)),
    "qwen2": dict(tie_word_embeddings=True, rope_theta=10000.0),
    "qwen3": dict(tie_word_embeddings=False, head_dim=32, rope_theta=10000.0),
    "gemma2": dict(num_hidden_layers=3, head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
                   attn_logit_softcapping=5.0, final_logit_softcapping=3.0, hidden_activation="gelu_pytorch_tanh"),
    "gemma3_text": dict(num_hidden_layers=6, head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                        rope_theta=100000.0, rope_local_base_freq=1000.0),
}


def make_hf_model(family: str, out_dir: Path, seed: int = 0):
    """Build, randomise (every parameter, norms and biases included) and save a tiny model."""
    import torch
    import transformers

    cfg_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
               "qwen3": transformers.Qwen3Config, "gemma2": transformers.Gemma2Config,
               "gemma3_text": transformers.Gemma3TextConfig}[family]
    model_cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
                 "qwen3": transformers.Qwen3ForCausalLM, "gemma2": transformers.Gemma2ForCausalLM,
                 "gemma3_text": transformers.Gemma3ForCausalLM}[family]
    config = cfg_cls(**{**COMMON, **FAMILIES[family]}, attn_implementation="eager")
    torch.manual_seed(seed)
    model = model_cls(config).eval().to(torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out_dir)
    return model
