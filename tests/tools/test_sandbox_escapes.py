"""Escape attempts against the Python sandbox, as a policy rewarded for results would try them: each case is
code run through run_python that tries one way out (network, other processes, files outside the scratch
directory, kernel interfaces) and prints `blocked ERRNO` when the attempt fails or `ESCAPED` when it works.
Every case must be blocked, the child must get as far as the attempt, and the parent must return within its
limit. The same cases run unconfined (a plain interpreter, same user) show which of them work without the
sandbox, so a case cannot pass only because the machine forbids it anyway."""

from __future__ import annotations

import os
import platform
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest

from tunix_rt.tools.sandbox import run_python, sandbox_unavailable

pytestmark = pytest.mark.skipif(sandbox_unavailable() is not None, reason=f"no sandbox here: {sandbox_unavailable()}")

# Syscall numbers the cases call raw (those above 423 are the same on every architecture).
_NR = {
    "x86_64": dict(ptrace=101, process_vm_readv=310, bpf=321, perf_event_open=298, keyctl=250, add_key=248,
                   userfaultfd=323, unshare=272, setns=308, mount=165, tgkill=234, rt_sigqueueinfo=129,
                   open_by_handle_at=304, name_to_handle_at=303, vfork=58, clone=56, kcmp=312, personality=135,
                   setuid=105, chroot=161, fchmodat=268, capset=126),
    "aarch64": dict(ptrace=117, process_vm_readv=270, bpf=280, perf_event_open=241, keyctl=219, add_key=217,
                    userfaultfd=282, unshare=97, setns=268, mount=40, tgkill=131, rt_sigqueueinfo=138,
                    open_by_handle_at=265, name_to_handle_at=264, vfork=None, clone=220, kcmp=272,
                    personality=92, setuid=146, chroot=51, fchmodat=53, capset=91),
}[platform.machine()]
_NR.update(io_uring_setup=425, pidfd_send_signal=424, pidfd_open=434, clone3=435, openat2=437, pidfd_getfd=438,
           fsopen=430, open_tree=428, memfd_secret=447)

# Run before each case: `attempt(f, *args)` prints what happened; `sc(name, *args)` is a raw syscall.
_PRELUDE = f"""
import ctypes, errno, os, sys
NR = {_NR!r}
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def sc(name, *args):
    r = libc.syscall(ctypes.c_long(NR[name]), *[a if isinstance(a, ctypes.Array) else ctypes.c_long(a) for a in args])
    if r < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return r
def attempt(f, *args):
    try:
        r = f(*args)
    except OSError as e:
        print("blocked", errno.errorcode.get(e.errno, e.errno))
    else:
        print("ESCAPED", repr(r)[:80])
    sys.stdout.flush()
"""

