"""The tiny SFT setup test_trainer.py trains, and a script that trains it where a test process cannot.

XLA_FLAGS (the virtual CPU device count) and jax.distributed must be set before jax starts, so the
mesh and multi-process checks run this file in subprocesses:

    python sharded_worker.py meshes RESULT.json OUTPUT_DIR
        one process with 8 virtual devices: the same training on a 1-device mesh, fsdp=4 x tp=2 and
        fsdp=8 (full fine-tuning and LoRA), a 1-device checkpoint resumed on fsdp=4 x tp=2, and the
        impossible-shape errors
    python sharded_worker.py process RESULT.json OUTPUT_DIR PORT NUM_PROCESSES PROCESS_ID
        one of several jax.distributed processes on localhost training over every global device, then
        resuming that run's checkpoint in a fresh Trainer

Each writes one JSON result (process 0 only, in process mode). Only tunix_rt, jax and numpy are
imported, so the file runs by path without the tests package on sys.path.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np

VOCAB, SEQ = 128, 32
NUM_ITEMS = 48  # batch 8: one epoch is the 6 steps every run schedules
STEPS = 6


def model_config():
    from tunix_rt.models.config import ModelConfig, RopeConfig

    # Every dimension the mesh rules split is divisible by fsdp 8, fsdp 4 and tp 2, so weights really shard.
    return ModelConfig(architecture="llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16, rope=(("full_attention", RopeConfig(theta=10000.0)),))


def new_model():
    from flax import nnx

    from tunix_rt.models.decoder import Decoder

    return Decoder(model_config(), rngs=nnx.Rngs(0))


def make_items(n: int = NUM_ITEMS, seed: int = 1234):
    """Random token ids (never 0, the pad id); even items train on every token, odd ones skip a prompt."""
    from tunix_rt.train.data import SFTExample

    rng = np.random.default_rng(seed)
    items = []
    for i in range(n):
        length = int(rng.integers(12, SEQ + 1))
        ids = rng.integers(1, VOCAB, size=length).astype(np.int32)
        mask = np.ones(length, bool)
        if i % 2:
            mask[: int(rng.integers(2, length // 2))] = False
        items.append(SFTExample(ids, mask))
    return items


def config(output, **overrides):
    from tunix_rt.train.config import SFTConfig

    values = dict(data="unused", output=str(output), steps=STEPS, batch_size=8, gradient_accumulation_steps=1,
                  max_length=SEQ, lora_rank=0, learning_rate=1e-2, save_steps=3, progress=False)
    values.update(overrides)
    return SFTConfig(**values)


def host_params(trainer) -> dict[str, np.ndarray]:
    """The trainable params as host arrays by path (gathered across processes when there are several)."""
    import jax
    from jax.experimental import multihost_utils

    leaves = jax.tree_util.tree_leaves_with_path(trainer.params)
    if jax.process_count() > 1:
        values = multihost_utils.process_allgather([x for _, x in leaves], tiled=True)
    else:
        values = [x for _, x in leaves]
    return {jax.tree_util.keystr(path): np.array(value) for (path, _), value in zip(leaves, values)}


def train(output, items, *, stop_after=None, mesh=None, objective=None, **overrides):
    """(records, trainer) of a fresh Trainer on a fresh model, fit to `stop_after` (None: the end)."""
    from tunix_rt.train.sft import SFTObjective
    from tunix_rt.train.trainer import Trainer

    objective = objective or SFTObjective(items, max_length=SEQ, pad_id=0)
    trainer = Trainer(config(output, **overrides), new_model(), objective, mesh=mesh)
    return trainer.fit(output=output, stop_after=stop_after), trainer


def _curve(records) -> dict:
    return {"losses": [r["loss"] for r in records], "grad_norms": [r["grad_norm"] for r in records]}


def _max_diff(a: dict, b: dict) -> tuple[float, str]:
    """The largest |a - b| over every param, and the param it is in."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((float(np.max(np.abs(a[k] - b[k]))), k) for k in a)


