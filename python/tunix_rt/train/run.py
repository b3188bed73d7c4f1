"""From a config to a trained model: load, build the objective, fit, export DIR/final (and a LoRA run's DIR/adapter).

A LoRA run's DIR/final is its adapter in peft's layout, which `--model` accepts (the loader puts it on the base
its adapter_config.json names); `save_merged=true` writes the base with the adapter merged there instead, a
float copy of the whole model (517 MB for the default model, against its 9 MB adapter).

This is what `tunix-rt sft|dpo|distill|grpo|ppo` run (the ALGORITHMS registry names each one's config,
objective and trainer); Python callers can call `run(config)` directly.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import jax
import yaml

from tunix_rt.checkpoints.default_model import DefaultModelMissing
from tunix_rt.checkpoints.hf_export import CLASSIFIERS, classifier_config, export_hf
from tunix_rt.checkpoints.loader import DEFAULT, LoadedModel, holds_quantized, load_model, resolve_model_path
from tunix_rt.checkpoints.output_dir import OutputDirError, check_output_dir, make_dirs
from tunix_rt.checkpoints.peft_adapter import load_adapter, save_adapter
from tunix_rt.models.decoder import Decoder
from tunix_rt.models.lora import merge_lora
from tunix_rt.parallel.mesh import initialize_distributed, make_mesh
from tunix_rt.train.config import (
    DistillConfig,
    DPOConfig,
    GRPOConfig,
    KTOConfig,
    PPOConfig,
    RewardConfig,
    RLConfig,
    SFTConfig,
    TrainConfig,
)
from tunix_rt.train.data import load_preferences, load_prompts, load_sft, load_unpaired, pack
from tunix_rt.train.image_data import VisionRows
from tunix_rt.train.rl_trainer import RLTrainer
from tunix_rt.train.trainer import Objective, Trainer

log = logging.getLogger("tunix_rt.train")
FINAL = "final"
ADAPTER = "adapter"  # a LoRA run's adapter in peft's layout (adapter_config.json, adapter_model.safetensors)
RUN_CONFIG = "config.yaml"


def _pad_id(tokenizer) -> int:
    for candidate in (tokenizer.pad_token_id, *tokenizer.eos_token_ids):
        if candidate is not None:
            return candidate
    return 0


def _sft_items(cfg: SFTConfig | DistillConfig, tokenizer, path: str, **options):
    examples = load_sft(path, tokenizer, max_length=cfg.max_length, **options)
    return pack(examples, cfg.max_length) if getattr(cfg, "packing", False) else examples


def _sft(cfg: SFTConfig, loaded: LoadedModel, data: str):
    from tunix_rt.train.sft import SFTObjective

    vision = loaded.model.config.vision
    images = None if vision is None else VisionRows.for_model(vision, loaded.tokenizer, loaded.source, data)
    items = _sft_items(cfg, loaded.tokenizer, data, assistant_only_loss=cfg.assistant_only_loss,
                       completion_only_loss=cfg.completion_only_loss, vision=images)
    return SFTObjective(items, max_length=cfg.max_length, pad_id=_pad_id(loaded.tokenizer))


def _dpo(cfg: DPOConfig, loaded: LoadedModel, data: str):
    from tunix_rt.train.dpo import DPOObjective

    vision = loaded.model.config.vision
    images = None if vision is None else VisionRows.for_model(vision, loaded.tokenizer, loaded.source, data)
    examples = load_preferences(data, loaded.tokenizer, max_length=cfg.max_length,
                                max_prompt_length=cfg.max_prompt_length, vision=images)
    ref = load_model(cfg.ref_model).model if cfg.ref_model and not cfg.reference_free else None
    return DPOObjective(examples, cfg, max_length=cfg.max_length, pad_id=_pad_id(loaded.tokenizer), ref_model=ref,
                        precompute_ref_log_probs=cfg.precompute_ref_log_probs)


def _kto(cfg: KTOConfig, loaded: LoadedModel, data: str):
    from tunix_rt.train.kto import KTOObjective

    examples = load_unpaired(data, loaded.tokenizer, max_length=cfg.max_length, max_prompt_length=cfg.max_prompt_length)
    ref = load_model(cfg.ref_model).model if cfg.ref_model else None
    return KTOObjective(examples, cfg, max_length=cfg.max_length, pad_id=_pad_id(loaded.tokenizer), ref_model=ref,
                        precompute_ref_log_probs=cfg.precompute_ref_log_probs, seed=cfg.seed)


def _reward(cfg: RewardConfig, loaded: LoadedModel, data: str):
    from tunix_rt.train.reward import RewardObjective, attach_score_head, packed_rows, reward_pad_id, whole_pairs

    model_type = loaded.hf_config.get("model_type")
    if model_type not in CLASSIFIERS:  # refused before training, not at export
        raise ValueError(f"a {model_type!r} model cannot be made a reward model (supported: {', '.join(CLASSIFIERS)})")
    attach_score_head(loaded.model, reward_pad_id(loaded.tokenizer), cfg.seed)  # a loaded reward model stays
    examples = whole_pairs(load_preferences(data, loaded.tokenizer, max_length=cfg.max_length,
                                            max_prompt_length=cfg.max_prompt_length), cfg.max_length)
    return RewardObjective(examples, max_length=cfg.max_length, pad_id=_pad_id(loaded.tokenizer),
                           center_rewards_coefficient=cfg.center_rewards_coefficient,
                           rows=packed_rows(cfg.batch_size, make_mesh(cfg.fsdp, cfg.tp).shape["fsdp"], cfg.max_length))


def _distill(cfg: DistillConfig, loaded: LoadedModel, data: str):
    from tunix_rt.train.distill import DistillObjective, OnPolicyDistillObjective, check_teacher

    tok = loaded.tokenizer
    teacher = load_model(cfg.teacher).model
    check_teacher(loaded.model.config.vocab_size, teacher.config.vocab_size)
    kd = dict(max_length=cfg.max_length, pad_id=_pad_id(tok), temperature=cfg.temperature, alpha=cfg.alpha,
              top_k=cfg.top_k)
    if cfg.on_policy:
        return OnPolicyDistillObjective(load_sft(data, tok, max_length=cfg.max_length), teacher, tok,
                                        max_new_tokens=cfg.max_new_tokens, seed=cfg.seed, batch_size=cfg.batch_size,
                                        rollout=cfg.rollout, sleep_engine=cfg.sleep_engine, **kd)
    return DistillObjective(_sft_items(cfg, tok, data), teacher, **kd)


def _sampler(cfg: RLConfig, loaded: LoadedModel, data: str):
    from tunix_rt.train.rewards import RewardScorer, resolve_reward
    from tunix_rt.train.rollout import GroupSampler

    # The reward functions (and tools and environments) resolve before tokenizing: a bad name fails at once.
    rewards = [resolve_reward(spec) for spec in cfg.reward]
    if cfg.reward_model:
        from tunix_rt.train.reward_model_reward import RewardModelReward

        models = [RewardModelReward(path, max_length=cfg.max_prompt_length + cfg.max_completion_length)
                  for path in cfg.reward_model]
        names = [m.name for m in models]
        rewards += [(name if names.count(name) == 1 else f"{name}#{i}", m) for i, (name, m) in enumerate(zip(names, models))]
    if cfg.tool or cfg.env:
        from tunix_rt.tools.environment import environment_factory
        from tunix_rt.train.agentic import agentic_sampler

        factory, tools = environment_factory(cfg.env, cfg.tool)
        return agentic_sampler(cfg, loaded.tokenizer, data, rewards, factory, tools)
    scorer = RewardScorer(rewards, cfg.reward_weights)
    return GroupSampler(cfg, load_prompts(data, loaded.tokenizer, max_prompt_length=cfg.max_prompt_length), scorer)


def _grpo(cfg: GRPOConfig, loaded: LoadedModel, data: str):
    from tunix_rt.train.grpo import GRPOObjective

    return GRPOObjective(cfg, _sampler(cfg, loaded, data), loaded.tokenizer, _pad_id(loaded.tokenizer))


def _ppo(cfg: PPOConfig, loaded: LoadedModel, data: str):
    from tunix_rt.train.ppo import PPOObjective, attach_value_head

    sampler = _sampler(cfg, loaded, data)
    attach_value_head(loaded.model)
    if cfg.value_model_init == "reward":  # TRL's habit: the critic starts as the (first) reward model's head
        from tunix_rt.train.reward_model_reward import RewardModelReward

        first = next(fn for _, fn in sampler.scorer.rewards if isinstance(fn, RewardModelReward))
        loaded.model.value_head.start_from(first.head)
    return PPOObjective(cfg, sampler, loaded.tokenizer, _pad_id(loaded.tokenizer))


def _policy_only(model):
    from tunix_rt.train.ppo import policy_only

    return policy_only(model)


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """One post-training algorithm, all the runner needs to know of it: its config class, its objective built
    from the loaded model and a data file (the data loader is the objective builder's), the trainer that
    runs it, and what the exported model keeps of the trained one."""

    config: type[TrainConfig]
    objective: Callable[[TrainConfig, LoadedModel, str], Objective]
    trainer: type[Trainer] = Trainer
    exported: Callable[[Decoder], Decoder] | None = None
    exported_config: Callable[[Decoder, dict], dict] | None = None  # the HF config the export writes
    saves_adapter: bool = True  # a LoRA run also writes its adapter alone (not where the model has a new head)


# `tunix-rt NAME` runs ALGORITHMS[NAME]; a new algorithm is one entry.
ALGORITHMS = {
    "sft": Algorithm(SFTConfig, _sft),
    "dpo": Algorithm(DPOConfig, _dpo),
    "distill": Algorithm(DistillConfig, _distill),
    "grpo": Algorithm(GRPOConfig, _grpo, RLTrainer),
    "ppo": Algorithm(PPOConfig, _ppo, RLTrainer, exported=_policy_only),
    "kto": Algorithm(KTOConfig, _kto),
    "reward": Algorithm(RewardConfig, _reward, saves_adapter=False,
                        exported_config=lambda model, hf: classifier_config(hf, 1, model.config.pad_token_id)),
}
CONFIGS = {name: algorithm.config for name, algorithm in ALGORITHMS.items()}


def algorithm_for(cfg: TrainConfig) -> Algorithm:
    """The registered algorithm whose config class cfg is (exactly, else the first it derives from)."""
    exact = [a for a in ALGORITHMS.values() if type(cfg) is a.config]
    derived = [a for a in ALGORITHMS.values() if isinstance(cfg, a.config)]
    if not exact + derived:
        raise TypeError(f"no algorithm is registered for {type(cfg).__name__}; known: {', '.join(CONFIGS)}")
    return (exact + derived)[0]


def build_objective(cfg: TrainConfig, loaded: LoadedModel, data: str) -> Objective:
    """The objective for cfg's algorithm over the rows of `data`."""
    return algorithm_for(cfg).objective(cfg, loaded, data)


def run_record(path: Path) -> dict | None:
    """The record of the run that wrote `path` (its config.yaml, a mapping with model and output), or None for a
    directory no training run wrote."""
    try:
        record = yaml.safe_load((path / RUN_CONFIG).read_text())
    except (OSError, yaml.YAMLError):
        return None
    return record if isinstance(record, dict) and {"model", "output"} <= record.keys() else None


# What a run writes in its directory, and what `resume=false overwrite=true` removes to start over.
_RUN_OUTPUTS = (RUN_CONFIG, "checkpoints", "metrics.jsonl", "tensorboard", FINAL, ADAPTER)


def prepare_run_dir(cfg: TrainConfig) -> tuple[Path, dict[str, dict]]:
    """The run directory, made or checked before anything loads, and the options a resume of it changes: a new
    or empty directory starts fresh, a run directory resumes (or, with resume=false and overwrite, starts over:
    the run's own files are removed); any other non-empty directory, or a file, is refused unless overwrite."""
    output = check_output_dir(cfg.output, overwrite=True, what="--output")  # a file is refused
    changed = {}
    if output.is_dir() and any(output.iterdir()):
        record = run_record(output)
        if record is None and not cfg.overwrite:
            raise OutputDirError(f"--output {output} is a non-empty directory that holds no tunix-rt run (no "
                                 f"{RUN_CONFIG}); choose a new or empty directory, or give --overwrite to write into it")
        if record is not None and not cfg.resume and cfg.overwrite and jax.process_index() == 0:
            for name in _RUN_OUTPUTS:
                path = output / name
                if path.is_dir():
                    shutil.rmtree(path)
                else:
                    path.unlink(missing_ok=True)
            log.info("resume=false overwrite=true: removed the earlier run's files in %s", output)
        elif record is not None and cfg.resume and (output / "checkpoints").is_dir():
            changed = check_resumed_options(record, cfg)
    make_dirs(output, "--output")
    return output, changed


def _model_path(model) -> str | None:
    try:
        return str(resolve_model_path(model).resolve())
    except (OSError, ValueError, DefaultModelMissing):
        return None if model is None else str(model)


# Options the checkpoints' parameters and moments depend on: a resume that changes one is refused.
_FIXED_BY_CHECKPOINT = ("model", "lora_rank", "lora_targets", "lora", "dequantize")
# Options whose change nobody needs told of.
_QUIET = ("output", "resume", "overwrite", "progress", "coordinator_address", "process_id")


def check_resumed_options(stored: dict, cfg: TrainConfig) -> dict[str, dict]:
    """A resume under options that make its checkpoints meaningless is refused with the option and both values;
    the other changes it accepts (learning rate, steps, data, ...) are logged and returned as
    {option: {"from": stored, "to": new}} for the run's metrics."""
    new = yaml.safe_load(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))  # as config.yaml holds it
    same_model = _model_path(stored.get("model")) == _model_path(new["model"])  # "m", "./m" and its full path
    for name in _FIXED_BY_CHECKPOINT:
        if name in stored and stored[name] != new.get(name) and not (name == "model" and same_model):
            raise ValueError(f"--output {cfg.output} holds checkpoints of a run with {name}={stored[name]!r}; this run "
                             f"has {name}={new.get(name)!r}, which they cannot resume. Choose another --output, or "
                             "give resume=false --overwrite to start over")
    changed = {k: {"from": stored.get(k), "to": v} for k, v in new.items()
               if k not in _QUIET and stored.get(k) != v and not (k == "model" and same_model)}
    if changed:
        log.warning("resuming %s with changed options: %s", cfg.output,
                    ", ".join(f"{k} {c['from']!r} -> {c['to']!r}" for k, c in changed.items()))
    return changed