# name -> code; the code may use PARENT (the caller's pid), DECOY (a process of the same user), OUTSIDE (a
# file outside the scratch directory), SECRET (a readable file there), PORT (a listening TCP port), UNIX (a
# listening Unix socket path). Each prints one line per attempt.
CASES = {
    # the network, by every family and by io_uring (the first very bad case)
    "io_uring_setup": "params = ctypes.create_string_buffer(120)\nattempt(sc, 'io_uring_setup', 8, params)",
    "tcp_localhost": "import socket\nattempt(socket.create_connection, ('127.0.0.1', PORT), 2)",
    "tcp6": "import socket\nattempt(socket.socket, socket.AF_INET6, socket.SOCK_STREAM)",
    "udp": "import socket\nattempt(socket.socket, socket.AF_INET, socket.SOCK_DGRAM)",
    "unix_socket": "import socket\ns = None\ndef go():\n    s = socket.socket(socket.AF_UNIX)\n    s.connect(UNIX)\n"
                   "attempt(go)",
    "netlink": "import socket\nattempt(socket.socket, socket.AF_NETLINK, socket.SOCK_RAW, 0)",
    "socketpair": "import socket\nattempt(socket.socketpair)",
    # metadata outside the scratch directory (the second)
    "chmod": "attempt(os.chmod, OUTSIDE, 0o777)",
    "fchmodat": "attempt(sc, 'fchmodat', -100, ctypes.create_string_buffer(OUTSIDE.encode()), 0o777)",
    "chown": "attempt(os.chown, OUTSIDE, 1234, 1234)",
    "utime": "attempt(os.utime, OUTSIDE, (0, 0))",
    "setxattr": "attempt(os.setxattr, OUTSIDE, 'user.evil', b'1')",
    "removexattr": "attempt(os.removexattr, OUTSIDE, 'user.keep')",
    "truncate": "attempt(os.truncate, OUTSIDE, 0)",
    "write_outside": "attempt(lambda: open(OUTSIDE, 'a').write('x'))",
    "rename_outside": "attempt(os.rename, OUTSIDE, OUTSIDE + '.moved')",
    "hardlink_into_scratch": "attempt(os.link, OUTSIDE, 'linked')",
    "symlink": "attempt(os.symlink, OUTSIDE, 'sym')",
    # other processes: signals by pid, group, pidfd, queue, SIGIO owner; priorities (the third)
    "kill_parent_probe": "attempt(os.kill, PARENT, 0)",
    "kill_decoy": "import signal\nattempt(os.kill, DECOY, signal.SIGKILL)",
    "tgkill_decoy": "attempt(sc, 'tgkill', DECOY, DECOY, 9)",
    "sigqueue_decoy": "attempt(sc, 'rt_sigqueueinfo', DECOY, 9, ctypes.create_string_buffer(128))",
    "pidfd_open": "attempt(os.pidfd_open, DECOY)",
    "pidfd_send_signal": "attempt(sc, 'pidfd_send_signal', 0, 9, 0, 0)",
    "pidfd_getfd": "attempt(sc, 'pidfd_getfd', 0, 0, 0)",
    "fcntl_setown": "import fcntl\nattempt(fcntl.fcntl, 1, fcntl.F_SETOWN, DECOY)",
    "setpriority_decoy": "attempt(os.setpriority, os.PRIO_PROCESS, DECOY, 19)",
    "prlimit_decoy": "import resource\nattempt(resource.prlimit, DECOY, resource.RLIMIT_NOFILE, (1, 1))",
    # what other processes hold: environments, command lines, memory
    "parent_environ": "attempt(lambda: open(f'/proc/{PARENT}/environ', 'rb').read())",
    "decoy_cmdline": "attempt(lambda: open(f'/proc/{DECOY}/cmdline', 'rb').read())",
    "list_processes": "attempt(os.listdir, '/proc')",
    "self_environ": "attempt(lambda: open('/proc/self/environ', 'rb').read())",
    "decoy_mem": "attempt(lambda: open(f'/proc/{DECOY}/mem', 'r+b'))",
    "process_vm_readv": "iov = ctypes.create_string_buffer(16)\n"
                        "attempt(sc, 'process_vm_readv', DECOY, iov, 1, iov, 1, 0)",
    "ptrace_attach": "attempt(sc, 'ptrace', 16, DECOY, 0, 0)",
    "kcmp": "attempt(sc, 'kcmp', PARENT, DECOY, 0, 0, 0)",
    # new processes and programs
    "fork": "attempt(os.fork)",
    "vfork_or_clone": "attempt(sc, 'vfork') if NR['vfork'] else attempt(sc, 'clone', 17, 0, 0, 0, 0)",
    "clone3": "args = ctypes.create_string_buffer(88)\nattempt(sc, 'clone3', args, 88)",
    "execv": "attempt(os.execv, '/bin/sh', ['sh', '-c', 'echo ESCAPED'])",
    "posix_spawn": "attempt(os.posix_spawn, '/bin/true', ['true'], {})",
    "subprocess": "import subprocess\nattempt(subprocess.run, ['true'])",
    # files by other routes: secrets, handles, openat2, memfd, new mounts, FIFOs
    "read_secret": "attempt(lambda: open(SECRET).read())",
    "read_etc": "attempt(lambda: open('/etc/passwd').read())",
    "list_home": "attempt(os.listdir, os.path.dirname(SECRET))",
    "openat2_secret": "how = ctypes.create_string_buffer(24)\n"
                      "attempt(sc, 'openat2', -100, ctypes.create_string_buffer(SECRET.encode()), how, 24)",
    "name_to_handle_at": "h = ctypes.create_string_buffer(136)\nh[0:4] = (128).to_bytes(4, 'little')\n"
                         "mnt = ctypes.create_string_buffer(4)\n"
                         "attempt(sc, 'name_to_handle_at', -100, ctypes.create_string_buffer(SECRET.encode()), h, mnt, 0)",
    "open_by_handle_at": "attempt(sc, 'open_by_handle_at', -100, ctypes.create_string_buffer(16), 0)",
    "memfd_create": "attempt(os.memfd_create, 'x')",
    "mkfifo": "attempt(os.mkfifo, 'fifo')",
    "mknod_stdout": "import stat\nattempt(os.mknod, '.stdout', stat.S_IFIFO | 0o600)",
    "fsopen": "attempt(sc, 'fsopen', ctypes.create_string_buffer(b'tmpfs'), 0)",
    "open_tree": "attempt(sc, 'open_tree', -100, ctypes.create_string_buffer(b'/'), 1)",
    "mount": "attempt(sc, 'mount', ctypes.create_string_buffer(b'none'), ctypes.create_string_buffer(b'.'),"
             " ctypes.create_string_buffer(b'tmpfs'), 0, 0)",
    "chroot": "attempt(sc, 'chroot', ctypes.create_string_buffer(b'.'))",
    "ioctl_tiocsti": "import fcntl\nattempt(fcntl.ioctl, 0, 0x5412, b'x')",
    # the kernel's other interfaces: namespaces, BPF, perf, keyrings, userfaultfd, identity, time, host name
    "unshare_user": "attempt(sc, 'unshare', 0x10000000)",
    "setns": "attempt(sc, 'setns', 0, 0)",
    "bpf": "attr = ctypes.create_string_buffer(128)\nattempt(sc, 'bpf', 0, attr, 128)",
    "perf_event_open": "attr = ctypes.create_string_buffer(128)\nattr[0:4] = (1).to_bytes(4, 'little')\n"
                       "attempt(sc, 'perf_event_open', attr, 0, -1, -1, 0)",
    "keyctl": "attempt(sc, 'keyctl', 0, -3, 0, 0, 0)",
    "add_key": "attempt(sc, 'add_key', ctypes.create_string_buffer(b'user'), ctypes.create_string_buffer(b'k'),"
               " ctypes.create_string_buffer(b'v'), 1, -3)",
    "userfaultfd": "attempt(sc, 'userfaultfd', 0)",
    "personality": "attempt(sc, 'personality', 0x0040000)",
    "setuid": "attempt(sc, 'setuid', os.getuid())",
    "capset": "hdr = ctypes.create_string_buffer((0x20080522).to_bytes(4, 'little') + bytes(4))\n"
              "attempt(sc, 'capset', hdr, ctypes.create_string_buffer(24))",
    "clock_settime": "import time\nattempt(time.clock_settime, time.CLOCK_REALTIME, time.clock_gettime(time.CLOCK_REALTIME))",
    "sethostname": "import socket\nattempt(socket.sethostname, socket.gethostname())",
    "memfd_secret": "attempt(sc, 'memfd_secret', 0)",
}


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """What the cases aim at: a decoy process of the same user, a file outside the scratch directory (with an
    extended attribute), a secret beside it, a TCP and a Unix listener."""
    where = tmp_path_factory.mktemp("targets")
    outside = where / "outside.txt"
    outside.write_text("keep me")
    os.chmod(outside, 0o644)
    try:
        os.setxattr(outside, "user.keep", b"1")
    except OSError:
        pass
    secret = where / "secret.txt"
    secret.write_text("api-key")
    # its output goes nowhere: were the worker to die, an orphan must not hold the runner's pipe open
    decoy = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], env={"API_KEY": "sk-secret"},
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    listener = socket.create_server(("127.0.0.1", 0))
    unix_path = str(where / "unix.sock")
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(unix_path)
    unix.listen()
    yield dict(PARENT=os.getpid(), DECOY=decoy.pid, OUTSIDE=str(outside), SECRET=str(secret),
               PORT=listener.getsockname()[1], UNIX=unix_path), outside, decoy, listener
    decoy.kill()
    decoy.wait()
    listener.close()
    unix.close()


