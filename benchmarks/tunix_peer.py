"""The google-tunix side of benchmarks/train.py: its PeftTrainer on SmolLM2-135M (run by the peer interpreter).

Tunix's Llama3 model takes SmolLM2's dimensions; the weights come from the HF directory that
benchmarks/train.py exports from the default GGUF (TUNIX_RT_BENCH_HF_DIR). LoRA goes through qwix
on the same seven projections. Step times are the intervals between the trainer's batch requests,
which in steady state is its step time (asynchronous dispatch keeps at most two steps in flight).
"""

from __future__ import annotations

import json
import os
import time


def llama_config(hf_dir: str):
    """Tunix's Llama3 ModelConfig with the dimensions of the HF checkpoint in hf_dir (SmolLM2's)."""
    from tunix.models.llama3 import model as llama

    with open(os.path.join(hf_dir, "config.json")) as f:
        hf = json.load(f)
    return llama.ModelConfig(
        num_layers=hf["num_hidden_layers"], vocab_size=hf["vocab_size"], embed_dim=hf["hidden_size"],
        hidden_dim=hf["intermediate_size"], num_heads=hf["num_attention_heads"],
        head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        num_kv_heads=hf["num_key_value_heads"], rope_theta=int(hf["rope_theta"]), norm_eps=hf["rms_norm_eps"],
        weight_tying=hf.get("tie_word_embeddings", True))


def train_steps(mode: str, dtype: str, steps: int, batch: int, seq_len: int, rank: int, alpha: float,
                targets: tuple[str, ...]) -> list[float]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    import qwix
    from flax import nnx
    from tunix.models.llama3 import params as llama_params
    from tunix.sft import peft_trainer, utils

    if dtype != "float32":
        raise SystemExit("the Tunix peer runs f32 only")
    hf_dir = os.environ["TUNIX_RT_BENCH_HF_DIR"]
    config = llama_config(hf_dir)
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    with mesh:
        model = llama_params.create_model_from_safe_tensors(hf_dir, config, mesh, dtype=jnp.float32)
        if mode == "lora":
            provider = qwix.LoraProvider(module_path=".*(" + "|".join(targets) + ")", rank=rank, alpha=alpha)
            model = qwix.apply_lora_to_model(model, provider, **model.get_model_input())
        rows = np.random.default_rng(0).integers(100, config.vocab_size, size=(batch * (steps + 1), seq_len))
        marks: list[float] = []

        def batches():
            for i in range(steps):
                marks.append(time.perf_counter())
                tokens = rows[i * batch:(i + 1) * batch].astype(np.int32)
                yield peft_trainer.TrainingInput(input_tokens=tokens, input_mask=np.ones_like(tokens, bool))
            marks.append(time.perf_counter())

        def model_input(x: peft_trainer.TrainingInput):
            return {"input_tokens": x.input_tokens, "input_mask": x.input_mask,
                    "positions": utils.build_positions_from_mask(x.input_mask),
                    "attention_mask": utils.make_causal_attn_mask(x.input_mask)}

        cfg = peft_trainer.TrainingConfig(eval_every_n_steps=10_000, max_steps=steps, pbar_description=None)
        trainer = peft_trainer.PeftTrainer(model, optax.adamw(1e-5), cfg).with_gen_model_input_fn(model_input)
        trainer.train(batches())
        jax.block_until_ready(nnx.state(trainer.model))
        marks.append(time.perf_counter())
    return [b - a for a, b in zip(marks[1:], marks[2:])]
