"""LoRA adapters in HF peft's layout, both ways: what a LoRA run trains leaves as a directory peft loads on the
base model's HF export, and an adapter trained by peft or TRL loads onto our decoder.

The layout (peft's save_pretrained): adapter_config.json (peft_type "LORA", r, lora_alpha, target_modules, ...)
and adapter_model.safetensors with `base_model.model.<HF module>.lora_A.weight` (r, in) and `.lora_B.weight`
(out, r) per adapted module. Module names come from the one HF name table (checkpoints/weights.py through
hf_export.inverse_names). peft's scaling is lora_alpha / r (lora_alpha / sqrt(r) with use_rslora), per module
where rank_pattern / alpha_pattern say so; LoRALinear.scaling holds it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tunix_rt.checkpoints.hf_export import inverse_names
from tunix_rt.checkpoints.output_dir import check_output_dir, staged_output_dir
from tunix_rt.models.decoder import Decoder
from tunix_rt.models.lora import ALL_TARGETS, LoRALinear, lora_targets

if TYPE_CHECKING:
    import regex

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_TENSOR = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<part>[AB])(?:\.[^.]+)?\.weight$")


# adapter_config.json's keys as peft's LoraConfig (0.21) writes them; any other key is refused, so an option
# this runtime would silently ignore never changes what an adapter means.
KNOWN_CONFIG_KEYS = frozenset("""
alora_invocation_tokens alpha_pattern arrow_config auto_mapping base_model_name_or_path bias corda_config
ensure_weight_tying eva_config exclude_modules fan_in_fan_out inference_mode init_lora_weights kasa_config
layer_replication layers_pattern layers_to_transform loftq_config lora_alpha lora_bias lora_dropout lora_ga_config
megatron_config megatron_core modules_to_save monteclora_config peft_type peft_version qalora_group_size r
rank_pattern revision runtime_config target_modules target_parameters task_type trainable_token_indices use_bdlora
use_dora use_qalora use_rslora velora_config""".split())
# Options that change what the adapter computes at inference, which this runtime does not implement.
_UNSUPPORTED_WHEN_SET = ("alora_invocation_tokens", "arrow_config", "kasa_config", "layer_replication", "lora_bias",
                         "monteclora_config", "target_parameters", "trainable_token_indices", "use_bdlora",
                         "use_qalora", "use_dora", "velora_config", "modules_to_save", "fan_in_fan_out")
MAX_ABS_VALUE = 1e4  # larger adapter weights (or scalings) are refused: no trained LoRA comes near it
MAX_PATTERNS, MAX_PATTERN_CHARS = 4096, 1024
PATTERN_SECONDS = 1.0  # the time all of an adapter's rank/alpha patterns may take to match its modules


class AdapterError(ValueError):
    """An adapter that does not fit the model it is loaded on, or is not a LoRA adapter we can run."""


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def hf_module_names(model: Decoder) -> dict[str, tuple[nnx.Module, str, int]]:
    """HF module name (model.layers.3.self_attn.q_proj) -> (owner module, attribute, entry) of every projection a
    LoRA adapter can target: the owner holds the projection stacked over the layers of one kind
    (models/layer_stack.py), `entry` is the layer's place in that stack."""
    inverse = inverse_names(model.config)
    paths = {id(module): path for path, module in nnx.iter_modules(model)}
    names = {}
    for owner, attr in lora_targets(model, ALL_TARGETS):
        for tensor, _, (entry,) in inverse[(*paths[id(owner)], attr, "kernel")]:
            names[tensor.removesuffix(".weight")] = (owner, attr, entry)
    return names


