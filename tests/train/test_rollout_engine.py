"""The rollout seam (train/rollout_engine.py): every objective that samples (GRPO, PPO, on-policy distillation)
does it through one RolloutEngine, which owns the engine's life. On-policy distillation is checked end to end
here (GRPO/PPO in test_rl.py): warmed up once, the trainer's weights taken in place after each step, asleep
between steps when asked, seeds from (run seed, step, prompt) so a resumed run samples what the uninterrupted
one did; the config's `rollout` section sizes the engine and is checked before anything loads."""

from __future__ import annotations

import math

import pytest

from tests.train.test_train_cli import write_jsonl
from tunix_rt.checkpoints.loader import load_model
from tunix_rt.engine.config import EngineConfig
from tunix_rt.train import run as run_module
from tunix_rt.train.config import DistillConfig, GRPOConfig, build_config
from tunix_rt.train.metrics import read_metrics
from tunix_rt.train.rollout_engine import RolloutEngine, rollout_config
from tunix_rt.train.trainer import Trainer

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fast_compiles")]

COMMON = ("max_length=64", "progress=false", "batch_size=2", "on_policy=true", "max_new_tokens=6",
          "rollout.kv_cache_memory=2000000")


@pytest.fixture(scope="module")
def models(tiny, teacher):
    return tiny, teacher


@pytest.fixture(scope="module")
def chats(root):
    return write_jsonl(root / "chats.jsonl", [{"messages": [{"role": "user", "content": f"hi {i}"},
                                                            {"role": "assistant", "content": f"the {i}"}]}
                                              for i in range(4)])


def distill_config(models, chats, output, *extra) -> DistillConfig:
    student, teacher = models
    return build_config(DistillConfig, overrides=[*COMMON, *extra], model=str(student), teacher=str(teacher),
                        data=chats, output=str(output))


def test_decode_and_prefill_buckets_follow_the_merged_section():
    derived = dict(max_num_seqs=8, max_num_batched_tokens=512, decode_and_prefill_buckets=True)
    assert rollout_config(None, **derived).token_buckets == (8, 512)
    assert rollout_config({"max_num_seqs": 3}, **derived).token_buckets == (3, 512)
    assert rollout_config({"max_num_batched_tokens": 64}, **derived).token_buckets == (8, 64)
    assert rollout_config({"token_buckets": [16, 512]}, **derived).token_buckets == (16, 512)  # the user's own
    assert rollout_config({"max_num_seqs": 3}, max_num_seqs=8).token_buckets is None


def test_seeds_depend_on_the_run_seed_the_rollout_the_row_and_the_stream_alone():
    rollout = RolloutEngine(None, EngineConfig(), seed=3)
    rollout.begin(5)
    first = rollout.seed(2)
    assert first == rollout.seed(2) and 0 <= first < 2**31
    assert len({rollout.seed(row, stream) for row in range(4) for stream in range(3)}) == 12
    again = RolloutEngine(None, EngineConfig(), seed=3)
    again.begin(5)
    assert again.seed(2) == first  # a fresh engine (a resumed run) draws the same seed
    rollout.begin(6)
    assert rollout.seed(2) != first
    other = RolloutEngine(None, EngineConfig(), seed=4)
    other.begin(5)
    assert other.seed(2) != first


def test_a_rollout_before_the_trainer_binds_its_weights_is_a_clear_error():
    with pytest.raises(RuntimeError, match=r"bind\(weights\) must be called"):
        RolloutEngine(None, EngineConfig(), seed=0).generate([[1, 2]], None)


def test_the_rollout_section_is_checked_before_loading(models, chats, tmp_path):
    # A section given whole replaces what came before; one entry (rollout.NAME=VALUE) is merged into it.
    cfg = distill_config(models, chats, tmp_path, "rollout={decode_steps: 4}", "rollout.max_num_seqs=3")
    assert cfg.rollout == {"decode_steps": 4, "max_num_seqs": 3}
    with pytest.raises(ValueError, match=r"unknown rollout option\(s\) max_seqs; valid: block_size"):
        distill_config(models, chats, tmp_path, "rollout.max_seqs=3")
    with pytest.raises(ValueError, match="rollout: Engine: block_size must be a positive integer, got 0"):
        distill_config(models, chats, tmp_path, "rollout.block_size=0")
    with pytest.raises(ValueError, match="option rollout must be dict"):
        distill_config(models, chats, tmp_path, "rollout=5")
    with pytest.raises(ValueError, match=r"override 'max_length.x=1': max_length is not a section"):
        distill_config(models, chats, tmp_path, "max_length.x=1")
    grpo = build_config(GRPOConfig, overrides=["rollout.max_num_batched_tokens=128"], data=chats, output=str(tmp_path),
                        reward=["brevity"])
    assert grpo.rollout == {"max_num_batched_tokens": 128}


def test_on_policy_distillation_samples_through_the_rollout_engine(models, chats, root):
    cfg = distill_config(models, chats, root / "steps", "sleep_engine=true", "steps=3")
    loaded = load_model(cfg.model)
    objective = run_module.build_objective(cfg, loaded, cfg.data)
    trainer = Trainer(cfg, loaded.model, objective)
    rollout = objective.rollout
    assert rollout.engine is None  # made on the first rollout
    records = [trainer.run_step(step) for step in range(3)]
    assert rollout.engine.config.kv_cache_memory == 2000000 and rollout.engine.config.max_num_seqs == 2
    assert rollout.engine.is_sleeping  # between steps, as sleep_engine asks
    warm = rollout.num_compiles
    assert warm >= 2  # the warm-up compiled the step programs before the first rollout
    for r in records:
        assert math.isfinite(r["loss"]) and r["time/rollout"] > 0 and r["time/sync"] > 0
    trainer.run_step(3)
    assert rollout.num_compiles == warm  # later steps take new weights in place: no recompiles


def test_a_resumed_on_policy_run_samples_what_the_uninterrupted_one_did(models, chats, root):
    full, resumed = root / "full", root / "resumed"
    run_module.run(distill_config(models, chats, full, "steps=4", "save_steps=2", "learning_rate=1e-2"))
    run_module.run(distill_config(models, chats, resumed, "steps=4", "save_steps=2", "learning_rate=1e-2"),
                   stop_after=2)
    run_module.run(distill_config(models, chats, resumed, "steps=4", "save_steps=2", "learning_rate=1e-2"))
    keys = ("loss", "kd", "ce", "grad_norm")
    want = [{k: r[k] for k in keys} for r in read_metrics(full)]
    assert [{k: r[k] for k in keys} for r in read_metrics(resumed)] == want
