"""The training loop: exact resume, exact gradient accumulation, the non-finite stop, bf16 compute, the
optimizer's schedules and weight-decay mask, fsdp/tp meshes and jax.distributed processes.

Every run trains the same tiny Llama (tests/train/sharded_worker.py) on 48 random SFT examples for at most
6 steps at learning_rate 1e-2. Runs of one configuration compile one program; a module-wide persistent
compilation cache (also handed to the subprocesses) lets every later Trainer of that configuration load it
instead of compiling, and XLA's optimization passes are off (they cost ~3x the compile time here and change
nothing these tests compare).

Tolerances: runs that differ only in where a sum is split (accumulation, sharding, processes) agree in loss
and gradient norm to float rounding (1e-5 relative; seen: ~3e-7). Their params agree to 5e-4, 5% of one Adam
step (seen: 1e-5 to 2.3e-4 depending on the random init, so 1e-5 would be flaky): Adam divides each gradient
entry by its own running RMS,
so an entry that sums to nearly zero carries its rounding (~1e-3 relative) into an update of size ~lr. A real
error (a missing all-reduce, a wrong shard, a lost micro-batch) moves params by ~lr and the loss at the next
step; a gradient wrongly scaled as a whole, which Adam and clipping would hide, shows in the gradient norm.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tests.ports import free_port
from tests.train import sharded_worker as W
from tunix_rt.models.decoder import Decoder
from tunix_rt.parallel.mesh import make_mesh, put_global
from tunix_rt.train.checkpointing import Checkpointer
from tunix_rt.train.data import DataOrder, SFTExample
from tunix_rt.train.errors import TrainingError
from tunix_rt.train.metrics import read_metrics
from tunix_rt.train.sft import SFTObjective
from tunix_rt.train.trainer import Trainer, clip_factor, make_optimizer

pytestmark = pytest.mark.slow

ITEMS = W.make_items()
PARAM_ATOL = 5e-4  # 5% of one Adam step: see the module docstring
LOSS_RTOL = 1e-5
WORKER = Path(W.__file__)
SUBPROCESS_TIMEOUT = 180


def host_tree(tree) -> dict[str, np.ndarray]:
    """Leaves by path as host arrays (typed PRNG keys as their key data)."""
    is_key = lambda x: jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
    return {jax.tree_util.keystr(p): np.array(jax.random.key_data(x) if is_key(x) else x)
            for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def assert_trees_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def latest_checkpoint(output: Path) -> int | None:
    checkpoints = Checkpointer(output / "checkpoints", max_to_keep=2)
    try:
        return checkpoints.latest_step()
    finally:
        checkpoints.close()


def max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float(np.max(np.abs(a[k] - b[k]))) for k in a)


# --- a persistent compilation cache for this module (and its subprocesses) ------------------------------------

# XLA's optimizations cost ~3x the compile time of these tiny programs and change nothing the tests check
# (every comparison is between programs compiled alike, or within a tolerance).
_COMPILE_OPTIONS = {"jax_compilation_cache_dir": None, "jax_persistent_cache_min_compile_time_secs": 0.0,
                    "jax_persistent_cache_min_entry_size_bytes": 0, "jax_disable_most_optimizations": True,
                    "jax_enable_compilation_cache": True}


@pytest.fixture(scope="module", autouse=True)
def compile_cache(tmp_path_factory):
    """Trainers of one configuration compile identical programs: the second and later load the first's."""
    from jax._src import compilation_cache

    path = str(tmp_path_factory.mktemp("jax_cache"))
    saved = {name: jax.config._read(name) for name in _COMPILE_OPTIONS}
    for name, value in {**_COMPILE_OPTIONS, "jax_compilation_cache_dir": path}.items():
        jax.config.update(name, value)
    compilation_cache.reset_cache()
    try:
        yield path
    finally:
        for name, value in saved.items():
            jax.config.update(name, value)
        compilation_cache.reset_cache()


def subprocess_env(compile_cache: str, devices: int) -> dict[str, str]:
    return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
                JAX_COMPILATION_CACHE_DIR=compile_cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0", JAX_DISABLE_MOST_OPTIMIZATIONS="1")


# --- runs shared by several tests -----------------------------------------------------------------------------


