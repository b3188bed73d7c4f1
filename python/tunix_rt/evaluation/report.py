"""The eval's results as one table (stdout), a JSON file and a PNG bar chart."""

from __future__ import annotations

import json
from pathlib import Path

MAIN_METRIC = {"perplexity": "perplexity", "choice": "acc", "accuracy": "accuracy"}


def table(task: str, results: list[dict]) -> str:
    metrics = [k for k in results[0]["metrics"] if k != "tokens_per_s"]
    head = f"{'format':<8} {'MB':>9} " + " ".join(f"{m:>12}" for m in metrics) + f" {'tokens/s':>10}"
    lines = [head]
    for r in results:
        values = " ".join(f"{r['metrics'][m]:>12.4f}" if isinstance(r["metrics"][m], float) else
                          f"{r['metrics'][m]:>12}" for m in metrics)
        lines.append(f"{r['format']:<8} {r['bytes'] / 1e6:>9.1f} {values} {r['metrics']['tokens_per_s']:>10.1f}")
    return "\n".join(lines)


def write(out_dir: Path, task: str, meta: dict, results: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    (out_dir / "eval.json").write_text(json.dumps({**meta, "task": task, "results": results}, indent=2) + "\n")
    metric = MAIN_METRIC[task]
    fig, ax = plt.subplots(figsize=(1.2 + 1.1 * len(results), 3.6))
    bars = ax.bar([r["format"] for r in results], [r["metrics"][metric] for r in results], color="#4c72b0")
    ax.bar_label(bars, fmt="%.3f")
    ax.set_ylabel(metric)
    ax.set_title(f"{task} on {Path(meta['data']).name}")
    fig.tight_layout()
    fig.savefig(out_dir / "eval.png", dpi=110)
    plt.close(fig)