def _script(name, values):
    head = "".join(f"{k} = {v!r}\n" for k, v in values.items())
    return _PRELUDE + head + textwrap.dedent(CASES[name]) + "\nprint('done')\n"


def _outcomes(stdout):
    lines = stdout.splitlines()
    assert lines and lines[-1] == "done", f"the attempt did not run to its end: {stdout!r}"
    return lines[:-1]


@pytest.mark.parametrize("name", sorted(CASES))
def test_escape_is_blocked(name, targets):
    values, outside, decoy, listener = targets
    before = os.stat(outside)
    start = time.monotonic()
    r = run_python(_script(name, values), wall_seconds=10)
    assert time.monotonic() - start < 10, "the parent waited past its limit"
    assert r.exit_status == 0, r.observation()
    outcomes = _outcomes(r.stdout)
    assert outcomes and all(o.startswith("blocked") for o in outcomes), r.observation()
    after = os.stat(outside)
    assert (after.st_mode, after.st_uid, after.st_mtime_ns, after.st_size) == \
        (before.st_mode, before.st_uid, before.st_mtime_ns, before.st_size)
    assert outside.read_text() == "keep me" and decoy.poll() is None
    listener.setblocking(False)
    with pytest.raises(BlockingIOError):  # nothing connected
        listener.accept()


