"""Greedy decode speed of the default model: quantized weights (as shipped) vs dequantized f32.

Usage: python benchmarks/decode_default.py [--tokens 64] [--repeats 3]
Both runs use the reference generator on the same prompt in one process; medians are printed
with their ratio. Compilation is excluded (one warm-up generation each).
"""

from __future__ import annotations

import argparse
import statistics
import time

from tunix_rt.checkpoints.loader import load_model
from tunix_rt.engine.reference_generator import GenerationConfig, generate
from tunix_rt.ops._ffi import isa_level


def tokens_per_second(loaded, prompt: str, n: int, repeats: int) -> tuple[float, str]:
    ids = loaded.tokenizer.encode(prompt)
    config = GenerationConfig(max_tokens=n)  # no stop tokens: always n tokens
    generate(loaded.model, [ids], config)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = generate(loaded.model, [ids], config)[0]
        times.append(time.perf_counter() - start)
    return n / statistics.median(times), loaded.tokenizer.decode(out.token_ids[:8])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    prompt = "The capital of France is"
    print(f"default model greedy decode, {args.tokens} tokens, batch 1 | kernel tier {isa_level()}")
    print(f"{'weights':>12} {'tok/s':>8}  first tokens")
    rates = {}
    for label, dequantize in (("quantized", False), ("f32", True)):
        rates[label], text = tokens_per_second(load_model("default", dequantize=dequantize), prompt, args.tokens,
                                               args.repeats)
        print(f"{label:>12} {rates[label]:>8.1f}  {text!r}")
    print(f"ratio quantized / f32: {rates['quantized'] / rates['f32']:.2f}x")


if __name__ == "__main__":
    main()
