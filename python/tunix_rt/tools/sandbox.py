"""Run untrusted Python (a policy's code, in agentic RL) in a separate, confined process.

In RL the sandbox runs code a policy wrote while rewarded for results, so it must hold against deliberate
escape. The child is a fresh interpreter (`python -I -S tools/sandbox_child.py`) that confines itself with
allowlists before it runs the code (see that file): Landlock grants reads only beneath the Python
installation and the system libraries and writes only beneath the child's scratch directory; a seccomp
filter (libseccomp) allows only the syscalls pure computation needs; capabilities are dropped; rlimits cap
CPU seconds (RLIMIT_CPU), address space (a 10 GB allocation fails with MemoryError), file size, open files.
The environment is scrubbed and /proc is unreadable, so other processes and the parent's environment stay
hidden.

The parent bounds every wait by the wall-clock limit: it kills the child's process group when the limit
passes, reads stdout and stderr from unnamed files it holds itself (nothing the child can replace, by a FIFO
or otherwise), capped, and removes the scratch directory. `sandbox_unavailable()` says why the confinement
cannot be set up on this machine (no Landlock, no seccomp or libseccomp, not Linux x86-64/aarch64); the
executor then refuses to run code rather than run it unconfined.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time

OUTPUT_LIMIT = 4096  # characters of stdout / stderr an observation keeps (the tail past it is cut)
_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_child.py")


@dataclasses.dataclass(frozen=True)
class ExecutionResult:
    """What a sandboxed run gave back: its exit status (negative: killed by that signal; None: killed at
    the wall-clock limit), its output, cut to OUTPUT_LIMIT characters each, and how long it ran."""

    exit_status: int | None
    stdout: str
    stderr: str
    seconds: float
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.exit_status == 0 and not self.timed_out

    def observation(self) -> str:
        """The text a policy reads back: the exit status (and why it stopped), then stdout and stderr."""
        if self.timed_out:
            status = f"killed after the {self.seconds:.1f} s wall-clock limit"
        elif self.exit_status is not None and self.exit_status < 0:
            try:
                name = signal.Signals(-self.exit_status).name
            except ValueError:  # a number with no name on this platform
                name = ""
            status = f"killed by signal {-self.exit_status} {name}".rstrip()
            if name == "SIGXCPU":
                status += " (CPU time limit)"
        else:
            status = f"exit status {self.exit_status}"
        parts = [status]
        if self.stdout:
            parts.append(f"stdout:\n{self.stdout}")
        if self.stderr:
            parts.append(f"stderr:\n{self.stderr}")
        return "\n".join(parts)


@functools.cache
def sandbox_unavailable() -> str | None:
    """Why this machine cannot confine a child as described above, or None when it can."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "aarch64"):
        return f"the sandbox needs Linux on x86-64 or aarch64, this is {sys.platform} {platform.machine()}"
    probe = run_python("print('ok')", wall_seconds=30, check_available=False)
    if probe.stdout.strip() != "ok":
        detail = probe.stderr.strip().splitlines()[-1:] or [probe.observation()]
        return f"the sandbox could not confine a child process here: {detail[0]}"
    return None


def _read_capped(f) -> str:
    """The first OUTPUT_LIMIT characters the child wrote to `f` (an unnamed file the parent holds)."""
    data = os.pread(f.fileno(), OUTPUT_LIMIT + 1, 0)
    text = data[:OUTPUT_LIMIT].decode("utf-8", "replace")
    return text + "\n[output truncated]" if len(data) > OUTPUT_LIMIT else text


def run_python(code: str, *, wall_seconds: float = 10.0, cpu_seconds: int = 5, memory_bytes: int = 1 << 30,
               file_bytes: int = 16 << 20, check_available: bool = True) -> ExecutionResult:
    """Run `code` as a script in a fresh confined interpreter with its own scratch directory (removed
    afterwards); never raises for anything the code does, and returns within the wall-clock limit plus
    the time to kill the child and remove its scratch directory. Limits: wall-clock seconds, CPU seconds,
    address space and the size of any file it writes (its output included)."""
    for name, value in (("wall_seconds", wall_seconds), ("cpu_seconds", cpu_seconds), ("memory_bytes", memory_bytes),
                        ("file_bytes", file_bytes)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"run_python: {name} must be a positive number, got {value!r}")
    if not isinstance(code, str):
        raise ValueError(f"run_python: code must be a string, got {type(code).__name__}")
    if check_available and (why := sandbox_unavailable()) is not None:
        raise RuntimeError(why)
    scratch = tempfile.mkdtemp(prefix="tunix-rt-sandbox-")
    try:
        code_path = os.path.join(scratch, "main.py")
        with open(code_path, "w") as f:
            f.write(code)
        argv = [sys.executable, "-I", "-S", _CHILD, scratch, code_path, str(max(1, int(cpu_seconds))),
                str(int(memory_bytes)), str(int(file_bytes))]
        start = time.monotonic()
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, cwd=scratch,
                                     start_new_session=True, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
            timed_out = False
            try:
                status = child.wait(timeout=wall_seconds)
            except BaseException as e:  # the limit passed (or the caller was interrupted): kill, then reap
                timed_out = isinstance(e, subprocess.TimeoutExpired)
                os.killpg(child.pid, signal.SIGKILL)  # not reaped yet, so the group is still the child's
                child.wait()  # SIGKILL cannot be caught: a short wait
                if not timed_out:
                    raise
                status = None
            seconds = time.monotonic() - start
            return ExecutionResult(status, _read_capped(out), _read_capped(err), seconds, timed_out)
    finally:
        _remove_scratch(scratch)


def _remove_scratch(scratch: str) -> None:
    """Remove the scratch directory whatever modes the child gave the directories it made (mkdir(d, 0o300)
    would keep a non-root parent out); it cannot make links, so nothing here leads outside."""
    for root, dirs, _ in os.walk(scratch):
        for d in dirs:
            try:
                os.chmod(os.path.join(root, d), 0o700, follow_symlinks=False)
            except OSError:
                pass
    shutil.rmtree(scratch, ignore_errors=True)

