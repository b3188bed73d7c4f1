"""`tunix-rt info` reports versions, devices, ISA features and the registered FFI targets."""

from __future__ import annotations

import subprocess
import sys


def test_info_lists_targets_and_isa():
    proc = subprocess.run([sys.executable, "-m", "tunix_rt.cli", "info"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for needle in ("jax ", "jaxlib ", "devices: ", "cpu isa: avx2=", "kernel tier: ", "tunix_rt_rms_norm_fwd",
                   "tunix_rt_rms_norm_bwd", "XLA FFI API 0.3"):
        assert needle in out, (needle, out)
