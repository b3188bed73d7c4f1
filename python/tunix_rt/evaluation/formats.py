"""A model in each precision `tunix-rt eval --formats` compares: written as a GGUF file of that type and read
back, so the model scored is the one `export --format gguf --quant FMT` ships and llama.cpp runs."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from flax import nnx

from tunix_rt.checkpoints.gguf_export import QUANTS, export_gguf
from tunix_rt.checkpoints.loader import LoadedModel, load_model
from tunix_rt.models.decoder import Decoder
from tunix_rt.models.lora import has_lora, merge_lora
from tunix_rt.ops.quant import QuantizedTensor

SOURCE = "source"  # the model as loaded (its own packing): the default
FORMATS = (SOURCE, *QUANTS)


def parse_formats(spec: str | None) -> list[str]:
    formats = [f.strip() for f in (spec or SOURCE).split(",") if f.strip()]
    unknown = [f for f in formats if f not in FORMATS]
    if unknown or not formats:
        raise ValueError(f"--formats takes a comma-separated list of {', '.join(FORMATS)}; got {spec!r}")
    return list(dict.fromkeys(formats))


def weight_bytes(model: Decoder) -> int:
    """Bytes of the model's parameters as held (packed weights at their packed size)."""
    total = 0
    for _, var in nnx.to_flat_state(nnx.state(model)):
        value = var.get_value()
        arrays = [value.qs, value.scales, value.mins] if isinstance(value, QuantizedTensor) else [value]
        total += sum(int(np.asarray(a).nbytes) for a in arrays if hasattr(a, "dtype"))
    return total


def models_in_formats(loaded: LoadedModel, formats: list[str]) -> Iterator[tuple[str, Decoder]]:
    """(format, model) for each format, one at a time (each is dropped before the next is made)."""
    model = merge_lora(loaded.model) if has_lora(loaded.model) else loaded.model
    with tempfile.TemporaryDirectory(prefix="tunix-rt-eval-") as work:
        for fmt in formats:
            if fmt == SOURCE:
                yield fmt, model
                continue
            path = export_gguf(model, loaded.tokenizer, Path(work) / f"{fmt}.gguf", quant=fmt,
                               source=loaded.base_source or loaded.source)
            converted = load_model(path).model
            path.unlink()
            yield fmt, converted
            del converted  # before the next format's is made
