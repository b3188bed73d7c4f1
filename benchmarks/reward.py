"""Reward model training: tunix-rt's `reward` against TRL's RewardTrainer on the same rows, same run.

Usage: python benchmarks/reward.py [--steps 20] [--gradient-checkpointing default|on|off]
                                  [--dtype default|float32|bfloat16] [--peer-python PY]

The default model (its Q4_1 weights dequantized, written once as an HF directory both sides load), LoRA r8 on
every projection plus the score head, batch 8 pairs, lr 1e-3, max_length 128, 2 threads each. Gradient
checkpointing and the compute dtype are each side's default unless given (then the same on both): TRL's
RewardConfig checkpoints and runs bf16 autocast on CPU; ours does neither (f32). Data: polite
against rude replies to everyday requests (320 training pairs; 100 held-out pairs whose requests and reply
templates the training set never shows). Prints the median seconds per step (the first 2 steps are warm-up), the
first step's (compile included), each process's peak RSS and the held-out accuracy after the run (chosen scored
above rejected), and the ratios.
TRL runs with torch 2.13.0 CPU (`pip install torch==2.13.0 trl peft datasets`); timings are never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from peer_process import peak_rss_gb, run_contender, trl_lora_and_timer

THREADS, BATCH, RANK, ALPHA, LR, MAX_LENGTH, WARMUP = 2, 8, 8, 16.0, 1e-3, 128, 2
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

THINGS = ["the weather", "a recipe for soup", "the train times", "a good book", "my homework", "the meeting notes",
          "a gift idea", "the bus route", "a movie to watch", "the tax form", "a song for a party", "the garden",
          "my resume", "the budget", "a name for my cat", "the printer", "a hiking trail", "the code review",
          "my password", "the dinner plan", "a birthday card", "the exam", "the report", "a workout plan"]
ASK = ["Can you help me with {}?", "Please tell me about {}.", "I need advice on {}.", "What do you know about {}?",
       "Could you look at {}?", "Any thoughts on {}?"]
POLITE = ["Of course, I would be glad to help with {}. Here is what I suggest.",
          "Happy to help! Let us go through {} together, step by step.",
          "Thank you for asking. I can certainly help you with {}.",
          "Sure thing, here is a friendly overview of {} for you.",
          "Great question! I will gladly explain {} clearly.",
          "I appreciate you asking about {}; here is some careful advice."]
RUDE = ["Ugh, {} again? Figure it out yourself.", "Not my problem. Stop bothering me about {}.",
        "Why would I care about {}? Go away.", "That is a stupid question about {}.",
        "Do it yourself, I am not wasting time on {}.", "Whatever. {} is boring and so are you."]


def pairs(split: str, n: int, seed: int) -> list[dict]:
    """Polite (chosen) against rude (rejected) replies; the held-out split's requests and replies are unseen."""
    import numpy as np

    rng = np.random.default_rng(seed)
    part = (lambda xs: xs[: len(xs) * 2 // 3]) if split == "train" else (lambda xs: xs[len(xs) * 2 // 3:])
    things, polite, rude = part(THINGS), part(POLITE), part(RUDE)
    rows = []
    for _ in range(n):
        thing = str(rng.choice(things))
        rows.append({"prompt": [{"role": "user", "content": str(rng.choice(ASK)).format(thing)}],
                     "chosen": [{"role": "assistant", "content": str(rng.choice(polite)).format(thing)}],
                     "rejected": [{"role": "assistant", "content": str(rng.choice(rude)).format(thing)}]})
    return rows


# --- contenders (each in its own process: `python reward.py --run NAME STEPS DIR`) ------------------------------


def run_ours(steps: int, work: str, options: dict) -> dict:
    import numpy as np

    from tunix_rt.checkpoints.loader import load_model
    from tunix_rt.train.config import RewardConfig
    from tunix_rt.train.data import load_preferences
    from tunix_rt.train.reward import RewardObjective, attach_score_head, reward_pad_id, whole_pairs
    from tunix_rt.train.trainer import Trainer

    loaded = load_model(os.environ["TUNIX_RT_BENCH_HF_DIR"])
    attach_score_head(loaded.model, reward_pad_id(loaded.tokenizer))
    train = whole_pairs(load_preferences(f"{work}/train.jsonl", loaded.tokenizer, max_length=MAX_LENGTH), MAX_LENGTH)
    held = load_preferences(f"{work}/held.jsonl", loaded.tokenizer, max_length=MAX_LENGTH)
    cfg = RewardConfig(data="-", output=f"{work}/ours", steps=steps, batch_size=BATCH, max_length=MAX_LENGTH,
                       lora_rank=RANK, lora_alpha=ALPHA, lora_targets=TARGETS, learning_rate=LR,
                       lr_scheduler_type="constant", warmup_ratio=0.0, progress=False, save_steps=10_000,
                       **options)
    pad = loaded.tokenizer.pad_token_id or 0
    trainer = Trainer(cfg, loaded.model, RewardObjective(train, max_length=MAX_LENGTH, pad_id=pad))
    times = []
    for step in range(steps):
        start = time.perf_counter()
        trainer.run_step(step)
        times.append(time.perf_counter() - start)
    accuracy = trainer.evaluate(RewardObjective(held, max_length=MAX_LENGTH, pad_id=pad))["eval_accuracy"]
    return {"times": times, "accuracy": float(np.asarray(accuracy)), "rss": peak_rss_gb()}


def run_trl(steps: int, work: str, options: dict) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    torch.set_num_threads(THREADS)
    hf_dir = os.environ["TUNIX_RT_BENCH_HF_DIR"]
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForSequenceClassification.from_pretrained(hf_dir, num_labels=1, dtype=torch.float32)
    model.config.pad_token_id = tokenizer.pad_token_id
    read = lambda name: [json.loads(line) for line in open(f"{work}/{name}.jsonl")]  # noqa: E731
    _, timer, times = trl_lora_and_timer("full", RANK, ALPHA, TARGETS)  # the step timer (LoRA set below: SEQ_CLS)

    same = {k: v for k, v in options.items() if k == "gradient_checkpointing"}  # the options both sides set
    if "compute_dtype" in options:
        same["bf16"] = options["compute_dtype"] == "bfloat16"
    config = RewardConfig(output_dir=f"{work}/trl", per_device_train_batch_size=BATCH, max_length=MAX_LENGTH,
                          max_steps=steps, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
                          logging_steps=1000, save_strategy="no", report_to=[], use_cpu=True,
                          dataloader_num_workers=0, **same)
    peft = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=list(TARGETS), task_type="SEQ_CLS")
    trainer = RewardTrainer(model=model, args=config, train_dataset=Dataset.from_list(read("train")),
                            processing_class=tokenizer, peft_config=peft, callbacks=[timer])
    trainer.train()
    model = trainer.model.eval()
    right = 0
    held = read("held")
    with torch.no_grad():
        for row in held:
            scores = []
            for side in ("chosen", "rejected"):
                text = tokenizer.apply_chat_template(row["prompt"] + row[side], tokenize=False)
                ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)
                scores.append(float(model(**ids).logits[0, 0]))
            right += scores[0] > scores[1]
    return {"times": times, "accuracy": right / len(held), "rss": peak_rss_gb()}


