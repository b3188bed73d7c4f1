"""tunix-rt: a JAX-native LLM post-training and rollout runtime."""

from tunix_rt.checkpoints.loader import load

__version__ = "0.1.0"
__all__ = ["load", "__version__"]
