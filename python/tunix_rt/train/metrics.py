"""Per-step metrics to DIR/metrics.jsonl (one JSON object per line) and TensorBoard event files.

On resume the log is cut back to the checkpoint's step, so the file always holds one curve. Besides the step
records ({"step", metric: value, ...}) the file holds event records ({"step", "event", ...}: a resume and the
options it changed), so the run's record says what each part of the curve was trained under.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

METRICS_FILE = "metrics.jsonl"


def _records(output: str | Path) -> list[dict]:
    path = Path(output) / METRICS_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def read_metrics(output: str | Path) -> list[dict]:
    """The step records of DIR/metrics.jsonl, in order."""
    return [r for r in _records(output) if "event" not in r]


def read_events(output: str | Path) -> list[dict]:
    """The event records of DIR/metrics.jsonl (e.g. {"step": 3, "event": "resumed", "changed": {...}})."""
    return [r for r in _records(output) if "event" in r]


def _jsonable(value):
    value = float(value) if not isinstance(value, (int, str)) else value
    return None if isinstance(value, float) and not math.isfinite(value) else value


class MetricsWriter:
    """Appends step and event records; process 0 only writes (the caller decides)."""

    def __init__(self, output: str | Path, *, resume_step: int = 0, tensorboard: bool = True):
        self.path = Path(output) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = [r for r in _records(output) if r.get("step", 0) <= resume_step] if resume_step else []
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
        self._file = open(self.path, "a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(Path(output) / "tensorboard"), purge_step=resume_step + 1 if resume_step else None)

    def write(self, step: int, values: dict) -> None:
        record = {"step": step, **{k: _jsonable(v) for k, v in values.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, step)

    def event(self, step: int, name: str, **fields) -> None:
        """Records that `name` happened at `step` (after that step's record); TensorBoard gets it as text."""
        record = {"step": step, "event": name, **fields}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            self._tb.add_text(f"events/{name}", json.dumps(fields), step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
