"""A ("fsdp", "tp") device mesh, the decoder's partition rules, and placing host data on it.

FSDP shards every large weight along one dimension and the batch along "fsdp"; tensor
parallelism splits attention heads and the MLP's hidden units along "tp" (column-parallel
q/k/v/gate/up, row-parallel o/down), Megatron-style. XLA's SPMD partitioner inserts the
collectives. A dimension the axis does not divide stays whole rather than failing.
"""

from __future__ import annotations

import re

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

FSDP, TP = "fsdp", "tp"

# (regex over the parameter path joined by "/", spec per dimension); the first match wins.
PARTITION_RULES: tuple[tuple[str, tuple], ...] = (
    (r"(q_proj|k_proj|v_proj|gate_proj|up_proj)/(base/)?kernel$", (FSDP, TP)),
    (r"(o_proj|down_proj)/(base/)?kernel$", (TP, FSDP)),
    (r"(q_proj|k_proj|v_proj)/(base/)?bias$", (TP,)),
    (r"(q_proj|k_proj|v_proj|gate_proj|up_proj)/lora_a$", (FSDP, None)),
    (r"(q_proj|k_proj|v_proj|gate_proj|up_proj)/lora_b$", (None, TP)),
    (r"(o_proj|down_proj)/lora_a$", (TP, None)),
    (r"(o_proj|down_proj)/lora_b$", (None, FSDP)),
    (r"experts/(gate_proj|up_proj)$", (None, FSDP, TP)),  # stacked MoE experts (E, in, out)
    (r"experts/down_proj$", (None, TP, FSDP)),
    (r"^embed/embedding$", (TP, FSDP)),
    (r"^lm_head/kernel$", (FSDP, TP)),
)


def make_mesh(fsdp: int = -1, tp: int = 1, devices=None) -> Mesh:
    """fsdp = -1 takes every device tp leaves; the product must equal the device count."""
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    if tp < 1 or n % tp:
        raise ValueError(f"tp={tp} must divide the number of devices ({n})")
    if fsdp == -1:
        fsdp = n // tp
    if fsdp * tp != n:
        raise ValueError(f"mesh fsdp={fsdp} x tp={tp} = {fsdp * tp} devices, but {n} are available")
    return Mesh(np.asarray(devices).reshape(fsdp, tp), (FSDP, TP))


def _path_str(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def partition_spec(path: str, shape: tuple[int, ...], mesh: Mesh) -> P:
    """The rule's spec for this parameter, each axis kept only where it divides the dimension. The decoder's
    layer weights lead with a layer-stack axis (models/layer_stack.py), never split: the scan reads one layer
    at a time."""
    stacked = re.search(r"(^|/)layers/kinds/", path) is not None  # the params' path, or an optimizer moment's
    for pattern, spec in PARTITION_RULES:
        spec = (None, *spec) if stacked else spec
        if re.search(pattern, path) and len(spec) == len(shape):
            return P(*(axis if axis and dim % mesh.shape[axis] == 0 else None for axis, dim in zip(spec, shape)))
    return P()


def state_shardings(tree, mesh: Mesh):
    """NamedShardings for every array leaf of a parameter pytree, from PARTITION_RULES."""

    def one(path, leaf):
        # a Variable's value sits under a trailing "value" key in flattened paths: drop it
        name = re.sub(r"/value$", "", _path_str(path))
        return NamedSharding(mesh, partition_spec(name, tuple(leaf.shape), mesh))

    return jax.tree_util.tree_map_with_path(one, tree)


def put_global(tree, shardings):
    """Host arrays (identical on every process) -> global jax.Arrays laid out by `shardings`.

    Each process supplies only the shards its own devices hold, so this works unchanged with
    several processes (jax.distributed).
    """

    def one(value, sharding):
        if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):  # typed keys travel as their raw data
            data = one(jax.random.key_data(value), sharding)
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(value))
        if isinstance(value, jax.Array) and value.is_fully_addressable and value.sharding.is_equivalent_to(sharding, value.ndim):
            return jax.device_put(value, sharding)  # the same buffers: a copy would double the model's memory
        value = np.asarray(value)
        return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

    return jax.tree.map(one, tree, shardings)


def batch_sharding(mesh: Mesh, ndim: int, batch_axis: int = 0) -> NamedSharding:
    """The batch dimension split over "fsdp" (data parallel); every other dimension whole."""
    spec = [None] * ndim
    spec[batch_axis] = FSDP
    return NamedSharding(mesh, P(*spec))


def initialize_distributed(coordinator_address: str, num_processes: int, process_id: int) -> None:
    """jax.distributed for multi-process training (CPU collectives through gloo)."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id)
