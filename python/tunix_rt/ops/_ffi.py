"""Loads the compiled extension and registers its XLA FFI handlers with jax, once per process."""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

try:
    from tunix_rt import _ext
except ImportError:  # a source checkout without a build: every op uses its pure-JAX reference
    _ext = None


@functools.cache
def cpu_targets() -> frozenset[str]:
    """Names of the FFI targets registered for the CPU platform (empty without the extension)."""
    if _ext is None:
        return frozenset()
    registrations = _ext.cpu_registrations()
    for name, capsule in registrations.items():
        jax.ffi.register_ffi_target(name, capsule, platform="cpu")
    return frozenset(registrations)


KERNEL_MODES = ("native", "reference", "interpret")


@functools.cache
def kernel_mode() -> str:
    """Which path the ops take, from TUNIX_RT_KERNELS (read once per process).

    native (default): the C++ handlers on CPU, the Pallas kernels on CUDA GPUs, the pure-JAX references
    elsewhere. reference: the pure-JAX references everywhere. interpret: the path a GPU takes, on any
    host: the Pallas kernels in interpret mode and the references for ops without one (the CI checks
    the accelerator path with it, since CI has no GPU).
    """
    mode = os.environ.get("TUNIX_RT_KERNELS", "").strip() or "native"
    if mode not in KERNEL_MODES:
        raise ValueError(f"TUNIX_RT_KERNELS={mode!r} is not one of {', '.join(KERNEL_MODES)}")
    return mode


# op family -> (its CPU FFI targets, the Pallas kernel it runs on CUDA GPUs or None: XLA over the reference)
OP_FAMILIES = {
    "paged attention": (("tunix_rt_paged_attention",), "Pallas/Triton paged_attention_pallas"),
    "kv-cache write": (("tunix_rt_write_kv", "tunix_rt_empty_kv"), None),
    "training attention": (("tunix_rt_attention_fwd", "tunix_rt_attention_bwd"),
                           "Pallas/Triton attention_pallas (bf16, power-of-two head_dim; f32: XLA)"),
    "rms norm": (("tunix_rt_rms_norm_fwd", "tunix_rt_rms_norm_bwd"), None),
    "quantized matmul": (("tunix_rt_quant_matmul", "tunix_rt_quantize", "tunix_rt_dequantize"),
                         "Pallas/Triton quant_matmul_pallas (bf16 activations; f32, quantize, dequantize: XLA)"),
    "float matmul (row-invariant; bf16 training, LoRA fused)": (("tunix_rt_bf16_matmul", "tunix_rt_bf16_matmul_plus"),
                                                                None),
    "moe routing and grouped matmul": (("tunix_rt_moe_route", "tunix_rt_moe_permute", "tunix_rt_moe_unpermute",
                                        "tunix_rt_moe_unpermute_bwd", "tunix_rt_grouped_matmul",
                                        "tunix_rt_grouped_matmul_dw"),
                                       "Pallas/Triton grouped_matmul_pallas (K, N multiples of 16; routing: XLA)"),
}


def kernel_table() -> list[tuple[str, str, str, str]]:
    """(op family, what runs on CPU, on CUDA, on TPU and ROCm) under this process's kernel mode."""
    mode, reference = kernel_mode(), "pure-JAX reference (XLA)"
    rows = []
    for family, (targets, pallas) in OP_FAMILIES.items():
        if mode == "native":
            built = all(t in cpu_targets() for t in targets)
            rows.append((family, f"C++ FFI ({isa_level()})" if built else reference, pallas or reference, reference))
        else:  # every platform takes one path
            path = f"{pallas} (interpret mode)" if pallas and mode == "interpret" else reference
            rows.append((family, path, path, path))
    return rows


def has_cpu_target(name: str) -> bool:
    """Whether `name` runs its C++ handler on CPU: it is built and the kernel mode is native."""
    return name in cpu_targets() and kernel_mode() == "native"


def cpu_features() -> dict[str, bool]:
    return dict(_ext.cpu_features()) if _ext is not None else {}


def isa_level() -> str | None:
    """The kernel tier the extension dispatches to (scalar, avx2, avxvnni, avx512), None without it."""
    return _ext.isa_level() if _ext is not None else None


def int8_matmul_kernels(fmt_id: int = 0) -> dict[str, str] | None:
    """The kernels quant_matmul's int8 route runs on this tier for a format id (ops.quant.FORMATS order):
    {"gemv": up to 4 rows, "gemm": past them ("none": the GEMV's for every M)}; None without the extension."""
    return dict(_ext.quant_int8_kernels(fmt_id)) if _ext is not None else None


def require_array(op: str, name: str, value):
    """`value` if it is an array (has shape and dtype), else a ValueError naming the op and argument."""
    if not hasattr(value, "shape") or not hasattr(value, "dtype"):
        raise ValueError(f"{op}: {name} must be an array, got {type(value).__name__}")
    return value


def platform_dispatch(target: str, compiled, reference, *args, cuda=None):
    """Runs `compiled` on CPU where `target` has a handler, `cuda(*args, interpret=False)` (a Pallas
    kernel) on CUDA GPUs where one is given, and `reference` on every other platform; `kernel_mode`
    can send every platform to the references, or to the GPU path in interpret mode.

    In a process whose only backend is the CPU only the CPU branch is traced: tracing the reference beside
    it (lax.platform_dependent traces every branch) was 40 % of the time a warm start spent making its
    programs. Elsewhere jax picks the branch when it lowers for a known platform, so no runtime cond is
    left behind.
    """
    mode = kernel_mode()
    if mode == "interpret":
        return cuda(*args, interpret=True) if cuda is not None else reference(*args)
    cpu = compiled if has_cpu_target(target) else reference
    if mode == "reference" or _cpu_only():
        return cpu(*args)
    accelerators = {} if cuda is None else {"cuda": functools.partial(cuda, interpret=False)}
    return jax.lax.platform_dependent(*args, cpu=cpu, default=reference, **accelerators)


@functools.cache
def _cpu_only() -> bool:
    return {d.platform for d in jax.devices()} == {"cpu"}


def ffi_api_version() -> tuple[int, int] | None:
    """The XLA FFI API version the extension was compiled against (vendored headers)."""
    return tuple(_ext.XLA_FFI_API_VERSION) if _ext is not None else None


def zero_cotangent(x):
    """The cotangent of an input a custom_vjp does not differentiate: float0 zeros for integer arrays
    (jax's rule), zeros of the input's dtype otherwise, None for an absent input."""
    if x is None:
        return None
    return np.zeros(x.shape, jax.dtypes.float0) if jnp.issubdtype(x.dtype, jnp.integer) else jnp.zeros_like(x)
