"""The program store: compiled programs kept whole on disk, used only where everything that decides them matches."""

from __future__ import annotations

import functools
import logging
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tunix_rt.engine.program_store import Programs, ProgramStore, store_stats


@functools.partial(jax.jit, static_argnums=2, donate_argnums=0)
def _step(buffer, x, power):
    return buffer + x**power, jnp.sum(x)


def _programs(store, context="ctx") -> Programs:
    return Programs({"step": (_step, (2,))}, context, store)


def _args(n=8, power=2):
    return jnp.arange(n, dtype=jnp.float32), np.linspace(0, 1, n, dtype=np.float32), power


def test_a_second_set_loads_what_the_first_stored(tmp_path):
    store = ProgramStore(tmp_path)
    first = _programs(store)
    expected = first(("step", 8, 2), *_args())
    loaded, stored = store_stats()
    assert stored >= 1 and len(list(tmp_path.glob("*.program"))) == 1
    second = _programs(ProgramStore(tmp_path))
    buffer, x, power = _args()
    got = second(("step", 8, 2), buffer, x, power)
    assert store_stats()[0] == loaded + 1
    assert buffer.is_deleted()  # the stored program donates as the jitted function does
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(a, b)


def test_a_program_text_is_the_compiled_hlo_whether_compiled_or_loaded(tmp_path):
    """What names a profile's ops (benchmarks/profile_decode.py): the optimized HLO, the same for a loaded
    program as for the one compiled and stored."""
    compiled = _programs(ProgramStore(tmp_path))
    compiled(("step", 8, 3), *_args(power=3))
    loaded = _programs(ProgramStore(tmp_path))
    loaded(("step", 8, 3), *_args(power=3))
    text = compiled.text(("step", 8, 3))
    assert text.startswith("HloModule") and "multiply" in text
    def instructions(hlo):  # names and ops; source locations differ with the caller
        return re.findall(r"(\S+) = \S+ (\w[\w-]*)\(", hlo)

    assert instructions(loaded.text(("step", 8, 3))) == instructions(text) != []
    with pytest.raises(KeyError):
        compiled.text(("step", 8, 2))  # not made


def test_what_decides_a_program_is_in_its_key(tmp_path):
    store = ProgramStore(tmp_path)
    _programs(store)(("step", 8, 2), *_args())
    _programs(store)(("step", 8, 3), *_args(power=3))  # a static argument
    _programs(store)(("step", 16, 2), *_args(n=16))  # shapes
    _programs(store, context="another model")(("step", 8, 2), *_args())  # what the functions close over
    assert len(list(tmp_path.glob("*.program"))) == 4
    loaded = store_stats()[0]
    out = _programs(store)(("step", 8, 3), *_args(power=3))
    assert store_stats()[0] == loaded + 1
    np.testing.assert_allclose(out[0], np.arange(8) + np.linspace(0, 1, 8) ** 3, rtol=1e-6)


