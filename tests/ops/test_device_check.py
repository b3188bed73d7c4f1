"""benchmarks/device_check.py runs only where a GPU is lent, for minutes: its kernel parts are tried here first in
interpret mode (small shapes), so that a broken part is found in CI and not in a device lease."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_kernel_parts_run_in_interpret_mode(tmp_path):
    out = tmp_path / "report.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "device_check.py"), "--interpret", "--parts",
                          "attention,train_attention,moe,quant", "--out", str(out)],
                         env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    for part in ("attention", "train_attention", "moe", "quant"):
        assert "error" not in report[part], (part, report[part])
    assert all(r["default"] is not None for r in report["attention"]["steps"])
    for row in report["train_attention"]["rows"]:  # bf16 inputs against the f32 reference
        assert "error" not in row and max(row["max_rel_err"].values()) < 2e-2, row
    for row in report["moe"]["rows"]:
        assert "error" not in row and max(row["max_rel_err"].values()) < 2e-2, row
    assert all(np.isfinite(t["kernel_ms"]) for t in report["quant"]["timings"])
