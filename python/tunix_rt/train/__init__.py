"""Post-training: the trainer core (trainer.py, one jitted step over any objective), its data (data.py) and
checkpoints, and the objectives: SFT, the DPO family, distillation, and GRPO / PPO on rollouts from the
embedded engine (rl_trainer.py, rollout.py). run.py takes a config (config.py) to an exported model."""
