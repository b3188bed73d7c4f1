"""The alignment pipeline on the default model in one process family: a reward model, GRPO against it, selection.

Usage: python benchmarks/reward_pipeline.py [--rm-steps 200] [--grpo-steps 30] [--temperature 0.7] [--beta 0.04]
                                           [--n 8] [--output DIR] [--reward-model DIR]

Task: a lookup grounded in the question, "Values: apple=4, pear=7, fig=2, plum=9. What is the value of pear?"
(four distinct fruits and digits; the answer checked by the math reward's final-number rule). Training questions
and 256 held-out ones from separate seeds.
1. `tunix-rt reward`: the right value against another value of the same list, in one of four phrasings, and the
   policy's own samples (one per training question, temperature 1) against a phrasing of the right value where
   the sample is wrong, or against another value where it is right: a reward model that never saw the policy's
   rambling scores it high, and GRPO learns to ramble (measured: reward up, accuracy down). LoRA r8, batch 8;
   held-out pair accuracy on 100 template pairs and the policy's samples of 100 unseen questions. (Arithmetic --
   right against near-miss sums -- stays at chance for this model within a few hundred steps: a reward model
   reads one position and cannot redo the sum there; a lookup is what attention does.)
2. The policy before RL on the held-out questions: greedy accuracy, and of N samples at temperature 1 the
   accuracy of one sample (mean over samples), of the one the reward model scores highest (best-of-N), and of
   the answer most samples give (majority vote).
3. `tunix-rt grpo --reward-model RM` (LoRA r8, 4 questions x 8 completions a step at --temperature, KL --beta
   to the start, 24 tokens): the reward model is the only reward that trains; the accuracy reward is logged
   beside it with weight 0. The same held-out measures after.
Prints a table, writes pipeline.json and pipeline.png (mean reward and training accuracy per GRPO step, held-out
accuracy before and after) into --output.
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

FRUITS = ["apple", "pear", "fig", "plum", "lime", "kiwi", "date", "grape", "lemon", "mango", "peach", "melon",
          "cherry", "olive", "berry", "guava"]
PHRASES = ["The value of {key} is {value}.", "{key} = {value}.", "It is {value}.", "The answer is {value}."]


def questions(n: int, seed: int) -> list[dict]:
    """{question, key, value, wrong}: four fruits with distinct digits, one asked for; wrong is another's value."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        keys, values = rng.sample(FRUITS, 4), rng.sample(range(1, 10), 4)
        k = rng.randrange(4)
        listing = ", ".join(f"{key}={value}" for key, value in zip(keys, values))
        out.append({"question": f"Values: {listing}. What is the value of {keys[k]}?", "key": keys[k],
                    "value": values[k], "wrong": rng.choice(values[:k] + values[k + 1:])})
    return out


def ask(q: dict) -> list[dict]:
    return [{"role": "user", "content": q["question"]}]


def preference_rows(qs: list[dict], seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for q in qs:
        phrase = rng.choice(PHRASES)
        rows.append({"prompt": ask(q),
                     "chosen": [{"role": "assistant", "content": phrase.format(key=q["key"], value=q["value"])}],
                     "rejected": [{"role": "assistant", "content": phrase.format(key=q["key"], value=q["wrong"])}]})
    return rows


def policy(adapter: str | None, qs: list[dict]):
    """(engine, prompt ids): the default model (with `adapter`) in the rollout engine, and each question as its
    chat prompt."""
    from tunix_rt.checkpoints.loader import load_model
    from tunix_rt.checkpoints.peft_adapter import load_adapter
    from tunix_rt.engine.engine import Engine

    loaded = load_model("default")
    if adapter is not None:
        load_adapter(loaded.model, adapter)
    tok = loaded.tokenizer
    prompts = [tok.apply_chat_template(ask(q), add_generation_prompt=True, tokenize=True) for q in qs]
    return Engine(loaded.model, tok, max_model_len=128, max_num_seqs=64), prompts


def policy_pairs(qs: list[dict], seed: int) -> list[dict]:
    """The default model's sample of each question (temperature 1, 32 tokens) against a phrasing of the right
    value (a wrong sample) or of another value (a right one)."""
    from tunix_rt.engine.params import SamplingParams

    engine, prompts = policy(None, qs)
    samples = engine.generate(prompts, SamplingParams(max_tokens=32, temperature=1.0, seed=seed))
    rng = random.Random(seed)
    rows = []
    for q, sample in zip(qs, samples):
        phrase = rng.choice(PHRASES)
        right = correct(sample.text, q)
        reply = [{"role": "assistant", "content": sample.text}]
        other = [{"role": "assistant", "content": phrase.format(key=q["key"], value=q["wrong" if right else "value"])}]
        chosen, rejected = (reply, other) if right else (other, reply)
        rows.append({"prompt": ask(q), "chosen": chosen, "rejected": rejected})
    return rows


def correct(text: str, q: dict) -> bool:
    from tunix_rt.train.rewards import answers_match, extract_answer

    return answers_match(extract_answer(text) or "", str(q["value"]))


def write_jsonl(path: str, rows: list[dict]) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return path


def tunix(*argv) -> float:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "tunix_rt", *map(str, argv)], capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"tunix-rt {argv[0]} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return time.perf_counter() - start


