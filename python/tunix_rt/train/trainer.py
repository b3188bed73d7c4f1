"""The one training loop every algorithm runs; an Objective supplies its batches and its loss.

State lives as nnx.State pytrees split from one Decoder: the trainable params (nnx.Param, or only
the nnx.LoRAParam adapters), the RNG streams (LoRA dropout), the frozen params and the rest
(quantized weights). One jitted step takes the params, optimizer state and RNGs donated, scans
over the gradient-accumulation micro-batches, clips, applies AdamW, and skips the update when the
loss or gradient is not finite (the host then stops with a clear message). Every loss is a sum
with a weight (tokens or pairs), so accumulation splits never change the result.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

from tunix_rt.models.decoder import Decoder, Embed, HeadParam, record_router_logits
from tunix_rt.models.layer_stack import as_bits
from tunix_rt.models.lora import apply_lora, has_lora
from tunix_rt.models.qat import enable_qat, fake_quant
from tunix_rt.models.quant_layers import QuantEmbed, set_int8_rows
from tunix_rt.ops.bf16_matmul import bf16_dot_general
from tunix_rt.ops.moe import load_balancing_loss, router_z_loss
from tunix_rt.parallel.mesh import batch_sharding, make_mesh, put_global, state_shardings
from tunix_rt.train.checkpointing import Checkpointer
from tunix_rt.train.config import TrainConfig
from tunix_rt.train.data import DataOrder, harmonized_lengths
from tunix_rt.train.errors import TrainingError, TrainingInterrupted
from tunix_rt.train.interrupt import StopOnInterrupt
from tunix_rt.train.metrics import MetricsWriter
from tunix_rt.train.rollout_engine import RolloutEngine

log = logging.getLogger("tunix_rt.train")


def is_extreme_metric(name: str) -> bool:
    """Metrics named *_max or *_min are extremes (combined by max or min, never divided); the others are sums
    over weight units."""
    return name.endswith(("_max", "_min"))


def combine_metrics(a: dict, b: dict) -> dict:
    """Two micro-batches' (or eval batches') metrics as one: sums added, extremes taken; a key only one has is
    kept."""
    out = dict(a)
    for k, v in b.items():
        if k not in a:
            out[k] = v
        elif is_extreme_metric(k):
            out[k] = (jnp.maximum if k.endswith("_max") else jnp.minimum)(a[k], v)
        else:
            out[k] = a[k] + v
    return out


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInputs:
    """What a jitted step reads besides the weights and the batch, each field with one owner: the objective's own
    arrays (`Objective.aux`) and the reference policy's weights the trainer keeps (None where the reference is
    the LoRA-disabled base, or none is needed)."""

    aux: Any
    reference: Any


@dataclasses.dataclass
class LossContext:
    """What an objective's loss sees inside the jitted step."""

    policy: Decoder
    aux: Any  # the objective's own arrays (a teacher's or DPO reference's weights), passed in, never baked in
    reference: Callable[[], Decoder]  # frozen policy: the LoRA-disabled base, or the initial weights