def run(cfg: TrainConfig, *, stop_after: int | None = None) -> Path:
    """Train as `cfg` says; returns DIR/final (a directory --model accepts)."""
    if cfg.num_processes > 1:
        initialize_distributed(cfg.coordinator_address, cfg.num_processes, cfg.process_id)
    output, changed = prepare_run_dir(cfg)
    loaded = load_model(cfg.model, dequantize=cfg.dequantize)
    if cfg.lora is not None:  # the run starts from this adapter (the trainer adds none of its own)
        load_adapter(loaded.model, cfg.lora, dropout=cfg.lora_dropout, seed=cfg.seed)
    objective = build_objective(cfg, loaded, cfg.data)
    eval_objective = build_objective(cfg, loaded, cfg.eval_data) if cfg.eval_data else None
    reference = None
    if cfg.lora_rank == 0 and objective.needs_reference and cfg.dequantize and holds_quantized(cfg.model):
        reference = load_model(cfg.model).model  # the packed weights: what the dequantized ones compute, 7x smaller
    algorithm = algorithm_for(cfg)
    trainer = algorithm.trainer(cfg, loaded.model, objective, reference=reference)
    log.info("training %d steps on %d items (%s)", trainer.steps, objective.num_items,
             "LoRA" if trainer.lora else "full")
    if jax.process_index() == 0:  # the run has started: its record says what its checkpoints hold
        (output / RUN_CONFIG).write_text(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))
    trainer.fit(output=output, eval_objective=eval_objective, stop_after=stop_after, resumed_with=changed)
    final = output / FINAL
    if trainer.step == trainer.steps:
        trainer.release_optimizer()
        model = trainer.model()
        if algorithm.exported is not None:
            model = algorithm.exported(model)
        base = _base_name(cfg.model)
        if trainer.lora and algorithm.saves_adapter and jax.process_index() == 0:  # the adapter, beside final/
            save_adapter(model, output / ADAPTER, base_model=base, overwrite=True)
            log.info("adapter: %s (on %s)", output / ADAPTER, base)
        if trainer.lora and not cfg.save_merged:
            if jax.process_index() == 0:
                save_adapter(model, final, base_model=base, overwrite=True)
            return final
        if trainer.lora:
            model = merge_lora(model)
        if jax.process_index() == 0:
            hf_config = loaded.hf_config if algorithm.exported_config is None else algorithm.exported_config(
                model, loaded.hf_config)
            export_hf(model, loaded.tokenizer, hf_config, final, dtype=cfg.export_dtype,
                      generation_config=loaded.generation_config or None, overwrite=True)  # the run's own
    return final


def _base_name(model: str | None) -> str:
    """What an adapter's base_model_name_or_path says: 'default' as it is, a path made absolute (the adapter
    may be loaded from another working directory)."""
    if model is None or str(model) == DEFAULT:
        return DEFAULT
    return str(Path(model).expanduser().resolve())