@dataclasses.dataclass
class ResumeRuns:
    whole: list[dict]  # records of the uninterrupted 6 steps
    first: list[dict]  # records of the run stopped after step 3 ...
    second: list[dict]  # ... and of the fresh Trainer that resumed it to step 6
    params: dict  # trainable params after the uninterrupted run
    opt_state: dict
    params_at_3: dict  # after the interrupted run's step 3
    resumed_params: dict
    resumed_opt_state: dict
    rngs: dict  # the RNG streams (LoRA dropout) after the uninterrupted and the resumed run
    resumed_rngs: dict
    whole_metrics: list[dict]  # metrics.jsonl of each output
    resumed_metrics: list[dict]


VARIANTS = {
    "full": {},  # batch 8
    "accumulation": {"batch_size": 4, "gradient_accumulation_steps": 2},  # the same 8 items per step
    "lora": {"lora_rank": 4},
    "lora_dropout": {"lora_rank": 4, "lora_dropout": 0.1},
}


def resume_runs(overrides: dict, tmp: Path) -> ResumeRuns:
    whole, interrupted = tmp / "whole", tmp / "interrupted"
    a, ta = W.train(whole, ITEMS, **overrides)
    b, tb = W.train(interrupted, ITEMS, stop_after=3, **overrides)
    params_at_3 = host_tree(tb.params)
    c, tc = W.train(interrupted, ITEMS, **overrides)  # a fresh model and Trainer, as after a crash
    return ResumeRuns(a, b, c, host_tree(ta.params), host_tree(ta.opt_state), params_at_3, host_tree(tc.params),
                      host_tree(tc.opt_state), host_tree(ta.rngs), host_tree(tc.rngs), read_metrics(whole),
                      read_metrics(interrupted))


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """name -> ResumeRuns of VARIANTS[name], run once on first use."""
    done: dict[str, ResumeRuns] = {}

    def get(name: str) -> ResumeRuns:
        if name not in done:
            done[name] = resume_runs(VARIANTS[name], tmp_path_factory.mktemp(name))
        return done[name]

    return get


# --- 1. exact resume ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["full", "accumulation", "lora", "lora_dropout"])
def test_resume_is_exact(resumed, name):
    runs = resumed(name)
    assert [r["step"] for r in runs.whole] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in runs.first] == [1, 2, 3]
    assert [r["step"] for r in runs.second] == [4, 5, 6]
    for key in ("loss", "grad_norm", "learning_rate", "weight", "epoch"):
        assert [r[key] for r in runs.first + runs.second] == [r[key] for r in runs.whole], key
    assert len({r["loss"] for r in runs.whole}) == 6  # it trains: every step's loss differs
    assert_trees_equal(runs.resumed_params, runs.params)
    assert_trees_equal(runs.resumed_opt_state, runs.opt_state)
    assert_trees_equal(runs.resumed_rngs, runs.rngs)
    assert max_abs_diff(runs.params_at_3, runs.params) > 1e-3  # the resumed run had work left to do
    # metrics.jsonl of the interrupted output: one curve, steps 1..6 once each, equal to the uninterrupted one
    # (timings, memory and compile counts are the process's own: a resumed process compiled its step again)
    own = ("step_time", "memory/peak_rss_gb", "compiles")
    strip = lambda records: [{k: v for k, v in r.items() if k not in own} for r in records]
    assert [r["step"] for r in runs.resumed_metrics] == [1, 2, 3, 4, 5, 6]
    assert strip(runs.resumed_metrics) == strip(runs.whole_metrics) == strip(runs.whole)


def test_records_follow_the_linear_schedule(resumed):
    runs = resumed("full")
    want = [1e-2 * (1 - (step - 1) / 6) for step in range(1, 7)]  # the rate each step applied (0-based count)
    np.testing.assert_allclose([r["learning_rate"] for r in runs.whole], want, rtol=1e-6)
    assert [r["epoch"] for r in runs.whole] == [step / 6 for step in range(1, 7)]


def test_put_global_places_typed_prng_keys():
    """What nnx.Dropout's RNG state holds."""
    mesh = make_mesh(1, 1, devices=jax.devices()[:1])
    keys = {"key": jax.random.key(0), "count": jnp.uint32(3)}
    placed = put_global(keys, jax.tree.map(lambda _: NamedSharding(mesh, P()), keys))
    np.testing.assert_array_equal(jax.random.key_data(placed["key"]), jax.random.key_data(keys["key"]))


