"""bf16 compute: the linear layers and the tied head run on bf16_matmul's kernel, tunix-rt's FFI op
(bf16_matmul=ffi) or XLA's dot with f32 sums (bf16_matmul=xla), and both train alike."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.train import sharded_worker as W
from tunix_rt.models.lora import LoRALinear
from tunix_rt.ops.bf16_matmul import default_kernel
from tunix_rt.train.sft import SFTObjective
from tunix_rt.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("fast_compiles")  # compile-bound (conftest.fast_compiles says when)


def _steps(tmp_path, **overrides) -> list[dict[str, float]]:
    objective = SFTObjective(W.make_items(16), max_length=W.SEQ, pad_id=0)
    trainer = Trainer(W.config(tmp_path, steps=2, compute_dtype="bfloat16", **overrides), W.new_model(), objective)
    hlo = trainer._train_step.lower(trainer.params, trainer.params_compute, trainer.opt_state, trainer.rngs,
                                    trainer.frozen_compute, trainer.rest, trainer._inputs(),
                                    trainer.train_batch(0)).as_text()
    assert ("tunix_rt_bf16_matmul" in hlo) == (trainer.cfg.bf16_matmul_kernel == "ffi")
    return [trainer.run_step(step) for step in range(2)]


@pytest.mark.slow
def test_ffi_bf16_matmul_trains_like_xla(tmp_path):
    xla, ffi = _steps(tmp_path / "xla", bf16_matmul="xla"), _steps(tmp_path / "ffi", bf16_matmul="ffi")
    for a, b in zip(xla, ffi):  # bf16 roundings of the same products, summed in another order
        np.testing.assert_allclose(b["loss"], a["loss"], rtol=2e-2)
        np.testing.assert_allclose(b["grad_norm"], a["grad_norm"], rtol=5e-2)


@pytest.mark.slow
def test_lora_steps_run_the_adapter_in_the_base_products_sums(tmp_path, monkeypatch):
    """A bf16 LoRA step runs each adapted projection as one fused product (ops.bf16_matmul.lora_matmul) and
    trains as the separate adapter product and add do."""
    def lora_steps(path):
        objective = SFTObjective(W.make_items(16), max_length=W.SEQ, pad_id=0)
        trainer = Trainer(W.config(path, steps=3, compute_dtype="bfloat16", bf16_matmul="ffi", lora_rank=4,
                                   learning_rate=1e-2), W.new_model(), objective)
        hlo = trainer._train_step.lower(trainer.params, trainer.params_compute, trainer.opt_state, trainer.rngs,
                                        trainer.frozen_compute, trainer.rest, trainer._inputs(),
                                        trainer.train_batch(0)).as_text()
        return hlo, [trainer.run_step(step) for step in range(3)]

    hlo, fused = lora_steps(tmp_path / "fused")
    assert "@tunix_rt_bf16_matmul_plus(" in hlo
    monkeypatch.setattr(LoRALinear, "_fused_kernel", lambda self, x: None)
    hlo, separate = lora_steps(tmp_path / "separate")
    assert "tunix_rt_bf16_matmul_plus" not in hlo
    for a, b in zip(separate, fused):  # bf16 roundings at other points of the same sums
        np.testing.assert_allclose(b["loss"], a["loss"], rtol=2e-2)
        np.testing.assert_allclose(b["grad_norm"], a["grad_norm"], rtol=5e-2)
    assert fused[-1]["loss"] < fused[0]["loss"]


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [False, True])
def test_moe_lora_trains_in_bf16_with_no_bf16_stacked_over_the_layers(tmp_path, checkpointing):
    """LoRA on a MoE model in bf16 (experts' grouped matmuls beside fused attention adapters): the base's stacks
    stay the f32 masters, no layer scan takes or stacks bf16, and the run trains as in f32."""
    from tests.train.test_moe_training import _moe_model

    def run(path, dtype):
        objective = SFTObjective(W.make_items(16), max_length=W.SEQ, pad_id=0)
        trainer = Trainer(W.config(path, steps=3, compute_dtype=dtype, lora_rank=4, learning_rate=1e-2,
                                   gradient_checkpointing=checkpointing), _moe_model(), objective)
        _assert_layer_scans_stack_no_bf16(trainer, 2)
        return [trainer.run_step(step)["loss"] for step in range(3)]

    bf16, f32 = run(tmp_path / "bf16", "bfloat16"), run(tmp_path / "f32", "float32")
    np.testing.assert_allclose(bf16, f32, rtol=3e-2)
    assert bf16[-1] < bf16[0]


def test_kernel_option(tmp_path):
    assert W.config(tmp_path, compute_dtype="bfloat16", bf16_matmul="xla").bf16_matmul_kernel == "xla"
    assert W.config(tmp_path, compute_dtype="bfloat16").bf16_matmul_kernel == default_kernel()
    assert W.config(tmp_path).bf16_matmul_kernel is None  # f32 compute: XLA's f32 dot
    for kernel in ("ffi", "xla"):
        with pytest.raises(ValueError, match=f"bf16_matmul={kernel} needs compute_dtype=bfloat16"):
            W.config(tmp_path, bf16_matmul=kernel)
    for value in ("amx", True, False):  # one type of value: a kernel's name
        with pytest.raises(ValueError, match=r"bf16_matmul must be one of ffi, xla \(or null"):
            W.config(tmp_path, compute_dtype="bfloat16", bf16_matmul=value)


def test_a_lora_base_is_cast_once_and_exported_in_f32(tmp_path):
    """The frozen base reaches every step in bf16: what lies outside the layers cast once when training starts,
    the layers' stacks as the f32 masters themselves, each layer casting its own inside the layer scan (no
    bf16 copy of the base held for the run), with or without checkpointing; the masters stay f32 for the
    merged export."""
    objective = SFTObjective(W.make_items(16), max_length=W.SEQ, pad_id=0)
    dtypes = lambda tree: {x.dtype for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)}
    layers = lambda tree: jax.tree.leaves({k: v for k, v in tree.items() if k == "layers"})
    others = lambda tree: {k: v for k, v in tree.items() if k != "layers"}
    for checkpointing in (False, True):
        trainer = Trainer(W.config(tmp_path / str(checkpointing), steps=2, compute_dtype="bfloat16", lora_rank=4,
                                   gradient_checkpointing=checkpointing), W.new_model(), objective)
        assert dtypes(others(trainer.frozen_compute)) == {jnp.dtype(jnp.bfloat16)}
        assert all(a is b for a, b in zip(layers(trainer.frozen_compute), layers(trainer.frozen), strict=True))
        assert dtypes(trainer.frozen) == {jnp.dtype(jnp.float32)}
        _assert_layer_scans_stack_no_bf16(trainer, W.model_config().num_layers)
        before = jax.tree.map(np.asarray, trainer.frozen_compute)
        records = [trainer.run_step(step) for step in range(2)]
        assert all(np.isfinite(r["loss"]) for r in records)
        jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, trainer.frozen_compute))
        assert dtypes(nnx.state(trainer.model(), nnx.Param)) == {jnp.dtype(jnp.float32)}


def _scans(jaxpr):
    """Every scan in a jaxpr, its sub-jaxprs' included."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else (value,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    yield from _scans(sub)


