"""The persistent XLA compilation cache every compiling command uses (generate, score, serve, the training
commands, the Python API's Engine): a short job is mostly its compile, and the second run of the same command
loads its programs from disk instead. JAX keys each entry by the program, the compile options and the
jax/jaxlib versions; the FFI kernels are looked up by name when a program runs, so a cached program calls the
installed ones. A directory that cannot be made or written costs the cache, never the command: a warning."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

log = logging.getLogger("tunix_rt")

DEFAULT_DIR = str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tunix-rt" / "xla")

_counts = {"requests": 0, "hits": 0}
_lock = threading.Lock()
_listening = False
_chosen = False  # whether this process has said which cache it wants (a command's flag, the caller)


def _count(event: str, **_) -> None:
    key = {"/jax/compilation_cache/compile_requests_use_cache": "requests",
           "/jax/compilation_cache/cache_hits": "hits"}.get(event)
    if key:
        with _lock:
            _counts[key] += 1


def use_compile_cache(directory: str | None) -> str | None:
    """Point JAX's persistent compilation cache at `directory` (made if missing), caching every program, unless
    the user configured one already (JAX_COMPILATION_CACHE_DIR), which is kept. None or "": no cache. Returns
    the directory in use, or None (also when `directory` cannot be made or written, with a warning)."""
    global _listening, _chosen
    import jax

    _chosen = True
    if not _listening:
        jax.monitoring.register_event_listener(_count)
        _listening = True
    configured = jax.config.jax_compilation_cache_dir
    if configured:
        return configured
    if not directory:
        return None
    path = Path(directory).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        if not os.access(path, os.W_OK | os.X_OK):
            raise PermissionError("not writable")
    except OSError as e:
        log.warning("compilation cache %s unusable (%s): compiling without it", path, e.strerror or e)
        return None
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return str(path)


def ensure_compile_cache() -> str | None:
    """The default cache, unless this process chose one (or none) already: what an Engine made from Python uses."""
    if _chosen:
        import jax

        return jax.config.jax_compilation_cache_dir or None
    return use_compile_cache(DEFAULT_DIR)


def cache_stats() -> tuple[int, int]:
    """(programs looked up in the persistent cache, of which found there) since the cache was turned on."""
    with _lock:
        return _counts["requests"], _counts["hits"]
