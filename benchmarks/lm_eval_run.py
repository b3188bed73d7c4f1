"""lm-evaluation-harness against `tunix-rt serve`: a log-likelihood multiple-choice task and a generate_until
task (benchmarks/lm_eval/*.yaml, local JSONL rows) through `lm_eval --model local-completions`.

lm-eval scores each choice with /v1/completions' echo + logprobs and tokenizes through the server's
/tokenize, /detokenize and /tokenizer_info (its "remote" tokenizer, picked automatically), so it needs neither
torch nor transformers. It runs from its own environment:

    python3 -m venv /tmp/lmeval && /tmp/lmeval/bin/pip install "lm-eval[api]>=0.4,<0.5"
    python benchmarks/lm_eval_run.py --lm-eval /tmp/lmeval/bin/lm_eval

Prints lm-eval's accuracies, then checks every log-likelihood lm-eval got from the server against
tunix-rt's teacher-forced scoring (models/scoring.py: one dense forward with float activations, no engine, no
server): the differences and the multiple-choice accuracy each gives. On a quantized model they differ by the
engine's int8 activations (as llama.cpp's quantized layers take them), not by the scoring path.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile

import httpx2 as httpx
import server_process

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TASKS = ("tunix_rt_multiple_choice", "tunix_rt_arithmetic")


def run_lm_eval(args, base: str, out_dir: str) -> dict:
    model_args = f"model={args.model},base_url={base}/v1/completions,num_concurrent={args.concurrency},max_retries=1"
    cmd = [args.lm_eval, "--model", "local-completions", "--model_args", model_args, "--include_path",
           os.path.join(HERE, "lm_eval"), "--tasks", ",".join(TASKS), "--output_path", out_dir, "--log_samples"]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    subprocess.run(cmd, check=True, cwd=ROOT, env=env)  # the tasks name their JSONL files from the repo root
    [results] = glob.glob(os.path.join(out_dir, "**", "results_*.json"), recursive=True)
    with open(results) as f:
        return json.load(f)


def encode_pair(base: str, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split of a request into context and continuation ids (trailing spaces move to the
    continuation; the continuation's ids are the whole text's past the context's)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation

    def encode(text):
        r = httpx.post(f"{base}/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=60)
        r.raise_for_status()
        return r.json()["tokens"]

    whole, head = encode(context + continuation), encode(context)
    return head, whole[len(head):]


def check_loglikelihoods(args, base: str, out_dir: str) -> dict:
    """Every (context, continuation) log-likelihood lm-eval received, against the dense teacher-forced one (float
    activations; the engine's quantized layers take int8 activations, as llama.cpp's do), and the accuracy each
    gives."""
    import numpy as np

    from tunix_rt.checkpoints.loader import load_model
    from tunix_rt.models.scoring import token_logprobs

    model = load_model(args.model).model
    [samples] = glob.glob(os.path.join(out_dir, "**", f"samples_{TASKS[0]}_*.jsonl"), recursive=True)
    diffs, served_right, dense_right, docs = [], 0, 0, 0
    with open(samples) as f:
        for line in f:
            sample = json.loads(line)  # lm-eval logs each request's args by name and its results as strings
            served, dense = [], []
            for i, (value, _) in enumerate(sample["filtered_resps"]):
                args_i = sample["arguments"][f"gen_args_{i}"]
                head, tail = encode_pair(base, args_i["arg_0"], args_i["arg_1"])
                served.append(float(value))
                dense.append(sum(token_logprobs(model, head + tail)[len(head):]))
            diffs += [abs(a - b) for a, b in zip(served, dense)]
            target = int(sample["target"])
            served_right += int(np.argmax(served)) == target
            dense_right += int(np.argmax(dense)) == target
            docs += 1
    return dict(count=len(diffs), median=float(np.median(diffs)), max=max(diffs), served_acc=served_right / docs,
                dense_acc=dense_right / docs)


def our_choice_accuracy(args) -> dict:
    """`tunix-rt eval --task choice` on the same file, in process (dense teacher-forced scoring)."""
    from tunix_rt.checkpoints.loader import load_model
    from tunix_rt.evaluation import tasks

    loaded = load_model(args.model)
    prepared = tasks.prepare_choice(os.path.join(HERE, "lm_eval", "multiple_choice.jsonl"), loaded.tokenizer)
    return tasks.score_choice(loaded.model, prepared, batch_size=8)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lm-eval", default="lm_eval", help="the lm_eval executable (lm-evaluation-harness 0.4.x)")
    parser.add_argument("--model", default="default")
    parser.add_argument("--concurrency", type=int, default=4)
    args = parser.parse_args()
    proc, base = server_process.start(["--model", args.model, "--max-num-seqs", "8"], log_prefix="lm-eval-")
    try:
        with tempfile.TemporaryDirectory(prefix="lm-eval-") as out_dir:
            results = run_lm_eval(args, base, out_dir)["results"]
            print(f"\n{'task':28} {'metric':22} {'value':>6}")
            for task in TASKS:
                for metric, value in sorted(results[task].items()):
                    if isinstance(value, float) and "stderr" not in metric:
                        print(f"{task:28} {metric:22} {value:6.3f}")
            check = check_loglikelihoods(args, base, out_dir)
            print(f"\n{check['count']} log-likelihoods from the server vs dense teacher-forced scoring (float "
                  f"activations): |difference| median {check['median']:.3f}, max {check['max']:.3f} nats; "
                  f"accuracy {check['served_acc']:.3f} served vs {check['dense_acc']:.3f} dense")
            ours = our_choice_accuracy(args)
            print(f"tunix-rt eval --task choice on the same file: acc {ours['acc']:.3f}, acc_norm {ours['acc_norm']:.3f} "
                  f"(lm-eval: {results[TASKS[0]]['acc,none']:.3f}, {results[TASKS[0]]['acc_norm,none']:.3f})")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