def test_a_damaged_entry_is_compiled_again_and_replaced(tmp_path, caplog):
    _programs(ProgramStore(tmp_path))(("step", 8, 2), *_args())
    (entry,) = tmp_path.glob("*.program")
    entry.write_bytes(entry.read_bytes()[: entry.stat().st_size // 2])
    with caplog.at_level(logging.WARNING):
        out = _programs(ProgramStore(tmp_path))(("step", 8, 2), *_args())
    assert "unusable" in caplog.text and "compiling instead" in caplog.text
    np.testing.assert_allclose(out[0], np.arange(8) + np.linspace(0, 1, 8) ** 2, rtol=1e-6)
    loaded = store_stats()[0]
    _programs(ProgramStore(tmp_path))(("step", 8, 2), *_args())  # the rewritten entry loads
    assert store_stats()[0] == loaded + 1


def test_an_entry_for_other_arguments_is_not_run(tmp_path, caplog):
    """A file whose program was compiled for other shapes (put under this key's name) is refused, not run."""
    store = ProgramStore(tmp_path)
    _programs(store)(("step", 16, 2), *_args(n=16))
    (other,) = tmp_path.glob("*.program")
    _programs(store)(("step", 8, 2), *_args())
    mine = next(p for p in tmp_path.glob("*.program") if p != other)
    mine.write_bytes(other.read_bytes())
    with caplog.at_level(logging.WARNING):
        out = _programs(ProgramStore(tmp_path))(("step", 8, 2), *_args())
    assert "compiled for other arguments" in caplog.text
    assert out[0].shape == (8,)


def test_an_unwritable_store_is_a_warning(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    programs = _programs(ProgramStore(blocker / "store"))
    with caplog.at_level(logging.WARNING):
        out = programs(("step", 8, 2), *_args())
        programs(("step", 16, 2), *_args(n=16))
    assert caplog.text.count("programs will compile again next run") == 1
    np.testing.assert_allclose(out[0], np.arange(8) + np.linspace(0, 1, 8) ** 2, rtol=1e-6)


_STORE_AND_RUN = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp, numpy as np
    from tunix_rt.engine.compile_cache import use_compile_cache
    from tunix_rt.engine.program_store import ProgramStore, Programs, store_stats
    from tunix_rt.ops.rms_norm import rms_norm

    use_compile_cache(sys.argv[1])
    f = jax.jit(lambda x, w: rms_norm(jnp.cumsum(x, axis=-1), w, eps=1e-6)[::2] * 3.0)
    x, w = np.linspace(-1, 1, 64, dtype=np.float32).reshape(8, 8), np.linspace(0.5, 1.5, 8, dtype=np.float32)
    if sys.argv[3] == "jit":
        print(np.asarray(f(x, w)).tolist())  # fills JAX's cache with this program
    else:
        out = Programs({"f": (f, ())}, "ctx", ProgramStore(sys.argv[2]))(("f",), x, w)
        print(np.asarray(out).tolist(), store_stats())
""")


def test_a_program_stored_beside_a_warm_xla_cache_runs_in_a_new_process(tmp_path):
    """XLA:CPU cannot serialize an executable it loaded from JAX's cache (the copy lacks its kernels: the failure
    shows only when it runs), so a program is stored from a compile of its own even when that cache holds it."""

    def run(mode):
        proc = subprocess.run([sys.executable, "-c", _STORE_AND_RUN, str(tmp_path / "xla"), str(tmp_path / "store"),
                               mode], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip()

    expected = run("jit")
    stored = run("programs")  # the XLA cache holds the program: compiled again, stored
    assert stored.startswith(expected) and stored.endswith("(0, 1)")
    loaded = run("programs")
    assert loaded.startswith(expected) and loaded.endswith("(1, 0)")


@pytest.mark.parametrize("greedy", [True, False])
def test_a_second_engine_loads_its_programs_and_generates_the_same(tmp_path, monkeypatch, greedy):
    from flax import nnx

    from tunix_rt.engine.engine import Engine
    from tunix_rt.engine.params import SamplingParams
    from tunix_rt.models.config import FULL, ModelConfig, RopeConfig
    from tunix_rt.models.decoder import Decoder

    tiny = Decoder(ModelConfig(architecture="llama", vocab_size=97, hidden_size=32, intermediate_size=48, num_layers=2,
                               num_heads=4, num_kv_heads=2, head_dim=8, rope=((FULL, RopeConfig(theta=10000.0)),)),
                   rngs=nnx.Rngs(0))
    monkeypatch.setattr(ProgramStore, "beside_compile_cache", classmethod(lambda cls: cls(tmp_path)))
    params = SamplingParams(max_tokens=12, temperature=0.0 if greedy else 0.8, seed=3)

    def generate():
        engine = Engine(tiny, None, max_model_len=64, max_num_seqs=2, decode_steps=4)
        return [list(out.token_ids) for out in engine.generate([[1, 5, 9, 2], [3, 3, 7]], params)]

    first = generate()
    loaded = store_stats()[0]
    assert generate() == first
    assert store_stats()[0] > loaded


def test_a_program_made_under_other_settings_is_not_loaded(tmp_path):
    """JAX settings changed at run time (globally, or by a context on this thread) key the store as jit's cache."""
    store = ProgramStore(tmp_path)
    _programs(store)(("step", 8, 2), *_args())
    with jax.default_matmul_precision("highest"):
        _programs(store)(("step", 8, 2), *_args())
    before = jax.config.values["jax_disable_most_optimizations"]
    jax.config.update("jax_disable_most_optimizations", not before)
    try:
        _programs(store)(("step", 8, 2), *_args())
    finally:
        jax.config.update("jax_disable_most_optimizations", before)
    assert len(list(tmp_path.glob("*.program"))) == 3
