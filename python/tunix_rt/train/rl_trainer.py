"""The RL loop (GRPO, PPO) on the one trainer core: rollouts from the embedded engine feed the jitted step.

Every num_iterations optimizer steps a new rollout runs:
1. rollout: the objective samples the step's prompts G times each through its RolloutEngine (which
   first takes the trainer's current weights in place: LoRA applied, no copy through disk, no recompile;
   woken first if it sleeps between rollouts) and scores them with the reward functions, then turns them
   into fixed-shape rows (advantages for GRPO);
2. reference: one jitted scoring pass adds what stays fixed over the iterations (reference log-probs,
   old log-probs or values, GAE for PPO);
3. train: num_iterations optimizer steps on that batch, each the trainer core's jitted step.
The prompt order is a pure function of the step (as the trainer core's data order), so a run resumes
from its checkpoints; save_steps is a multiple of num_iterations, so a resumed run starts on a rollout.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from tunix_rt.engine.sampler import log_softmax, tempered_logits
from tunix_rt.models.batch_invariant import unavailable_reason, use_batch_invariant_kernels
from tunix_rt.models.decoder import head_logits
from tunix_rt.models.kv_cache import ExactPagedLayout
from tunix_rt.train.config import RLConfig
from tunix_rt.train.group_packing import pack_groups
from tunix_rt.train.rl_losses import sampling_correction
from tunix_rt.train.rollout_engine import RolloutEngine, rollout_config
from tunix_rt.train.trainer import LossContext, StepInputs, Trainer, is_extreme_metric, note_program

_CORE_KEYS = frozenset({"loss", "grad_norm", "weight", "learning_rate"})  # what the trainer core's step reports


def completion_hidden(model, batch: dict, *, block_size: int | None = None) -> jax.Array:
    """(N, C, D) final hidden states at the completion window: entry j predicts completion token j.

    The rows are packed groups (group_packing.pack_groups): completion i lives in row i // G. With
    `block_size` (the exact mode) the rows run as the engine ran them: paged_hidden.
    """
    if block_size is None:
        h, _ = model.hidden_states(batch["tokens"], batch["positions"], segment_ids=batch["segment_ids"])
    else:
        h = paged_hidden(model, batch, block_size)
    index = batch["completion_index"]
    rows = jnp.arange(index.shape[0]) // (index.shape[0] // h.shape[0])
    return h[rows[:, None], index]


def paged_hidden(model, batch: dict, block_size: int) -> jax.Array:
    """(R, L, D) hidden states of the packed rows computed through a paged KV cache laid out as the engine's
    (group_packing.paged_layout): every token packed into one (1, R * L) step, attention by the engine's
    paged_attention over blocks of the engine's size, so each query sums its keys in the engine's order. The
    gradient goes through the training attention over the packed rows (kv_cache._exact_attention)."""
    tokens = batch["tokens"]
    rows, length = tokens.shape
    g = batch["paged_tables"].shape[0] // rows
    width = batch["paged_tables"].shape[1]
    per_row = (1 + g) * width  # blocks a row owns
    row = jnp.arange(rows)[:, None]

    def to_global(local, blocks_per_row, stride):
        return jnp.where(local >= 0, local + row * blocks_per_row * stride, -1).reshape(-1)

    slots = to_global(batch["paged_slots"], per_row, block_size)
    seq = to_global(batch["paged_seq"], g, 1)
    tables = batch["paged_tables"] + (jnp.arange(rows * g) // g * per_row)[:, None]
    copy_src = (batch["paged_copy_src"] + row * length).reshape(-1)
    copy_slots = to_global(batch["paged_copy_slots"], per_row, block_size)
    cache = ExactPagedLayout(slots, seq, tables, copy_src, copy_slots, batch["segment_ids"], num_blocks=rows * per_row,
                             block_size=block_size, dtype=model.dtype)
    h, _ = model.hidden_states(tokens.reshape(1, -1), batch["positions"].reshape(1, -1), cache)
    return h.reshape(rows, length, -1)


def completion_logprobs(model, batch: dict, temperature: float, *, entropy: bool = False,
                        hidden: jax.Array | None = None, block_size: int | None = None
                        ) -> tuple[jax.Array, jax.Array | None]:
    """(N, C) tempered log-probs of the completion tokens (and their entropy) under softmax(logits / temperature),
    the distribution sampled from, through the fused chunked head: no (N, C, vocab) logits are formed.
    `hidden` reuses completion_hidden's output when the caller has it. With `block_size` (the exact mode) the
    head and the log-probs are the engine's: full logits from its output head, then the sampler's
    tempered_logits and log_softmax, so the numbers equal the engine's bit for bit."""
    h = completion_hidden(model, batch, block_size=block_size) if hidden is None else hidden
    if block_size is None:
        return model.token_logprobs(h, batch["targets"], temperature=temperature, entropy=entropy)
    n, c, d = h.shape
    logits = head_logits(model.config, model.output_head(), h.reshape(n * c, d))
    # the temperature as a run-time value, as the engine's is: a constant divisor would become a reciprocal
    t = jax.lax.optimization_barrier(jnp.full((n * c,), temperature, jnp.float32))
    off = jnp.zeros((n * c,), jnp.int32)
    logps = log_softmax(tempered_logits(logits, t, off, jnp.ones_like(t), jnp.zeros_like(t)))
    token = jnp.take_along_axis(logps, batch["targets"].reshape(-1, 1), axis=-1).reshape(n, c)
    ent = -(jnp.exp(logps) * logps).sum(-1).reshape(n, c) if entropy else None
    return token, ent


