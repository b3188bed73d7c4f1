"""Training on realistic rows, side by side with TRL, in one run: short chats, mixed-length chats, short DPO pairs.

Usage: python benchmarks/train_real.py --peer-python PY [--steps 8] [--only ours,trl] [--workloads sft-short,...]
       [--modes lora,full] [--dtypes float32,bfloat16]

Workloads (the rows are written once as JSONL and both sides read the same file):
  sft-short  64 one-turn chats of ~40 tokens with the chat template (a user question, a one-sentence answer)
  sft-mixed  64 one-turn chats whose lengths are drawn between 20 and 500 tokens
  dpo-short  48 pairs {"prompt": "Give me a fruit name #i.", "chosen": "Mango.", "rejected": "I will not answer that."}
  sft-8k     8 one-turn chats of ~8000 tokens (a long text and its summary-length answer), batch 1, max_length
             8192, gradient checkpointing on both sides (a long row's activations would not fit otherwise)
Every contender trains SmolLM2-135M-Instruct (the default model's GGUF dequantized to f32, written once as an
HF directory both load) with its own defaults for padding and loss masks: batch 8, max_length 512 (sft-8k: as
above), LoRA rank 8 (alpha 16) on the seven projections or full fine-tuning, AdamW, 2 threads, each in its own
subprocess one after another. tunix-rt pads each batch to a bucket of its longest row and runs the output head on the trained
tokens only (assistant turns, completions); TRL pads to the batch's longest row and (for chats, its default)
trains every token. DPO: tunix-rt precomputes the reference's log-probs once per pair before the first step,
as its CLI does (the time is printed beside the run, outside s/step); TRL's DPOTrainer runs the reference
in every step (its default, precompute_ref_log_probs=False).

Printed per run: the median step time after 2 warm-up steps (compiles in later steps included in their step),
non-padding tokens/s (the dataset's mean tokens per batch of 8 over that median), peak RSS of the process,
and the ratio of tokens/s against TRL f32 on the same workload and mode.

  ours  tunix-rt's trainer (this interpreter), f32 or bf16 compute (bf16 operands, f32 sums, f32 masters)
  trl   TRL SFTTrainer / DPOTrainer, torch CPU (--peer-python: an interpreter with trl, peft, datasets and
        torch==2.13.0); bf16 is torch autocast
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import sys
import tempfile
import time

from peer_process import run_contender, trl_lora_and_timer

BATCH, MAX_LENGTH, RANK, ALPHA, THREADS, WARMUP = 8, 512, 8, 16.0, 2, 2
LONG = {"sft-8k": (1, 8192)}  # workloads of long rows: (batch, max_length), with gradient checkpointing


def shape(workload: str) -> tuple[int, int, bool]:
    """(batch, max_length, gradient checkpointing) of a workload."""
    return (*LONG[workload], True) if workload in LONG else (BATCH, MAX_LENGTH, False)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
WORDS = ("apple river stone light quick garden blue music table window paper cloud market silver forest "
         "engine yellow story winter bridge").split()


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def write_workload(name: str, path: str) -> None:
    rng = random.Random(0)
    rows = []
    if name == "sft-short":
        fruits = ["apple", "mango", "pear", "kiwi", "plum", "grape", "lemon", "lime", "fig", "peach"]
        for i in range(64):
            fruit = rng.choice(fruits)
            rows.append({"messages": [
                {"role": "user", "content": f"Name a fruit that starts with the letter {fruit[0]}, please (#{i})."},
                {"role": "assistant", "content": f"Sure: {fruit.capitalize()} is a fruit that starts with {fruit[0]}."}]})
    elif name == "sft-8k":
        text = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))
        rows = [{"messages": [{"role": "user", "content": "Summarise this: " + text(5600)},
                              {"role": "assistant", "content": text(600)}]} for _ in range(8)]
    elif name == "sft-mixed":
        for _ in range(64):
            words = max(4, int(rng.uniform(20, 500) / 1.25) - 30)  # ~1.25 tokens a word, ~30 of template
            user = max(2, int(words * rng.uniform(0.2, 0.6)))
            text = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))
            rows.append({"messages": [{"role": "user", "content": text(user)},
                                      {"role": "assistant", "content": text(words - user)}]})
    else:
        rows = [{"prompt": f"Give me a fruit name #{i}.", "chosen": "Mango.", "rejected": "I will not answer that."}
                for i in range(48)]
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


# --- contenders (each in a subprocess: `python train_real.py --run NAME WORKLOAD MODE DTYPE STEPS DATA`) ------


def run_ours(workload: str, mode: str, dtype: str, steps: int, data: str) -> dict:
    from tunix_rt.checkpoints.loader import load_model
    from tunix_rt.train.config import DPOConfig, SFTConfig, build_config
    from tunix_rt.train.run import build_objective
    from tunix_rt.train.trainer import Trainer

    loaded = load_model(os.environ["TUNIX_RT_BENCH_HF_DIR"], dequantize=True)
    with tempfile.TemporaryDirectory() as out:
        batch, max_length, checkpointing = shape(workload)
        cfg = build_config(DPOConfig if workload.startswith("dpo") else SFTConfig, data=data, output=out,
                           steps=steps, batch_size=batch, max_length=max_length,
                           gradient_checkpointing=checkpointing,
                           lora_rank=RANK if mode == "lora" else 0, lora_alpha=ALPHA, dequantize=True,
                           compute_dtype=dtype, progress=False, save_steps=10_000)
        objective = build_objective(cfg, loaded, data)
        trainer = Trainer(cfg, loaded.model, objective)
        start = time.perf_counter()
        objective.precompute(trainer.score)  # as fit() does: DPO's reference log-probs, once per pair
        precompute = time.perf_counter() - start
        times = []
        for step in range(steps):
            start = time.perf_counter()
            trainer.run_step(step)  # returns host floats: the step has finished
            times.append(time.perf_counter() - start)
    return {"times": times, "peak_rss_gb": peak_rss_gb(), "compiles": trainer.compiles, "precompute_s": precompute}


def run_trl(workload: str, mode: str, dtype: str, steps: int, data: str) -> dict:
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(THREADS)
    path = os.environ["TUNIX_RT_BENCH_HF_DIR"]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    dataset = load_dataset("json", data_files=data, split="train")
    peft_config, timer, times = trl_lora_and_timer(mode, RANK, ALPHA, TARGETS)

    batch, max_length, checkpointing = shape(workload)
    common = dict(per_device_train_batch_size=batch, max_length=max_length, max_steps=steps, logging_steps=1000,
                  save_strategy="no", report_to=[], use_cpu=True, bf16=dtype == "bfloat16",
                  dataloader_num_workers=0, gradient_checkpointing=checkpointing)
    with tempfile.TemporaryDirectory() as out:
        if workload.startswith("dpo"):
            from trl import DPOConfig, DPOTrainer

            trainer = DPOTrainer(model=model, args=DPOConfig(output_dir=out, **common), train_dataset=dataset,
                                 processing_class=tokenizer, peft_config=peft_config, callbacks=[timer])
        else:
            from trl import SFTConfig, SFTTrainer

            trainer = SFTTrainer(model=model, args=SFTConfig(output_dir=out, packing=False, **common),
                                 train_dataset=dataset, processing_class=tokenizer, peft_config=peft_config,
                                 callbacks=[timer])
        trainer.train()
    return {"times": times, "peak_rss_gb": peak_rss_gb()}


CONTENDERS = {"ours": run_ours, "trl": run_trl}


def tokens_per_batch(workload: str, data: str) -> float:
    """Non-padding tokens of the dataset's rows (pairs as their two rows), averaged per batch."""
    from tunix_rt.checkpoints.loader import load_model
    from tunix_rt.train.data import load_preferences, load_sft

    tokenizer = load_model(os.environ["TUNIX_RT_BENCH_HF_DIR"]).tokenizer
    batch, max_length, _ = shape(workload)
    if workload.startswith("dpo"):
        pairs = load_preferences(data, tokenizer, max_length=max_length)
        total = sum(2 * len(p.prompt_ids) + len(p.chosen_ids) + len(p.rejected_ids) for p in pairs)
        return total / len(pairs) * batch
    rows = load_sft(data, tokenizer, max_length=max_length)
    return sum(len(r.input_ids) for r in rows) / len(rows) * batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8, help="steps per run; the first 2 are warm-up")
    parser.add_argument("--peer-python", default=sys.executable, help="interpreter with trl, peft, datasets, torch")
    parser.add_argument("--only", default="ours,trl")
    parser.add_argument("--workloads", default="sft-short,sft-mixed,dpo-short")
    parser.add_argument("--modes", default="lora,full", help="DPO runs LoRA only")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--run", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        name, workload, mode, dtype, steps, data = args.run
        print(json.dumps(CONTENDERS[name](workload, mode, dtype, int(steps), data)))
        return

    from tunix_rt.checkpoints.hf_export import export_hf
    from tunix_rt.checkpoints.loader import load_model

    work = tempfile.mkdtemp(prefix="tunix-rt-bench-")
    hf_dir = os.path.join(work, "model")  # both sides read the same weights as an HF directory
    loaded = load_model("default", dequantize=True)
    export_hf(loaded.model, loaded.tokenizer, loaded.hf_config, hf_dir)
    del loaded
    os.environ["TUNIX_RT_BENCH_HF_DIR"] = hf_dir
    print(f"training on real rows, SmolLM2-135M f32 weights, batch {BATCH}, max_length {MAX_LENGTH} (long rows: "
          f"{LONG}), {THREADS} threads, median of steps {WARMUP + 1}..{args.steps}", flush=True)
    results = {}
    for workload in args.workloads.split(","):
        data = os.path.join(work, f"{workload}.jsonl")
        write_workload(workload, data)
        tokens = tokens_per_batch(workload, data)
        modes = ["lora"] if workload.startswith("dpo") else args.modes.split(",")
        for mode in modes:
            for dtype in args.dtypes.split(","):
                for name in args.only.split(","):
                    python = sys.executable if name == "ours" else args.peer_python
                    result = run_contender(python, __file__, ["--run", name, workload, mode, dtype, str(args.steps),
                                                              data], THREADS, TUNIX_RT_BENCH_HF_DIR=hf_dir)
                    label = f"{workload:9} {mode:4} {name:4} {dtype:8}"
                    if "error" in result:
                        print(f"  {label} failed: {result['error']}", flush=True)
                        continue
                    step = statistics.median(result["times"][WARMUP:])
                    results[workload, mode, name, dtype] = (step, tokens / step, result["peak_rss_gb"])
                    compiles = f" {result['compiles']} compiles" if "compiles" in result else ""
                    if result.get("precompute_s", 0) > 0.05:
                        compiles += f", reference log-probs precomputed in {result['precompute_s']:.1f} s"
                    print(f"  {label} {step:6.2f} s/step {tokens / step:7.1f} tok/s {result['peak_rss_gb']:5.2f} GB"
                          f"{compiles}", flush=True)
    print()
    print(f"{'workload':9} {'mode':4} {'run':4} {'dtype':8} {'s/step':>7} {'tok/s':>7} {'peak GB':>7} "
          f"{'tok/s vs TRL f32':>16}")
    for (workload, mode, name, dtype), (step, rate, rss) in results.items():
        peer = results.get((workload, mode, "trl", "float32"))
        ratio = f"{rate / peer[1]:.2f}x" if peer else "-"
        print(f"{workload:9} {mode:4} {name:4} {dtype:8} {step:7.2f} {rate:7.1f} {rss:7.2f} {ratio:>16}")
    import shutil

    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