def _assert_layer_scans_stack_no_bf16(trainer, num_layers: int) -> None:
    """No layer scan of the trainer's step takes or stacks a bf16 array (XLA:CPU has no bf16 dynamic slice or
    update: it converts whole stacks to f32 for every layer), the forward's and the backward's alike."""
    step = jax.make_jaxpr(trainer._step)(trainer.params, trainer.params_compute, trainer.opt_state, trainer.rngs,
                                         trainer.frozen_compute, trainer.rest, trainer._inputs(), trainer.train_batch(0))
    layer_scans = [scan for scan in _scans(step.jaxpr) if scan.params["length"] == num_layers]
    assert len(layer_scans) >= 2  # the forward and the backward
    for scan in layer_scans:
        stacked = [*scan.invars[scan.params["num_consts"] + scan.params["num_carry"]:],
                   *scan.outvars[scan.params["num_carry"]:]]
        assert jnp.dtype(jnp.bfloat16) not in {v.aval.dtype for v in stacked}


@pytest.mark.slow
def test_full_fine_tuning_casts_each_layer_in_the_layer_scan(tmp_path):
    """bf16 full fine-tuning differentiates the f32 masters, each layer casting its own inside the layer scan (a
    bf16 copy's gradients left the scan stacked in bf16, which XLA:CPU writes through f32 converts of the whole
    stack for every layer): no copy is kept, the step program stacks no bf16 gradient, and the run trains as
    one whose checkpointed layers cast the masters themselves."""
    objective = SFTObjective(W.make_items(16), max_length=W.SEQ, pad_id=0)
    trainer = Trainer(W.config(tmp_path, steps=3, compute_dtype="bfloat16"), W.new_model(), objective)
    assert trainer.params_compute is None
    _assert_layer_scans_stack_no_bf16(trainer, W.model_config().num_layers)
    records = [trainer.run_step(step) for step in range(3)]
    checkpointed = Trainer(W.config(tmp_path / "gc", steps=3, compute_dtype="bfloat16", gradient_checkpointing=True),
                           W.new_model(), objective)
    for step, record in enumerate(records):
        np.testing.assert_allclose(checkpointed.run_step(step)["loss"], record["loss"], rtol=1e-3)


