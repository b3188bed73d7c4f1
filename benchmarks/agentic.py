"""Agentic GRPO step time on the README's calculator example, side by side with TRL's GRPOTrainer with `tools=`,
in one run.

Usage: python benchmarks/agentic.py [--steps 4] [--peer-python PY] [--only ours,trl]

Both contenders run the same step on the same task: the rows of examples/calculator_agentic.jsonl (two worked
examples, then a 3-digit product to compute), 2 prompts x 8 trajectories, up to 96 tokens per trajectory after
the prompt (the policy's and the tool results together), at most 3 tool rounds (tunix-rt max_turns=4, TRL
max_tool_calling_iterations=3), the calculator tool (tunix_rt.tools.functions.calculator, the same function in
both), the accuracy reward (tunix_rt.train.rewards.accuracy_reward, the same function), LoRA rank 8 (alpha 16)
on all seven projections, AdamW at 3e-4 (--learning-rate), beta 0, one iteration per rollout, 2 threads. SmolLM2's chat template
knows no tools and TRL refuses it, so TRL's tokenizer gets Qwen2.5's template (ChatML like SmolLM2's, with the
hermes tools prompt, <tool_call> calls and <tool_response> results that tunix-rt renders for SmolLM2 itself:
the same conversation up to the system prompt's wording), whose calls TRL knows how to parse.

  ours  tunix-rt `grpo --tool calculator` on the default GGUF (Q4_1 base kept packed: QLoRA), this interpreter
  trl   TRL GRPOTrainer(tools=[calculator]), torch CPU, transformers generate, on the same weights in f32 (an
        HF directory), --peer-python (an interpreter with trl + peft + torch==2.13.0)

Each runs in its own subprocess, one after the other, and reports the median step time after one warm-up step,
its tool-call rate and its peak resident memory.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile

from peer_process import run_contender, timed_steps

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "examples", "calculator_agentic.jsonl")
PROMPTS, GENERATIONS, MAX_COMPLETION, TOOL_ROUNDS, RANK, ALPHA = 2, 8, 96, 3, 8, 16.0
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
THREADS = 2


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def run_ours(model: str, data: str, steps: int, lr: float) -> dict:
    from tunix_rt.checkpoints.loader import load_model
    from tunix_rt.train.config import GRPOConfig
    from tunix_rt.train.rl_trainer import RLTrainer
    from tunix_rt.train.run import build_objective

    with tempfile.TemporaryDirectory() as out:
        cfg = GRPOConfig(model=model, data=data, output=out, steps=steps, batch_size=PROMPTS * GENERATIONS,
                         num_generations=GENERATIONS, max_completion_length=MAX_COMPLETION, max_prompt_length=512,
                         max_turns=TOOL_ROUNDS + 1, tool=("calculator",), reward=("accuracy",), lora_rank=RANK,
                         lora_alpha=ALPHA, lora_targets=TARGETS, learning_rate=lr, save_steps=10_000, progress=False,
                         shuffle=False)
        loaded = load_model(model, dequantize=False)
        trainer = RLTrainer(cfg, loaded.model, build_objective(cfg, loaded, cfg.data))
        times, metrics = timed_steps(trainer, steps)
        return {"times": times, "tool_call_rates": [m["agentic/tool_call_rate"] for m in metrics],
                "lengths": [m["completions/mean_length"] for m in metrics], "peak_rss_gb": peak_rss_gb()}


def run_trl(model: str, data: str, steps: int, lr: float) -> dict:
    import torch
    from datasets import load_dataset
    from peer_process import trl_lora_and_timer
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen2_5_chat_template

    sys.path.insert(0, os.path.join(ROOT, "python"))  # the tool and reward functions (stdlib and numpy only)
    from tunix_rt.tools.functions import calculator
    from tunix_rt.train.rewards import accuracy_reward

    torch.set_num_threads(THREADS)
    peft_config, timer, times = trl_lora_and_timer("lora", RANK, ALPHA, TARGETS)
    rates, lengths = [], []

    class Rates(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                lengths.append(logs["completions/mean_length"])
                rates.append(logs.get("tools/call_frequency", float("nan")))

    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = qwen2_5_chat_template  # see the module's docstring
    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(output_dir=out, per_device_train_batch_size=PROMPTS * GENERATIONS,
                            num_generations=GENERATIONS, max_completion_length=MAX_COMPLETION, max_steps=steps,
                            max_tool_calling_iterations=TOOL_ROUNDS, learning_rate=lr, logging_steps=1,
                            save_strategy="no", report_to=[], use_cpu=True, beta=0.0, temperature=1.0, use_vllm=False,
                            gradient_checkpointing=False, dataloader_num_workers=0, shuffle_dataset=False)
        trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32),
                              processing_class=tokenizer, reward_funcs=accuracy_reward, args=config,
                              train_dataset=load_dataset("json", data_files=data, split="train"), tools=[calculator],
                              peft_config=peft_config, callbacks=[timer, Rates()])
        trainer.train()
    return {"times": times, "tool_call_rates": rates, "lengths": lengths, "peak_rss_gb": peak_rss_gb()}


RUNS = {"ours": run_ours, "trl": run_trl}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4, help="steps per run; the first is warm-up")
    parser.add_argument("--peer-python", default=sys.executable, help="interpreter with trl + peft installed")
    parser.add_argument("--only", default="ours,trl")
    parser.add_argument("--learning-rate", type=float, default=3e-4,
                        help="the example's 3e-4; 1e-9 keeps both policies as they start, so each step does the same work")
    parser.add_argument("--run", nargs=5, metavar=("NAME", "MODEL", "DATA", "STEPS", "LR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        name, model, data, steps, lr = args.run
        print(json.dumps(RUNS[name](model, data, int(steps), float(lr))))
        return

    from tunix_rt.checkpoints.hf_export import export_hf
    from tunix_rt.checkpoints.loader import load_model

    work = tempfile.mkdtemp(prefix="tunix-rt-agentic-")
    hf_dir = os.path.join(work, "hf")  # f32 weights as an HF directory, for TRL
    loaded = load_model("default", dequantize=True)
    export_hf(loaded.model, loaded.tokenizer, loaded.hf_config, hf_dir)
    del loaded
    runs = {"ours": "default", "trl": hf_dir}
    print(f"Agentic GRPO step (calculator), SmolLM2-135M-Instruct, {PROMPTS} prompts x {GENERATIONS} trajectories x "
          f"up to {MAX_COMPLETION} tokens, <= {TOOL_ROUNDS} tool rounds, LoRA r{RANK}, learning rate "
          f"{args.learning_rate:g}, {THREADS} threads; median of steps 2..{args.steps}", flush=True)
    medians = {}
    for name in args.only.split(","):
        python = sys.executable if name == "ours" else args.peer_python
        argv = ["--run", name, runs[name], DATA, str(args.steps), str(args.learning_rate)]
        result = run_contender(python, __file__, argv, THREADS)
        if "error" in result:
            print(f"  {name:5} failed: {result['error']}", flush=True)
            continue
        medians[name] = statistics.median(result["times"][1:])
        length = statistics.mean(result["lengths"][1:])
        print(f"  {name:5} {medians[name]:7.2f} s/step  tool-call rate per step "
              f"{' '.join(f'{r:.2f}' for r in result['tool_call_rates'])}  mean trajectory {length:5.1f} tokens "
              f"({PROMPTS * GENERATIONS * length / medians[name]:5.1f} tokens/s)  peak RSS "
              f"{result['peak_rss_gb']:.2f} GB", flush=True)
    if "ours" in medians and "trl" in medians:
        print(f"\nTRL / ours: {medians['trl'] / medians['ours']:.2f}x")
    import shutil

    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
