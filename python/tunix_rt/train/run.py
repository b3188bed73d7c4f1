"""From a config to a trained model: load, build the objective, fit, export DIR/final.

This is what `tunix-rt sft|dpo|distill|grpo|ppo` run; Python callers can call `run(config)` directly.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import jax
import yaml

from tunix_rt.checkpoints.hf_export import export_hf
from tunix_rt.checkpoints.loader import LoadedModel, holds_quantized, load_model
from tunix_rt.parallel.mesh import initialize_distributed
from tunix_rt.train.config import DistillConfig, DPOConfig, GRPOConfig, PPOConfig, RLConfig, SFTConfig, TrainConfig
from tunix_rt.train.data import load_preferences, load_prompts, load_sft, pack
from tunix_rt.train.lora import merge_lora
from tunix_rt.train.rl_trainer import RLTrainer
from tunix_rt.train.trainer import Trainer

log = logging.getLogger("tunix_rt.train")
FINAL = "final"


def _pad_id(tokenizer) -> int:
    for candidate in (tokenizer.pad_token_id, *tokenizer.eos_token_ids):
        if candidate is not None:
            return candidate
    return 0


def _sft_items(cfg: SFTConfig | DistillConfig, tokenizer, path: str):
    examples = load_sft(path, tokenizer, max_length=cfg.max_length,
                        assistant_only_loss=getattr(cfg, "assistant_only_loss", True),
                        completion_only_loss=getattr(cfg, "completion_only_loss", True))
    return pack(examples, cfg.max_length) if getattr(cfg, "packing", False) else examples


def build_objective(cfg: TrainConfig, loaded: LoadedModel, data: str):
    """The objective for cfg's algorithm over the rows of `data`."""
    tok, pad = loaded.tokenizer, _pad_id(loaded.tokenizer)
    if isinstance(cfg, DPOConfig):
        from tunix_rt.train.dpo import DPOObjective

        pref = cfg.preference()
        examples = load_preferences(data, tok, max_length=cfg.max_length, max_prompt_length=cfg.max_prompt_length)
        ref = load_model(cfg.ref_model).model if cfg.ref_model and not pref.reference_free else None
        return DPOObjective(examples, pref, max_length=cfg.max_length, pad_id=pad, ref_model=ref,
                            precompute_ref_log_probs=cfg.precompute_ref_log_probs)
    if isinstance(cfg, DistillConfig):
        from tunix_rt.train.distill import DistillObjective, check_teacher

        teacher = load_model(cfg.teacher).model
        check_teacher(loaded.model.config.vocab_size, teacher.config.vocab_size)
        kd = dict(max_length=cfg.max_length, pad_id=pad, temperature=cfg.temperature, alpha=cfg.alpha, top_k=cfg.top_k)
        if cfg.on_policy:
            from tunix_rt.train.distill import OnPolicyDistillObjective

            examples = load_sft(data, tok, max_length=cfg.max_length)
            return OnPolicyDistillObjective(examples, teacher, tok, max_new_tokens=cfg.max_new_tokens, seed=cfg.seed,
                                            batch_size=cfg.batch_size, rollout=cfg.rollout,
                                            sleep_engine=cfg.sleep_engine, **kd)
        return DistillObjective(_sft_items(cfg, tok, data), teacher, **kd)
    if isinstance(cfg, RLConfig):
        return _rl_objective(cfg, loaded, data, pad)
    from tunix_rt.train.sft import SFTObjective

    return SFTObjective(_sft_items(cfg, tok, data), max_length=cfg.max_length, pad_id=pad)


def _rl_objective(cfg: RLConfig, loaded: LoadedModel, data: str, pad: int):
    from tunix_rt.train.rewards import resolve_reward
    from tunix_rt.train.rollout import Sampler

    rewards = [resolve_reward(spec) for spec in cfg.reward]  # before tokenizing: a bad name fails at once
    sampler = Sampler(cfg, load_prompts(data, loaded.tokenizer, max_prompt_length=cfg.max_prompt_length), rewards)
    if isinstance(cfg, PPOConfig):
        from tunix_rt.train.ppo import PPOObjective, attach_value_head

        attach_value_head(loaded.model)
        return PPOObjective(cfg, sampler, loaded.tokenizer, pad)
    from tunix_rt.train.grpo import GRPOObjective

    return GRPOObjective(cfg, sampler, loaded.tokenizer, pad)


def run(cfg: TrainConfig, *, stop_after: int | None = None) -> Path:
    """Train as `cfg` says; returns DIR/final (an HF directory --model accepts)."""
    if cfg.num_processes > 1:
        initialize_distributed(cfg.coordinator_address, cfg.num_processes, cfg.process_id)
    output = Path(cfg.output)
    output.mkdir(parents=True, exist_ok=True)
    (output / "config.yaml").write_text(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))
    loaded = load_model(cfg.model, dequantize=cfg.dequantize)
    objective = build_objective(cfg, loaded, cfg.data)
    eval_objective = build_objective(cfg, loaded, cfg.eval_data) if cfg.eval_data else None
    reference = None
    if cfg.lora_rank == 0 and objective.needs_reference and cfg.dequantize and holds_quantized(cfg.model):
        reference = load_model(cfg.model).model  # the packed weights: what the dequantized ones compute, 7x smaller
    trainer = (RLTrainer if isinstance(cfg, RLConfig) else Trainer)(cfg, loaded.model, objective, reference=reference)
    log.info("training %d steps on %d items (%s)", trainer.steps, objective.num_items,
             "LoRA" if trainer.lora else "full")
    trainer.fit(output=output, eval_objective=eval_objective, stop_after=stop_after)
    final = output / FINAL
    if trainer.step == trainer.steps:
        trainer.release_optimizer()
        model = trainer.model()
        if trainer.lora:
            model = merge_lora(model)
        if isinstance(cfg, PPOConfig):
            from tunix_rt.train.ppo import policy_only

            model = policy_only(model)
        if jax.process_index() == 0:
            export_hf(model, loaded.tokenizer, loaded.hf_config, final, dtype=cfg.export_dtype,
                      generation_config=loaded.generation_config or None)
    return final


CONFIGS = {"sft": SFTConfig, "dpo": DPOConfig, "distill": DistillConfig, "grpo": GRPOConfig, "ppo": PPOConfig}
