"""What every test module may use: a compilation cache per test process, one Hypothesis profile for every
property test (no per-example deadline, as a first example pays XLA's compile; no health-check failures for
slow or large draws, as op tests draw whole arrays), and XLA's cheap compile mode for modules whose programs
are small and compiled once per example."""

import gc
import os
import tempfile

# Each test process (an xdist worker, or the main one) and the CLI processes it starts keep their compilation
# caches in a directory of their own (compile_cache.DEFAULT_DIR follows XDG_CACHE_HOME): JAX writes a cache entry
# in place, so a process loading the entry another is still writing reads half of it, and XLA aborts.
os.environ["XDG_CACHE_HOME"] = os.path.join(tempfile.gettempdir(), f"tunix-rt-tests-{os.getuid()}",
                                            os.environ.get("PYTEST_XDIST_WORKER", "main"))

# The program store (engine/program_store.py) is off in test processes and the CLI processes they start, except
# where its own tests turn it on: twice in CI a long-lived test worker crashed inside XLA's deserialization of a
# stored program (not reproduced in stress runs of thousands of loads beside compiles and executions; most likely
# the memory-mapping limit that _release_compiled_programs below keeps workers from).
os.environ.setdefault("TUNIX_RT_PROGRAM_STORE", "off")

import jax  # noqa: E402
import pytest  # noqa: E402

# Nor do the test processes themselves read JAX's persistent compilation cache (the CLI processes they start do):
# a long-lived worker crashed inside XLA's deserialization of an entry from it too, with the program store off
# (an AsyncEngine's warm-up thread, the only thread at work). Modules that test the cache turn it on for
# themselves (test_trainer's compile_cache fixture).
jax.config.update("jax_enable_compilation_cache", False)
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile("tunix-rt", deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile("tunix-rt")


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
    """Drop JAX's compiled programs after each module. XLA:CPU maps each executable's code in ~9 memory mappings
    and keeps it while its jit cache holds it; a worker running a thousand tests came to 65530 (Linux's default
    vm.max_map_count), where the next compile or load segfaults inside XLA."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="module")
def fast_compiles():
    """Compile with XLA's expensive passes off (use: pytestmark = pytest.mark.usefixtures("fast_compiles")), in
    this process and in the processes it starts (the CLI reads JAX_DISABLE_MOST_OPTIMIZATIONS): the programs are
    small and the compile is what costs. For tests whose programs are compared with programs compiled alike, or
    with a reference within a tolerance. Not for bits shared by differently built programs (batch invariance, the
    trainer's log-probs equal to the engine's, a stacked layer equal to the unstacked one): those are claims about
    the optimized programs users run, and -O0 changes bits (it flipped a near-tie greedy token against llama.cpp)."""
    before = jax.config.values["jax_disable_most_optimizations"]
    jax.config.update("jax_disable_most_optimizations", True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
        yield
    jax.config.update("jax_disable_most_optimizations", before)
