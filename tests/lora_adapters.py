"""A LoRA adapter with random weights, saved in peft's layout: what the multi-adapter tests serve."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from tunix_rt.checkpoints.peft_adapter import save_adapter
from tunix_rt.models.lora import ALL_TARGETS, LoRALinear, apply_lora


def random_adapter(model, path, *, rank: int, seed: int, targets=ALL_TARGETS, scale: float = 0.5):
    """Put rank-`rank` adapters on `model` (in place), give B random values (peft starts it at zero, which would
    change nothing) and save them to `path`; returns the directory."""
    apply_lora(model, rank=rank, alpha=8.0, seed=seed, targets=targets)
    rng = np.random.default_rng(seed)
    for _, module in nnx.iter_modules(model):
        if isinstance(module, LoRALinear):
            module.lora_b.set_value(jnp.asarray(rng.normal(size=module.lora_b[...].shape) * scale, jnp.float32))
    return save_adapter(model, path)
