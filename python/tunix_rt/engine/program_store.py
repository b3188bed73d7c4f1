"""Whole compiled programs kept on disk beside the XLA compilation cache, so that a second run of the same
command neither traces, lowers nor compiles them.

JAX's persistent cache is keyed by the lowered program: a warm run still traces and lowers every program
before it can look one up, and on the default model that was most of a warm `generate`'s program time. An
entry here is keyed instead by everything that decides a program before it is traced: this tunix-rt's code
(every module and the extension, by content), the versions of Python, jax, jaxlib and flax, JAX's
configuration, the kernel switches and XLA flags in the environment, the host's CPU features and devices,
the caller's description of what its functions close over (model structure, config), the program's key and
its arguments' shapes, dtypes and placements. A stored program is used only when the signature it was
compiled for is the call's; an entry that cannot be read, loaded or written costs the store (a warning, or
a recompile), never the command. Entries are written whole (a temporary file renamed into place), so
processes sharing a directory never see half of one. Like JAX's own cache, the store trusts the files in its
directory: it is the user's cache directory, not a place for files from elsewhere.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import re
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import numpy as np

log = logging.getLogger(__name__)

SUBDIRECTORY = "tunix-rt-programs"  # inside the compilation cache directory (JAX's cache ignores directories)
_ENV_PREFIXES = ("TUNIX_RT_", "XLA_FLAGS", "JAX_")
_counts = {"loaded": 0, "stored": 0}
_lock = threading.Lock()


def _count(event: str) -> None:
    with _lock:
        _counts[event] += 1


def store_stats() -> tuple[int, int]:
    """(programs loaded whole from a store, programs written to one) by this process."""
    with _lock:
        return _counts["loaded"], _counts["stored"]


def canonical(obj: object) -> str:
    """repr(obj) without the memory addresses some reprs hold (functions in a graphdef's static attributes)."""
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(obj))


def enabled() -> bool:
    """TUNIX_RT_PROGRAM_STORE: on (default, also when unset or empty) or off; anything else is refused."""
    value = os.environ.get("TUNIX_RT_PROGRAM_STORE", "").strip().lower() or "on"
    if value not in ("on", "off"):
        raise ValueError(f"TUNIX_RT_PROGRAM_STORE={value!r} is not one of on, off")
    return value == "on"


def _cpu_features() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    import platform

    return f"{platform.machine()} {platform.processor()}"


@functools.cache
def _code_fingerprint() -> str:
    """This tunix-rt's modules and extension (by content), and the versions of what traces and compiles."""
    import flax
    import jaxlib

    root = Path(__file__).resolve().parent.parent
    digest = hashlib.blake2b(digest_size=32)
    for path in sorted(root.rglob("*")):
        if path.suffix in (".py", ".so", ".pyd") and path.is_file():
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    for part in (sys.version, jax.__version__, jaxlib.__version__, flax.__version__, _cpu_features()):
        digest.update(part.encode())
    return digest.hexdigest()


def environment_fingerprint() -> str:
    """What every program depends on besides its caller's description and its arguments: the code, and the
    process's settings as they are now (JAX's configuration and the environment can change as it runs)."""
    environ = sorted((k, v) for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES))
    devices = [(d.platform, d.device_kind, d.id) for d in jax.devices()]
    from jax._src import config as jax_config

    # The global values, and this thread's view of those that key jit's own caches (contexts override them).
    config = canonical(sorted((k, v) for k, v in jax.config.values.items() if k != "jax_compilation_cache_dir"))
    return "\n".join((_code_fingerprint(), repr(environ), repr(devices), config, canonical(jax_config.trace_context())))


def _signature(args: Sequence) -> tuple:
    """The arguments' tree and each leaf's shape, dtype and placement: part of a program's key."""
    leaves, tree = jax.tree.flatten(list(args))
    return str(tree), tuple((tuple(np.shape(a)), str(getattr(a, "dtype", None) or np.result_type(a)),
                             str(getattr(a, "sharding", "host"))) for a in leaves)


def _no_cache_writes():
    """A context in which JAX writes no compiled program to its persistent cache (on this thread)."""
    from jax._src import config

    return config.persistent_cache_min_compile_time_secs(float("inf"))


def _avals(leaves: Sequence) -> list[tuple]:
    return [(tuple(a.shape), str(np.dtype(a.dtype))) for a in leaves]


