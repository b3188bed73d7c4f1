"""The engine's LoRA adapters: registered adapters on the host, `max_loras` of them resident in the model's
adapter slots (models/multi_lora.py), least-recently-used eviction.

A request names an adapter (vLLM's LoRARequest). It takes a slot when the scheduler admits it and gives it back
when it finishes, is aborted or preempted; a slot whose adapter no running request uses may be given to another
adapter (its weights written into the runner's slot arrays, which keep their shapes: nothing recompiles). An
adapter removed while requests use it stays until they end; new requests cannot name it. Each registration has
a version of its own, which the prefix cache keys blocks by, so an adapter loaded again under the same name never
shares blocks computed with the old weights.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import os
import re

import jax.numpy as jnp
import numpy as np
from flax import nnx

from tunix_rt.checkpoints.peft_adapter import hf_module_names, read_adapter
from tunix_rt.engine.errors import LoRAAdapterError, UnknownLoRAAdapterError
from tunix_rt.models.multi_lora import MultiLoRALinear


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """vLLM's LoRARequest: the adapter a request runs with. A name the engine does not know yet is loaded from
    `lora_path` first. `lora_int_id` is kept for code written against vLLM; names identify adapters here."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""


@dataclasses.dataclass(eq=False)
class Adapter:
    name: str
    path: str
    version: int  # set when registered: a new one per registration
    weights: dict[str, tuple[np.ndarray, np.ndarray]]  # HF module name -> (A (in, r), B * scaling (r, out))
    pending: int = 0  # sequences in the engine that name it
    running: int = 0  # of which admitted (holding its slot)
    removed: bool = False

    @property
    def cache_key(self) -> tuple:
        return ("lora", self.name, self.version)


ADAPTER_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:/-]{0,127}")


def check_adapter_name(name) -> None:
    """An adapter's name is what clients send as `model` and what logs and metrics print: one rule for all of
    them, a safe character set (letters, digits, _ . : / -, not starting with . - / :) of 1 to 128 characters."""
    if not isinstance(name, str) or not ADAPTER_NAME.fullmatch(name):
        shown = repr(name[:40]) + ("..." if len(name) > 40 else "") if isinstance(name, str) else repr(name)
        raise LoRAAdapterError(f"adapter name {shown} is not allowed: use 1 to 128 letters, digits and _ . : / - "
                               f"(not starting with . - / :)")