def test_lora_dropout_step_advances_the_rng_streams(tmp_path):
    """Dropout draws new masks each step: its counters move inside the gradient trace."""
    trainer = Trainer(W.config(tmp_path, lora_rank=4, lora_dropout=0.1), W.new_model(),
                      SFTObjective(ITEMS, max_length=W.SEQ, pad_id=0))
    before = host_tree(trainer.rngs)
    trainer.run_step(0)
    after = host_tree(trainer.rngs)
    assert any(not np.array_equal(before[k], after[k]) for k in before)  # the dropout streams advanced


# --- 2. gradient accumulation ---------------------------------------------------------------------------------


def test_gradient_accumulation_is_exact(resumed):
    """batch 8 in one micro-batch vs batch 4 accumulated twice: the sampler draws the same 8 items per step."""
    one, two = resumed("full"), resumed("accumulation")
    np.testing.assert_allclose([r["loss"] for r in two.first], [r["loss"] for r in one.first], rtol=LOSS_RTOL)
    np.testing.assert_allclose([r["grad_norm"] for r in two.first], [r["grad_norm"] for r in one.first], rtol=LOSS_RTOL)
    assert [r["weight"] for r in two.first] == [r["weight"] for r in one.first]  # the same tokens
    assert max_abs_diff(two.params_at_3, one.params_at_3) < PARAM_ATOL


# --- 3. non-finite loss ---------------------------------------------------------------------------------------


class PoisonedSFT(SFTObjective):
    """SFT whose rows for the `poisoned` items weigh their tokens by NaN: any step drawing one has a NaN loss."""

    def __init__(self, items, poisoned, **kw):
        super().__init__(items, **kw)
        self.poisoned = np.asarray(sorted(poisoned))

    def host_batch(self, indices, valid, lengths):
        batch = super().host_batch(indices, valid, lengths)
        poisoned = np.isin(indices, self.poisoned)[batch["head_row"]] & (batch["head_mask"] > 0)
        batch["head_mask"][poisoned] = np.nan
        return batch


def test_non_finite_loss_stops_with_the_last_good_state(resumed, tmp_path):
    full = resumed("full")  # the same program, and the same data up to step 4
    order = DataOrder(len(ITEMS), 8, seed=W.config(tmp_path).seed)
    poisoned = order.indices(4)[:1]  # drawn by step 5 only
    assert not np.isin(poisoned, np.concatenate([order.indices(s) for s in range(4)])).any()
    objective = PoisonedSFT(ITEMS, poisoned, max_length=W.SEQ, pad_id=0)

    records, trainer = W.train(tmp_path, ITEMS, stop_after=4, objective=objective)  # saves step 3, stops after 4
    assert [r["loss"] for r in records] == [r["loss"] for r in full.whole[:4]]
    params_4, opt_4 = host_tree(trainer.params), host_tree(trainer.opt_state)

    with pytest.raises(TrainingError) as failure:
        trainer.fit(output=tmp_path)  # resumes at 3, redoes step 4, fails on step 5
    message = str(failure.value)
    assert message.startswith("step 5:") and "not finite" in message, message
    assert "last good state is saved at step 4" in message, message
    assert trainer.step == 4
    assert_trees_equal(host_tree(trainer.params), params_4)  # the NaN update was skipped ...
    assert_trees_equal(host_tree(trainer.opt_state), opt_4)  # ... Adam's moments and count too
    assert latest_checkpoint(tmp_path) == 4
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4]

    fresh = Trainer(W.config(tmp_path), W.new_model(), objective)
    assert fresh.fit(output=tmp_path, stop_after=4) == []  # restored at step 4: nothing left before the stop
    assert fresh.step == 4
    assert_trees_equal(host_tree(fresh.params), params_4)
    with pytest.raises(TrainingError, match=r"^step 5:"):
        fresh.fit(output=tmp_path)


def test_first_step_failure_claims_no_checkpoint(tmp_path):
    objective = PoisonedSFT(ITEMS, range(len(ITEMS)), max_length=W.SEQ, pad_id=0)
    with pytest.raises(TrainingError) as failure:
        W.train(tmp_path, ITEMS, objective=objective)
    assert latest_checkpoint(tmp_path) is None
    assert "saved at step 0" not in str(failure.value) and "nothing was saved" in str(failure.value)


