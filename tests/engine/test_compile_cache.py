"""Every compiling command keeps a persistent compilation cache: its second run loads what the first compiled."""

from __future__ import annotations

import re
import subprocess
import sys

_STATS = re.compile(r"compilation cache: (\d+) of (\d+) programs loaded, (\d+) compiled")


def _score(*flags: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "tunix_rt.cli", "-v", "score", "--text", "Paris is nice", "--json",
                           *flags], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return proc


def _stats(proc) -> tuple[int, int, int]:
    match = _STATS.search(proc.stderr)
    assert match, proc.stderr
    return tuple(map(int, match.groups()))


def test_second_run_compiles_nothing(tmp_path):
    cache = tmp_path / "xla"
    first = _score("--compile-cache-dir", str(cache))
    loaded, programs, compiled = _stats(first)
    assert loaded == 0 and programs == compiled > 0
    second = _score("--compile-cache-dir", str(cache))
    assert _stats(second) == (programs, programs, 0)
    assert second.stdout == first.stdout


def test_unusable_cache_is_a_warning_not_a_failure(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    proc = _score("--compile-cache-dir", str(blocker / "xla"))
    assert "compiling without it" in proc.stderr and "compilation cache: off" in proc.stderr
    assert '"logprobs"' in proc.stdout