class RLObjective:
    """What GRPO and PPO share: prompts as items, G rows per prompt, a rollout per batch, token metrics.

    A rollout objective of the trainer's protocol (trainer.RolloutObjective): subclasses give `sample_batch`
    (host: prompts -> completions through `self.rollout` -> rows), `score` (traced once per rollout) and `loss`.
    """

    needs_reference = False

    def __init__(self, cfg: RLConfig, sampler, tokenizer, pad_id: int):
        if cfg.exact_on_policy and (why := unavailable_reason()):
            raise ValueError(f"exact_on_policy=true needs the row-invariant CPU kernels, and {why}; run without it "
                             "(importance_sampling_correction weighs out the engine/trainer mismatch, and the "
                             "mismatch/* metrics record it)")
        self.cfg, self.sampler, self.tokenizer, self.pad_id = cfg, sampler, tokenizer, pad_id
        self.num_items = len(sampler.examples)
        rows = cfg.batch_size * cfg.gradient_accumulation_steps
        self.rollout = RolloutEngine(tokenizer, rollout_config(
            cfg.rollout, decode_and_prefill_buckets=True, max_model_len=sampler.max_model_len, max_num_seqs=rows,
            max_num_batched_tokens=max(512, rows), kv_cache_memory=256 << 20, seed=cfg.seed,
            logprobs_mode="processed_logprobs"),
            seed=cfg.seed, sleep=cfg.sleep_engine)

    @property
    def exact_block_size(self) -> int | None:
        """The engine's KV block size when the trainer computes as the engine does (exact_on_policy), else None."""
        return self.rollout.config.block_size if self.cfg.exact_on_policy else None

    def logprobs(self, model, batch: dict, *, entropy: bool = False, hidden: jax.Array | None = None):
        """completion_logprobs at the run's temperature, the engine's way in the exact mode."""
        return completion_logprobs(model, batch, self.cfg.temperature, entropy=entropy, hidden=hidden,
                                   block_size=self.exact_block_size)

    def hidden(self, model, batch: dict) -> jax.Array:
        return completion_hidden(model, batch, block_size=self.exact_block_size)

    def pack(self, completions, seq_len: int) -> dict:
        return pack_groups(completions, self.cfg, seq_len, self.pad_id, block_size=self.exact_block_size)

    def aux(self):
        return None

    def precompute(self, score) -> None:
        pass  # what stays fixed per rollout is scored after each rollout (RLTrainer._score)

    @staticmethod
    def mismatch(logps: jax.Array, sampler_logps: jax.Array, mask: jax.Array) -> tuple[dict, dict]:
        """How far the engine's sampling is from the policy trained, on the sampled tokens: the trainer's tempered
        log-probs against the engine's log-probs of the distribution it drew from (processed_logprobs). Returns
        (per-token metrics for token_sums: |difference| and the k3 estimate of KL(sampler || trainer), whose mean
        over sampled tokens is unbiased), and the largest |difference| (a *_max metric). Meaningful on a rollout's
        first step only, before the policy moves (RLTrainer reports them then)."""
        diff = jax.lax.stop_gradient(logps) - sampler_logps  # log of r = p_trainer / p_sampler
        per_token = {"mismatch/logp_abs_mean": jnp.abs(diff), "mismatch/kl": jnp.expm1(diff) - diff}
        return per_token, {"mismatch/logp_abs_max": jnp.max(jnp.where(mask > 0, jnp.abs(diff), 0.0))}

    def sampling_weights(self, trainer_logps: jax.Array, batch: dict, mask: jax.Array) -> tuple[jax.Array, dict, dict]:
        """The run's importance sampling over the mismatch (rl_losses.sampling_correction): the (B, T) weights of
        the policy loss, their per-token metrics and their extremes. `trainer_logps`: the policy's log-probs of the
        sampled tokens at rollout time."""
        cfg = self.cfg
        return sampling_correction(trainer_logps, batch["sampler_logps"], mask, mode=cfg.importance_sampling_mode,
                                   cap=cfg.importance_sampling_cap)

    @staticmethod
    def token_sums(metrics: dict[str, jax.Array], mask: jax.Array) -> dict[str, jax.Array]:
        """Per-token metrics summed over the counted tokens, with their count ("tokens"): the host divides,
        so each is a token mean whatever unit the loss is aggregated in."""
        m = mask.astype(jnp.float32)
        return {"tokens": m.sum(), **{k: (v.astype(jnp.float32) * m).sum() for k, v in metrics.items()}}


