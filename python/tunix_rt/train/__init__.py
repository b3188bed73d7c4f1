"""Post-training: the trainer core (trainer.py, one jitted step over any objective), its data (data.py) and
checkpoints, and the objectives: SFT, the DPO family, distillation, and GRPO / PPO on rollouts from the
embedded engine (rollout_engine.py owns the engine for a run; rollout.py samples groups of completions,
rewards.py scores them, group_packing.py packs them into rows; rl_trainer.py). run.py takes a config
(config.py) to an exported model through its registry of algorithms."""
