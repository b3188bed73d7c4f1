"""Training configs: kw_only dataclasses validated on construction, built from YAML + key=value.

Option names follow TRL's (learning_rate, per_device batch as batch_size, gradient_accumulation_steps,
max_length, packing, assistant_only_loss, beta, loss_type, ...), so a TRL user reads them at sight.
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from tunix_rt.models.lora import ALL_TARGETS
from tunix_rt.ops.bf16_matmul import KERNELS as MATMUL_KERNELS
from tunix_rt.ops.bf16_matmul import default_kernel
from tunix_rt.train.losses import PreferenceConfig

SCHEDULES = ("linear", "cosine", "constant")
# The most tokens a length option may ask for (2^20, past any model's context): a typo such as
# max_completion_length=1000000000 is refused with the config, not after the model has loaded.
MAX_TOKENS = 1 << 20
COMPUTE_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(kw_only=True)
class TrainConfig:
    """What every trainer shares: model, data, optimizer, precision, parallelism, outputs."""

    model: str = "default"
    data: str
    output: str
    eval_data: str | None = None
    steps: int | None = None  # None: one pass over the data
    batch_size: int = 8  # sequences per optimizer step and micro-batch
    gradient_accumulation_steps: int = 1
    max_length: int = 512
    learning_rate: float | None = None  # None: 2e-5 for full fine-tuning, 1e-4 with LoRA
    lr_scheduler_type: str = "linear"
    warmup_steps: int = 0
    warmup_ratio: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float | None = 1.0
    compute_dtype: str = "float32"  # bf16 compute keeps f32 master weights
    # bf16 compute's matmul kernel (ops/bf16_matmul.py): "ffi" tunix-rt's op, "xla" XLA's dot with f32 sums;
    # None: the faster one for this CPU (XLA's on AMX-BF16 CPUs, ours elsewhere)
    bf16_matmul: str | None = None
    seed: int = 42
    shuffle: bool = True
    lora_rank: int = 0  # 0: full fine-tuning
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_targets: tuple[str, ...] = ALL_TARGETS
    lora: str | None = None  # a peft LoRA adapter directory to start from: its rank, alpha and targets are the run's
    dequantize: bool | None = None  # None: keep a quantized base for LoRA (QLoRA), dequantize for full
    # quantization-aware training (models/qat.py): the forward sees each weight as the export will store it
    # (q8_0, q4_0, q4_1: `export --format gguf --quant`; int8, int4: `quantize`, qat_group_size), the gradient
    # passes straight through
    qat: str | None = None
    qat_group_size: int | None = None
    fsdp: int = -1  # mesh axis sizes; -1 takes the devices the other axis leaves
    tp: int = 1
    logging_steps: int = 1
    eval_steps: int | None = None
    save_steps: int = 100
    save_total_limit: int = 2
    resume: bool = True  # continue from the newest checkpoint in output/checkpoints
    overwrite: bool = False  # write into a non-empty directory that is not a run; with resume=false, start over
    export_dtype: str = "float32"
    save_merged: bool = False  # LoRA runs: DIR/final is the base with the adapter merged (else the adapter alone)
    router_aux_loss_coef: float = 0.0  # MoE models: Switch/Mixtral load-balancing loss weight (HF's name)
    router_z_loss_coef: float = 0.0  # MoE models: ST-MoE router z-loss weight
    gradient_checkpointing: bool = False  # recompute each decoder layer's activations in the backward pass
    train_vision_tower: bool = False  # a model with an image encoder: full fine-tuning trains it too (LoRA never)
    progress: bool = True
    coordinator_address: str | None = None  # multi-process (jax.distributed): host:port of process 0
    num_processes: int = 1
    process_id: int = 0

    def __post_init__(self):
        for name in ("batch_size", "gradient_accumulation_steps", "max_length", "logging_steps", "save_steps",
                     "save_total_limit"):
            _positive(self, name)
        for name in ("steps", "eval_steps"):
            if getattr(self, name) is not None:
                _positive(self, name)
        _at_most(self, "max_length", MAX_TOKENS)
        if self.lr_scheduler_type not in SCHEDULES:
            raise ValueError(f"lr_scheduler_type must be one of {', '.join(SCHEDULES)}, got {self.lr_scheduler_type!r}")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"compute_dtype must be one of {', '.join(COMPUTE_DTYPES)}, got {self.compute_dtype!r}")
        if self.export_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"export_dtype must be one of {', '.join(COMPUTE_DTYPES)}, got {self.export_dtype!r}")
        if self.learning_rate is not None and not (math.isfinite(self.learning_rate) and self.learning_rate > 0):
            raise ValueError(f"learning_rate must be a finite positive number, got {self.learning_rate}")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ValueError(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if self.warmup_steps < 0 or not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(f"warmup_steps and weight_decay must be >= 0 (and finite), got {self.warmup_steps} and "
                             f"{self.weight_decay}")
        if self.max_grad_norm is not None and not (math.isfinite(self.max_grad_norm) and self.max_grad_norm > 0):
            raise ValueError(f"max_grad_norm must be a finite positive number (or null to disable clipping), got "
                             f"{self.max_grad_norm}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if not (math.isfinite(self.adam_epsilon) and self.adam_epsilon > 0):
            raise ValueError(f"adam_epsilon must be a finite positive number, got {self.adam_epsilon}")
        for name in ("router_aux_loss_coef", "router_z_loss_coef"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if isinstance(self.bf16_matmul, bool) or self.bf16_matmul not in (None, *MATMUL_KERNELS):
            raise ValueError(f"bf16_matmul must be one of {', '.join(MATMUL_KERNELS)} (or null: the faster one for "
                             f"this CPU), got {self.bf16_matmul!r}")
        if self.bf16_matmul is not None and self.compute_dtype != "bfloat16":
            raise ValueError(f"bf16_matmul={self.bf16_matmul} needs compute_dtype=bfloat16 (f32 compute runs XLA's "
                             "f32 dot)")
        if self.lora_rank < 0:
            raise ValueError(f"lora_rank must be >= 0 (0 = full fine-tuning), got {self.lora_rank}")
        if self.fsdp == 0 or self.fsdp < -1 or self.tp < 1:
            raise ValueError(f"mesh axes: fsdp must be -1 or positive and tp positive, got fsdp={self.fsdp} tp={self.tp}")
        if self.num_processes > 1 and not self.coordinator_address:
            raise ValueError("num_processes > 1 needs coordinator_address (host:port of process 0)")
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"process_id must be in [0, num_processes), got {self.process_id}")
        if self.qat is not None:
            from tunix_rt.models.qat import fake_quant

            fake_quant(self.qat, self.qat_group_size)  # the format and group checked now, not at step 1
            if self.compute_dtype != "float32":
                raise ValueError("qat needs compute_dtype=float32: it trains against the exact weights the export "
                                 "writes, which bf16 compute would round first")
        elif self.qat_group_size is not None:
            raise ValueError("qat_group_size is set but qat is not")
        if self.lora is not None:
            self._adopt_adapter()
        if self.dequantize is None:
            self.dequantize = self.lora_rank == 0
        if self.lora_rank == 0 and not self.dequantize:
            raise ValueError("full fine-tuning needs float weights: set dequantize=true (or use lora_rank > 0)")
        self.lora_targets = tuple(self.lora_targets)

    def _adopt_adapter(self) -> None:
        """Training from an adapter: its rank, alpha and targets are the run's (a lora_rank that differs is refused)."""
        from tunix_rt.checkpoints.peft_adapter import adapter_targets, read_adapter_config

        adapter = read_adapter_config(self.lora)
        rank = int(adapter["r"])
        if self.lora_rank not in (0, rank):
            raise ValueError(f"lora_rank={self.lora_rank} differs from the rank {rank} of the adapter lora={self.lora}")
        self.lora_rank, self.lora_alpha, self.lora_targets = rank, float(adapter["lora_alpha"]), adapter_targets(self.lora)

    @property
    def bf16_matmul_kernel(self) -> str | None:
        """The kernel of the bf16 products (None with f32 compute)."""
        return (self.bf16_matmul or default_kernel()) if self.compute_dtype == "bfloat16" else None

    @property
    def lr(self) -> float:
        if self.learning_rate is not None:
            return self.learning_rate
        return 1e-4 if self.lora_rank else 2e-5


