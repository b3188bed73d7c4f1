"""GRPO step time on the default model, side by side with TRL's GRPOTrainer and Tunix's GRPOLearner, in one run.

Usage: python benchmarks/grpo.py [--steps 5] [--peer-python PY] [--only ours,ours-exact,ours-f32,ours-bf16,trl,...]

Every contender runs the same GRPO step: 4 prompts x 4 completions of up to 64 tokens (sampled at
temperature 1 from SmolLM2-135M-Instruct), LoRA rank 8 (alpha 16) on all seven projections, AdamW,
no KL term (beta 0, TRL's default), one iteration per rollout, the same reward function (`brevity`
below, TRL's signature, which tunix-rt takes as path:function), 2 threads. The
prompts ask for stories, so every completion runs to (nearly) 64 tokens and each contender does the
same work; the table shows the mean completion length beside each. Each runs in its own
subprocess, one after the other, and reports the median step time after one warm-up step.

  ours      tunix-rt RLTrainer on the default GGUF (Q4_1 base kept packed: QLoRA), this interpreter
  ours-exact ours with exact_on_policy=true: the trainer computes its log-probs as the engine does
  ours-f32  the same on the f32 weights (the HF directory the peers load)
  ours-bf16 ours-f32 with bf16 compute (bf16 operands, f32 sums: XLA's AMX dots on AMX CPUs, where the
            engine samples in bf16 too; tunix-rt's vdpbf16ps op elsewhere, the engine in f32)
  trl       TRL GRPOTrainer, torch CPU, transformers generate (no vLLM) (--peer-python: an
            interpreter with trl + peft + torch==2.13.0)
  trl-bf16  the same with bf16=True (torch autocast: oneDNN's bf16 kernels, AMX where the CPU has them)
  tunix     google-tunix 0.1.7 GRPOLearner with its vanilla sampler (benchmarks/tunix_grpo_peer.py; the
            same --peer-python, with jax 0.10.2 and google-tunix)
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time

from peer_process import run_contender, timed_steps

PROMPTS_PER_STEP, GENERATIONS, MAX_NEW, RANK, ALPHA = 4, 4, 64, 8, 16.0
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
THREADS = 2
TOPICS = ("a lighthouse keeper", "a lost robot", "a desert city", "a winter market", "a river pilot",
          "a clockmaker", "a mountain school", "a night train", "a ship's cat", "an old library")


def brevity(prompts, completions, completion_ids, **columns) -> list[float]:
    """The benchmark's reward, the same function in every contender: shorter is better."""
    return [-len(ids) / 100.0 for ids in completion_ids]


def prompts_file(directory: str) -> str:
    path = os.path.join(directory, "prompts.jsonl")
    with open(path, "w") as f:
        for topic in TOPICS * 4:
            message = {"role": "user", "content": f"Write a long, detailed story about {topic}."}
            f.write(json.dumps({"prompt": [message]}) + "\n")
    return path


# --- contenders (each runs in a subprocess: `python grpo.py --run NAME STEPS`) -------------------------------


def run_ours(model: str, steps: int, compute_dtype: str = "float32", exact: bool = False) -> dict:
    from tunix_rt.checkpoints.loader import load_model
    from tunix_rt.train.config import GRPOConfig
    from tunix_rt.train.rl_trainer import RLTrainer
    from tunix_rt.train.run import build_objective

    with tempfile.TemporaryDirectory() as out:
        cfg = GRPOConfig(model=model, data=prompts_file(out), output=out, steps=steps,
                         batch_size=PROMPTS_PER_STEP * GENERATIONS, num_generations=GENERATIONS,
                         max_completion_length=MAX_NEW, lora_rank=RANK, lora_alpha=ALPHA, lora_targets=TARGETS,
                         reward=(f"{os.path.abspath(__file__)}:brevity",), learning_rate=1e-5, save_steps=10_000,
                         progress=False, shuffle=False, compute_dtype=compute_dtype,
                         exact_on_policy=exact)
        loaded = load_model(model, dequantize=False)
        trainer = RLTrainer(cfg, loaded.model, build_objective(cfg, loaded, cfg.data))
        times, metrics = timed_steps(trainer, steps)
        splits = [{k: m[k] for k in ("time/rollout", "time/reference", "time/train", "time/sync")} for m in metrics]
        return {"times": times, "splits": splits, "lengths": [m["completions/mean_length"] for m in metrics],
                "compiles": trainer.num_compiles()}