@pytest.mark.slow
def test_layers_under_nnx_remat_train_a_bf16_copy_the_update_writes(tmp_path):
    """Checkpointed layers whose call changes their state (a MoE's sown router logits) go through nnx.remat and
    cannot cast their own weights: the steps differentiate a bf16 copy that the optimizer update writes beside
    the f32 masters. After every step (and after a restore) it is the masters rounded to bf16."""
    from tests.train.test_moe_training import _moe_model

    objective = SFTObjective(W.make_items(16), max_length=W.SEQ, pad_id=0)
    trainer = Trainer(W.config(tmp_path, steps=3, compute_dtype="bfloat16", gradient_checkpointing=True,
                               router_aux_loss_coef=0.01), _moe_model(), objective)
    rounded = lambda: jax.tree.map(lambda x: np.asarray(x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x),
                                   trainer.params)
    for step in range(3):
        assert np.isfinite(trainer.run_step(step)["loss"])
        jax.tree.map(np.testing.assert_array_equal, rounded(), jax.tree.map(np.asarray, trainer.params_compute))
    trainer.params_compute = None
    trainer.load_state(trainer.state())
    jax.tree.map(np.testing.assert_array_equal, rounded(), jax.tree.map(np.asarray, trainer.params_compute))


@pytest.mark.slow
def test_checkpointed_lora_with_dropout_trains_in_bf16(tmp_path):
    """LoRA dropout under gradient checkpointing goes through nnx.remat, which cannot cast the layers' weights: the
    base is held as the bf16 bits the layer scan reads, the adapters cast themselves, and the run trains."""
    objective = SFTObjective(W.make_items(16), max_length=W.SEQ, pad_id=0)
    trainer = Trainer(W.config(tmp_path, steps=3, compute_dtype="bfloat16", lora_rank=4, lora_dropout=0.1,
                               gradient_checkpointing=True), W.new_model(), objective)
    assert trainer.params_compute is None
    assert {x.dtype for x in jax.tree.leaves(trainer.frozen_compute["layers"])} == {jnp.dtype(jnp.uint16)}
    records = [trainer.run_step(step) for step in range(3)]
    assert all(np.isfinite(r["loss"]) for r in records) and records[-1]["loss"] < records[0]["loss"]
