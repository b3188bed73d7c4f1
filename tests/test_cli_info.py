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


def _info(mode: str) -> subprocess.CompletedProcess:
    import os

    env = dict(os.environ, TUNIX_RT_KERNELS=mode)
    return subprocess.run([sys.executable, "-m", "tunix_rt.cli", "info"], capture_output=True, text=True, timeout=120,
                          env=env)


def test_info_lists_the_kernel_of_each_op_family_per_platform():
    out = _info("native").stdout
    assert "kernels (TUNIX_RT_KERNELS=native" in out
    assert "  paged attention: cpu C++ FFI (" in out and "cuda Pallas/Triton paged_attention_pallas" in out
    assert "  quantized matmul: cpu C++ FFI (" in out and "cuda Pallas/Triton quant_matmul_pallas" in out
    interpret = _info("interpret").stdout
    assert ("  paged attention: cpu Pallas/Triton paged_attention_pallas (interpret mode); "
            "cuda Pallas/Triton paged_attention_pallas (interpret mode)") in interpret
    kernel = "Pallas/Triton quant_matmul_pallas (bf16 activations; f32, quantize, dequantize: XLA) (interpret mode)"
    assert f"  quantized matmul: cpu {kernel}; cuda {kernel}" in interpret
    assert "  rms norm: cpu pure-JAX reference (XLA); cuda pure-JAX reference (XLA)" in interpret


def test_info_names_an_unknown_kernel_mode():
    proc = _info("fastest")
    assert proc.returncode != 0
    assert "TUNIX_RT_KERNELS='fastest' is not one of native, reference, interpret" in proc.stderr
