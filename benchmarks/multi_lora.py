"""Many LoRA adapters in one engine against one model without adapters, same run, same concurrency.

Four random rank-R adapters on every projection of the default model (SmolLM2-135M Q4_1) are served by one engine
with 4 adapter slots; N concurrent greedy requests cycle through the 4 adapters, so every step mixes all of them.
The peer is the same engine config without adapter slots serving the base model: what one adapter merged into
the model costs (merged into the packed Q4_1 weights, as a requantized export would be). Also shown: the
multi-adapter engine serving base-model requests only (the adapter products skipped at run time), and one adapter
merged into float weights (`merge_lora`: what a float merge of a quantized base gives).

    python benchmarks/multi_lora.py [--streams 16] [--max-tokens 64] [--rank 16] [--repeats 3]

Prints decode tokens/s (generated tokens over the wall time of the whole batch, prompts of ~40 tokens included),
the median of --repeats, each configuration's ratio to the base model, and the process's peak RSS.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time

import jax.numpy as jnp
import numpy as np
from flax import nnx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))

from tunix_rt.checkpoints.loader import load_model  # noqa: E402
from tunix_rt.checkpoints.peft_adapter import load_adapter, save_adapter  # noqa: E402
from tunix_rt.engine.engine import Engine  # noqa: E402
from tunix_rt.engine.params import SamplingParams  # noqa: E402
from tunix_rt.models.lora import LoRALinear, apply_lora, merge_lora  # noqa: E402

TOPICS = ["the sea", "a library", "mountains", "rain", "a small robot", "bread", "the moon", "trains"]


def make_adapters(model_path: str, out: str, count: int, rank: int) -> list[str]:
    paths = []
    for i in range(count):
        model = load_model(model_path).model
        apply_lora(model, rank=rank, alpha=2.0 * rank, seed=i)
        rng = np.random.default_rng(i)
        for _, module in nnx.iter_modules(model):
            if isinstance(module, LoRALinear):
                module.lora_b.set_value(jnp.asarray(rng.normal(size=module.lora_b[...].shape) * 0.01, jnp.float32))
        paths.append(str(save_adapter(model, os.path.join(out, f"adapter{i}"))))
    return paths


def timed(engine: Engine, prompts, params, loras, repeats: int) -> tuple[float, int]:
    """Median tokens/s over `repeats` batches (after one warm-up batch that compiles what the batch needs)."""
    engine.generate(prompts, params, lora_request=loras)
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        outs = engine.generate(prompts, params, lora_request=loras)
        rates.append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start))
    return statistics.median(rates), sum(len(o.token_ids) for o in outs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-float-merge", action="store_true", help="leave out the float-merged model")
    args = parser.parse_args()

    loaded = load_model(args.model)
    tok = loaded.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"Write a short poem about {TOPICS[i % 8]}."}],
                                       add_generation_prompt=True, tokenize=True) for i in range(args.streams)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    sizes = dict(max_num_seqs=args.streams, max_model_len=512)
    rows = []
    with tempfile.TemporaryDirectory(prefix="multi-lora-") as tmp:
        paths = make_adapters(args.model, tmp, 4, args.rank)
        base = Engine(loaded.model, tok, **sizes)
        rows.append(("base model, no adapter slots", *timed(base, prompts, params, None, args.repeats)))
        del base
        multi = Engine(loaded.model, tok, max_loras=4, max_lora_rank=args.rank, **sizes)
        for i, path in enumerate(paths):
            multi.add_lora(f"adapter{i}", path)
        names = [f"adapter{i % 4}" for i in range(args.streams)]
        rows.append(("4 adapters mixed, one engine", *timed(multi, prompts, params, names, args.repeats)))
        rows.append(("same engine, base requests only", *timed(multi, prompts, params, None, args.repeats)))
        del multi
        if not args.skip_float_merge:
            merged = load_model(args.model).model
            load_adapter(merged, paths[0])
            merged_engine = Engine(merge_lora(merged), tok, **sizes)
            rows.append(("1 adapter merged into float weights",
                         *timed(merged_engine, prompts, params, None, args.repeats)))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    reference = rows[0][1]
    print(f"\n{args.streams} streams x {args.max_tokens} tokens, rank {args.rank}, median of {args.repeats}")
    print(f"{'configuration':40} {'tokens/s':>9} {'vs base':>8}")
    for name, rate, _ in rows:
        print(f"{name:40} {rate:9.1f} {rate / reference:7.2f}x")
    print(f"peak RSS {peak:.2f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