def run_trl(model: str, steps: int, bf16: bool = False) -> dict:
    import torch
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(THREADS)
    times, marks, lengths = [], [], []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            marks.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - marks[-1])

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                lengths.append(logs["completions/mean_length"])

    with tempfile.TemporaryDirectory() as out:
        data = load_dataset("json", data_files=prompts_file(out), split="train")
        config = GRPOConfig(output_dir=out, per_device_train_batch_size=PROMPTS_PER_STEP * GENERATIONS,
                            num_generations=GENERATIONS, max_completion_length=MAX_NEW, max_steps=steps,
                            learning_rate=1e-5, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                            beta=0.0, temperature=1.0, use_vllm=False, gradient_checkpointing=False,
                            dataloader_num_workers=0, shuffle_dataset=False, bf16=bf16)
        policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        trainer = GRPOTrainer(model=policy, reward_funcs=brevity, args=config, train_dataset=data,
                              peft_config=LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                                                     target_modules=list(TARGETS), task_type="CAUSAL_LM"),
                              callbacks=[Timer()])
        trainer.train()
    return {"times": times, "lengths": lengths}


def run_tunix(model: str, steps: int) -> dict:
    from transformers import AutoTokenizer
    from tunix_grpo_peer import grpo_steps  # benchmarks/tunix_grpo_peer.py, on PYTHONPATH

    tokenizer = AutoTokenizer.from_pretrained(model)
    with tempfile.TemporaryDirectory() as out, open(prompts_file(out)) as f:
        prompts = [tokenizer.apply_chat_template(json.loads(line)["prompt"], add_generation_prompt=True, tokenize=False)
                   for line in f]
    return grpo_steps(model, prompts, steps, prompts_per_step=PROMPTS_PER_STEP, generations=GENERATIONS,
                      max_new_tokens=MAX_NEW, rank=RANK, alpha=ALPHA, targets=TARGETS, reward_fn=brevity)


RUNS = {"ours": run_ours, "ours-f32": run_ours, "ours-bf16": functools.partial(run_ours, compute_dtype="bfloat16"),
        "ours-exact": functools.partial(run_ours, exact=True),
        "trl": run_trl, "trl-bf16": functools.partial(run_trl, bf16=True), "tunix": run_tunix}

# --- parent ------------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5, help="steps per run; the first is warm-up")
    parser.add_argument("--peer-python", default=sys.executable, help="interpreter with trl + peft installed")
    parser.add_argument("--only", default="ours,ours-f32,ours-bf16,trl,trl-bf16,tunix")
    parser.add_argument("--run", nargs=3, metavar=("NAME", "MODEL", "STEPS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        name, model, steps = args.run
        print(json.dumps(RUNS[name](model, int(steps))))
        return

    from tunix_rt.checkpoints.hf_export import export_hf
    from tunix_rt.checkpoints.loader import load_model

    hf_dir = tempfile.mkdtemp(prefix="tunix-rt-bench-")  # f32 weights as an HF directory, for ours-f32 and TRL
    loaded = load_model("default", dequantize=True)
    export_hf(loaded.model, loaded.tokenizer, loaded.hf_config, hf_dir)
    del loaded
    models = {"ours": "default", "ours-exact": "default", "ours-f32": hf_dir, "ours-bf16": hf_dir, "trl": hf_dir,
              "trl-bf16": hf_dir, "tunix": hf_dir}
    print(f"GRPO step, SmolLM2-135M-Instruct, {PROMPTS_PER_STEP} prompts x {GENERATIONS} completions x up to "
          f"{MAX_NEW} tokens, LoRA r{RANK}, {THREADS} threads; median of steps 2..{args.steps}", flush=True)
    medians = {}
    for name in args.only.split(","):
        python = sys.executable if name.startswith("ours") else args.peer_python
        result = run_contender(python, __file__, ["--run", name, models[name], str(args.steps)], THREADS)
        if "error" in result:
            print(f"  {name:8} failed: {result['error']}", flush=True)
            continue
        medians[name] = statistics.median(result["times"][1:])
        length = statistics.mean(result["lengths"]) if result.get("lengths") else float("nan")
        line = f"  {name:8} {medians[name]:7.2f} s/step  mean completion {length:5.1f} tokens"
        if "splits" in result:
            split = {k: statistics.median(s[k] for s in result["splits"][1:]) for k in result["splits"][0]}
            line += "  (" + ", ".join(f"{k[5:]} {v:.2f} s" for k, v in split.items()) + ")"
            line += f"  compiles {result['compiles']}"
        print(line, flush=True)
    print()
    print(f"{'run':10} {'s/step':>7} {'TRL / this':>11} {'TRL-bf16 / this':>16} {'Tunix / this':>13}")
    for name, seconds in medians.items():
        cell = lambda peer: f"{medians[peer] / seconds:.2f}x" if peer in medians else "-"
        print(f"{name:10} {seconds:7.2f} {cell('trl'):>11} {cell('trl-bf16'):>16} {cell('tunix'):>13}")
    import shutil

    shutil.rmtree(hf_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
