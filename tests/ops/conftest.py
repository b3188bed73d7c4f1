"""Shared by the op tests."""

import contextlib
import os

import jax
import pytest

from tunix_rt.ops import _ffi


@pytest.fixture(scope="module", autouse=True)
def _on_cpu():
    """The FFI handlers are registered for CPU: run every test there even when an accelerator exists."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


@contextlib.contextmanager
def kernels(mode: str):
    """Ops traced inside take the path TUNIX_RT_KERNELS=mode picks (the mode is read once per process, so
    its cache is cleared on the way in and out)."""
    old = os.environ.get("TUNIX_RT_KERNELS")
    os.environ["TUNIX_RT_KERNELS"] = mode
    _ffi.kernel_mode.cache_clear()
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TUNIX_RT_KERNELS")
        else:
            os.environ["TUNIX_RT_KERNELS"] = old
        _ffi.kernel_mode.cache_clear()
