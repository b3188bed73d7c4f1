"""Custom XLA FFI ops, each beside its pure-JAX reference (same signature)."""

from tunix_rt.ops.rms_norm import rms_norm, rms_norm_reference

__all__ = ["rms_norm", "rms_norm_reference"]