class RLTrainer(Trainer):
    def __init__(self, cfg: RLConfig, model, objective: RLObjective, *, mesh=None, reference=None):
        if cfg.eval_data:
            raise ValueError("eval_data is not supported for grpo/ppo (the rewards are the evaluation)")
        super().__init__(cfg, model, objective, mesh=mesh, reference=reference)
        groups = cfg.batch_size // cfg.num_generations
        if groups % self.mesh.shape["fsdp"]:
            raise ValueError(f"batch_size / num_generations ({groups} groups, one packed row each) must be a multiple "
                             f"of the fsdp mesh axis ({self.mesh.shape['fsdp']})")
        self._score_step = jax.jit(self._score)
        self._rollout: tuple[int, dict, dict] | None = None  # (rollout index, device batch, host metrics)
        self.score_compiles = 0
        self._score_programs: set[tuple] = set()

    def _set_kernels(self, model) -> None:
        if self.cfg.exact_on_policy:  # the trainer's products summed as the engine's (models/batch_invariant.py)
            use_batch_invariant_kernels(model)

    # --- how the data is walked: prompts per step, num_iterations steps per rollout ------------------

    def _items_per_step(self) -> int:
        return self.cfg.prompts_per_step

    def _steps_per_pass(self) -> int:
        return super()._steps_per_pass() * self.cfg.num_iterations

    def _epoch(self, steps_done: int) -> float:
        return self.data_order.epoch(-(-steps_done // self.cfg.num_iterations))

    # --- the scoring pass --------------------------------------------------------------------------

    def _score(self, params, rngs, frozen, rest, inputs: StepInputs, batches):
        def one(batch):
            model = self._model(self.eval_graphdef, params, rngs, frozen, rest)
            ref = self._reference(self.eval_graphdef, params, rngs, frozen, rest, inputs)
            return self.objective.score(LossContext(model, inputs.aux, ref), batch)

        return jax.lax.map(one, batches)

    def _end_rollout(self) -> dict[str, float]:
        return {}  # each rollout ends in _new_rollout; its times are reported with its metrics

    def num_compiles(self) -> int:
        """Programs compiled so far: train step, scoring pass and the engine's step programs."""
        return self.compiles + self.score_compiles + self.objective.rollout.num_compiles

    # --- one step ------------------------------------------------------------------------------------

    def _new_rollout(self, index: int) -> tuple[dict, dict]:
        self.objective.rollout.begin(index)
        host, metrics = self.objective.sample_batch(self.data_order.indices(index))
        times = self.objective.rollout.finish()
        start = time.perf_counter()
        accum = self.cfg.gradient_accumulation_steps
        batch = self._device_batch({k: v.reshape(accum, -1, *v.shape[1:]) for k, v in host.items()}, 1)
        scored = self._score_step(self.params, self.rngs, self.frozen_compute, self.rest, self._inputs(), batch)
        if note_program(self._score_programs, batch):
            self.score_compiles += 1
        batch.update(jax.block_until_ready(scored))
        times["time/reference"] = time.perf_counter() - start
        return batch, {**metrics, **times}

    def train_batch(self, step: int) -> dict[str, jax.Array]:
        index = step // self.cfg.num_iterations
        if self._rollout is None or self._rollout[0] != index:
            self._rollout = (index, *self._new_rollout(index))
        return self._rollout[1]

    def run_step(self, step: int) -> dict[str, float]:
        fresh = self._rollout is None or self._rollout[0] != step // self.cfg.num_iterations
        batch_metrics = {}
        if fresh:
            self.train_batch(step)
            batch_metrics = self._rollout[2]
        start = time.perf_counter()
        out = super().run_step(step)
        tokens = out.pop("tokens")
        for name in set(out) - _CORE_KEYS:  # the objective's token sums, both divided by the same weight
            if not is_extreme_metric(name):
                out[name] = out[name] / tokens if tokens > 0 else 0.0
        if not fresh:  # the policy has moved since the rollout: no longer the sampler's
            out = {k: v for k, v in out.items() if not k.startswith("mismatch/")}
        out["time/train"] = time.perf_counter() - start
        out.update(batch_metrics)
        out["compiles"] = float(self.num_compiles())
        return out