def metrics(run: str) -> list[dict]:
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def evaluate_policy(adapter: str | None, reward_model: str, held, n: int) -> dict:
    """Held-out accuracy of the default model (with `adapter`): greedy, one of n samples, best-of-n by the
    reward model, majority of n."""
    import numpy as np

    from tunix_rt.engine.params import SamplingParams
    from tunix_rt.evaluation.selection import by_majority, by_reward
    from tunix_rt.train.reward_model_reward import RewardModelReward

    engine, prompts = policy(adapter, held)
    greedy = engine.generate(prompts, SamplingParams(max_tokens=48, temperature=0.0))
    sampled = engine.generate(prompts, SamplingParams(max_tokens=48, temperature=1.0, n=n, seed=1))
    reward = RewardModelReward(reward_model)
    right = lambda text, q: float(correct(text, q))  # noqa: E731
    out = {"greedy": [], "single": [], "best_of_n": [], "majority": []}
    for q, g, samples in zip(held, greedy, sampled):
        texts = [s.text for s in samples]
        out["greedy"].append(right(g.text, q))
        out["single"].append(np.mean([right(t, q) for t in texts]))
        completions = [[{"role": "assistant", "content": t}] for t in texts]
        out["best_of_n"].append(right(texts[by_reward(ask(q), completions, reward).index], q))
        out["majority"].append(right(texts[by_majority(texts).index], q))
    result = {k: float(np.mean(v)) for k, v in out.items()}
    result["example"] = greedy[0].text
    return result