# Cases that work for any user outside the sandbox (the rest need privileges or kernel settings a machine
# may lack): each must print ESCAPED when run by a plain interpreter, so the test above can fail.
ESCAPE_UNCONFINED = ["io_uring_setup", "tcp_localhost", "udp", "unix_socket", "socketpair", "chmod", "utime",
                     "write_outside", "hardlink_into_scratch", "symlink", "kill_parent_probe", "pidfd_open",
                     "fcntl_setown", "parent_environ", "decoy_cmdline", "list_processes", "fork", "posix_spawn",
                     "subprocess", "read_secret", "read_etc", "list_home", "memfd_create", "mkfifo", "setuid",
                     "self_environ"]


@pytest.mark.parametrize("name", ESCAPE_UNCONFINED)
def test_case_escapes_without_the_sandbox(name, targets, tmp_path):
    values = dict(targets[0], OUTSIDE=str(tmp_path / "own.txt"))  # its own file: the real one stays intact
    (tmp_path / "own.txt").write_text("x")
    if name == "io_uring_setup" and _sysctl("kernel/io_uring_disabled") not in (None, "0"):
        pytest.skip("io_uring is disabled on this machine")
    code = _script(name, values).replace("attempt(os.fork)", "attempt(lambda: os.fork() or os.wait())")
    r = subprocess.run([sys.executable, "-I", "-S", "-c", code], cwd=tmp_path, capture_output=True, text=True,
                       timeout=30)
    if name == "fork":
        r = subprocess.CompletedProcess(r.args, r.returncode, "\n".join(
            line for line in r.stdout.splitlines() if not line.startswith("ESCAPED 0")) + "\n", r.stderr)
    outcomes = _outcomes(r.stdout)
    assert any(o.startswith("ESCAPED") for o in outcomes), (r.stdout, r.stderr)


def _sysctl(name):
    try:
        with open(f"/proc/sys/{name}") as f:
            return f.read().strip()
    except OSError:
        return None


