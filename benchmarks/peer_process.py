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
