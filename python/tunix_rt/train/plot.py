"""`tunix-rt plot DIR`: draw the curves in DIR/metrics.jsonl to PNG, one panel per metric."""

from __future__ import annotations

import math
from pathlib import Path

from tunix_rt.checkpoints.output_dir import staged_output_file
from tunix_rt.train.metrics import METRICS_FILE, read_metrics

_SKIP = {"step", "epoch"}


def plot_metrics(output: str | Path, keys: list[str] | None = None, out_file: str | Path | None = None, *,
                 overwrite: bool = False) -> Path:
    """Write DIR/metrics.png (the run's own plot, redrawn each time) or `out_file` (an existing file is replaced
    only with `overwrite`) and return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(output)
    if not records:
        raise ValueError(f"{Path(output) / METRICS_FILE} does not exist or holds no records")
    available = sorted({k for r in records for k, v in r.items() if k not in _SKIP and isinstance(v, (int, float))})
    keys = keys or available
    unknown = [k for k in keys if k not in available]
    if unknown:
        raise ValueError(f"no metric named {', '.join(unknown)} in {METRICS_FILE}; available: {', '.join(available)}")
    cols = min(3, len(keys))
    rows = math.ceil(len(keys) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.2 * rows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="." if len(points) < 50 else None)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(keys):]:
        ax.set_visible(False)
    fig.tight_layout()
    out = Path(out_file) if out_file else Path(output) / "metrics.png"
    try:
        with staged_output_file(out, overwrite=overwrite or not out_file, sources=[Path(output) / METRICS_FILE],
                                what="--output") as staging:
            fig.savefig(staging, dpi=100, format="png")
    finally:
        plt.close(fig)
    return out
