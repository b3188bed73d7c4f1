"""Run untrusted Python (a policy's code, in agentic RL) in a separate, confined process.

The child is a fresh interpreter (`python -I -S`) that confines itself before it runs the code, with what
an unprivileged process can use on Linux:
- resource limits: CPU seconds (RLIMIT_CPU), address space (RLIMIT_AS: a 10 GB allocation fails with
  MemoryError), file size (RLIMIT_FSIZE), open files, no core dumps; the parent adds a wall-clock limit and
  kills the child when it passes;
- Landlock: every file-system write right (write, truncate, create, remove, rename, link) is allowed only
  beneath the child's scratch directory, so writing anywhere else fails with PermissionError; reads stay
  allowed (the standard library must load);
- a seccomp filter: `socket` (no network, not even 127.0.0.1 or a Unix socket), `fork`, `vfork`, `clone`
  and `clone3` (no processes or threads: a fork bomb gets PermissionError on its first fork) fail with
  EPERM, as do `ptrace` and the other-ABI syscalls (x32) that could slip past the filter.
stdout and stderr go to files in the scratch directory (capped by RLIMIT_FSIZE), read back truncated, so
a program that prints forever cannot fill the parent's memory. `sandbox_unavailable()` says why the
confinement cannot be set up on this machine (no Landlock, no seccomp, not Linux x86-64/aarch64); the
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

# The child's confinement, run by `python -I -S -c` before the code: argv = [scratch, code file,
# cpu seconds, memory bytes, file bytes]. Kept free of imports beyond the standard library's core.
_CHILD = r'''
import ctypes, os, resource, struct, sys
scratch, code_path, cpu, memory, fsize = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
libc = ctypes.CDLL(None, use_errno=True)

def fail(what):
    err = ctypes.get_errno()
    sys.stderr.write(f"sandbox: {what} failed: {os.strerror(err)}\n")
    os._exit(125)

resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
os.chdir(scratch)
if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
    fail("no_new_privs")

abi = libc.syscall(444, None, 0, 1)  # landlock_create_ruleset(NULL, 0, LANDLOCK_CREATE_RULESET_VERSION)
if abi < 1:
    fail("landlock")
# write-side rights: WRITE_FILE, REMOVE_DIR, REMOVE_FILE, MAKE_CHAR .. MAKE_SYM; REFER (ABI 2), TRUNCATE (3)
rights = 0x2 | 0x10 | 0x20 | 0x40 | 0x80 | 0x100 | 0x200 | 0x400 | 0x800 | 0x1000
rights |= (0x2000 if abi >= 2 else 0) | (0x4000 if abi >= 3 else 0)
attr = struct.pack("=Q", rights)
ruleset = libc.syscall(444, ctypes.c_char_p(attr), len(attr), 0)
if ruleset < 0:
    fail("landlock ruleset")
fd = os.open(scratch, os.O_PATH | os.O_DIRECTORY)
beneath = struct.pack("=Qi", rights, fd)
if libc.syscall(445, ruleset, 1, ctypes.c_char_p(beneath), 0) != 0:  # LANDLOCK_RULE_PATH_BENEATH
    fail("landlock rule")
if libc.syscall(446, ruleset, 0) != 0:
    fail("landlock restrict")
os.close(fd)
os.close(ruleset)

arch, denied = {"x86_64": (0xC000003E, (41, 56, 57, 58, 101, 435)),  # socket clone fork vfork ptrace clone3
                "aarch64": (0xC00000B7, (198, 220, 117, 435))}[os.uname().machine]  # socket clone ptrace clone3
ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
deny, allow, kill = 0x00050000 | 1, 0x7FFF0000, 0x80000000  # ERRNO(EPERM), ALLOW, KILL_PROCESS
prog = [(ld, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, kill), (ld, 0, 0, 0), (jge, 0, 1, 0x40000000), (ret, 0, 0, deny)]
for nr in denied:
    prog += [(jeq, 0, 1, nr), (ret, 0, 0, deny)]
prog.append((ret, 0, 0, allow))
filters = b"".join(struct.pack("=HBBI", *f) for f in prog)
buf = ctypes.create_string_buffer(filters)
fprog = struct.pack("=HxxxxxxQ", len(prog), ctypes.addressof(buf))
if libc.prctl(22, 2, ctypes.c_char_p(fprog), 0, 0) != 0:  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
    fail("seccomp")

with open(code_path) as f:
    source = f.read()
del ctypes, libc, struct, resource, buf, fprog, filters, prog
sys.argv = ["main.py"]
try:
    exec(compile(source, "main.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
except SystemExit:
    raise
except BaseException as e:  # the traceback from the code's own frames, as `python main.py` prints it
    import traceback
    traceback.print_exception(type(e), e, e.__traceback__.tb_next)
    sys.exit(1)
'''


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


def _read_capped(path: str) -> str:
    try:
        with open(path, "rb") as f:
            data = f.read(OUTPUT_LIMIT + 1)
    except OSError:
        return ""
    text = data[:OUTPUT_LIMIT].decode("utf-8", "replace")
    return text + "\n[output truncated]" if len(data) > OUTPUT_LIMIT else text


def run_python(code: str, *, wall_seconds: float = 10.0, cpu_seconds: int = 5, memory_bytes: int = 1 << 30,
               file_bytes: int = 16 << 20, check_available: bool = True) -> ExecutionResult:
    """Run `code` as a script in a fresh confined interpreter with its own scratch directory (removed
    afterwards); never raises for anything the code does. Limits: wall-clock seconds, CPU seconds,
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
        out_path, err_path = os.path.join(scratch, ".stdout"), os.path.join(scratch, ".stderr")
        argv = [sys.executable, "-I", "-S", "-c", _CHILD, scratch, code_path, str(int(cpu_seconds)),
                str(int(memory_bytes)), str(int(file_bytes))]
        start = time.monotonic()
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, cwd=scratch,
                                     start_new_session=True, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
            timed_out = False
            try:
                status = child.wait(timeout=wall_seconds)
            except subprocess.TimeoutExpired:
                timed_out = True
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
                status = None
        seconds = time.monotonic() - start
        return ExecutionResult(status, _read_capped(out_path), _read_capped(err_path), seconds, timed_out)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