class Objective(Protocol):
    """What every objective gives the trainer core: its items, its loss and what the loss reads."""

    num_items: int  # examples (or packed rows, or pairs, or prompts) in the dataset
    needs_reference: bool
    # The engine it samples through (rollout_engine.RolloutEngine: on-policy and RL objectives), or None. The
    # trainer binds its current weights to it and begins each rollout with the step's index.
    rollout: RolloutEngine | None

    def loss(self, ctx: LossContext, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
        """(loss summed over weight units, weight, metrics summed over the same units). A metric whose name ends
        in "_max" ("_min") is a maximum (minimum) instead: combined over micro-batches by max (min) and reported
        as it is."""

    def aux(self) -> Any:
        """Extra state the loss reads (a pytree of arrays), or None."""

    def precompute(self, score: Callable[[Callable, Any], list]) -> None:
        """Before training: compute what stays fixed per item (DPO's reference log-probs) with
        `score(fn, objective)`, which runs fn(LossContext, batch) over every batch of the objective's
        items and returns the host results per batch; most objectives have nothing to do."""


class DatasetObjective(Objective, Protocol):
    """An objective whose batches are built from its dataset's items (SFT, DPO, distillation): the Trainer."""

    def batch_lengths(self, indices: np.ndarray) -> tuple[int, ...]:
        """The (bucketed) lengths of the batch axes these items need; a step's micro-batches use the largest."""

    def host_batch(self, indices: np.ndarray, valid: np.ndarray, lengths: tuple[int, ...]) -> dict[str, np.ndarray]:
        """Arrays for these items at `lengths`; rows with valid False must carry zero weight."""


class RolloutObjective(Objective, Protocol):
    """An objective whose batches are rollouts of its prompts (GRPO, PPO): the RLTrainer."""

    rollout: RolloutEngine

    def sample_batch(self, prompt_indices: np.ndarray) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """Rows (one packed row per group) and metrics from sampling these prompts through `rollout`."""

    def score(self, ctx: LossContext, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """What stays fixed over a rollout's iterations (reference or old log-probs, values), traced once."""


def set_compute_dtype(model: nnx.Module, dtype, *, matmul_kernel: str | None = None) -> None:
    """Layers compute in `dtype` (their params are cast on the way in; the masters stay f32). With a
    `matmul_kernel` ("ffi" or "xla", see ops/bf16_matmul.py) the bf16 products of the linear layers and
    the tied head run on bf16_matmul with f32 sums; without one, on XLA's dot as the layers call it."""
    dot_general = bf16_dot_general(matmul_kernel) if matmul_kernel is not None else jax.lax.dot_general
    for _, module in nnx.iter_modules(model):
        if isinstance(module, (nnx.Linear, nnx.Embed, Decoder, QuantEmbed)):
            module.dtype = jnp.dtype(dtype)
        if isinstance(module, (nnx.Linear, Embed)):
            module.dot_general = dot_general


def peak_rss_gb() -> float:
    """This process's peak resident memory so far, in GB (10^9 bytes; Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


@jax.jit
def _all_finite(tree) -> jax.Array:
    """Whether every float leaf of `tree` is finite, as one reduction on device (no leaf goes to the host)."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


def _last_good(last_saved: int | None) -> str:
    """Where a failed run's user can resume from: the last checkpoint, verified finite when it was saved."""
    return (f"the last good state is the checkpoint at step {last_saved}" if last_saved
            else "no good state was saved")


def _in_layers(path) -> bool:
    """Whether a state path is in the decoder's layer stack (not, say, a vision tower's layers)."""
    return bool(path) and getattr(path[0], "key", None) == "layers"


def _cast(tree, dtype, *, skip_layers: bool = False, layers_as_bits: bool = False):
    """f32 leaves at `dtype`; with skip_layers, the decoder layers' stay f32 (the layers cast their own inside
    the layer scan, models/decoder.py); with layers_as_bits (bf16 only), the decoder layers' float leaves are
    rounded to bf16 and held as the uint16 bits the layer scan reads (layer_stack.as_bits). Other leaves are
    passed through, never copied."""
    def cast(path, x):
        if _in_layers(path):
            if layers_as_bits and x.dtype in (jnp.float32, jnp.bfloat16):
                return _bf16_bits(x)
            if skip_layers:
                return x
        return x.astype(dtype) if x.dtype == jnp.float32 and dtype != jnp.float32 else x

    return jax.tree_util.tree_map_with_path(cast, tree)


@jax.jit
def _bf16_bits(x: jax.Array) -> jax.Array:
    """x rounded to bf16, as its uint16 bits: one pass making one array (XLA:CPU copies to bitcast)."""
    return as_bits(x.astype(jnp.bfloat16))


def decays(params):
    """Which parameters weight decay applies to: matrices, not vectors (norms, biases), reading a decoder layer's
    weight per layer (it leads with a layer-stack axis, models/layer_stack.py)."""
    def one(path, x):
        return x.ndim - _in_layers(path) > 1

    return jax.tree_util.tree_map_with_path(one, params)


def make_optimizer(cfg: TrainConfig, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW under a warmup then linear/cosine/constant schedule. Global-norm clipping is the step's own
    (`clip_factor`): taken with the mean over the batch's weight, it scales the gradients in place."""
    warmup = min(cfg.warmup_steps or int(cfg.warmup_ratio * total_steps), total_steps)
    decay = max(total_steps - warmup, 1)
    if cfg.lr_scheduler_type == "cosine":
        after = optax.cosine_decay_schedule(cfg.lr, decay)
    elif cfg.lr_scheduler_type == "linear":
        after = optax.linear_schedule(cfg.lr, 0.0, decay)
    else:
        after = optax.constant_schedule(cfg.lr)
    schedule = optax.join_schedules([optax.linear_schedule(0.0, cfg.lr, warmup), after], [warmup]) if warmup else after
    adamw = optax.adamw(schedule, b1=cfg.adam_beta1, b2=cfg.adam_beta2, eps=cfg.adam_epsilon,
                        weight_decay=cfg.weight_decay, mask=decays)
    return adamw, schedule


def clip_factor(grad_norm: jax.Array, max_norm: float | None) -> jax.Array:
    """What multiplies gradients of global norm `grad_norm` to clip them to `max_norm` (optax's
    clip_by_global_norm: unchanged below the bound, scaled onto it above)."""
    if not max_norm:
        return jnp.ones_like(grad_norm)
    return jnp.where(grad_norm < max_norm, 1.0, max_norm / grad_norm)


def note_program(seen: set[tuple], batch: dict) -> bool:
    """Record the batch signature (each array's name, shape and dtype) a jitted step runs on; True when it is new:
    the step compiles (or loads from the compilation cache) a program for it. Counted by signature, as the
    engine counts its programs by key: the jit's cache size once showed no new entry for a new trainer's first
    step in a full test run."""
    signature = tuple((k, tuple(v.shape), str(v.dtype)) for k, v in sorted(batch.items()))
    if signature in seen:
        return False
    seen.add(signature)
    return True


class Trainer:
    def __init__(self, cfg: TrainConfig, model: Decoder, objective: DatasetObjective, *, mesh=None,
                 reference: Decoder | None = None):
        """`reference`: for full fine-tuning, a frozen model computing what `model` computes at the start
        (its packed quantized weights as loaded, a seventh of the f32 copy the trainer makes otherwise)."""
        self.cfg = cfg
        self.objective = objective
        self.mesh = mesh if mesh is not None else make_mesh(cfg.fsdp, cfg.tp)
        fsdp = self.mesh.shape["fsdp"]
        if cfg.batch_size % fsdp:
            raise ValueError(f"batch_size ({cfg.batch_size}) must be a multiple of the fsdp mesh axis ({fsdp})")
        if objective.num_items < 1:
            raise ValueError("the dataset has no usable examples")
        self.steps = cfg.steps or self._steps_per_pass()
        self.lora = cfg.lora_rank > 0
        if self.lora and not has_lora(model):
            apply_lora(model, rank=cfg.lora_rank, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout,
                       targets=cfg.lora_targets, seed=cfg.seed)
        if cfg.qat is not None:
            count = enable_qat(model, fake_quant(cfg.qat, cfg.qat_group_size))
            log.info("qat=%s: %d weights trained through their %s quantization", cfg.qat, count, cfg.qat)
        self.compute_dtype = jnp.dtype(cfg.compute_dtype)
        self.inference_dtype = model.dtype  # what the model was loaded in: the rollout engine runs at it
        set_compute_dtype(model, self.compute_dtype, matmul_kernel=cfg.bf16_matmul_kernel)
        self._set_kernels(model)
        self.model_config = model.config
        model.remat = cfg.gradient_checkpointing
        # LoRA differentiates its adapters only (models/layer_stack.py): set for the steps' programs, and unset on
        # the caller's model and the one model() returns, which others may differentiate as they like.
        model.layers.constant_params = self.lora
        self.router_losses = any(model.config.moe_layers) and (cfg.router_aux_loss_coef > 0 or cfg.router_z_loss_coef > 0)
        # The layers cast their own f32 params to the compute dtype inside the layer scan (models/decoder.py), so
        # the weights enter the scan and their gradients leave it in f32: XLA:CPU stacks bf16 values over the
        # layers through f32 converts of the whole stack, for every layer. Except checkpointed layers whose
        # call changes their state (dropout's RNG, sown router logits): those go through nnx.remat, cast up front.
        through_nnx_remat = (self.lora and cfg.lora_dropout > 0) or self.router_losses
        self._layers_cast_themselves = not (cfg.gradient_checkpointing and through_nnx_remat)
        if cfg.gradient_checkpointing and through_nnx_remat:
            log.warning("gradient_checkpointing with %s recomputes through nnx.remat, which saves no memory on "
                        "XLA:CPU (models/remat.py)", "router losses" if self.router_losses else "lora_dropout")
        model.train()
        trainable = nnx.Any(nnx.LoRAParam, HeadParam) if self.lora else nnx.Param
        if not self.lora and not cfg.train_vision_tower:  # an image encoder stays as loaded unless asked
            trainable = nnx.All(nnx.Param, nnx.Not(nnx.PathContains("vision")))
        self.graphdef, params, rngs, frozen, rest = nnx.split(model, trainable, nnx.RngState, nnx.Param, ...)
        self.eval_graphdef = self._graphdef_in_eval_mode(model)
        model.layers.constant_params = False
        shard = lambda tree: put_global(tree, state_shardings(tree, self.mesh))
        self.params, self.rngs, self.frozen, self.rest = shard(params), shard(rngs), shard(frozen), shard(rest)
        # What the steps read of the frozen weights (a LoRA base), cast to the compute dtype once, not in every
        # step (those casts were 12 % of a bf16 LoRA step); self.frozen keeps the f32 masters for export. Where the
        # layers cast their own weights, one layer at a time inside the layer scan, their stacks stay the masters:
        # a bf16 copy held for the run cost the default model's bf16 LoRA step 0.25 GB of its 1.68 GB peak for
        # 3 % of its time (and, under checkpointing, its recomputation would stack every layer's weights). Where
        # they cannot (nnx.remat's), a bf16 base's layer stacks are held as the bits the layer scan reads
        # (models/layer_stack.py).
        bf16 = self.compute_dtype == jnp.bfloat16
        self.frozen_compute = (_cast(self.frozen, self.compute_dtype, skip_layers=True) if self._layers_cast_themselves else
                               _cast(self.frozen, self.compute_dtype, layers_as_bits=True) if bf16 and self.lora else
                               _cast(self.frozen, self.compute_dtype))
        # Where the layers cannot cast their trained weights (nnx.remat's), the steps differentiate a
        # compute-dtype copy, which the optimizer update writes beside the f32 masters it writes anyway.
        self._compute_copy = bf16 and not self._layers_cast_themselves and not self.lora
        self.params_compute = self._cast_params(self.params)
        param_shardings, rng_shardings = state_shardings(params, self.mesh), state_shardings(rngs, self.mesh)
        self.initial_params, self._reference_graphdef = None, None
        if objective.needs_reference and not self.lora:
            if reference is not None:
                set_compute_dtype(reference, self.compute_dtype, matmul_kernel=cfg.bf16_matmul_kernel)
                set_int8_rows(reference, 0)  # exact products, as the dequantized policy's
                reference.eval()
                self._reference_graphdef, reference_state = nnx.split(reference)
                self.initial_params = shard(reference_state)
            else:  # a frozen copy: the step donates self.params
                self.initial_params = jax.tree.map(jnp.copy, self.params)
        self.optimizer, self.schedule = make_optimizer(cfg, self.steps)
        # Optimizer moments follow the rules by their paths, which repeat the params' paths.
        opt_shardings = state_shardings(jax.eval_shape(self.optimizer.init, self.params), self.mesh)
        self.opt_state = jax.jit(self.optimizer.init, out_shardings=opt_shardings)(self.params)
        aux = objective.aux()
        self.aux = shard(aux) if aux is not None else None
        self.step = 0
        self.compiles = 0
        self._programs: set[tuple] = set()  # the batch signatures the train step has run on
        self._train_step = jax.jit(self._step, donate_argnums=(0, 1, 2, 3),
                                   out_shardings=(param_shardings, param_shardings if self._compute_copy else None,
                                                  opt_shardings, rng_shardings, None))
        self._eval_step = jax.jit(self._eval)
        self._score_fn = None
        self._planned_lengths: dict[int, tuple[int, ...]] | None = None
        self.data_order = DataOrder(objective.num_items, self._items_per_step(), seed=cfg.seed, shuffle=cfg.shuffle)
        if self._items_per_step() > objective.num_items:
            log.warning("each step takes %d items but the data holds %d: every step repeats items (a smaller "
                        "batch_size or gradient_accumulation_steps avoids it)", self._items_per_step(),
                        objective.num_items)
        if objective.rollout is not None:  # it samples from the model being trained
            objective.rollout.bind(self.inference_model)

    def _items_per_step(self) -> int:
        """Dataset items one optimizer step consumes."""
        return self.cfg.batch_size * self.cfg.gradient_accumulation_steps

    def _steps_per_pass(self) -> int:
        """Optimizer steps in one pass over the data (the default number of steps)."""
        return math.ceil(self.objective.num_items / self._items_per_step())

    def _epoch(self, steps_done: int) -> float:
        """Passes over the data that `steps_done` steps made."""
        return self.data_order.epoch(steps_done)

    def _set_kernels(self, model) -> None:
        """A subclass's last word on the kernels the model computes with, before it is split (RL's exact mode)."""

    @staticmethod
    def _graphdef_in_eval_mode(model: nnx.Module):
        model.eval()
        graphdef = nnx.graphdef(model)
        model.train()
        return graphdef

    def _cast_params(self, params):
        """The compute-dtype copy of the trained weights the steps differentiate (None: they read the masters)."""
        return _cast(params, self.compute_dtype) if self._compute_copy else None

    # --- the jitted programs ---------------------------------------------------------------------

    def _model(self, graphdef, params, rngs, frozen, rest) -> Decoder:
        skip = self._layers_cast_themselves
        return nnx.merge(graphdef, _cast(params, self.compute_dtype, skip_layers=skip or self.lora), rngs,
                         _cast(frozen, self.compute_dtype, skip_layers=skip), rest)

    def _reference(self, graphdef, params, rngs, frozen, rest, inputs: StepInputs) -> Callable[[], Decoder]:
        def build():
            if self.lora:  # adapters at zero give back the base model exactly
                ref = jax.tree.map(jnp.zeros_like, params)
            elif self._reference_graphdef is not None:
                return nnx.merge(self._reference_graphdef, jax.lax.stop_gradient(inputs.reference))
            else:
                ref = inputs.reference
            return self._model(graphdef, jax.lax.stop_gradient(ref), rngs, frozen, rest)

        return build

    def _loss(self, params, rngs, frozen, rest, inputs: StepInputs, batch, graphdef):
        # Fresh containers for the RNG state, so dropout may advance its counters inside the
        # gradient trace (nnx refuses to mutate state created at an outer trace level).
        rngs = jax.tree.map(lambda x: x, rngs)
        model = self._model(graphdef, params, rngs, frozen, rest)
        reference = self._reference(graphdef, params, rngs, frozen, rest, inputs)
        run = lambda m: self.objective.loss(LossContext(m, inputs.aux, reference), batch)
        if self.router_losses:
            record_router_logits(model)
            (loss_sum, weight, metrics), recorded = nnx.capture(run, nnx.Intermediate)(model)
            loss_sum, metrics = self._add_router_losses(jax.tree.leaves(recorded), loss_sum, weight, metrics)
        else:
            loss_sum, weight, metrics = run(model)
        return loss_sum, (weight, metrics, nnx.state(model, nnx.RngState))

    def _add_router_losses(self, calls, loss_sum, weight, metrics):
        """MoE auxiliary losses (means over every router call the policy made), weighted like the
        objective's per-unit loss: added as coef * value * weight to a sum the step divides by the weight."""
        k = self.model_config.num_experts_per_tok
        aux = sum(load_balancing_loss(lg, jax.lax.top_k(lg, k)[1], lg.shape[-1]) for lg in calls) / len(calls)
        z = sum(router_z_loss(lg) for lg in calls) / len(calls)
        cfg = self.cfg
        loss_sum = loss_sum + (cfg.router_aux_loss_coef * aux + cfg.router_z_loss_coef * z) * weight
        return loss_sum, {**metrics, "router_aux_loss": aux * weight, "router_z_loss": z * weight}

    def _step(self, params, compute, opt_state, rngs, frozen, rest, inputs: StepInputs, batches):
        loss_grad = jax.value_and_grad(self._loss, has_aux=True)
        if compute is None:
            grad_fn = loss_grad
        else:  # differentiate the compute copy; the gradients are summed and applied in f32
            def grad_fn(params, *args):
                value, g = loss_grad(compute, *args)
                return value, jax.tree.map(lambda g, p: g.astype(p.dtype), g, params)

        def micro(carry, batch):
            grads, rngs, loss_sum, weight, metrics = carry
            (loss, (w, m, rngs)), g = grad_fn(params, rngs, frozen, rest, inputs, batch, self.graphdef)
            return (jax.tree.map(jnp.add, grads, g), rngs, loss_sum + loss, weight + w, combine_metrics(metrics, m)), None

        first = jax.tree.map(lambda x: x[0], batches)
        (loss, (w, m, rngs)), g = grad_fn(params, rngs, frozen, rest, inputs, first, self.graphdef)
        rest_batches = jax.tree.map(lambda x: x[1:], batches)
        (grads, rngs, loss_sum, weight, metrics), _ = jax.lax.scan(micro, (g, rngs, loss, w, m), rest_batches)
        denom = jnp.maximum(weight, 1e-9)
        loss = loss_sum / denom
        grad_norm = optax.global_norm(grads) / denom
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        # The mean over the weight and the clipping in one multiply, outside the cond: it rewrites the
        # gradients in place, where a clip inside the cond would write a second copy of them.
        factor = clip_factor(grad_norm, self.cfg.max_grad_norm) / denom
        grads = jax.tree.map(lambda x: x * factor.astype(x.dtype), grads)

        def update(state):
            params, _, opt_state = state
            updates, new_opt = self.optimizer.update(grads, opt_state, params)
            new_params = optax.apply_updates(params, updates)
            return new_params, self._cast_params(new_params), new_opt

        # A cond, not a select of new against old state: only the taken branch runs, so the update writes
        # into the donated buffers instead of holding a second copy of the params and Adam's moments.
        new_params, new_compute, new_opt = jax.lax.cond(finite, update, lambda state: state,
                                                        (params, compute, opt_state))
        out = {"loss": loss, "grad_norm": grad_norm, "weight": weight,
               **{k: v if is_extreme_metric(k) else v / denom for k, v in metrics.items()}}
        return new_params, new_compute, new_opt, rngs, out

    def _eval(self, params, rngs, frozen, rest, inputs: StepInputs, batch):
        loss_sum, (weight, metrics, _) = self._loss(params, rngs, frozen, rest, inputs, batch, self.eval_graphdef)
        return loss_sum, weight, metrics

    # --- host side ---------------------------------------------------------------------------------

    def _inputs(self) -> StepInputs:
        return StepInputs(self.aux, self.initial_params)

    def _device_batch(self, host: dict[str, np.ndarray], batch_axis: int) -> dict[str, jax.Array]:
        return {key: put_global(value, batch_sharding(self.mesh, value.ndim, batch_axis)) for key, value in host.items()}

    def _micro_batches(self, step: int) -> list[np.ndarray]:
        return np.split(self.data_order.indices(step), self.cfg.gradient_accumulation_steps)

    def _needed_lengths(self, step: int) -> tuple[int, ...]:
        """The bucketed lengths the step's largest micro-batch needs (they all take one shape)."""
        return tuple(np.max([self.objective.batch_lengths(idx) for idx in self._micro_batches(step)], axis=0).tolist())

    def _step_lengths(self, step: int) -> tuple[int, ...]:
        """The step's batch lengths: its row-length bucket, and the other axes (the head window) as large as any
        step of this run with that bucket needs, planned once from the data order (a pure function of the step)
        so a run compiles one train step per row-length bucket."""
        if self._planned_lengths is None:
            self._planned_lengths = harmonized_lengths([self._needed_lengths(s) for s in range(self.steps)])
        need = self._needed_lengths(step)
        return self._planned_lengths.get(need[0], need)

    def train_batch(self, step: int) -> dict[str, jax.Array]:
        """(accumulation, rows, ...) arrays: one host batch per micro-batch, at the step's lengths, stacked."""
        lengths = self._step_lengths(step)
        if self.objective.rollout is not None:
            self.objective.rollout.begin(step)
        hosts = [self.objective.host_batch(idx, np.ones(len(idx), bool), lengths) for idx in self._micro_batches(step)]
        return self._device_batch({k: np.stack([h[k] for h in hosts]) for k in hosts[0]}, 1)

    def run_step(self, step: int) -> dict[str, float]:
        batch = self.train_batch(step)
        sampled = self._end_rollout()  # before the step: an engine asked to sleep frees its KV cache for it
        self.params, self.params_compute, self.opt_state, self.rngs, out = self._train_step(
            self.params, self.params_compute, self.opt_state, self.rngs, self.frozen_compute, self.rest, self._inputs(),
            batch)
        if note_program(self._programs, batch):
            self.compiles += 1
            log.info("compiled the train step for batch shape %s (%d so far)",
                     {k: v.shape for k, v in batch.items() if k in ("tokens", "head_index")}, self.compiles)
        out = {k: float(v) for k, v in jax.device_get(out).items()}
        if self.objective.rollout is not None:
            self.objective.rollout.weights_changed()
        out.update(sampled)
        out["learning_rate"] = float(self.schedule(step))
        out["compiles"] = float(self.compiles)
        out["memory/peak_rss_gb"] = peak_rss_gb()
        return out

    def _end_rollout(self) -> dict[str, float]:
        """Ends the step's rollout where the objective samples: its engine sleeps now if the run asks, and the
        step's sampling times (time/sync, time/rollout) are returned."""
        return self.objective.rollout.finish() if self.objective.rollout is not None else {}

    def _walk(self, objective: DatasetObjective):
        """Device batches over every item in order, batch_size at a time (the last padded with weightless rows),
        their lengths harmonized as the train steps' are."""
        b = self.cfg.batch_size
        batches = []
        for start in range(0, objective.num_items, b):
            idx = np.arange(start, start + b)
            valid = idx < objective.num_items
            batches.append((np.where(valid, idx, 0), valid))
        planned = harmonized_lengths([objective.batch_lengths(idx) for idx, _ in batches])
        for idx, valid in batches:
            lengths = planned[objective.batch_lengths(idx)[0]]
            yield self._device_batch(objective.host_batch(idx, valid, lengths), 0)

    def score(self, fn: Callable, objective: DatasetObjective) -> list:
        """fn(LossContext, batch) over every batch of `objective`'s items with the current params (eval mode, no
        gradient), as host arrays per batch; a progress bar shows the pass."""
        if self._score_fn is None:
            self._score_fn = jax.jit(self._scored, static_argnums=0)
        batches = tqdm(self._walk(objective), total=-(-objective.num_items // self.cfg.batch_size), desc="precompute",
                       unit="batch", file=sys.stderr, disable=not (self.cfg.progress and jax.process_index() == 0),
                       dynamic_ncols=True)
        args = (self.params, self.rngs, self.frozen_compute, self.rest, self._inputs())
        return [jax.device_get(self._score_fn(fn, *args, batch)) for batch in batches]

    def _scored(self, fn, params, rngs, frozen, rest, inputs: StepInputs, batch):
        model = self._model(self.eval_graphdef, params, rngs, frozen, rest)
        return fn(LossContext(model, inputs.aux, self._reference(self.eval_graphdef, params, rngs, frozen, rest, inputs)),
                  batch)

    def evaluate(self, eval_objective: DatasetObjective) -> dict[str, float]:
        """Mean loss (and metrics) over the whole eval set; the last batch is padded with weightless rows."""
        totals, weight = {}, 0.0
        for batch in self._walk(eval_objective):
            loss_sum, w, metrics = jax.device_get(self._eval_step(self.params, self.rngs, self.frozen_compute, self.rest,
                                                                  self._inputs(), batch))
            weight += float(w)
            totals = combine_metrics(totals, {"loss": float(loss_sum), **{k: float(v) for k, v in metrics.items()}})
        return {f"eval_{k}": v if is_extreme_metric(k) else v / max(weight, 1e-9) for k, v in totals.items()}

    def state(self) -> dict:
        return {"params": self.params, "opt_state": self.opt_state, "rngs": self.rngs}

    def state_is_finite(self) -> bool:
        """Whether every float leaf of the params and optimizer state is finite: checked before a state is
        saved or called good, since a finite loss says nothing of the update that followed it."""
        return bool(_all_finite((self.params, self.opt_state)))

    def load_state(self, state: dict) -> None:
        self.params, self.opt_state, self.rngs = state["params"], state["opt_state"], state["rngs"]
        self.params_compute = self._cast_params(self.params)

    def release_optimizer(self) -> None:
        """After the last step: drop the optimizer's moments (twice the params), so the export's host
        copies of the model take their place instead of adding to the run's peak memory."""
        self.opt_state = None

    def model(self) -> Decoder:
        """The current model (eval mode, params in f32) for export or generation."""
        model = nnx.merge(self.eval_graphdef, self.params, self.rngs, self.frozen, self.rest)
        model.layers.constant_params = False
        return model

    def inference_model(self) -> Decoder:
        """The current model as a rollout engine runs it. Where bf16 training runs on XLA's bf16 dots
        (the "xla" kernel: native on AMX CPUs), the engine samples in bf16 too: the float params cast
        once here, half the bytes each decode step streams. Elsewhere at the dtype the model was loaded
        in, on XLA's dot: XLA would widen bf16 weights to f32 on every decode step of a few rows."""
        model = self.model()
        if self.cfg.bf16_matmul_kernel == "xla":
            nnx.update(model, _cast(nnx.state(model, nnx.Param), jnp.bfloat16))
            set_compute_dtype(model, jnp.bfloat16, matmul_kernel="xla")
        else:
            set_compute_dtype(model, self.inference_dtype)
        return model

    def fit(self, *, output: str | Path, eval_objective: DatasetObjective | None = None,
            stop_after: int | None = None, resumed_with: dict | None = None) -> list[dict]:
        """Train to cfg.steps (resuming from output/checkpoints when cfg.resume); returns the records.

        A resume is recorded in metrics.jsonl as a "resumed" event with `resumed_with`, the options it changed
        (run.check_resumed_options). `stop_after` ends the run early at that step (tests use it to simulate an
        interruption).
        """
        cfg, output = self.cfg, Path(output)
        main = jax.process_index() == 0
        checkpointer = Checkpointer(output / "checkpoints", max_to_keep=cfg.save_total_limit)
        latest = checkpointer.latest_step()
        if latest is not None and not cfg.resume:
            checkpointer.close()
            raise ValueError(f"{checkpointer.directory} holds checkpoints of an earlier run (up to step {latest}); "
                             "resume=false would mix the two runs: give --overwrite to start over in place, or choose another "
                             "--output")
        if eval_objective is not None and eval_objective.rollout is not None:
            eval_objective.rollout.bind(self.inference_model)
        for objective in (self.objective, eval_objective):
            if objective is not None:
                objective.precompute(self.score)
        if self.initial_params is not None and not any(o is not None and o.needs_reference
                                                       for o in (self.objective, eval_objective)):
            self.initial_params = None  # what the reference gave is precomputed: free the copy of the weights
        if latest is not None:
            state, record = checkpointer.restore(latest, self.state())
            self.load_state(state)
            self.step = record["step"]
            log.info("resumed from %s at step %d", checkpointer.directory, self.step)
        writer = MetricsWriter(output, resume_step=self.step) if main else None
        if writer is not None and latest is not None:
            writer.event(self.step, "resumed", changed=resumed_with or {})
        records = []
        bar = tqdm(total=self.steps, initial=self.step, desc="train", unit="step", file=sys.stderr,
                   disable=not (cfg.progress and main), dynamic_ncols=True)
        last_saved = latest
        try:
            with StopOnInterrupt() as interrupt:
                while self.step < self.steps and (stop_after is None or self.step < stop_after):
                    if interrupt.requested:  # the first Ctrl-C, at a step boundary
                        raise KeyboardInterrupt
                    start = time.perf_counter()
                    out = self.run_step(self.step)
                    if not (math.isfinite(out["loss"]) and math.isfinite(out["grad_norm"])):
                        if self.step == 0:
                            kept = "nothing was saved (no step had succeeded)"
                        elif last_saved == self.step:  # verified finite when it was saved
                            kept = f"the last good state is saved at step {self.step}"
                        elif self.state_is_finite():  # keep the last good state
                            checkpointer.save(self.step, self.state(), {"step": self.step})
                            kept = f"the last good state is saved at step {self.step}"
                        else:  # a finite loss at step N does not make N's update finite (learning_rate=inf)
                            kept = (f"the state after step {self.step} is not finite either, so it was not saved; "
                                    f"{_last_good(last_saved)}")
                        raise TrainingError(
                            f"step {self.step + 1}: the loss ({out['loss']}) or gradient norm ({out['grad_norm']}) is not "
                            f"finite, so training stopped; the update was skipped and {kept}. Lower learning_rate, set "
                            "max_grad_norm, or check the data.")
                    self.step += 1
                    out["step_time"] = time.perf_counter() - start
                    out["epoch"] = self._epoch(self.step)
                    if eval_objective is not None and cfg.eval_steps and self.step % cfg.eval_steps == 0:
                        out.update(self.evaluate(eval_objective))
                    records.append({"step": self.step, **out})
                    if writer is not None and (self.step % cfg.logging_steps == 0 or self.step == self.steps):
                        writer.write(self.step, out)
                    bar.update(1)
                    bar.set_postfix(loss=f"{out['loss']:.4f}")
                    if self.step % cfg.save_steps == 0 or self.step == self.steps:
                        if not self.state_is_finite():  # never saved, so a checkpoint is always a good state
                            raise TrainingError(
                                f"step {self.step}: its loss was finite but its update left non-finite parameters "
                                f"or optimizer state, so training stopped without saving it; "
                                f"{_last_good(last_saved)}. Lower learning_rate, set max_grad_norm, or check the data.")
                        checkpointer.save(self.step, self.state(), {"step": self.step})
                        last_saved = self.step
        except KeyboardInterrupt:  # at a step boundary, or a second Ctrl-C wherever it lands
            resumes = (f"the checkpoint at step {last_saved} is kept: re-run the same command to resume"
                       if last_saved else "no checkpoint was saved yet")
            raise TrainingInterrupted(f"interrupted at step {self.step + 1} of {self.steps}; {resumes}") from None
        finally:
            bar.close()
            checkpointer.close()
            if writer is not None:
                writer.close()
        return records
