"""SFT training throughput on the default model, side by side with TRL and Tunix, in one run.

Usage: python benchmarks/train.py [--steps 6] [--peer-python PY] [--only ours,trl,tunix] [--quick]

Every contender trains SmolLM2-135M-Instruct (the default model's GGUF dequantized to f32, written
once as an HF directory that all three load) on the
same random token rows: batch 8, sequence length 128, every token trained, no padding, no gradient
checkpointing, AdamW, 2 threads. LoRA is rank 8 (alpha 16) on all seven linear projections in every
framework. Each runs in its own subprocess, one after the other (never concurrently), and reports
the median step time after warm-up steps (compilation excluded); the table gives tokens/s
(8 x 128 / median step time) and ratios against TRL f32 and Tunix.

  ours   tunix-rt's Trainer (this interpreter); bf16 compute takes the linear layers' products (bf16
         operands, f32 sums) on tunix-rt's vdpbf16ps FFI op ("bfloat16-ffi", bf16_matmul=ffi) or on
         XLA's dot ("bfloat16-xla", bf16_matmul=xla: AMX tiles where the CPU has them)
  trl    TRL SFTTrainer, torch CPU (--peer-python: an interpreter with trl + torch==2.13.0)
  tunix  google-tunix 0.1.7 PeftTrainer (same --peer-python, with jax 0.10 and google-tunix)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from peer_process import run_contender, trl_lora_and_timer

BATCH, SEQ_LEN, RANK, ALPHA = 8, 128, 8, 16.0
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
THREADS = 2


def token_rows(vocab: int, count: int, seed: int = 0):
    import numpy as np

    return np.random.default_rng(seed).integers(100, vocab, size=(count, SEQ_LEN)).astype(np.int32)


def median_step(times: list[float], warmup: int) -> float:
    return statistics.median(times[warmup:])


# --- contenders (each runs in a subprocess: `python train.py --run NAME MODE DTYPE STEPS`) ---------------------


def run_ours(mode: str, dtype: str, steps: int) -> list[float]:
    import tempfile

    import numpy as np

    from tunix_rt.checkpoints.loader import load_model
    from tunix_rt.train.config import SFTConfig
    from tunix_rt.train.data import SFTExample
    from tunix_rt.train.sft import SFTObjective
    from tunix_rt.train.trainer import Trainer

    loaded = load_model(os.environ["TUNIX_RT_BENCH_HF_DIR"])
    rows = token_rows(loaded.model.config.vocab_size, BATCH * (steps + 1))
    items = [SFTExample(r, np.ones(SEQ_LEN, bool)) for r in rows]
    with tempfile.TemporaryDirectory() as out:
        cfg = SFTConfig(data="-", output=out, steps=steps, batch_size=BATCH, max_length=SEQ_LEN,
                        lora_rank=RANK if mode == "lora" else 0, lora_alpha=ALPHA, lora_targets=TARGETS,
                        dequantize=True, compute_dtype=dtype.split("-")[0],
                        bf16_matmul=dtype.split("-")[1] if "-" in dtype else None,
                        learning_rate=1e-5, shuffle=False, progress=False, save_steps=10_000)
        trainer = Trainer(cfg, loaded.model, SFTObjective(items, max_length=SEQ_LEN, pad_id=0))
        times = []
        for step in range(steps):
            start = time.perf_counter()
            trainer.run_step(step)  # returns host floats: the step has finished
            times.append(time.perf_counter() - start)
    return times


def run_trl(mode: str, dtype: str, steps: int) -> list[float]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    torch.set_num_threads(THREADS)
    model = AutoModelForCausalLM.from_pretrained(os.environ["TUNIX_RT_BENCH_HF_DIR"], dtype=torch.float32)
    rows = token_rows(model.config.vocab_size, BATCH * (steps + 1))
    data = Dataset.from_dict({"input_ids": [r.tolist() for r in rows]})
    peft_config, timer, times = trl_lora_and_timer(mode, RANK, ALPHA, TARGETS)

    import tempfile

    with tempfile.TemporaryDirectory() as out:
        config = SFTConfig(output_dir=out, per_device_train_batch_size=BATCH, max_length=SEQ_LEN, max_steps=steps,
                           learning_rate=1e-5, logging_steps=1000, save_strategy="no", report_to=[], use_cpu=True,
                           bf16=dtype == "bfloat16", packing=False, gradient_checkpointing=False,
                           dataloader_num_workers=0, dataset_num_proc=None)
        trainer = SFTTrainer(model=model, args=config, train_dataset=data, peft_config=peft_config,
                             callbacks=[timer])
        trainer.train()
    return times


def run_tunix(mode: str, dtype: str, steps: int) -> list[float]:
    from tunix_peer import train_steps  # benchmarks/tunix_peer.py, on PYTHONPATH

    return train_steps(mode, dtype, steps, BATCH, SEQ_LEN, RANK, ALPHA, TARGETS)


CONTENDERS = {"ours": run_ours, "trl": run_trl, "tunix": run_tunix}

# --- parent ------------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="steps per run; the first 2 are warm-up")
    parser.add_argument("--peer-python", default=sys.executable, help="interpreter with trl / google-tunix installed")
    parser.add_argument("--only", default="ours,trl,tunix")
    parser.add_argument("--modes", default="full,lora")
    parser.add_argument("--run", nargs=4, metavar=("NAME", "MODE", "DTYPE", "STEPS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        name, mode, dtype, steps = args.run
        times = CONTENDERS[name](mode, dtype, int(steps))
        print(json.dumps({"times": times}))
        return

    import tempfile

    from tunix_rt.checkpoints.hf_export import export_hf
    from tunix_rt.checkpoints.loader import load_model

    hf_dir = tempfile.mkdtemp(prefix="tunix-rt-bench-")  # the peers read the same weights as an HF directory
    loaded = load_model("default", dequantize=True)
    export_hf(loaded.model, loaded.tokenizer, loaded.hf_config, hf_dir)
    del loaded
    warmup = 2
    names = args.only.split(",")
    plan = [(n, m, "float32") for m in args.modes.split(",") for n in names]
    plan += [("ours", m, f"bfloat16-{k}") for k in ("ffi", "xla") for m in args.modes.split(",") if "ours" in names]
    plan += [("trl", m, "bfloat16") for m in args.modes.split(",") if "trl" in names]
    rates = {}
    print(f"SFT throughput, SmolLM2-135M f32 weights, batch {BATCH} x {SEQ_LEN} tokens, {THREADS} threads, "
          f"median of steps {warmup + 1}..{args.steps}", flush=True)
    for name, mode, dtype in plan:
        python = sys.executable if name == "ours" else args.peer_python
        result = run_contender(python, __file__, ["--run", name, mode, dtype, str(args.steps)], THREADS,
                               TUNIX_RT_BENCH_HF_DIR=hf_dir, XLA_FLAGS=os.environ.get("XLA_FLAGS", ""))
        if "error" in result:
            print(f"  {name:6} {mode:5} {dtype:12} failed: {result['error']}", flush=True)
            continue
        step = median_step(result["times"], warmup)
        rates[name, mode, dtype] = BATCH * SEQ_LEN / step
        print(f"  {name:6} {mode:5} {dtype:12} {step:7.2f} s/step {rates[name, mode, dtype]:8.1f} tok/s", flush=True)
    print()
    print(f"{'run':24} {'tok/s':>8} {'vs TRL f32':>11} {'vs Tunix':>9}")
    for (name, mode, dtype), rate in rates.items():
        trl = rates.get(("trl", mode, "float32"))
        tunix = rates.get(("tunix", mode, "float32"))
        cell = lambda peer: f"{rate / peer:.2f}x" if peer else "-"
        print(f"{name + ' ' + mode + ' ' + dtype:24} {rate:8.1f} {cell(trl):>11} {cell(tunix):>9}")
    import shutil

    shutil.rmtree(hf_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
