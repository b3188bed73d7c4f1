"""Loads the compiled extension and registers its XLA FFI handlers with jax, once per process."""

from __future__ import annotations

import functools

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


def has_cpu_target(name: str) -> bool:
    return name in cpu_targets()


def cpu_features() -> dict[str, bool]:
    return dict(_ext.cpu_features()) if _ext is not None else {}


def isa_level() -> str | None:
    """The kernel tier the extension dispatches to (scalar, avx2, avx512), None without it."""
    return _ext.isa_level() if _ext is not None else None


def require_array(op: str, name: str, value):
    """`value` if it is an array (has shape and dtype), else a ValueError naming the op and argument."""
    if not hasattr(value, "shape") or not hasattr(value, "dtype"):
        raise ValueError(f"{op}: {name} must be an array, got {type(value).__name__}")
    return value


def platform_dispatch(target: str, compiled, reference, *args):
    """Runs `compiled` where `target` has a CPU handler, and `reference` on every other platform.

    In a process whose only backend is the CPU only `compiled` is traced: tracing the reference beside it
    (lax.platform_dependent traces every branch) was 40 % of the time a warm start spent making its
    programs. Elsewhere jax picks the branch when it lowers for a known platform, so no runtime cond is
    left behind.
    """
    if not has_cpu_target(target):
        return reference(*args)
    if _cpu_only():
        return compiled(*args)
    return jax.lax.platform_dependent(*args, cpu=compiled, default=reference)


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