def test_a_fifo_in_place_of_the_output_does_not_hang_the_caller(monkeypatch, tmp_path):
    """The issue's fourth case: the code tried to swap its output for a FIFO so that the parent's read blocks.
    The outputs are unnamed files the parent holds, FIFOs cannot be made, and the scratch directory goes."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    code = ("import os\nfor p in os.listdir('.'):\n    os.remove(p)\n"
            "for p in ('.stdout', '.stderr'):\n    try:\n        os.mkfifo(p)\n    except OSError as e:\n"
            "        print('blocked', e.errno)\nprint('x' * 100, flush=True)\nimport time\ntime.sleep(30)")
    start = time.monotonic()
    r = run_python(code, wall_seconds=2)
    assert time.monotonic() - start < 6 and r.timed_out
    assert r.stdout.startswith("blocked 1\nblocked 1\n" + "x" * 100)
    assert [p for p in tmp_path.iterdir() if p.name.startswith("tunix-rt-sandbox-")] == []


def test_directories_the_code_locks_are_removed(monkeypatch, tmp_path):
    """mkdir(d, 0o300) with files inside would keep a non-root caller's rmtree out: the scratch goes anyway."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    r = run_python("import os\nos.mkdir('d', 0o300)\nos.mkdir('d/e', 0o000)\nopen('d/f', 'w').write('x')\n"
                   "print('made')")
    assert r.stdout == "made\n", r.observation()
    assert [p for p in tmp_path.iterdir() if p.name.startswith("tunix-rt-sandbox-")] == []


def test_the_parent_stays_responsive_while_hostile_code_runs():
    """A run that spins, sleeps and floods its output is a separate process: another thread of the caller
    keeps working, and the run comes back at its limit."""
    done = threading.Event()
    result = {}

    def hostile():
        result["r"] = run_python("print('x' * 100000)\nwhile True:\n    pass", wall_seconds=3, cpu_seconds=10)
        done.set()

    thread = threading.Thread(target=hostile)
    thread.start()
    ticks, start = 0, time.monotonic()
    while not done.is_set() and time.monotonic() - start < 15:
        time.sleep(0.01)
        ticks += 1
    thread.join(5)
    assert done.is_set() and ticks > 50
    assert result["r"].timed_out and len(result["r"].stdout) < 5000


def test_the_child_sees_a_scrubbed_environment_and_no_proc():
    r = run_python("import os\nprint(sorted(os.environ))\nopen('/proc/self/status').read()")
    assert r.stdout == "['LANG', 'PATH']\n"
    assert r.stderr.rstrip().endswith("PermissionError: [Errno 13] Permission denied: '/proc/self/status'")


def test_the_standard_library_still_works():
    """What the allowlists leave: pure computation with the standard library, files in the scratch directory,
    time, randomness, hashing, compression, signals to itself."""
    code = textwrap.dedent("""
        import collections, datetime, decimal, fractions, hashlib, itertools, json, math, os, random, re
        import statistics, signal, time, zlib
        open('data.json', 'w').write(json.dumps({'x': [1, 2, 3]}))
        os.mkdir('sub'); os.rename('data.json', 'sub/d.json')
        print(json.load(open('sub/d.json'))['x'], sorted(os.listdir('sub')))
        print(hashlib.sha256(b'a').hexdigest()[:8], len(zlib.compress(b'a' * 1000)), fractions.Fraction(1, 3) * 3)
        print(decimal.Decimal(1) / 7, statistics.mean([1, 2, 3]), math.comb(10, 3), len(os.urandom(8)))
        random.seed(0); print(random.random() < 1, datetime.datetime.now().year > 2000, time.monotonic() > 0)
        signal.signal(signal.SIGUSR1, lambda *a: print('got USR1'))
        os.kill(os.getpid(), signal.SIGUSR1)
    """)
    r = run_python(code)
    assert r.ok, r.observation()
    lines = r.stdout.splitlines()
    assert lines[0] == "[1, 2, 3] ['d.json']" and lines[1].startswith("ca978112 ") and lines[-1] == "got USR1"


def test_stat_of_outputs_is_not_a_path_the_child_sees():
    r = run_python("import os\nprint(os.fstat(1).st_nlink, sorted(os.listdir('.')))")
    nlink, listing = r.stdout.split(" ", 1)
    assert nlink == "0" and listing.strip() == "['main.py']"
    assert stat.S_ISREG(os.stat(__file__).st_mode)
