"""Every compiling command keeps a persistent compilation cache: its second run loads what the first compiled
(the engine's programs whole, from the program store beside it; the rest from XLA's cache)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

_STATS = re.compile(r"compilation cache: (\d+) of (\d+) programs loaded, (\d+) compiled; program store: (\d+) "
                    r"programs loaded whole, (\d+) stored")


def _run(command: str, *flags: str, store: str = "on") -> subprocess.CompletedProcess:
    args = (["score", "--text", "Paris is nice", "--json"] if command == "score"
            else ["generate", "--prompt", "Paris is", "--max-tokens", "4"])
    proc = subprocess.run([sys.executable, "-m", "tunix_rt", "-v", *args, *flags], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "TUNIX_RT_PROGRAM_STORE": store})
    assert proc.returncode == 0, proc.stderr
    return proc


def _stats(proc) -> tuple[int, int, int, int, int]:
    match = _STATS.search(proc.stderr)
    assert match, proc.stderr
    return tuple(map(int, match.groups()))


@pytest.mark.parametrize("command", ["score", "generate"])
def test_second_run_compiles_nothing(tmp_path, command):
    cache = tmp_path / "xla"
    first = _run(command, "--compile-cache-dir", str(cache))
    loaded, programs, compiled, whole, stored = _stats(first)
    assert loaded == whole == 0 and programs == compiled > 0
    assert (stored > 0) == (command == "generate")  # the engine's programs are stored whole; score has none
    second = _run(command, "--compile-cache-dir", str(cache))
    assert _stats(second) == (programs - stored, programs - stored, 0, stored, 0)
    assert "loaded ('forward'" in second.stderr if command == "generate" else "compiling (" not in second.stderr
    assert second.stdout == first.stdout


def test_the_program_store_can_be_turned_off(tmp_path):
    """TUNIX_RT_PROGRAM_STORE=off: the engine's programs come from XLA's cache alone (traced and lowered again)."""
    cache = tmp_path / "xla"
    _run("generate", "--compile-cache-dir", str(cache), store="off")
    second = _run("generate", "--compile-cache-dir", str(cache), store="off")
    loaded, programs, compiled, whole, stored = _stats(second)
    assert whole == stored == 0 and loaded == programs > 0 and compiled == 0
    assert not (cache / "tunix-rt-programs").exists()
    proc = subprocess.run([sys.executable, "-m", "tunix_rt", "generate", "--prompt", "hi", "--max-tokens", "1",
                           "--compile-cache-dir", str(cache)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TUNIX_RT_PROGRAM_STORE": "maybe"})
    assert proc.returncode != 0 and "TUNIX_RT_PROGRAM_STORE='maybe' is not one of on, off" in proc.stderr


def test_unusable_cache_is_a_warning_not_a_failure(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    proc = _run("score", "--compile-cache-dir", str(blocker / "xla"))
    assert "compiling without it" in proc.stderr and "compilation cache: off" in proc.stderr
    assert '"logprobs"' in proc.stdout