def plot(path: str, grpo: list[dict], before: dict, after: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [m["step"] for m in grpo]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(steps, [m["reward"] for m in grpo], label="reward model score (mean)")
    left.set_xlabel("GRPO step")
    left.set_ylabel("reward")
    twin = left.twinx()
    twin.plot(steps, [m["rewards/accuracy/mean"] for m in grpo], color="tab:orange", label="accuracy (weight 0)")
    twin.set_ylabel("training accuracy")
    left.legend(loc="upper left")
    twin.legend(loc="lower right")
    left.set_title("GRPO against the reward model")
    names = ["greedy", "single", "best_of_n", "majority"]
    x = range(len(names))
    right.bar([i - 0.2 for i in x], [before[k] for k in names], width=0.4, label="before GRPO")
    right.bar([i + 0.2 for i in x], [after[k] for k in names], width=0.4, label="after GRPO")
    right.set_xticks(list(x), names)
    right.set_ylabel("held-out accuracy")
    right.legend()
    right.set_title("held-out questions")
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rm-steps", type=int, default=200)
    ap.add_argument("--grpo-steps", type=int, default=30)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--heldout", type=int, default=256, help="held-out questions")
    ap.add_argument("--temperature", type=float, default=0.7, help="GRPO's sampling temperature")
    ap.add_argument("--beta", type=float, default=0.04, help="GRPO's KL weight")
    ap.add_argument("--reward-model", default=None, help="a run DIR of this script's step 1 to reuse (DIR/rm)")
    ap.add_argument("--output", default=None, help="directory for the runs, pipeline.json and pipeline.png")
    args = ap.parse_args()
    work = args.output or tempfile.mkdtemp(prefix="tunix-rt-reward-pipeline-")
    os.makedirs(work, exist_ok=True)
    train, held = questions(400, 0), questions(args.heldout, 1)
    grpo_rows = write_jsonl(f"{work}/grpo.jsonl", [{"prompt": ask(q), "answer": str(q["value"])} for q in train])
    rm, rm_seconds = args.reward_model, 0.0
    if rm is None:
        unseen = questions(100, 2)
        rm_train = write_jsonl(f"{work}/rm_train.jsonl", preference_rows(train, 0) + policy_pairs(train, 0))
        rm_held = write_jsonl(f"{work}/rm_held.jsonl", preference_rows(unseen, 1) + policy_pairs(unseen, 1))
        rm = f"{work}/rm"
        rm_seconds = tunix("reward", "--data", rm_train, "--output", rm, "--steps", args.rm_steps, "--lora-rank", 8,
                           "batch_size=8", "learning_rate=1e-3", "max_length=128", f"eval_data={rm_held}",
                           f"eval_steps={args.rm_steps}", "progress=false", "--overwrite")
    rm_acc = [m for m in metrics(rm) if "eval_accuracy" in m][-1]["eval_accuracy"]
    made = f"reused from {rm}" if args.reward_model else f"{args.rm_steps} steps in {rm_seconds:.0f}s"
    print(f"reward model: {made}, held-out pair accuracy {rm_acc:.3f}", flush=True)

    before = evaluate_policy(None, f"{rm}/final", held, args.n)
    print(f"before GRPO: {before}", flush=True)
    grpo = f"{work}/grpo"
    grpo_seconds = tunix("grpo", "--data", grpo_rows, "--output", grpo, "--steps", args.grpo_steps, "--lora-rank", 8,
                         "--reward", "accuracy", "--reward-model", f"{rm}/final", "reward_weights=[0,1]",
                         "batch_size=32", "num_generations=8", "max_completion_length=24", "learning_rate=3e-4",
                         f"temperature={args.temperature}", f"beta={args.beta}",
                         "progress=false", "--overwrite")
    curve = [m for m in metrics(grpo) if "reward" in m]
    after = evaluate_policy(f"{grpo}/final", f"{rm}/final", held, args.n)
    print(f"after GRPO: {after}", flush=True)

    report = {"reward_model": {"steps": args.rm_steps, "heldout_pair_accuracy": rm_acc, "seconds": rm_seconds},
              "grpo": {"steps": args.grpo_steps, "seconds": grpo_seconds,
                       "reward": [m["reward"] for m in curve],
                       "train_accuracy": [m["rewards/accuracy/mean"] for m in curve]},
              "before": before, "after": after, "n": args.n}
    with open(f"{work}/pipeline.json", "w") as f:
        json.dump(report, f, indent=1)
    plot(f"{work}/pipeline.png", curve, before, after)
    first, last = curve[:5], curve[-5:]
    mean = lambda xs, k: sum(m[k] for m in xs) / len(xs)  # noqa: E731
    print(f"\nGRPO {args.grpo_steps} steps in {grpo_seconds:.0f}s: mean reward {mean(first, 'reward'):+.3f} (first 5 "
          f"steps) -> {mean(last, 'reward'):+.3f} (last 5); training accuracy {mean(first, 'rewards/accuracy/mean'):.3f}"
          f" -> {mean(last, 'rewards/accuracy/mean'):.3f}")
    print(f"held-out accuracy ({len(held)} questions, N = {args.n}):")
    print(f"{'':<14}{'greedy':>8}{'1 sample':>10}{'best-of-N':>11}{'majority':>10}")
    for name, r in (("before GRPO", before), ("after GRPO", after)):
        print(f"{name:<14}{r['greedy']:>8.3f}{r['single']:>10.3f}{r['best_of_n']:>11.3f}{r['majority']:>10.3f}")
    print(f"wrote {work}/pipeline.json and {work}/pipeline.png")


if __name__ == "__main__":
    main()
