"""Post-training: trainer core, SFT, DPO family, distillation (and later GRPO/PPO)."""
