"""tunix-rt: a JAX-native LLM post-training and rollout runtime."""

from tunix_rt.checkpoints.loader import load
from tunix_rt.engine.engine import Engine, EngineStats
from tunix_rt.engine.params import RequestOutput, SamplingParams
from tunix_rt.engine.structured import StructuredOutputsParams

__version__ = "0.1.0"
__all__ = ["Engine", "EngineStats", "RequestOutput", "SamplingParams", "StructuredOutputsParams", "load", "__version__"]