def infinite_learning_rate_after(monkeypatch, good_updates: int) -> None:
    """Trainers made from here on update at learning_rate 1e-2, then inf: a step whose loss is finite leaves
    non-finite params (as learning_rate=inf did from the first update)."""
    from tunix_rt.train import trainer as trainer_module

    def make(cfg, total_steps):
        schedule = lambda count: jnp.where(count < good_updates, cfg.lr, jnp.inf)
        return optax.adamw(schedule, weight_decay=cfg.weight_decay), schedule

    monkeypatch.setattr(trainer_module, "make_optimizer", make)


def all_finite(tree) -> bool:
    return all(np.isfinite(x).all() for x in host_tree(tree).values() if np.issubdtype(x.dtype, np.inexact))


def test_non_finite_update_is_never_called_good(monkeypatch, tmp_path):
    """Step 4's loss is finite but its update is not: step 5 stops and points at step 3, the last finite state."""
    infinite_learning_rate_after(monkeypatch, 3)
    with pytest.raises(TrainingError) as failure:
        W.train(tmp_path, ITEMS)  # save_steps=3
    message = str(failure.value)
    assert message.startswith("step 5:") and "not finite either" in message, message
    assert "last good state is the checkpoint at step 3" in message, message
    assert latest_checkpoint(tmp_path) == 3
    trainer = Trainer(W.config(tmp_path), W.new_model(), SFTObjective(ITEMS, max_length=W.SEQ, pad_id=0))
    checkpoints = Checkpointer(tmp_path / "checkpoints", max_to_keep=2)
    try:
        state, _ = checkpoints.restore(3, trainer.state())
    finally:
        checkpoints.close()
    assert all_finite(state["params"]) and all_finite(state["opt_state"])


def test_non_finite_state_is_not_saved_at_a_save_step(monkeypatch, tmp_path):
    infinite_learning_rate_after(monkeypatch, 0)  # learning_rate=inf from the first update
    with pytest.raises(TrainingError) as failure:
        W.train(tmp_path, ITEMS, save_steps=1)
    message = str(failure.value)
    assert message.startswith("step 1:") and "non-finite parameters" in message, message
    assert "no good state was saved" in message, message
    assert latest_checkpoint(tmp_path) is None


# --- 4. bf16 compute ------------------------------------------------------------------------------------------


def test_bf16_compute_keeps_f32_masters(resumed, tmp_path):
    full = resumed("full")
    records, trainer = W.train(tmp_path, ITEMS, stop_after=3, compute_dtype="bfloat16")
    losses, f32 = [r["loss"] for r in records], [r["loss"] for r in full.first]
    np.testing.assert_allclose(losses, f32, rtol=2e-2)
    assert losses != f32  # bf16 really computed (f32 would repeat the losses exactly)
    for name, tree in (("params", trainer.params), ("opt_state", trainer.opt_state)):
        dtypes = {str(x.dtype) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)}
        assert dtypes == {"float32"}, (name, dtypes)


# --- 5. the optimizer -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("options, total, want", [
    ({"lr_scheduler_type": "linear", "warmup_steps": 2}, 10, {0: 0.0, 1: 0.5, 2: 1.0, 6: 0.5, 9: 0.125, 10: 0.0}),
    ({"lr_scheduler_type": "cosine", "warmup_steps": 2}, 10,
     {0: 0.0, 1: 0.5, 2: 1.0, 4: 0.5 * (1 + math.cos(math.pi / 4)), 6: 0.5, 10: 0.0}),
    ({"lr_scheduler_type": "constant", "warmup_ratio": 0.25}, 8, {0: 0.0, 1: 0.5, 2: 1.0, 5: 1.0, 8: 1.0}),
    ({"lr_scheduler_type": "linear"}, 4, {0: 1.0, 1: 0.75, 2: 0.5, 4: 0.0}),
    ({"lr_scheduler_type": "cosine", "warmup_steps": 20}, 10, {0: 0.0, 5: 0.5, 10: 1.0}),  # warmup capped at the total
])
def test_schedules(tmp_path, options, total, want):
    _, schedule = make_optimizer(W.config(tmp_path, learning_rate=1.0, **options), total)
    got = {step: float(schedule(step)) for step in want}
    np.testing.assert_allclose([got[s] for s in want], [want[s] for s in want], atol=1e-6, err_msg=str(got))


