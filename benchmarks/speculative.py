"""Speculative decoding (n-gram prompt lookup, or a draft model) against plain decoding on the default model,
same run.

Usage: python benchmarks/speculative.py [--method ngram|draft_model] [--draft PATH] [--dequantize]
    [--task copy|story] [--streams 1,2,8] [--tokens 96] [--repeats 5] [--k 3] [--disable-by-batch-size N|none]

Tasks: `copy` is input-grounded, where lookup pays: the chat model is asked to copy a given paragraph with one
change (each stream its own paragraph); `story` is free writing (each stream its own subject), where only a
draft model can guess. Greedy, so the two engines must give the same text (checked). `--dequantize` makes the
target the default model's f32 copy (a draft model then is the packed model itself by default: a quantized
draft for its full-precision target). Prints, per stream count, generated tokens/s of each engine (medians of
`repeats` runs after a warm-up run that compiles), their ratio, the drafts' acceptance rate, and the process's
peak resident memory; and the kernel tier. The speculative engine keeps the config's defaults (speculation off
past one running request) unless told.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

from tunix_rt.engine.engine import Engine
from tunix_rt.engine.params import SamplingParams
from tunix_rt.ops._ffi import isa_level

PARAGRAPHS = [
    "The river rises in the northern hills and runs south for two hundred miles, past three market towns and a "
    "ruined abbey, before it reaches the sea at a wide and muddy estuary.",
    "Our library opens at nine in the morning on weekdays and at ten on Saturdays. It is closed on Sundays and on "
    "public holidays, and the reading room closes half an hour before the building does.",
    "To make the dough, mix the flour and the salt in a large bowl, add the yeast and the warm water, and knead "
    "for ten minutes until it is smooth. Leave it to rise for an hour in a warm place.",
    "The committee met on Tuesday to discuss the new budget. After a long debate it agreed to spend more on "
    "schools and roads, and to hold the tax rate where it was for one more year.",
]


SUBJECTS = ["a fox who learns to read", "a lighthouse keeper's last night", "two robots who open a bakery",
            "a girl who finds a map in a library book"]


def _prompts(engine: Engine, streams: int, task: str) -> list[list[int]]:
    tok = engine.tokenizer
    chats = [[{"role": "user", "content": "Copy this text exactly, but write 'Tuesday' as 'Monday':\n\n"
               + PARAGRAPHS[i % len(PARAGRAPHS)] if task == "copy" else
               f"Write a short story about {SUBJECTS[i % len(SUBJECTS)]}."}] for i in range(streams)]
    return [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True) for c in chats]


def _run(engine: Engine, prompts, params) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outs) / seconds, [o.token_ids for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--method", default="ngram", choices=("ngram", "draft_model"))
    ap.add_argument("--draft", default="default", help="the draft model (draft_model): a path or 'default'")
    ap.add_argument("--dequantize", action="store_true", help="the target is the default model's f32 copy")
    ap.add_argument("--task", default="copy", choices=("copy", "story"))
    ap.add_argument("--streams", default="1,2,8")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--disable-by-batch-size", default="1", help="an integer, or 'none' (always speculate)")
    args = ap.parse_args()
    limit = None if args.disable_by_batch_size == "none" else int(args.disable_by_batch_size)
    spec = dict(method=args.method, num_speculative_tokens=args.k, disable_by_batch_size=limit)
    if args.method == "draft_model":
        spec["model"] = args.draft
    engines = {"plain": Engine("default", dequantize=args.dequantize),
               "spec": Engine("default", dequantize=args.dequantize, speculative_config=spec)}
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0)
    target = "f32 copy of the default model" if args.dequantize else "default model"
    drafts = f"draft model {args.draft}" if args.method == "draft_model" else "ngram"
    print(f"{target}, greedy, {args.task} prompts, {args.tokens} new tokens | kernel tier {isa_level()} | "
          f"{drafts} k={args.k}, disable_by_batch_size={limit}")
    print(f"{'streams':>7} {'plain tok/s':>12} {'spec tok/s':>12} {'ratio':>6} {'accepted':>9}  same text")
    for streams in map(int, args.streams.split(",")):
        prompts = _prompts(engines["plain"], streams, args.task)
        rates, texts = {}, {}
        for name, engine in engines.items():
            _run(engine, prompts, params)  # compiles
            before = engine.stats()
            runs = [_run(engine, prompts, params) for _ in range(args.repeats)]
            after = engine.stats()
            rates[name], texts[name] = statistics.median(r for r, _ in runs), runs[-1][1]
            if name == "spec":
                drafts = after.spec_draft_tokens - before.spec_draft_tokens
                accepted = f"{(after.spec_accepted_tokens - before.spec_accepted_tokens) / drafts:.0%}" if drafts else "-"
        print(f"{streams:>7} {rates['plain']:>12.1f} {rates['spec']:>12.1f} {rates['spec'] / rates['plain']:>5.2f}x "
              f"{accepted:>9}  {texts['plain'] == texts['spec']}")
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GB")
    print("sample:", engines["spec"].tokenizer.decode(texts["spec"][0])[:200].replace("\n", " "))


if __name__ == "__main__":
    main()
