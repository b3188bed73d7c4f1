"""Runs one benchmark contender in a subprocess and reads back the JSON line it prints last."""

from __future__ import annotations

import json
import os
import subprocess


def run_contender(python: str, script: str, argv: list[str], threads: int, **env_extra: str) -> dict:
    """`python script argv...` with `threads` BLAS/OpenMP threads and the benchmarks folder on PYTHONPATH;
    the last line starting with "{" of its stdout, or {"error": ...} with the tail of its output."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.path.dirname(os.path.abspath(__file__)) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               **env_extra)
    proc = subprocess.run([python, os.path.abspath(script), *argv], env=env, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"error": " | ".join(tail) or f"exit {proc.returncode}"}
    return json.loads(lines[-1])


def peak_rss_gb(pid: int | str = "self") -> float:
    """A process's peak RSS from /proc (VmHWM): getrusage's maxrss would carry a parent's over fork and exec."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / 1e9
    return float("nan")


def llama_last_logits(llm):
    """The logits of the last token a llama_cpp.Llama evaluated (llama-cpp-python 0.3 keeps no scores without
    logits_all: they are read from its context)."""
    import numpy as np

    return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))


def timed_steps(trainer, steps: int) -> tuple[list[float], list[dict]]:
    """Each of `steps` tunix-rt RL steps (trainer.run_step) timed: the wall seconds and the metrics of each."""
    import time

    times, metrics = [], []
    for step in range(steps):
        start = time.perf_counter()
        metrics.append(trainer.run_step(step))
        times.append(time.perf_counter() - start)
    return times, metrics


def trl_lora_and_timer(mode: str, rank: int, alpha: float, targets) -> tuple:
    """(peft LoraConfig or None for full fine-tuning, a transformers callback, its list of step times): what
    every TRL contender sets up the same way. Imported in the peer's interpreter only."""
    import time

    from transformers import TrainerCallback

    peft_config = None
    if mode == "lora":
        from peft import LoraConfig

        peft_config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=list(targets),
                                 task_type="CAUSAL_LM")
    times, marks = [], []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            marks.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - marks[-1])

    return peft_config, Timer(), times