@pytest.mark.parametrize("max_norm", [0.5, 3.0, 1e6, None])
def test_clip_factor_is_optax_clip_by_global_norm(max_norm):
    """The step clips with one multiply (in place); it must equal optax's transform, below and above the bound."""
    keys = jax.random.split(jax.random.key(0), 3)
    grads = {"a": jax.random.normal(keys[0], (7, 5)), "b": {"c": jax.random.normal(keys[1], (11,))}}
    norm = optax.global_norm(grads)
    got = jax.tree.map(lambda g: g * clip_factor(norm, max_norm), grads)
    want = optax.clip_by_global_norm(max_norm).update(grads, None)[0] if max_norm else grads
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-6)
    assert (float(optax.global_norm(got)) < float(norm)) == (max_norm is not None and max_norm < float(norm))


def test_weight_decay_skips_vectors(tmp_path):
    """Zero gradients: AdamW's only move is decay, lr_t * wd * p per step, on matrices only (not norms, biases)."""
    cfg = dataclasses.replace(W.model_config(), qkv_bias=True)
    params = nnx.state(Decoder(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    train_cfg = W.config(tmp_path, learning_rate=0.5, weight_decay=0.1, warmup_steps=1, lr_scheduler_type="linear")
    optimizer, schedule = make_optimizer(train_cfg, 4)

    @jax.jit
    def three_steps(params):
        state, zeros = optimizer.init(params), jax.tree.map(jnp.zeros_like, params)
        for _ in range(3):
            updates, state = optimizer.update(zeros, state, params)
            params = optax.apply_updates(params, updates)
        return params

    current = three_steps(params)
    factor = math.prod(1 - float(schedule(s)) * 0.1 for s in range(3))  # lr 0, 0.5, 1/3: 0.95 * (1 - 1/30)
    before, after = host_tree(params), host_tree(current)
    per_layer_ndim = {k: v.ndim - k.startswith("['layers']") for k, v in before.items()}  # layers are stacked
    vectors = [k for k in before if per_layer_ndim[k] == 1]
    assert any("bias" in k for k in vectors) and any("scale" in k for k in vectors)
    assert any("layers" in k for k in vectors) and any("layers" not in k for k in vectors)
    for k in before:
        want = before[k] * factor if per_layer_ndim[k] > 1 else before[k]
        np.testing.assert_allclose(after[k], want, rtol=1e-6, atol=0, err_msg=k)


# --- 6. meshes ------------------------------------------------------------------------------------------------


def test_trainer_takes_the_model_weights_without_a_copy(tmp_path):
    """On one device the trainer's params are the model's buffers (a copy doubled the weights' memory for
    the whole run); the first step's donation consumes them."""
    model = W.new_model()
    before = {k: v for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    trainer = Trainer(W.config(tmp_path), model, SFTObjective(ITEMS, max_length=W.SEQ, pad_id=0))
    after = dict(nnx.to_flat_state(trainer.params))
    assert after.keys() == before.keys()
    for k in after:
        assert after[k].get_value().unsafe_buffer_pointer() == before[k].get_value().unsafe_buffer_pointer(), k
    trainer.run_step(0)
    assert all(v.get_value().is_deleted() for v in before.values())


def test_a_batch_larger_than_the_data_warns(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="tunix_rt.train"):
        Trainer(W.config(tmp_path), W.new_model(), SFTObjective(ITEMS[:3], max_length=W.SEQ, pad_id=0))
    assert "each step takes 8 items but the data holds 3" in caplog.text


@pytest.mark.parallel
def test_mesh_rejects_impossible_shapes():
    one = jax.devices()[:1]
    with pytest.raises(ValueError, match="devices"):
        make_mesh(2, 1, devices=one)
    with pytest.raises(ValueError, match="tp=2 must divide"):
        make_mesh(-1, 2, devices=one)


@pytest.mark.parallel
def test_meshes_match_one_device(resumed, compile_cache, tmp_path):
    """One process with 8 virtual devices: a 1-device mesh, fsdp=4 x tp=2 and fsdp=8 train alike."""
    full, lora = resumed("full"), resumed("lora")  # the 1-device programs are cached for the subprocess
    result = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, str(WORKER), "meshes", str(result), str(tmp_path / "runs")],
                          env=subprocess_env(compile_cache, 8), capture_output=True, text=True,
                          timeout=SUBPROCESS_TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-5000:]
    out = json.loads(result.read_text())

    errors = out["errors"]
    assert "6 devices, but 8 are available" in errors["make_mesh(fsdp=3, tp=2)"]
    assert "tp=3 must divide" in errors["make_mesh(tp=3)"]
    assert "16 devices, but 8 are available" in errors["make_mesh(fsdp=4, tp=4)"]
    assert "must be a multiple of the fsdp mesh axis (8)" in errors["batch_size=4 on fsdp=8"]

    for prefix, reference in (("", full), ("lora_", lora)):
        one = out[f"{prefix}one"]
        np.testing.assert_allclose(one["losses"], [r["loss"] for r in reference.first], rtol=LOSS_RTOL)
        for name in ("fsdp4_tp2", "fsdp8") if not prefix else ("fsdp4_tp2",):
            run = out[prefix + name]
            np.testing.assert_allclose(run["losses"], one["losses"], rtol=LOSS_RTOL, err_msg=prefix + name)
            np.testing.assert_allclose(run["grad_norms"], one["grad_norms"], rtol=LOSS_RTOL, err_msg=prefix + name)
            assert run["max_param_diff"] < PARAM_ATOL, (prefix + name, run["max_param_diff"], run["max_param_diff_at"])

    # the weights really are split: the q_proj kernels (2 layers stacked, (2, 64, 64)) and their Adam moment over
    # both axes but the layers', LoRA's B (2, 4, 64) over tp with its frozen base kernels over both
    assert out["fsdp4_tp2"]["mesh"] == {"fsdp": 4, "tp": 2}
    placed = lambda run, what: (out[run][f"q_proj_{what}"]["spec"], out[run][f"q_proj_{what}"]["shape"],
                                out[run][f"q_proj_{what}"]["shard_shape"])
    assert placed("fsdp4_tp2", "trained") == placed("fsdp4_tp2", "mu") == ([None, "fsdp", "tp"], [2, 64, 64],
                                                                           [2, 16, 32])
    assert placed("fsdp8", "trained") == placed("fsdp8", "mu") == ([None, "fsdp", "tp"], [2, 64, 64], [2, 8, 64])
    assert out["lora_fsdp4_tp2"]["q_proj_trained"]["path"].endswith("['lora_b'].value")
    assert placed("lora_fsdp4_tp2", "trained") == placed("lora_fsdp4_tp2", "mu") == ([None, None, "tp"], [2, 4, 64],
                                                                                     [2, 4, 32])
    assert placed("lora_fsdp4_tp2", "frozen") == ([None, "fsdp", "tp"], [2, 64, 64], [2, 16, 32])

    # a checkpoint written on one device resumes on fsdp=4 x tp=2 (Orbax reshards it) and goes on alike
    moved = out["resharded_resume"]
    assert moved["steps"] == [4]
    np.testing.assert_allclose(moved["losses"], [full.whole[3]["loss"]], rtol=LOSS_RTOL)
    np.testing.assert_allclose(moved["grad_norms"], [full.whole[3]["grad_norm"]], rtol=LOSS_RTOL)


# --- 7. jax.distributed -----------------------------------------------------------------------------------


@pytest.mark.parallel
def test_two_processes_match_one_process(resumed, compile_cache, tmp_path):
    """2 processes x 2 CPU devices on localhost (gloo collectives), fsdp over the 4 global devices; then the
    same 2 processes resume the run's step-3 checkpoint in fresh Trainers for one more step."""
    full = resumed("full")
    result, port = tmp_path / "result.json", free_port()
    env = subprocess_env(compile_cache, 2)
    logs = [tmp_path / f"process{pid}.log" for pid in range(2)]
    procs, hung, deadline = [], [], time.monotonic() + SUBPROCESS_TIMEOUT
    try:
        for pid, log in enumerate(logs):
            with open(log, "w") as sink:  # files, not pipes: a full pipe would stall a process mid-collective
                command = [sys.executable, str(WORKER), "process", str(result), str(tmp_path / "run"), str(port), "2",
                           str(pid)]
                procs.append(subprocess.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT))
        # until both finish, one fails (its peer would wait for it until jax's own timeouts) or time runs out
        failed = lambda: any(p.poll() for p in procs)  # poll(): None running, 0 done, else failed
        while any(p.poll() is None for p in procs) and not failed() and time.monotonic() < deadline:
            time.sleep(0.2)
        if not failed():
            hung = [pid for pid, p in enumerate(procs) if p.poll() is None]
    finally:
        for proc in procs:  # both go down if either failed or hung
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    report = "\n".join(f"--- process {pid} (exit {p.returncode})\n{log.read_text()[-4000:]}"
                       for pid, (p, log) in enumerate(zip(procs, logs)))
    assert not hung, f"process(es) {hung} still running after {SUBPROCESS_TIMEOUT} s, killed:\n{report}"
    assert all(p.returncode == 0 for p in procs), report

    out = json.loads(result.read_text())
    assert (out["process_count"], out["global_devices"], out["local_devices"]) == (2, 4, 2)
    assert out["mesh"] == {"fsdp": 4, "tp": 1}
    np.testing.assert_allclose(out["losses"], [r["loss"] for r in full.first], rtol=LOSS_RTOL)
    np.testing.assert_allclose(out["grad_norms"], [r["grad_norm"] for r in full.first], rtol=LOSS_RTOL)
    arrays = np.load(result.with_suffix(".npz"))
    gathered = {name: arrays[f"p{i}"] for i, name in enumerate(out["param_names"])}
    assert max_abs_diff(gathered, full.params_at_3) < PARAM_ATOL
    # the checkpoint both processes wrote at step 3 (save_steps 3) restores in a fresh 2-process Trainer
    assert out["resumed"]["losses"] == [pytest.approx(full.whole[3]["loss"], rel=LOSS_RTOL)]
    assert out["resumed"]["grad_norms"] == [pytest.approx(full.whole[3]["grad_norm"], rel=LOSS_RTOL)]
    assert latest_checkpoint(tmp_path / "run") == 3  # stop_after=4 saves nothing new


