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


def trainer_steps(mode: str, output, model, steps: int = 2, **config):
    """(the train step's jaxpr as text, each step's metrics) of an SFT run on sharded_worker's items with the
    ops traced under TUNIX_RT_KERNELS=mode: a training step through the accelerator path's kernels."""
    from tests.train import sharded_worker as W
    from tunix_rt.train.sft import SFTObjective
    from tunix_rt.train.trainer import Trainer

    with kernels(mode):
        objective = SFTObjective(W.make_items(16), max_length=W.SEQ, pad_id=0)
        trainer = Trainer(W.config(output / mode, steps=steps, **config), model, objective)
        program = str(jax.make_jaxpr(trainer._train_step)(
            trainer.params, trainer.params_compute, trainer.opt_state, trainer.rngs, trainer.frozen_compute,
            trainer.rest, trainer._inputs(), trainer.train_batch(0)))
        return program, [trainer.run_step(step) for step in range(steps)]
