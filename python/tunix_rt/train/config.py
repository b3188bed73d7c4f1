"""Training configs: kw_only dataclasses validated on construction, built from YAML + key=value.

Option names follow TRL's (learning_rate, per_device batch as batch_size, gradient_accumulation_steps,
max_length, packing, assistant_only_loss, beta, loss_type, ...), so a TRL user reads them at sight.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from tunix_rt.train.lora import ALL_TARGETS

SCHEDULES = ("linear", "cosine", "constant")
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
    seed: int = 42
    shuffle: bool = True
    lora_rank: int = 0  # 0: full fine-tuning
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_targets: tuple[str, ...] = ALL_TARGETS
    dequantize: bool | None = None  # None: keep a quantized base for LoRA (QLoRA), dequantize for full
    fsdp: int = -1  # mesh axis sizes; -1 takes the devices the other axis leaves
    tp: int = 1
    logging_steps: int = 1
    eval_steps: int | None = None
    save_steps: int = 100
    save_total_limit: int = 2
    resume: bool = True  # continue from the newest checkpoint in output/checkpoints
    export_dtype: str = "float32"
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
        if self.lr_scheduler_type not in SCHEDULES:
            raise ValueError(f"lr_scheduler_type must be one of {', '.join(SCHEDULES)}, got {self.lr_scheduler_type!r}")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"compute_dtype must be one of {', '.join(COMPUTE_DTYPES)}, got {self.compute_dtype!r}")
        if self.export_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"export_dtype must be one of {', '.join(COMPUTE_DTYPES)}, got {self.export_dtype!r}")
        if self.learning_rate is not None and not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be positive, got {self.learning_rate}")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ValueError(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if self.warmup_steps < 0 or self.weight_decay < 0:
            raise ValueError("warmup_steps and weight_decay must be >= 0")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive (or null to disable clipping), got {self.max_grad_norm}")
        if self.lora_rank < 0:
            raise ValueError(f"lora_rank must be >= 0 (0 = full fine-tuning), got {self.lora_rank}")
        if self.fsdp == 0 or self.fsdp < -1 or self.tp < 1:
            raise ValueError(f"mesh axes: fsdp must be -1 or positive and tp positive, got fsdp={self.fsdp} tp={self.tp}")
        if self.num_processes > 1 and not self.coordinator_address:
            raise ValueError("num_processes > 1 needs coordinator_address (host:port of process 0)")
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"process_id must be in [0, num_processes), got {self.process_id}")
        if self.dequantize is None:
            self.dequantize = self.lora_rank == 0
        if self.lora_rank == 0 and not self.dequantize:
            raise ValueError("full fine-tuning needs float weights: set dequantize=true (or use lora_rank > 0)")
        self.lora_targets = tuple(self.lora_targets)

    @property
    def lr(self) -> float:
        if self.learning_rate is not None:
            return self.learning_rate
        return 1e-4 if self.lora_rank else 2e-5

    @property
    def warmup(self) -> int:
        return self.warmup_steps or int(self.warmup_ratio * (self.steps or 0))


def _positive(cfg, name: str) -> None:
    value = getattr(cfg, name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclasses.dataclass(kw_only=True)
class SFTConfig(TrainConfig):
    packing: bool = False
    assistant_only_loss: bool = True  # conversational rows: train on the assistant turns only
    completion_only_loss: bool = True  # prompt/completion rows: train on the completion only


@dataclasses.dataclass(kw_only=True)
class DPOConfig(TrainConfig):
    loss_type: str = "sigmoid"  # sigmoid | ipo | hinge | robust | orpo | simpo
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    max_prompt_length: int | None = None
    ref_model: str | None = None  # None: the LoRA-disabled base with LoRA, the initial weights without

    @property
    def lr(self) -> float:  # TRL's DPO default is 1e-6 for full fine-tuning
        if self.learning_rate is not None:
            return self.learning_rate
        return 5e-5 if self.lora_rank else 1e-6


@dataclasses.dataclass(kw_only=True)
class DistillConfig(TrainConfig):
    teacher: str
    temperature: float = 2.0
    alpha: float = 0.5  # alpha * T^2 * KL(teacher || student) + (1 - alpha) * CE
    top_k: int = 0  # 0: the full teacher distribution
    on_policy: bool = False  # the student samples completions through the rollout engine
    max_new_tokens: int = 64  # on-policy completion length

    def __post_init__(self):
        super().__post_init__()
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
        values[key.strip().replace("-", "_")] = yaml.safe_load(raw) if raw else None
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
        if typing.get_origin(option) is tuple:
            items = [value] if isinstance(value, str) else value
            if isinstance(items, (list, tuple)) and all(isinstance(v, str) for v in items):
                return tuple(items)
    expected = " or ".join(getattr(o, "__name__", str(o)) for o in options if o is not type(None))
    raise ValueError(f"option {name} must be {expected}, got {value!r}")