# --- 6. bucketed batches and gradient checkpointing -----------------------------------------------------------


class FixedLengthSFT(SFTObjective):
    """SFT padded to max_length, as batches were before bucketing: the reference the bucketed batches must equal."""

    def batch_lengths(self, indices):
        return (self.max_length, super().batch_lengths(indices)[1])


def test_bucketed_batches_and_gradient_checkpointing_give_the_same_step(tmp_path):
    """A batch padded to its bucket, to max_length, or recomputed layer by layer: the same loss and gradient."""
    items = [SFTExample(e.input_ids[:10], e.loss_mask[:10]) for e in ITEMS]  # rows of <= 10 tokens: bucket 16 < 32
    runs = {}
    for name, objective, overrides in (("bucketed", SFTObjective(items, max_length=W.SEQ, pad_id=0), {}),
                                       ("fixed", FixedLengthSFT(items, max_length=W.SEQ, pad_id=0), {}),
                                       ("remat", SFTObjective(items, max_length=W.SEQ, pad_id=0),
                                        {"gradient_checkpointing": True})):
        trainer = Trainer(W.config(tmp_path / name, **overrides), W.new_model(), objective)
        assert trainer.train_batch(0)["tokens"].shape[-1] == (W.SEQ if name == "fixed" else 16)
        runs[name] = trainer.run_step(0)
    for name in ("fixed", "remat"):
        for key in ("loss", "grad_norm"):
            np.testing.assert_allclose(runs[name][key], runs["bucketed"][key], rtol=LOSS_RTOL)
    assert runs["bucketed"]["compiles"] == 1 and runs["bucketed"]["memory/peak_rss_gb"] > 0


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_gradient_checkpointing_in_bf16_gives_the_same_step(tmp_path, lora_rank):
    """bf16 compute: checkpointed layers cast their own f32 params inside the recomputed region; the step
    must be the one the up-front cast gives (the same bf16 values either way)."""
    runs = {}
    for remat in (False, True):
        cfg = W.config(tmp_path / str(remat), compute_dtype="bfloat16", gradient_checkpointing=remat, lora_rank=lora_rank)
        runs[remat] = Trainer(cfg, W.new_model(), SFTObjective(ITEMS, max_length=W.SEQ, pad_id=0)).run_step(0)
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(runs[True][key], runs[False][key], rtol=1e-5)