class LoRAManager:
    def __init__(self, model: nnx.Module, runner, *, slots: int, rank: int, max_registered: int):
        self.model, self.runner, self.max_rank = model, runner, rank
        self.max_registered = max(max_registered, slots)
        entries: dict[int, dict[int, str]] = {}  # id(stacked projection) -> {entry: HF module name}
        for name, (owner, attr, entry) in hf_module_names(model).items():
            entries.setdefault(id(getattr(owner, attr)), {})[entry] = name
        index = {id(leaf): i for i, leaf in enumerate(runner.leaves)}
        # One per stacked projection: (runner leaf index of A, of B, host A (layers, in, slots * rank), host B
        # (layers, slots * rank, out), {entry: HF module name})
        self._stacks = []
        for _, module in nnx.iter_modules(model):
            if isinstance(module, MultiLoRALinear):
                a, b = module.lora_a.get_value(), module.lora_b.get_value()
                self._stacks.append((index[id(a)], index[id(b)], np.zeros(a.shape, np.float32),
                                     np.zeros(b.shape, np.float32), entries[id(module)]))
        self.slots: list[Adapter | None] = [None] * slots
        self._recent: collections.OrderedDict[int, None] = collections.OrderedDict((i, None) for i in range(slots))
        self.adapters: dict[str, Adapter] = {}
        self._versions = itertools.count(1)

    # -- registry ---------------------------------------------------------------------------------

    def read(self, name: str, path: str | os.PathLike) -> Adapter:
        """The peft adapter at `path`, read and checked against the model (a file's faults, another base's
        shapes, a rank over max_lora_rank are LoRAAdapterErrors), not yet registered. Touches no engine state, so
        it may run off the engine's thread."""
        check_adapter_name(name)
        try:
            _, modules = read_adapter(self.model, path)
        except Exception as e:  # noqa: BLE001 - unreadable files raise many kinds: each is the request's fault
            raise LoRAAdapterError(f"adapter {name!r}: {e}") from None
        over = [m for m in modules if m.rank > self.max_rank]
        if over:
            raise LoRAAdapterError(f"adapter {name!r} has rank {over[0].rank} ({over[0].name}), over this engine's "
                                   f"max_lora_rank {self.max_rank}")
        return Adapter(name, str(path), 0, {m.name: (m.a, m.b * np.float32(m.scaling)) for m in modules})

    def register(self, adapter: Adapter) -> Adapter:
        """Make a read adapter nameable by requests (a name in use is refused)."""
        if adapter.name in self.adapters:
            raise LoRAAdapterError(f"an adapter named {adapter.name!r} is already loaded", code="lora_adapter_exists")
        if not all(np.isfinite(w).all() for pair in adapter.weights.values() for w in pair):
            # the slots hold finite values only: a row's product then never sees another slot's (0 x inf = NaN)
            raise LoRAAdapterError(f"adapter {adapter.name!r} has non-finite weights")
        if len(self.adapters) >= self.max_registered:
            raise LoRAAdapterError(f"{len(self.adapters)} adapters are loaded, this engine's limit (max_cpu_loras "
                                   f"{self.max_registered}): unload one first")
        adapter.version = next(self._versions)
        self.adapters[adapter.name] = adapter
        return adapter

    def add(self, name: str, path: str | os.PathLike) -> Adapter:
        return self.register(self.read(name, path))

    def remove(self, name: str) -> None:
        """Unregister `name`: new requests cannot name it; the ones in flight finish with it."""
        adapter = self.adapters.get(name)
        if adapter is None:
            raise UnknownLoRAAdapterError(f"no adapter named {name!r} is loaded")
        adapter.removed = True  # it lives on under no name until its requests end
        self.adapters.pop(name)
        self._forget_if_done(adapter)

    def get(self, request: LoRARequest | str) -> Adapter:
        """The adapter a request names, registered from its path first when the name is new."""
        name = request if isinstance(request, str) else request.lora_name
        adapter = self.adapters.get(name)
        if adapter is not None:
            return adapter
        if isinstance(request, LoRARequest) and request.lora_path:
            return self.add(name, request.lora_path)
        raise UnknownLoRAAdapterError(f"no adapter named {name!r} is loaded")

    # -- requests ---------------------------------------------------------------------------------

    def request_added(self, adapter: Adapter, sequences: int) -> None:
        adapter.pending += sequences

    def request_done(self, adapter: Adapter) -> None:
        adapter.pending -= 1
        self._forget_if_done(adapter)

    def acquire(self, adapter: Adapter) -> int | None:
        """A slot holding `adapter` for one admitted sequence, loading it there if needed; None when every slot
        holds an adapter that running sequences use."""
        slot = next((i for i, held in enumerate(self.slots) if held is adapter), None)
        if slot is None:
            slot = next((i for i in self._recent if self.slots[i] is None or self.slots[i].running == 0), None)
            if slot is None:
                return None
            self._write(slot, adapter)
        self._recent.move_to_end(slot)
        adapter.running += 1
        return slot

    def release(self, adapter: Adapter) -> None:
        adapter.running -= 1

    def resident(self) -> list[str | None]:
        return [None if a is None else a.name for a in self.slots]

    # -- slots ------------------------------------------------------------------------------------

    def _write(self, slot: int, adapter: Adapter) -> None:
        """Put `adapter` in `slot`: its columns of every layer's A and rows of B (zero where it adapts nothing)."""
        r = self.max_rank
        cols = slice(slot * r, (slot + 1) * r)
        updates = {}
        for ia, ib, host_a, host_b, names in self._stacks:
            changed = False
            for entry, name in names.items():
                a, b = adapter.weights.get(name, (None, None))
                if a is None and not host_a[entry, :, cols].any() and not host_b[entry, cols].any():
                    continue  # nothing there before, nothing now
                host_a[entry, :, cols], host_b[entry, cols] = 0.0, 0.0
                if a is not None:
                    host_a[entry, :, slot * r:slot * r + a.shape[1]] = a
                    host_b[entry, slot * r:slot * r + b.shape[0]] = b
                changed = True
            if changed:
                updates[ia], updates[ib] = jnp.asarray(host_a), jnp.asarray(host_b)
        self.runner.replace_leaves(updates)
        self.slots[slot] = adapter

    def _forget_if_done(self, adapter: Adapter) -> None:
        if adapter.removed and adapter.pending == 0:
            for i, held in enumerate(self.slots):
                if held is adapter:
                    self.slots[i] = None  # its weights stay until another adapter takes the slot