class ProgramStore:
    """Compiled programs on disk, one file per key digest."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self._warned = False

    @classmethod
    def beside_compile_cache(cls) -> ProgramStore | None:
        """The store in the persistent compilation cache's directory, or None when that cache is off, the
        programs are not for the CPU (the only platform whose stored programs are tested here), or
        TUNIX_RT_PROGRAM_STORE=off (programs then come from JAX's cache alone: traced and lowered each run)."""
        cache = jax.config.jax_compilation_cache_dir
        return cls(Path(cache) / SUBDIRECTORY) if enabled() and cache and jax.default_backend() == "cpu" else None

    def _path(self, digest: str) -> Path:
        return self.directory / f"{digest}.program"

    def load(self, digest: str):
        """The stored program, loaded, or None (absent, unreadable, or made by something this process cannot load)."""
        from jax.experimental import serialize_executable

        from tunix_rt.ops._ffi import cpu_targets

        try:
            blob = self._path(digest).read_bytes()
        except OSError:
            return None
        cpu_targets()  # the kernels a stored program calls are found by name when it loads
        try:
            return serialize_executable.deserialize_and_load(*pickle.loads(blob))
        except Exception as e:  # a truncated or foreign entry: compile instead (and overwrite it)
            log.warning("program store: entry %s unusable (%s: %s): compiling instead", digest[:16],
                        type(e).__name__, e)
            return None

    @staticmethod
    def compile(lowered):
        """Compile `lowered` afresh, for storing. XLA:CPU cannot serialize an executable that it deserialized (from
        JAX's persistent cache): the copy lacks the program's kernels, which is found only when it runs. So a
        program to store must not come from that cache: an option the CPU compiler does not read (a GPU one)
        moves its cache key off every entry, and it is not written there either (no compile is long enough).
        Returns the compiled program and whether it may be stored (False if it came from the cache after all)."""
        from tunix_rt.engine.compile_cache import cache_stats

        hits = cache_stats()[1]
        with _no_cache_writes():
            compiled = lowered.compile(compiler_options={"xla_gpu_force_compilation_parallelism": 1})
        return compiled, cache_stats()[1] == hits

    def save(self, digest: str, compiled) -> None:
        from jax.experimental import serialize_executable

        try:
            blob = pickle.dumps(serialize_executable.serialize(compiled))
        except Exception as e:  # a program this JAX cannot serialize (closed-over constants): kept in memory only
            log.debug("program store: not storing %s (%s: %s)", digest[:16], type(e).__name__, e)
            return
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(blob)
                os.replace(tmp, self._path(digest))
                _count("stored")
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as e:
            if not self._warned:
                log.warning("program store %s unusable (%s): programs will compile again next run", self.directory,
                            e.strerror or e)
                self._warned = True


class Programs:
    """A set of jitted functions run by program key: the first call of a key loads its compiled program from the
    store or compiles it (and stores it); every later call runs the compiled program directly. A key names
    the function (its first element) and must determine the shapes of the arguments it is called with."""

    def __init__(self, functions: dict[str, tuple[Callable, tuple[int, ...]]], context: str,
                 store: ProgramStore | None):
        self._functions = functions  # name -> (jitted function, its static argnums)
        self._context = context
        self._store = store
        self._ready: dict[tuple, tuple[Callable, tuple[int, ...]]] = {}

    def keys(self):
        """The keys of the programs made so far."""
        return self._ready.keys()

    def text(self, key: tuple) -> str:
        """The optimized HLO of the program `key` (made already): what names its ops in a profile."""
        return self._ready[key][0].as_text()

    def function(self, name: str) -> Callable:
        """The jitted function behind the programs named `name` (to lower it by hand, as tests do)."""
        return self._functions[name][0]

    def __call__(self, key: tuple, *args):
        ready = self._ready.get(key)
        if ready is None:
            ready = self._prepare(key, args)
        program, static = ready
        return program(*(a for i, a in enumerate(args) if i not in static))

    def _prepare(self, key: tuple, args: tuple):
        fn, static = self._functions[key[0]]
        dynamic = [a for i, a in enumerate(args) if i not in static]
        signature = _signature(dynamic)
        program = None
        if self._store is not None:
            digest = hashlib.blake2b(
                "\n".join((environment_fingerprint(), self._context, canonical(key),
                           canonical([args[i] for i in static]), canonical(signature))).encode(),
                digest_size=32).hexdigest()
            program = self._store.load(digest)
            if program is not None and _avals(jax.tree.leaves(program.args_info)) != _avals(jax.tree.leaves(dynamic)):
                log.warning("program store: entry for %s was compiled for other arguments: compiling instead", key)
                program = None
            if program is not None:
                _count("loaded")
                log.info("loaded %s from the program store (%d programs so far)", key, len(self._ready) + 1)
        if program is None:
            log.info("compiling %s (new shape; %d programs so far)", key, len(self._ready) + 1)
            if self._store is None:
                program = fn.lower(*args).compile()
            else:
                program, storable = self._store.compile(fn.lower(*args))
                if storable:
                    self._store.save(digest, program)
        ready = self._ready[key] = (program, static)
        return ready