def _positive(cfg, name: str) -> None:
    value = getattr(cfg, name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _at_most(cfg, name: str, limit: int) -> None:
    value = getattr(cfg, name)
    if value is not None and value > limit:
        raise ValueError(f"{name} must be at most {limit}, got {value!r}")


def _check_prompt_length(cfg) -> None:
    """A preference config's max_prompt_length: None, or 1..MAX_TOKENS."""
    if cfg.max_prompt_length is not None:
        _positive(cfg, "max_prompt_length")
        _at_most(cfg, "max_prompt_length", MAX_TOKENS)


def _preference_lr(cfg) -> float:
    """DPO's and KTO's learning rate: the given one, else TRL's default (5e-5 with LoRA, 1e-6 full)."""
    if cfg.learning_rate is not None:
        return cfg.learning_rate
    return 5e-5 if cfg.lora_rank else 1e-6


@dataclasses.dataclass(kw_only=True)
class SFTConfig(TrainConfig):
    packing: bool = False
    assistant_only_loss: bool = True  # conversational rows: train on the assistant turns only
    completion_only_loss: bool = True  # prompt/completion rows: train on the completion only


@dataclasses.dataclass(kw_only=True)
class DPOConfig(TrainConfig, PreferenceConfig):
    """The preference loss's options (loss_type: sigmoid | ipo | hinge | robust | orpo | simpo, beta,
    label_smoothing, simpo_gamma) come from PreferenceConfig; the loss reads this config directly."""

    max_prompt_length: int | None = None
    ref_model: str | None = None  # None: the LoRA-disabled base with LoRA, the initial weights without
    precompute_ref_log_probs: bool = True  # the reference's log-probs once per pair up front, not in every step

    def __post_init__(self):
        super().__post_init__()
        self._check_preference()  # a bad loss_type, beta, ... fails here, before any model loads
        _check_prompt_length(self)

    @property
    def lr(self) -> float:  # TRL's DPO default is 1e-6 for full fine-tuning
        return _preference_lr(self)


@dataclasses.dataclass(kw_only=True)
class KTOConfig(TrainConfig):
    """TRL's KTOConfig (loss_type "kto"): unpaired rows {"prompt", "completion", "label"} (train/kto.py)."""

    beta: float = 0.1
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    max_prompt_length: int | None = None
    ref_model: str | None = None  # None: the LoRA-disabled base with LoRA, the initial weights without
    precompute_ref_log_probs: bool = True

    def __post_init__(self):
        super().__post_init__()
        for name in ("beta", "desirable_weight", "undesirable_weight"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf")):
                raise ValueError(f"{name} must be a positive finite number, got {value!r}")
        _check_prompt_length(self)

    @property
    def lr(self) -> float:  # TRL's KTO default is 1e-6 for full fine-tuning, as DPO's
        return _preference_lr(self)


@dataclasses.dataclass(kw_only=True)
class RewardConfig(TrainConfig):
    """TRL's RewardConfig: a reward model on preference pairs (train/reward.py)."""

    max_prompt_length: int | None = None
    center_rewards_coefficient: float | None = None  # TRL's: weight of mean((r_chosen + r_rejected)^2)

    def __post_init__(self):
        super().__post_init__()
        _check_prompt_length(self)
        c = self.center_rewards_coefficient
        if c is not None and not (isinstance(c, (int, float)) and not isinstance(c, bool) and 0 <= c < float("inf")):
            raise ValueError(f"center_rewards_coefficient must be a finite number >= 0 or None, got {c!r}")
        if self.lora_rank and not self.save_merged:  # the adapter alone would lack the trained score head
            self.save_merged = True


@dataclasses.dataclass(kw_only=True)
class RolloutOptions:
    """What runs that sample through the embedded engine share (GRPO, PPO, on-policy distillation)."""

    # Engine options (EngineConfig's names: kv_cache_memory, max_num_seqs, max_num_batched_tokens, block_size,
    # decode_steps, enable_prefix_caching, ...) over the sizing the run derives; rollout.NAME=VALUE sets one.
    rollout: dict | None = None
    sleep_engine: bool = False  # free the engine's KV cache while the trainer runs (memory-tight hosts)

    def _check_rollout(self) -> None:
        from tunix_rt.train.rollout_engine import check_rollout_section

        self.rollout = check_rollout_section(self.rollout)


@dataclasses.dataclass(kw_only=True)
class DistillConfig(TrainConfig, RolloutOptions):
    teacher: str
    temperature: float = 2.0
    alpha: float = 0.5  # alpha * T^2 * KL(teacher || student) + (1 - alpha) * CE
    top_k: int = 0  # 0: the full teacher distribution
    on_policy: bool = False  # the student samples completions through the rollout engine
    max_new_tokens: int = 64  # on-policy completion length

    def __post_init__(self):
        super().__post_init__()
        if self.qat is not None and self.on_policy:
            raise ValueError("qat with on_policy=true: the student's rollouts would sample the float weights, "
                             "off the fake-quantized policy it trains; use qat with on_policy=false")
        self._check_rollout()
        _positive(self, "max_new_tokens")
        _at_most(self, "max_new_tokens", MAX_TOKENS)
        if not self.temperature > 0:
            raise ValueError(f"temperature must be positive, got {self.temperature}")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")


def build_config(cls: type[TrainConfig], *, config_file: str | os.PathLike | None = None,
                 overrides: list[str] = (), **explicit: Any) -> TrainConfig:
    """cls from (lowest to highest precedence) a YAML file, `key=value` strings and explicit values."""
    values: dict[str, Any] = {}
    if config_file is not None:
        path = Path(config_file)
        try:
            loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
        except OSError as e:
            raise ValueError(f"cannot read config file {str(path)!r}: {e.strerror}") from None
        except yaml.YAMLError as e:
            raise ValueError(f"config file {str(path)!r} is not valid YAML: {e}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ValueError(f"config file {str(path)!r} must hold a mapping of option: value")
        values.update(loaded or {})
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r} must look like key=value")
        key = key.strip().replace("-", "_")
        value = yaml.safe_load(raw) if raw else None
        section, dot, field = key.partition(".")
        if dot:  # rollout.max_num_seqs=16: one entry of a section
            if not isinstance(values.get(section), (dict, type(None))):
                raise ValueError(f"override {item!r}: {section} is not a section")
            values[section] = {**(values.get(section) or {}), field: value}
        else:
            values[key] = value
    values.update({k: v for k, v in explicit.items() if v is not None})
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ValueError(f"unknown option(s) {', '.join(unknown)} for {cls.__name__}; valid: {', '.join(sorted(fields))}")
    hints = typing.get_type_hints(cls)
    checked = {name: _coerce(name, value, hints[name]) for name, value in values.items()}
    missing = [f.name for f in fields.values()
               if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and f.name not in checked]
    if missing:
        raise ValueError(f"missing required option(s): {', '.join(missing)}")
    return cls(**checked)


def _coerce(name: str, value: Any, hint) -> Any:
    """Check a value against a field's annotation; ints pass as floats, lists as tuples."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union else (hint,)
    if value is None:
        if type(None) in options:
            return None
        raise ValueError(f"option {name} cannot be null")
    for option in options:
        if option is float and isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                continue
        if option is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if option is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if option in (str, bool) and type(value) is option:
            return value
        if option is dict and isinstance(value, dict):
            return value
        if typing.get_origin(option) is tuple:
            item = typing.get_args(option)[0]
            items = [value] if isinstance(value, (str, int, float)) else value
            if not isinstance(items, (list, tuple)):
                continue
            try:
                return tuple(_coerce(f"{name} entry", v, item) for v in items)
            except ValueError:
                continue
    expected = " or ".join(str(o) if typing.get_origin(o) else o.__name__ for o in options if o is not type(None))
    raise ValueError(f"option {name} must be {expected}, got {value!r}")


ADVANTAGE_ESTIMATORS = ("grpo", "dr_grpo", "rloo")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
IMPORTANCE_LEVELS = ("token", "sequence")
SAMPLING_CORRECTION_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@dataclasses.dataclass(kw_only=True)
class RLConfig(TrainConfig, RolloutOptions):
    """What GRPO and PPO share: rollouts through the embedded engine, rewards, the clipped objective.

    batch_size counts completions (TRL's convention), so each step samples
    batch_size * gradient_accumulation_steps / num_generations prompts. Rows are as long as the longest
    prompt (cut to max_prompt_length) plus max_completion_length; max_length does not apply.
    """

    reward: tuple[str, ...] = ()  # built-in names or module:function (--reward, repeatable)
    reward_model: tuple[str, ...] = ()  # reward models (sequence classifiers) scoring completions (--reward-model)
    reward_weights: tuple[float, ...] | None = None  # one per reward, then one per reward model; None: all 1
    # Agentic RL (train/agentic.py): multi-turn trajectories acting on environments. `tool`: built-in names
    # (calculator, python) or module:function (--tool, repeatable); `env`: module:Factory (--env) of the
    # environments (tools/environment.py). Either makes the run agentic; max_completion_length then bounds a
    # whole trajectory after its prompt (the policy's tokens and the spliced tool results).
    tool: tuple[str, ...] = ()
    env: str | None = None
    max_turns: int = 4  # assistant turns per trajectory (TRL's max_tool_calling_iterations)
    max_tool_time: float = 30.0  # seconds a trajectory may spend in its environment's steps (tool calls)
    num_generations: int = 4  # completions per prompt (the group size G)
    max_prompt_length: int = 256
    max_completion_length: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    num_iterations: int = 1  # mu: optimizer steps on each rollout batch
    epsilon: float = 0.2  # clip range of the ratio, below 1
    epsilon_high: float | None = None  # above 1 (DAPO's clip-higher); None: epsilon
    loss_agg_mode: str = "token-mean"  # token-mean | seq-mean-token-mean | seq-mean-token-sum-norm
    mask_truncated_completions: bool = False  # completions cut at max_completion_length train on no token
    # Importance sampling over the engine/trainer mismatch, as TRL's vllm_importance_sampling_*: each token's
    # policy loss weighed by p_trainer / p_sampler of the sampled tokens (per token or per sequence), truncated
    # at the cap or masked above it (rl_losses.sampling_correction).
    importance_sampling_correction: bool = True
    importance_sampling_mode: str = "sequence_mask"  # token_truncate | token_mask | sequence_truncate | sequence_mask
    importance_sampling_cap: float = 3.0
    # The trainer's log-probs computed as the engine computes them (its batch-invariant kernels, paged attention
    # over the same blocks, the sampler's tempered log_softmax), so they equal the engine's bit for bit and the
    # first iteration's importance ratio is exactly 1. Needs float32 compute and no top-k/top-p/min-p.
    exact_on_policy: bool = False
    # On, as in TRL's GRPOConfig: the engine shares the process, and the layers' activations were a third of
    # the step's memory (default-model PPO peak 3.93 -> 3.52 GB, the train step 14 % slower).
    gradient_checkpointing: bool = True

    def __post_init__(self):
        super().__post_init__()
        if self.qat is not None:
            raise ValueError("qat is for sft, dpo and distill: an RL run samples from the float weights, which "
                             "fake-quantized training would leave off-policy")
        self.reward = (self.reward,) if isinstance(self.reward, str) else tuple(self.reward)
        self.reward_model = (self.reward_model,) if isinstance(self.reward_model, str) else tuple(self.reward_model)
        self.tool = (self.tool,) if isinstance(self.tool, str) else tuple(self.tool)
        self._check_rollout()
        for name in ("num_generations", "max_prompt_length", "max_completion_length", "num_iterations", "max_turns"):
            _positive(self, name)
        if self.max_prompt_length + self.max_completion_length > MAX_TOKENS:  # what the engine holds per sequence
            raise ValueError(f"max_prompt_length + max_completion_length must be at most {MAX_TOKENS}, got "
                             f"{self.max_prompt_length} + {self.max_completion_length}")
        if not self.max_tool_time > 0:
            raise ValueError(f"max_tool_time must be a positive number of seconds, got {self.max_tool_time!r}")
        if self.reward_weights is not None:
            self.reward_weights = tuple(float(w) for w in self.reward_weights)
            if len(self.reward_weights) != len(self.reward) + len(self.reward_model):
                raise ValueError(f"reward_weights has {len(self.reward_weights)} entries for {len(self.reward)} "
                                 f"reward functions and {len(self.reward_model)} reward models")
        if self.batch_size % self.num_generations:
            raise ValueError(f"batch_size ({self.batch_size}) must be a multiple of num_generations "
                             f"({self.num_generations}): each micro-batch trains on whole groups of completions")
        if self.save_steps % self.num_iterations:
            raise ValueError(f"save_steps ({self.save_steps}) must be a multiple of num_iterations "
                             f"({self.num_iterations}), so a resumed run starts on a fresh rollout")
        if not 0 < self.epsilon < 1:
            raise ValueError(f"epsilon must be in (0, 1), got {self.epsilon}")
        if self.epsilon_high is not None and not self.epsilon_high > 0:
            raise ValueError(f"epsilon_high must be positive (or null for epsilon), got {self.epsilon_high}")
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"loss_agg_mode must be one of {', '.join(LOSS_AGG_MODES)}, got {self.loss_agg_mode!r}")
        if self.importance_sampling_mode not in SAMPLING_CORRECTION_MODES:
            raise ValueError(f"importance_sampling_mode must be one of {', '.join(SAMPLING_CORRECTION_MODES)}, "
                             f"got {self.importance_sampling_mode!r}")
        if not self.importance_sampling_cap > 0:
            raise ValueError(f"importance_sampling_cap must be positive, got {self.importance_sampling_cap}")
        # The engine validates the sampling options the same way; checking here fails before any loading.
        from tunix_rt.engine.params import SamplingParams

        SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p)
        if self.temperature < 1e-5:
            raise ValueError("temperature must be > 0: a group of greedy completions has nothing to compare")
        if self.exact_on_policy and self.compute_dtype != "float32":
            raise ValueError(f"exact_on_policy needs compute_dtype=float32 (the engine samples at the model's "
                             f"float32), got {self.compute_dtype}")
        if self.exact_on_policy and (self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0):
            raise ValueError("exact_on_policy needs top_k=0, top_p=1 and min_p=0: the loss is over the tempered "
                             "distribution, the engine would report the truncated one")

    @property
    def prompts_per_step(self) -> int:
        return self.batch_size * self.gradient_accumulation_steps // self.num_generations


@dataclasses.dataclass(kw_only=True)
class GRPOConfig(RLConfig):
    num_generations: int = 8
    beta: float = 0.0  # weight of the k3 KL to the reference (0: no reference pass)
    advantage_estimator: str = "grpo"  # grpo (group-normalised) | dr_grpo (mean-only) | rloo
    importance_sampling_level: str = "token"  # token (GRPO) | sequence (GSPO)
    # The k3 KL times pi / pi_old (TRL's default): its gradient is then the unbiased reverse-KL gradient.
    use_bias_correction_kl: bool = True
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards all agree, refill with new prompts
    max_resample_rounds: int = 3  # extra sampling rounds dynamic sampling may spend per step

    def __post_init__(self):
        super().__post_init__()
        if self.num_generations < 2:
            raise ValueError(f"num_generations must be >= 2 (advantages compare completions of one prompt), "
                             f"got {self.num_generations}")
        if not self.beta >= 0:
            raise ValueError(f"beta must be >= 0, got {self.beta}")
        if self.advantage_estimator not in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage_estimator must be one of {', '.join(ADVANTAGE_ESTIMATORS)}, "
                             f"got {self.advantage_estimator!r}")
        if self.importance_sampling_level not in IMPORTANCE_LEVELS:
            raise ValueError(f"importance_sampling_level must be one of {', '.join(IMPORTANCE_LEVELS)}, "
                             f"got {self.importance_sampling_level!r}")
        if self.max_resample_rounds < 0:
            raise ValueError(f"max_resample_rounds must be >= 0, got {self.max_resample_rounds}")


@dataclasses.dataclass(kw_only=True)
class PPOConfig(RLConfig):
    num_generations: int = 1  # PPO's critic needs no group; more samples per prompt are allowed
    num_iterations: int = 4  # PPO epochs on each rollout batch
    kl_coef: float = 0.05  # per-token KL penalty in the reward (0: no reference pass)
    gamma: float = 1.0
    lam: float = 1.0  # verl's default: with one reward at the end, lam < 1 leans on a critic that starts untrained
    vf_coef: float = 0.1
    cliprange_value: float = 0.2
    entropy_coef: float = 0.0
    whiten_advantages: bool = True
    value_model_init: str = "zeros"  # the value head's start: zeros, or "reward": the first --reward-model's score head

    def __post_init__(self):
        super().__post_init__()
        if self.value_model_init not in ("zeros", "reward"):
            raise ValueError(f"value_model_init must be zeros or reward, got {self.value_model_init!r}")
        if self.value_model_init == "reward" and not self.reward_model:
            raise ValueError("value_model_init=reward starts the critic from a reward model: give --reward-model")
        if not self.kl_coef >= 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")
        for name in ("gamma", "lam"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if not self.vf_coef >= 0 or not self.cliprange_value > 0 or not self.entropy_coef >= 0:
            raise ValueError("vf_coef and entropy_coef must be >= 0 and cliprange_value > 0")
