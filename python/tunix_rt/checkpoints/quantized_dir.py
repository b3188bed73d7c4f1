"""HF directories with quantized linear weights: writing them (`tunix-rt quantize`) and reading them.

Layout: the source directory's files, with config.json gaining
    "quantization_config": {"quant_method": "tunix_rt", "format": F, "group_size": G}
and every quantized weight X.weight (HF (out, in)) stored as X.weight.qs / .scales (/ .mins for
q4_1): the arrays of ops.quantize(W.T), whose (K, N) = (in, out) is the decoder's kernel orientation.
Embeddings and norms stay as they were.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from tunix_rt.checkpoints import hf_dir
from tunix_rt.checkpoints.errors import CheckpointError
from tunix_rt.checkpoints.output_dir import check_output_dir, staged_output_dir
from tunix_rt.ops.quant import QuantizedTensor, check_quantized, quantize, resolve_format

QUANT_METHOD = "tunix_rt"
_PARTS = ("qs", "scales", "mins")
_QUANTIZABLE = re.compile(r"(^model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight$)|(^lm_head\.weight$)")
_AUX_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
              "generation_config.json")


def quantization_config(model_dir: Path) -> dict | None:
    config = hf_dir.read_json(model_dir / "config.json") if (model_dir / "config.json").is_file() else {}
    qc = config.get("quantization_config")
    if qc is None:
        return None
    if qc.get("quant_method") != QUANT_METHOD:
        raise CheckpointError(f"unsupported quantization_config quant_method {qc.get('quant_method')!r} "
                              f"(tunix-rt reads its own '{QUANT_METHOD}' checkpoints)")
    resolve_format(qc.get("format"), qc.get("group_size"))
    return qc


def quantize_checkpoint(src: Path, out: str | os.PathLike, fmt: str, group_size: int | None = None, *,
                        overwrite: bool = False) -> dict:
    """Write `out`: src's HF checkpoint with its linear weights quantized. Returns a summary.

    `out` is built beside itself and renamed into place when complete (checkpoints/output_dir.py): a
    non-empty `out` is refused unless `overwrite`, and `out` may never be or overlap `src`.
    """
    from safetensors.numpy import save_file

    f, group = resolve_format(fmt, group_size)
    out = check_output_dir(out, overwrite=overwrite, sources=[src], what="quantize output")
    if not src.is_dir():
        raise CheckpointError(f"tunix-rt quantize needs an HF model directory, got {str(src)!r}")
    config = hf_dir.read_json(src / "config.json") if (src / "config.json").is_file() else None
    if config is None:
        raise CheckpointError(f"{src} has no config.json (not an HF model directory)")
    if "quantization_config" in config:
        raise CheckpointError(f"{src} is already quantized ({config['quantization_config']})")
    hf_dir.read_config(src)  # an architecture we can run
    tensors: dict[str, np.ndarray] = {}
    quantized = kept = 0
    unfit = []  # linear weights whose K is not a multiple of the group: left in float
    files = hf_dir.safetensors_files(src)
    for name, array in tqdm(hf_dir.iter_tensors(src), desc=f"quantize {fmt}", unit="tensor", leave=False):
        linear = _QUANTIZABLE.match(name) and array.ndim == 2
        if linear and array.shape[1] % group:
            unfit.append(name)
        if linear and array.shape[1] % group == 0:
            qt = quantize(jnp.asarray(array, jnp.float32).T, fmt, group)
            for part in _PARTS:
                if getattr(qt, part) is not None:
                    tensors[f"{name}.{part}"] = np.asarray(getattr(qt, part))
            quantized += 1
        else:
            tensors[name] = np.asarray(array)
            kept += 1
    config["quantization_config"] = {"quant_method": QUANT_METHOD, "format": f.name, "group_size": group}
    with staged_output_dir(out, overwrite=overwrite, sources=[src], what="quantize output") as staging:
        save_file(tensors, str(staging / hf_dir.SINGLE_FILE), metadata={"format": "pt"})
        size = (staging / hf_dir.SINGLE_FILE).stat().st_size
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for name in _AUX_FILES:
            if (src / name).is_file():
                shutil.copyfile(src / name, staging / name)
    return {"quantized": quantized, "kept": kept, "unfit": unfit, "bytes": size,
            "source_bytes": sum(p.stat().st_size for p in files)}


def group_quantized(tensors: Iterable[tuple[str, np.ndarray]], fmt: str,
                    group: int) -> Iterator[tuple[str, np.ndarray | QuantizedTensor]]:
    """Reassemble X.weight.{qs,scales[,mins]} into QuantizedTensors named X.weight."""
    f, group = resolve_format(fmt, group)
    needed = len(_PARTS) if f.has_min else len(_PARTS) - 1
    pending: dict[str, dict[str, np.ndarray]] = {}
    for name, array in tensors:
        base, _, part = name.rpartition(".")
        if part not in _PARTS:
            yield name, array
            continue
        parts = pending.setdefault(base, {})
        parts[part] = array
        if len(parts) == needed:
            del pending[base]
            n = parts["qs"].shape[0]
            k = parts["scales"].shape[1] * group
            for what in ("scales", "mins"):
                if what in parts and not np.isfinite(np.asarray(parts[what], np.float32)).all():
                    raise CheckpointError(f"quantized tensor {base} has non-finite {what}: the file is corrupt")
            qt = QuantizedTensor(parts["qs"], parts["scales"], parts.get("mins"), fmt, (k, n), group)
            try:
                check_quantized(qt)
            except ValueError as e:
                raise CheckpointError(f"quantized tensor {base}: {e}") from None
            yield base, qt
    if pending:
        raise CheckpointError(f"quantized tensors missing parts: {sorted(pending)[:3]}")