CONTENDERS = {"ours": run_ours, "trl": run_trl}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--peer-python", default=sys.executable, help="interpreter with trl, peft and torch 2.13.0")
    parser.add_argument("--gradient-checkpointing", choices=("default", "on", "off"), default="default")
    parser.add_argument("--dtype", choices=("default", "float32", "bfloat16"), default="default",
                        help="compute dtype")
    parser.add_argument("--run", nargs=3, metavar=("NAME", "STEPS", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    options = {}  # what both sides set alike; the rest stays each side's default
    if args.gradient_checkpointing != "default":
        options["gradient_checkpointing"] = args.gradient_checkpointing == "on"
    if args.dtype != "default":
        options["compute_dtype"] = args.dtype
    if args.run:
        name, steps, work = args.run
        print(json.dumps(CONTENDERS[name](int(steps), work, options)))
        return

    from tunix_rt.checkpoints.hf_export import export_hf
    from tunix_rt.checkpoints.loader import load_model

    work = tempfile.mkdtemp(prefix="tunix-rt-reward-bench-")
    hf_dir = os.path.join(work, "model")
    loaded = load_model("default", dequantize=True)
    export_hf(loaded.model, loaded.tokenizer, loaded.hf_config, hf_dir)
    del loaded
    for split, n, seed in (("train", 320, 0), ("held", 100, 1)):
        with open(os.path.join(work, f"{split}.jsonl"), "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in pairs(split, n, seed))
    results = {}
    for name in CONTENDERS:
        python = sys.executable if name == "ours" else args.peer_python
        results[name] = run_contender(python, __file__, ["--run", name, str(args.steps), work,
                                                         f"--gradient-checkpointing={args.gradient_checkpointing}",
                                                         f"--dtype={args.dtype}"],
                                      THREADS, TUNIX_RT_BENCH_HF_DIR=hf_dir)
    print(f"reward model, default model (compute {args.dtype}), LoRA r{RANK} + score head, batch {BATCH} pairs, "
          f"{args.steps} steps, "
          f"{THREADS} threads, gradient checkpointing {args.gradient_checkpointing}; held-out: 100 unseen polite/rude "
          "pairs")
    print(f"{'':<8}{'s/step':>10}{'first step s':>14}{'peak RSS GB':>14}{'held-out acc':>14}")
    for name, r in results.items():
        if "error" in r:
            print(f"{name:<8} error: {r['error']}")
            continue
        r["step"] = statistics.median(r["times"][WARMUP:])
        print(f"{name:<8}{r['step']:>10.3f}{r['times'][0]:>14.2f}{r['rss']:>14.2f}{r['accuracy']:>14.2f}")
    if all("step" in r for r in results.values()):
        ours, trl = results["ours"], results["trl"]
        print(f"ours / TRL: {ours['step'] / trl['step']:.2f}x the time per step, {ours['rss'] / trl['rss']:.2f}x the "
              f"peak RSS, accuracy {100 * (ours['accuracy'] - trl['accuracy']):+.0f} points")


if __name__ == "__main__":
    main()
