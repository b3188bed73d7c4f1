"""The algorithm registry (train/run.py ALGORITHMS): every training command is one entry naming its config
class, objective builder and trainer, and the runner finds the entry from the config alone."""

from __future__ import annotations

import dataclasses

import pytest

from tunix_rt.cli import _parser
from tunix_rt.train.config import GRPOConfig, PPOConfig, SFTConfig, TrainConfig
from tunix_rt.train.rl_trainer import RLTrainer
from tunix_rt.train.run import ALGORITHMS, CONFIGS, algorithm_for
from tunix_rt.train.trainer import Trainer


def test_every_training_command_is_one_registry_entry():
    sub = next(a for a in _parser()._actions if a.dest == "command")
    trained = {name for name, parser in sub.choices.items() if any(a.dest == "overrides" for a in parser._actions)}
    assert trained == set(ALGORITHMS) == set(CONFIGS)
    for name, algorithm in ALGORITHMS.items():
        assert CONFIGS[name] is algorithm.config
        cfg = algorithm.config(**{f.name: "x" for f in dataclasses.fields(algorithm.config)
                                  if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING},
                               **({"reward": ("brevity",)} if name in ("grpo", "ppo") else {}))
        assert algorithm_for(cfg) is algorithm
    assert ALGORITHMS["grpo"].trainer is ALGORITHMS["ppo"].trainer is RLTrainer
    assert ALGORITHMS["sft"].trainer is Trainer and ALGORITHMS["ppo"].exported is not None


def test_a_derived_config_finds_its_algorithm_and_an_unknown_one_is_refused():
    @dataclasses.dataclass(kw_only=True)
    class MySFT(SFTConfig):
        note: str = ""

    assert algorithm_for(MySFT(data="d", output="o")) is ALGORITHMS["sft"]
    assert algorithm_for(PPOConfig(data="d", output="o", reward=("brevity",))) is ALGORITHMS["ppo"]
    assert algorithm_for(GRPOConfig(data="d", output="o", reward=("brevity",))) is ALGORITHMS["grpo"]
    with pytest.raises(TypeError, match="no algorithm is registered for TrainConfig; known: sft, dpo, distill"):
        algorithm_for(TrainConfig(data="d", output="o"))
