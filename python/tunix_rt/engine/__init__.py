"""Sampling from models: the reference generator (the rollout engine builds on the same models)."""
