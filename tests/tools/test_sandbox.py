"""The Python executor's confinement (tools/sandbox.py): each escape attempt the agentic-RL issue names comes
back as an error observation within its limit, and the caller goes on."""

from __future__ import annotations

import os
import time

import pytest

from tunix_rt.tools.sandbox import OUTPUT_LIMIT, run_python, sandbox_unavailable

pytestmark = pytest.mark.skipif(sandbox_unavailable() is not None, reason=f"no sandbox here: {sandbox_unavailable()}")


def test_runs_code_and_reports_its_output():
    r = run_python("import math\nprint(math.factorial(20))\nimport sys; print('warn', file=sys.stderr)")
    assert r.ok and r.exit_status == 0
    assert r.stdout == "2432902008176640000\n" and r.stderr == "warn\n"
    assert r.observation() == "exit status 0\nstdout:\n2432902008176640000\n\nstderr:\nwarn\n"


def test_exit_status_and_traceback_of_the_code_alone():
    assert run_python("import sys; sys.exit(3)").exit_status == 3
    r = run_python("def f():\n    raise ValueError('boom')\nf()")
    assert r.exit_status == 1 and not r.ok
    assert r.stderr.startswith("Traceback (most recent call last):\n  File \"main.py\", line 3")
    assert r.stderr.rstrip().endswith("ValueError: boom") and "<string>" not in r.stderr


def test_infinite_loop_stops_at_the_cpu_limit():
    start = time.monotonic()
    r = run_python("while True:\n    pass", cpu_seconds=1, wall_seconds=20)
    assert time.monotonic() - start < 10 and not r.ok and not r.timed_out
    assert "CPU time limit" in r.observation()


def test_sleeping_code_stops_at_the_wall_clock_limit():
    start = time.monotonic()
    r = run_python("import time\ntime.sleep(60)", wall_seconds=1.5)
    assert r.timed_out and r.exit_status is None and time.monotonic() - start < 10
    assert "wall-clock limit" in r.observation()


def test_allocating_10_gb_fails():
    r = run_python("x = bytearray(10 * 1024**3)\nprint(len(x))")
    assert r.exit_status == 1 and "MemoryError" in r.stderr and r.stdout == ""


def test_no_socket_not_even_to_localhost():
    r = run_python("import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)\nprint('connected')")
    assert r.exit_status == 1 and "PermissionError" in r.stderr and "connected" not in r.stdout


def test_writes_outside_the_scratch_directory_fail(tmp_path):
    target = tmp_path / "escaped.txt"
    code = f"open('inside.txt', 'w').write('ok')\nprint(open('inside.txt').read())\nopen({str(target)!r}, 'w').write('x')"
    r = run_python(code)
    assert r.stdout == "ok\n" and "PermissionError" in r.stderr and r.exit_status == 1
    assert not target.exists()
    for code in (f"import os\nos.remove({__file__!r})", f"import os\nos.mkdir({str(tmp_path / 'd')!r})"):
        assert "PermissionError" in run_python(code).stderr
    assert os.path.exists(__file__) and not (tmp_path / "d").exists()


def test_fork_bomb_fails_at_its_first_fork():
    start = time.monotonic()
    r = run_python("import os\nwhile True:\n    os.fork()")
    assert r.exit_status == 1 and "PermissionError" in r.stderr and time.monotonic() - start < 10
    assert "PermissionError" in run_python("import subprocess\nsubprocess.run(['true'])").stderr


def test_output_is_capped():
    r = run_python("while True:\n    print('x' * 1000)", file_bytes=1 << 20)
    assert not r.ok and len(r.stdout) <= OUTPUT_LIMIT + 40 and r.stdout.endswith("[output truncated]")


def test_bad_limits_are_refused():
    for kw in (dict(wall_seconds=0), dict(cpu_seconds=-1), dict(memory_bytes=True), dict(file_bytes="1")):
        with pytest.raises(ValueError, match=next(iter(kw))):
            run_python("print(1)", **kw)
    with pytest.raises(ValueError, match="code"):
        run_python(b"print(1)")


def test_the_python_tool_returns_the_observation():
    from tunix_rt.tools.functions import call_tool, resolve_tool

    result = call_tool({"python": resolve_tool("python")}, "python", {"code": "print(6 * 7)"})
    assert not result.error and result.content == "exit status 0\nstdout:\n42\n"
