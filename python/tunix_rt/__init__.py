"""tunix-rt: a JAX-native LLM post-training and rollout runtime."""
__version__ = "0.1.0"