def save_adapter(model: Decoder, out_dir: str | os.PathLike, *, base_model: str = "", overwrite: bool = False
                 ) -> Path:
    """Write `model`'s LoRA adapters as a peft adapter directory (staged beside it, renamed into place)."""
    tensors, ranks, alphas, modules = {}, {}, {}, []
    for name, (owner, attr, entry) in hf_module_names(model).items():
        lora = getattr(owner, attr)
        if not isinstance(lora, LoRALinear):
            continue
        a = np.asarray(jax.device_get(lora.lora_a[...][entry]), np.float32)  # (in, r)
        b = np.asarray(jax.device_get(lora.lora_b[...][entry]), np.float32)  # (r, out)
        tensors[f"{_PREFIX}{name}.lora_A.weight"] = np.ascontiguousarray(a.T)
        tensors[f"{_PREFIX}{name}.lora_B.weight"] = np.ascontiguousarray(b.T)
        ranks[name] = a.shape[1]
        alphas[name] = lora.scaling * a.shape[1]
        modules.append(name.rsplit(".", 1)[1])
    if not tensors:
        raise AdapterError("the model has no LoRA adapters to save")
    rank = max(set(ranks.values()), key=list(ranks.values()).count)
    alpha = max(set(alphas.values()), key=list(alphas.values()).count)
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, "r": rank,
        "lora_alpha": alpha, "lora_dropout": 0.0, "target_modules": sorted(set(modules)), "bias": "none",
        "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True, "use_rslora": False,
        "use_dora": False, "modules_to_save": None, "layers_to_transform": None,
        "rank_pattern": {f"^{re.escape(k)}$": v for k, v in ranks.items() if v != rank},
        "alpha_pattern": {f"^{re.escape(k)}$": v for k, v in alphas.items() if v != alpha},
    }
    out_dir = check_output_dir(out_dir, overwrite=overwrite, what="adapter directory")
    from safetensors.numpy import save_file

    with staged_output_dir(out_dir, overwrite=overwrite, what="adapter directory") as staging:
        save_file(tensors, str(staging / WEIGHTS), metadata={"format": "pt"})
        (staging / CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return out_dir


def is_adapter_dir(path: str | os.PathLike) -> bool:
    return (Path(path) / CONFIG).is_file()


def read_adapter_config(path: str | os.PathLike) -> dict:
    """adapter_config.json, checked to be a LoRA adapter this runtime can apply."""
    path = Path(path)
    if not (path / CONFIG).is_file():
        raise AdapterError(f"{path} is not a peft adapter directory (no {CONFIG})")
    if not (path / WEIGHTS).is_file():
        raise AdapterError(f"{path} has no {WEIGHTS} (adapters saved as .bin are not read; save with safetensors)")
    try:
        config = json.loads((path / CONFIG).read_text(encoding="utf-8"), parse_constant=_refuse_constant)
    except (OSError, ValueError) as e:
        raise AdapterError(f"{path / CONFIG} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{path / CONFIG} must hold a JSON object")
    unknown = sorted(set(config) - KNOWN_CONFIG_KEYS)
    if unknown:
        raise AdapterError(f"{path / CONFIG}: unknown key(s) {', '.join(map(repr, unknown[:10]))} (not options of "
                           f"peft's LoraConfig)")
    unsupported = [
        (config.get("peft_type", "LORA") != "LORA", f"peft_type {config.get('peft_type')!r} (only LORA)"),
        (config.get("bias", "none") != "none", f"bias {config.get('bias')!r} (only 'none')"),
    ] + [(bool(config.get(key)), f"{key} {config[key]!r}"[:120]) for key in _UNSUPPORTED_WHEN_SET if key in config]
    reasons = [why for bad, why in unsupported if bad]
    if reasons:
        raise AdapterError(f"{path}: unsupported adapter option(s): {', '.join(reasons)}")
    for key in ("r", "lora_alpha"):
        _check_number(config.get(key), f"{path / CONFIG}: {key}")
    for key in ("rank_pattern", "alpha_pattern"):
        patterns = config.get(key) or {}
        if not isinstance(patterns, dict) or len(patterns) > MAX_PATTERNS:
            raise AdapterError(f"{path / CONFIG}: {key} must be an object of at most {MAX_PATTERNS} patterns")
        for pattern, value in patterns.items():
            if len(pattern) > MAX_PATTERN_CHARS:
                raise AdapterError(f"{path / CONFIG}: a {key} key is longer than {MAX_PATTERN_CHARS} characters")
            _check_number(value, f"{path / CONFIG}: {key}[{pattern!r}]")
    return config


def _check_number(value, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_ABS_VALUE:
        raise AdapterError(f"{what} must be a positive number up to {MAX_ABS_VALUE:g}, got {value!r}")


class _PatternMatcher:
    """peft's rank_pattern / alpha_pattern rule (the first key matching the end of a module's name, as
    peft.utils.other.get_pattern_key), matched with the `regex` engine: a time limit over all of an adapter's
    matches, and the interpreter lock released while it matches, so a catastrophic pattern ((.*)*X) costs one
    AdapterError, not a frozen server."""

    def __init__(self, where: str):
        self.where = where
        self.budget = PATTERN_SECONDS
        self.compiled: dict[str, regex.Pattern] = {}

    def value(self, patterns: dict, module: str, default):
        import regex  # here, not at the top: loading a model without patterns never needs it (9 ms)

        for key, value in (patterns or {}).items():
            if key not in self.compiled:
                try:
                    self.compiled[key] = regex.compile(rf"(.*\.)?({key})$")
                except regex.error as e:
                    raise AdapterError(f"{self.where}: pattern {key!r} is not a valid regular expression: {e}") from None
            start = time.monotonic()
            try:
                if self.budget <= 0:
                    raise TimeoutError
                matched = self.compiled[key].match(module, timeout=self.budget, concurrent=True)
            except TimeoutError:
                raise AdapterError(f"{self.where}: the rank/alpha patterns take more than {PATTERN_SECONDS:g} s to "
                                   f"match the module names ({key!r} was matching: a pattern that backtracks "
                                   f"without end?)") from None
            self.budget -= time.monotonic() - start
            if matched:
                return value
        return default


def _load_tensors(path: Path) -> dict[str, np.ndarray]:
    """The adapter's tensors as float32 (peft saves them in the training dtype, often bfloat16)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="flax") as f:
            return {key: np.asarray(f.get_tensor(key).astype(jnp.float32)) for key in f.keys()}
    except (SafetensorError, OSError) as e:
        raise AdapterError(f"{path} is not a readable safetensors file: {e}") from None


@dataclasses.dataclass(frozen=True)
class AdaptedModule:
    """One projection's adapter, read and checked against the model it is for."""

    name: str  # the HF module name
    owner: nnx.Module  # it and `attr` name the projection stacked over its kind's layers; `entry`, the layer's place
    attr: str
    entry: int
    a: np.ndarray  # (in, r)
    b: np.ndarray  # (r, out)
    scaling: float

    @property
    def rank(self) -> int:
        return self.a.shape[1]


def read_adapter(model: Decoder, path: str | os.PathLike) -> tuple[dict, list[AdaptedModule]]:
    """The adapter at `path` (its config and one AdaptedModule per adapted projection), checked against `model`:
    a tensor naming a module the model lacks, or of another shape (an adapter of another base), is an
    AdapterError naming it."""
    path = Path(path)
    config = read_adapter_config(path)
    names = hf_module_names(model)
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for key, value in _load_tensors(path / WEIGHTS).items():
        match = _TENSOR.match(key)
        if match is None:
            raise AdapterError(f"{path / WEIGHTS}: tensor {key!r} is not a LoRA A or B weight")
        pairs.setdefault(match["module"], {})[match["part"]] = value
    if not pairs:
        raise AdapterError(f"{path / WEIGHTS} holds no LoRA weights")
    modules = []
    patterns = _PatternMatcher(str(path / CONFIG))
    for module, parts in sorted(pairs.items()):
        if module not in names:
            raise AdapterError(f"{path}: the adapter targets {module}, which this model has no adaptable projection "
                               f"named (an adapter of another base model?)")
        if set(parts) != {"A", "B"}:
            raise AdapterError(f"{path}: {module} has lora_{next(iter(parts))} but not both lora_A and lora_B")
        owner, attr, entry = names[module]
        layer = getattr(owner, attr)
        din, dout = getattr(layer, "base", layer).kernel.get_value().shape[-2:]
        a, b = parts["A"], parts["B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != din or b.shape[0] != dout or a.shape[0] != b.shape[1]:
            raise AdapterError(f"{path}: {module}'s lora_A {list(a.shape)} and lora_B {list(b.shape)} do not fit its "
                               f"({dout}, {din}) weight (an adapter of another base model?)")
        rank = a.shape[0]
        declared = patterns.value(config.get("rank_pattern"), module, config["r"])
        if declared != rank:
            raise AdapterError(f"{path}: {module}'s lora_A has rank {rank}, but its config says r = {declared}")
        alpha = float(patterns.value(config.get("alpha_pattern"), module, config["lora_alpha"]))
        scaling = alpha / (rank ** 0.5 if config.get("use_rslora") else rank)
        for part, tensor in (("lora_A", a), ("lora_B", b * np.float32(scaling))):
            if not np.isfinite(tensor).all():
                raise AdapterError(f"{path}: {module}'s {part} has non-finite values (NaN or inf)"
                                   + (" once scaled by lora_alpha / r" if part == "lora_B" else ""))
            if tensor.size and float(np.abs(tensor).max()) > MAX_ABS_VALUE:
                raise AdapterError(f"{path}: {module}'s {part} has values beyond ±{MAX_ABS_VALUE:g} (max "
                                   f"|{float(np.abs(tensor).max()):.3g}|"
                                   + (" once scaled by lora_alpha / r" if part == "lora_B" else "") + ")")
        modules.append(AdaptedModule(module, owner, attr, entry, np.ascontiguousarray(a.T, np.float32),
                                     np.ascontiguousarray(b.T, np.float32), scaling))
    return config, modules


def load_adapter(model: Decoder, path: str | os.PathLike, *, dropout: float = 0.0, seed: int = 0) -> dict:
    """Wrap the projections `path`'s adapter targets in LoRALinear with its weights, in place (`dropout` for
    training on from it); returns the adapter's config. The model is changed only when every tensor fits
    (read_adapter). A stacked projection takes one adapter per layer of its stack, at the largest rank its
    layers have (smaller ranks zero-padded, exact); layers the adapter leaves out get zeros (the base layer).
    Where a stack's layers differ in scaling (rank_pattern, alpha_pattern), each layer's B takes its own and the
    stack's scaling is 1."""
    config, modules = read_adapter(model, path)
    stacks: dict[tuple[int, str], list[AdaptedModule]] = {}
    for m in modules:
        if isinstance(getattr(m.owner, m.attr), LoRALinear):
            raise AdapterError(f"{m.name} already has a LoRA adapter")
        stacks.setdefault((id(m.owner), m.attr), []).append(m)
    rngs = nnx.Rngs(params=seed, dropout=seed + 1)
    for parts in stacks.values():
        owner, attr = parts[0].owner, parts[0].attr
        lora = LoRALinear(getattr(owner, attr), rank=max(m.rank for m in parts), alpha=1.0, dropout=dropout, rngs=rngs)
        a, b = np.zeros(lora.lora_a.shape, np.float32), np.zeros(lora.lora_b.shape, np.float32)
        one_scaling = len({m.scaling for m in parts}) == 1
        for m in parts:
            a[m.entry, :, :m.rank] = m.a
            b[m.entry, :m.rank] = m.b if one_scaling else m.b * np.float32(m.scaling)
        lora.lora_a.set_value(jnp.asarray(a))
        lora.lora_b.set_value(jnp.asarray(b))
        lora.scaling = parts[0].scaling if one_scaling else 1.0
        setattr(owner, attr, lora)
    return config


def adapter_targets(path: str | os.PathLike) -> tuple[str, ...]:
    """The projection names (q_proj, ...) an adapter directory's weights adapt."""
    from safetensors import safe_open

    with safe_open(str(Path(path) / WEIGHTS), "np") as f:
        modules = {m["module"].rsplit(".", 1)[-1] for m in map(_TENSOR.match, f.keys()) if m}
    return tuple(t for t in ALL_TARGETS if t in modules)
