"""Shared by the op tests."""

import jax
import pytest


@pytest.fixture(scope="module", autouse=True)
def _on_cpu():
    """The FFI handlers are registered for CPU: run every test there even when an accelerator exists."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield
