"""Runs a test script once per kernel tier (TUNIX_RT_ISA caps the tier the extension dispatches to)
in subprocesses, all at once (each is mostly jax start-up), and collects what each one wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from tunix_rt.ops import _ffi

# Every tier TUNIX_RT_ISA can cap the dispatch to, in order. avxvnni (AVX2 with AVX-VNNI) has kernels of
# its own only in the int8 matmul, so the other op families' tests run TIERS, without it.
ALL_TIERS = ("scalar", "avx2", "avxvnni", "avx512")
TIERS = ("scalar", "avx2", "avx512")


def has_avx_vnni() -> bool:
    f = _ffi.cpu_features()
    return bool(f.get("avx_vnni") and f.get("f16c"))


def hardware_tier() -> str:
    """The highest tier this CPU runs: scalar, avx2, avxvnni or avx512."""
    f = _ffi.cpu_features()
    if not (f.get("avx2") and f.get("fma")):
        return "scalar"
    if f.get("avx512f") and f.get("avx512bw") and f.get("avx512vl"):
        return "avx512"
    return "avxvnni" if has_avx_vnni() else "avx2"


def expected_tier(asked: str) -> str:
    """The tier a run capped at `asked` uses: the cap or the hardware's, whichever is lower (a cap at
    avxvnni on a CPU without AVX-VNNI gives avx2)."""
    tier = ALL_TIERS[min(ALL_TIERS.index(asked), ALL_TIERS.index(hardware_tier()))]
    return "avx2" if tier == "avxvnni" and not has_avx_vnni() else tier


def run_tiers(tiers: Sequence[str], script: str, tmp: Path, args: Sequence[str] = ()) -> dict[str, tuple[dict, dict]]:
    """tier -> (the JSON report the script printed last, the arrays it saved to the .npz path given
    as its final argument)."""
    procs = {}
    for tier in tiers:
        env = dict(os.environ, TUNIX_RT_ISA=tier, JAX_PLATFORMS="cpu")
        npz = tmp / f"{tier}.npz"
        cmd = [sys.executable, "-c", script, *args, str(npz)]
        procs[tier] = (npz, subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    out = {}
    for tier, (npz, proc) in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-4000:]
        out[tier] = (json.loads(stdout.strip().splitlines()[-1]), dict(np.load(npz)))
    return out