def _raises(fn) -> str | None:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def meshes(result: Path, output: Path) -> None:
    import jax

    from tunix_rt.parallel.mesh import make_mesh

    devices = jax.devices()
    assert len(devices) == 8, devices
    items = make_items()
    out: dict = {"errors": {
        "make_mesh(fsdp=3, tp=2)": _raises(lambda: make_mesh(3, 2)),
        "make_mesh(tp=3)": _raises(lambda: make_mesh(-1, 3)),
        "make_mesh(fsdp=4, tp=4)": _raises(lambda: make_mesh(4, 4)),
        "batch_size=4 on fsdp=8": _raises(lambda: train(output / "bad", items, batch_size=4, mesh=make_mesh(8, 1))),
    }}
    runs = {"one": (1, 1), "fsdp4_tp2": (4, 2), "fsdp8": (8, 1)}
    for lora in (0, 4):
        params = {}
        for name, (fsdp, tp) in runs.items():
            if lora and name == "fsdp8":
                continue
            key = f"lora_{name}" if lora else name
            mesh = make_mesh(fsdp, tp, devices=devices[: fsdp * tp])
            records, trainer = train(output / key, items, stop_after=3, mesh=mesh, lora_rank=lora)
            params[name] = host_params(trainer)
            diff, where = _max_diff(params[name], params["one"])
            run = {**_curve(records), "max_param_diff": diff, "max_param_diff_at": where, "mesh": dict(mesh.shape)}
            # where the layers' q_proj weight lives (stacked over the 2 layers, models/layer_stack.py): its trained
            # array (the kernel, or LoRA's B), Adam's first moment
            # of it and, with LoRA, the frozen base kernel; the spec the rules gave and the block each device holds
            trained = "lora_b" if lora else "kernel"
            trees = (("trained", trainer.params, trained), ("mu", trainer.opt_state, trained),
                     ("frozen", trainer.frozen, "kernel"))
            for tree_name, tree, leaf_name in trees:
                for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
                    p = jax.tree_util.keystr(path)
                    if "['layers']['kinds'][0]['attn']['q_proj']" in p and leaf_name in p and (tree_name != "mu" or ".mu[" in p):
                        run[f"q_proj_{tree_name}"] = {
                            "path": p, "spec": list(leaf.sharding.spec), "shape": list(leaf.shape),
                            "shard_shape": list(leaf.addressable_shards[0].data.shape)}
            out[key] = run
    # resume on another mesh: the 1-device run's step-3 checkpoint restored onto fsdp=4 x tp=2, one more step
    shutil.copytree(output / "one", output / "moved")
    records, trainer = train(output / "moved", items, stop_after=4, mesh=make_mesh(4, 2, devices=devices))
    out["resharded_resume"] = {**_curve(records), "steps": [r["step"] for r in records]}
    result.write_text(json.dumps(out))


def process(result: Path, output: Path, port: int, num_processes: int, process_id: int) -> None:
    from tunix_rt.parallel.mesh import initialize_distributed

    initialize_distributed(f"127.0.0.1:{port}", num_processes, process_id)
    import jax

    items = make_items()
    records, trainer = train(output, items, stop_after=3)  # cfg.fsdp = -1: a mesh over every global device
    params = host_params(trainer)
    resumed, _ = train(output, items, stop_after=4)  # a fresh Trainer restores the checkpoint both processes wrote
    if jax.process_index() == 0:
        np.savez(result.with_suffix(".npz"), **{f"p{i}": params[k] for i, k in enumerate(sorted(params))})
        result.write_text(json.dumps({**_curve(records), "resumed": _curve(resumed), "mesh": dict(trainer.mesh.shape),
                                      "global_devices": jax.device_count(), "local_devices": jax.local_device_count(),
                                      "process_count": jax.process_count(), "param_names": sorted(params)}))


if __name__ == "__main__":
    mode, result, output = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    if mode == "meshes":
        meshes(result, output)
    elif mode == "process":
        process(result, output, int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
