"""Reading an HF-layout model directory: config.json, (sharded) safetensors, generation config."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from tunix_rt.checkpoints.errors import CheckpointError
from tunix_rt.models.config import ModelConfig

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return data


def read_config(model_dir: Path) -> ModelConfig:
    path = model_dir / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{model_dir} has no config.json (not an HF model directory)")
    return ModelConfig.from_hf_dict(read_json(path))


def read_generation_config(model_dir: Path) -> dict:
    path = model_dir / "generation_config.json"
    return read_json(path) if path.is_file() else {}


def safetensors_files(model_dir: Path) -> list[Path]:
    """The shards in the order the index lists them, or the single file."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index} has no weight_map")
        files = [model_dir / name for name in dict.fromkeys(weight_map.values())]
    elif (model_dir / SINGLE_FILE).is_file():
        files = [model_dir / SINGLE_FILE]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir} holds no .safetensors weights")
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"{f.name} is listed in {INDEX_FILE} but missing from {model_dir}")
    return files


@contextlib.contextmanager
def _reading(path: Path):
    """A safetensors file opened for reading; what it cannot read is a CheckpointError naming the file."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="flax") as f:
            yield f
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path} is not a readable safetensors file: {e}") from None


def tensor_names(model_dir: Path) -> list[str]:
    """The names of every tensor, read from the safetensors headers alone (no tensor data)."""
    names = []
    for path in safetensors_files(model_dir):
        with _reading(path) as f:
            names.extend(f.keys())
    return names


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def check_layer_count(model_dir: Path, num_layers: int) -> None:
    """A config that asks for more decoder layers than the checkpoint holds fails here, at once, instead of
    after the whole model is built."""
    names = [n for n in tensor_names(model_dir) if "vision_tower" not in n]  # a multimodal model's decoder layers
    held = {int(m.group(1)) for m in map(_LAYER.search, names) if m}
    if held and num_layers > len(held):  # (no layer names at all: an unknown scheme, left to the loader)
        raise CheckpointError(f"{model_dir / 'config.json'} asks for num_hidden_layers={num_layers}, but the "
                              f"checkpoint holds the weights of {len(held)} layer(s)")


def iter_tensors(model_dir: Path) -> Iterator[tuple[str, np.ndarray]]:
    """(name, array) for every tensor; bf16 arrives as ml_dtypes.bfloat16."""
    for path in safetensors_files(model_dir):
        with _reading(path) as f:
            for name in f.keys():
                yield name, np.asarray(f.get_tensor(name))
