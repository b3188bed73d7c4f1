"""tunix-rt: a JAX-native LLM post-training and rollout runtime.

The public names load on first use (PEP 562), so `import tunix_rt.ops` or `tunix_rt.train.config` does not
pull in the engine, the checkpoint loader or the structured-output grammar library.
"""

import importlib

__version__ = "0.1.0"
_LAZY = {
    "load": "tunix_rt.checkpoints.loader",
    "Engine": "tunix_rt.engine.engine",
    "EngineStats": "tunix_rt.engine.engine",
    "RequestOutput": "tunix_rt.engine.params",
    "SamplingParams": "tunix_rt.engine.params",
    "StructuredOutputsParams": "tunix_rt.engine.structured",
}
__all__ = [*_LAZY, "__version__"]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'tunix_rt' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
