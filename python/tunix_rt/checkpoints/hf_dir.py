"""Reading an HF-layout model directory: config.json, (sharded) safetensors, generation config."""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterator
from pathlib import Path

import ml_dtypes
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


_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "I64": np.int64,
           "I32": np.int32, "I16": np.int16, "I8": np.int8, "U64": np.uint64, "U32": np.uint32, "U16": np.uint16,
           "U8": np.uint8, "BOOL": np.bool_, "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}
_ITEMSIZE = {"F8_E8M0": 1, "C64": 8}  # dtypes a header may name that no tensor tunix-rt reads has
_MAX_HEADER = 100 << 20  # safetensors' own bound on the JSON header


class SafetensorsFile:
    """One safetensors file's header, its tensors read on demand with plain reads into fresh arrays. The
    safetensors package maps the file instead: every page read stays in the process's resident memory until the
    file is closed, which made loading a model peak at the file's size on top of the model's copy."""

    def __init__(self, path: Path):
        self.path = path
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                head = f.read(8)
                n = int.from_bytes(head, "little") if len(head) == 8 else -1
                if not 2 <= n <= min(_MAX_HEADER, size - 8):
                    raise CheckpointError(f"{path} is not a readable safetensors file: bad header length")
                header = json.loads(f.read(n))
        except OSError as e:
            raise CheckpointError(f"cannot read {path}: {e.strerror}") from None
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise CheckpointError(f"{path} is not a readable safetensors file: its header is not JSON ({e})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{path} is not a readable safetensors file: its header is not a JSON object")
        header.pop("__metadata__", None)
        self.tensors = {}  # name -> (dtype or None where numpy has none, shape, file offset, bytes)
        for name, entry in header.items():
            try:
                kind, shape, (start, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
                dtype = np.dtype(_DTYPES[kind]).newbyteorder("<") if kind in _DTYPES else None
                itemsize = dtype.itemsize if dtype is not None else _ITEMSIZE[kind]
                ok = all(isinstance(d, int) and d >= 0 for d in shape) and isinstance(start, int) and 0 <= start <= end
                ok = ok and end - start == math.prod(shape) * itemsize
            except (KeyError, TypeError, ValueError):
                ok = False
            if not ok:
                raise CheckpointError(f"{path} is not a readable safetensors file: tensor {name!r} has a malformed "
                                      f"entry in the header ({entry!r:.200})")
            if 8 + n + end > size:
                raise CheckpointError(f"{path} is not a readable safetensors file: it ends before tensor {name!r}'s "
                                      "data (truncated)")
            self.tensors[name] = (dtype, shape, 8 + n + start, end - start)

    def read(self, name: str) -> np.ndarray:
        dtype, shape, offset, nbytes = self.tensors[name]
        if dtype is None:
            raise CheckpointError(f"{self.path}: tensor {name!r} has a dtype tunix-rt does not read")
        out = np.empty(shape, dtype)
        try:
            with open(self.path, "rb") as f:
                f.seek(offset)
                got = f.readinto(memoryview(out.reshape(-1).view(np.uint8)))
        except OSError as e:
            raise CheckpointError(f"cannot read {self.path}: {e.strerror}") from None
        if got != nbytes:
            raise CheckpointError(f"{self.path} is not a readable safetensors file: it ends inside tensor {name!r} "
                                  "(truncated)")
        return out


def tensor_names(model_dir: Path) -> list[str]:
    """The names of every tensor, read from the safetensors headers alone (no tensor data)."""
    return [name for path in safetensors_files(model_dir) for name in SafetensorsFile(path).tensors]


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_STACKED = re.compile(r"(?:^|\.)(?:layers|experts)\.(\d+)\.")


def check_layer_count(model_dir: Path, num_layers: int) -> None:
    """A config that asks for more decoder layers than the checkpoint holds fails here, at once, instead of
    after the whole model is built."""
    names = [n for n in tensor_names(model_dir) if "vision_tower" not in n]  # a multimodal model's decoder layers
    held = {int(m.group(1)) for m in map(_LAYER.search, names) if m}
    if held and num_layers > len(held):  # (no layer names at all: an unknown scheme, left to the loader)
        raise CheckpointError(f"{model_dir / 'config.json'} asks for num_hidden_layers={num_layers}, but the "
                              f"checkpoint holds the weights of {len(held)} layer(s)")


def _stack_order(name: str) -> tuple:
    """Tensors of one layer-stacked weight in a row (every layer's q_proj, then every layer's k_proj, ...; a
    quantized weight's parts together): each stack is whole, moved to the device and its host parts freed
    before the next is read, instead of every layer's tensors waiting for the last layer."""
    indices = tuple(int(i) for i in _STACKED.findall(name))  # the layer, and an expert's index
    return _STACKED.sub(lambda m: m.group(0).replace(m.group(1), "*"), name).split(".weight", 1)[0], indices, name


def iter_tensors(model_dir: Path) -> Iterator[tuple[str, np.ndarray]]:
    """(name, array) for every tensor, the tensors of one layer-stacked weight in a row (_stack_order); bf16
    arrives as ml_dtypes.bfloat16."""
    where: dict[str, SafetensorsFile] = {}
    for f in map(SafetensorsFile, safetensors_files(model_dir)):
        for name in f.tensors:
            if name in where:
                raise CheckpointError(f"tensor {name!r} is in both {where[name].path.name} and {f.path.name}")
            where[name] = f
    for name in sorted(where, key=_stack_order):
        yield name, where[name].read(name)
