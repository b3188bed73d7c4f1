"""Does a 1B-class model train here? LoRA on a Llama-3.2-1B-shaped model with random weights.

Usage: python benchmarks/train_1b.py [--steps 3] [--dtype float32|bfloat16] [--no-gradient-checkpointing]

The model has Llama 3.2 1B's shape (hidden 2048, 16 layers, 32 query / 8 KV heads, MLP 8192, vocabulary
128,256, tied embeddings), random weights made here (nothing is downloaded). It trains LoRA rank 8 on the seven
projections at batch 8 x 512 random tokens, every token trained, with gradient_checkpointing on by default.
Prints each step's time, the median after the first (compiling) step, and the peak RSS of the process. Its
(tokens, vocab) f32 logits alone would be 2.1 GB per copy; the fused head never forms them.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np

LLAMA_3_2_1B = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128_256, hidden_size=2048,
                    intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                    head_dim=64, rms_norm_eps=1e-5, rope_theta=500_000.0, tie_word_embeddings=True,
                    max_position_embeddings=131_072, hidden_act="silu")
BATCH, SEQ_LEN = 8, 512


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--no-gradient-checkpointing", action="store_true")
    args = parser.parse_args()

    import jax
    from flax import nnx

    from tunix_rt.models.config import ModelConfig
    from tunix_rt.models.decoder import Decoder
    from tunix_rt.train.config import SFTConfig
    from tunix_rt.train.data import SFTExample
    from tunix_rt.train.sft import SFTObjective
    from tunix_rt.train.trainer import Trainer, peak_rss_gb

    cfg = ModelConfig.from_hf_dict(LLAMA_3_2_1B)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    rng = np.random.default_rng(0)
    items = [SFTExample(rng.integers(1, cfg.vocab_size, SEQ_LEN).astype(np.int32), np.ones(SEQ_LEN, bool))
             for _ in range(BATCH * args.steps)]
    remat = not args.no_gradient_checkpointing
    print(f"Llama-3.2-1B shape ({params / 1e9:.2f}B params), LoRA r8, batch {BATCH} x {SEQ_LEN}, {args.dtype}, "
          f"gradient_checkpointing={remat}", flush=True)
    with tempfile.TemporaryDirectory() as out:
        train_cfg = SFTConfig(data="-", output=out, steps=args.steps, batch_size=BATCH, max_length=SEQ_LEN,
                              lora_rank=8, lora_alpha=16.0, dequantize=True, compute_dtype=args.dtype,
                              gradient_checkpointing=remat, shuffle=False, progress=False, save_steps=10_000)
        trainer = Trainer(train_cfg, model, SFTObjective(items, max_length=SEQ_LEN, pad_id=0))
        times = []
        for step in range(args.steps):
            start = time.perf_counter()
            out_step = trainer.run_step(step)
            times.append(time.perf_counter() - start)
            print(f"  step {step + 1}: {times[-1]:.1f} s, loss {out_step['loss']:.3f}, peak RSS "
                  f"{peak_rss_gb():.2f} GB", flush=True)
    warm = times[1:] or times
    print(f"median {statistics.median(warm):.1f} s/step ({BATCH * SEQ_LEN / statistics.median(warm):.1f} tok/s), "
          f"peak RSS {peak_rss_gb():.2f} GB", flush=True)


if __name__ == "__main__":
    main()
