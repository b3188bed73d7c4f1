"""Quantization-aware training against quantizing after training, on the default model.

Usage: python benchmarks/qat.py [--quant q4_0] [--steps 60] [--lora-rank 8]

A small fine-tuning task made here: chats asking for a sum of two numbers below 100 and answering
"a + b = c." (400 distinct pairs, 320 trained on, 80 held out). Two LoRA SFT runs with the same seed and
options, one plain and one with qat=QUANT; each is then evaluated with `tunix-rt eval --task perplexity` on
the held-out chats (assistant tokens) as f32 and as QUANT (the model written as that GGUF type and read back,
what llama.cpp would run). Prints both runs' perplexities and the gap QUANT - f32 of each, and each `sft`
process's wall time (load, compile, the steps, saving) and peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def write_data(directory: str) -> tuple[str, str]:
    rng = random.Random(0)
    pairs = rng.sample([(a, b) for a in range(100) for b in range(100)], 400)
    rows = [{"messages": [{"role": "user", "content": f"What is {a} + {b}?"},
                          {"role": "assistant", "content": f"{a} + {b} = {a + b}."}]} for a, b in pairs]
    paths = []
    for name, part in (("train", rows[:320]), ("heldout", rows[320:])):
        path = os.path.join(directory, f"{name}.jsonl")
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in part)
        paths.append(path)
    return paths[0], paths[1]


def run(argv: list[str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "tunix_rt", *argv], capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"tunix-rt {argv[0]} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return time.perf_counter() - start


def peak_rss_gb(metrics_path: str) -> float:
    with open(metrics_path) as f:
        return max(json.loads(line).get("memory/peak_rss_gb", 0.0) for line in f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quant", default="q4_0", choices=["q8_0", "q4_0", "q4_1"])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--lora-rank", type=int, default=8)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="tunix-rt-qat-") as work:
        train, heldout = write_data(work)
        rows = []
        for label, extra in (("post-training quantization", []), (f"qat={args.quant}", [f"qat={args.quant}"])):
            out = os.path.join(work, label.split("=")[0].replace(" ", "_"))
            seconds = run(["sft", "--data", train, "--output", out, "--steps", str(args.steps), "--lora-rank",
                           str(args.lora_rank), "learning_rate=1e-3", "batch_size=8", "max_length=64",
                           "progress=false", *extra])
            evaluation = os.path.join(out, "eval")
            run(["eval", "--lora", os.path.join(out, "adapter"), "--data", heldout, "--formats", f"f32,{args.quant}",
                 "--output", evaluation])
            with open(os.path.join(evaluation, "eval.json")) as f:
                ppl = {r["format"]: r["metrics"]["perplexity"] for r in json.load(f)["results"]}
            rows.append((label, ppl["f32"], ppl[args.quant], seconds, peak_rss_gb(os.path.join(out, "metrics.jsonl"))))
    print(f"default model, LoRA r{args.lora_rank}, {args.steps} steps of 8 chats; held-out perplexity (80 chats)")
    print(f"{'run':<28} {'f32':>8} {args.quant:>8} {'gap':>8} {'sft s':>8} {'peak GB':>8}")
    for label, f32, quant, seconds, rss in rows:
        print(f"{label:<28} {f32:8.4f} {quant:8.4f} {quant - f32:+8.4f} {seconds:8.1f} {rss:8.2f}")


if __name__ == "__main__":
    main()
