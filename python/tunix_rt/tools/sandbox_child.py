"""The sandboxed child: confines this interpreter, then runs the policy's code. Run as a script by
tools/sandbox.py (`python -I -S sandbox_child.py SCRATCH CODE CPU MEMORY FSIZE`), never imported; it uses the
standard library's core only, as nothing else is on the path of `python -I -S`.

Everything is an allowlist:
- files: Landlock handles every file-system right; reads are granted only beneath the Python installation,
  the system's libraries and a few named files, writes only beneath the scratch directory. /proc, /home, the
  project, keys and data stay unreadable;
- syscalls: a seccomp filter built with libseccomp (which knows each architecture's syscall numbers and
  rejects other ABIs) allows only what pure computation in CPython needs; every other syscall fails with
  EPERM. Signals, fcntl, ioctl and prlimit are allowed only with arguments that touch this process alone;
- network and signals: Landlock also denies TCP bind/connect (ABI 4) and scopes signals and abstract Unix
  sockets to this process (ABI 6) where the kernel has them, under the seccomp layer;
- privileges: no_new_privs, every capability dropped (a root caller's child holds none), rlimits on CPU,
  memory, file size, open files and cores.
Any step that fails exits with status 125 and says which on stderr: the code never runs unconfined.
What it does not hide: stat() and access() of paths it cannot open (Landlock does not govern them), so the
code can tell which files and /proc/PID entries exist, with their sizes and times, though not read them; a
PID and mount namespace would hide those too, where the machine allows unprivileged user namespaces.
"""

import ctypes
import errno
import os
import resource
import struct
import sys

# Syscalls a pure computation needs once CPython is running: file access (Landlock decides where),
# memory, time, signals to itself, exit. Names a platform lacks (open, stat ... on aarch64) are skipped.
ALLOWED = """
read write readv writev pread64 pwrite64 lseek close
open openat openat2 stat fstat lstat newfstatat statx access faccessat faccessat2 readlink readlinkat
getcwd chdir fchdir getdents64 mkdir mkdirat rmdir unlink unlinkat rename renameat renameat2
ftruncate fsync fdatasync dup dup2 dup3 sendfile copy_file_range
mmap munmap mprotect mremap brk madvise
rt_sigaction rt_sigprocmask rt_sigreturn sigaltstack
getpid gettid getuid geteuid getgid getegid getresuid getresgid getgroups
uname sysinfo getrandom getrusage times sched_getaffinity sched_yield
clock_gettime clock_getres gettimeofday time clock_nanosleep nanosleep poll ppoll select pselect6
futex set_robust_list rseq set_tid_address
exit exit_group
""".split()

# (syscall, argument index, allowed values): the call is allowed only with one of those values there.
PID = os.getpid()
F_DUPFD, F_GETFD, F_SETFD, F_GETFL, F_SETFL, F_DUPFD_CLOEXEC = 0, 1, 2, 3, 4, 1030
TCGETS, TIOCGWINSZ, FIONCLEX, FIOCLEX = 0x5401, 0x5413, 0x5450, 0x5451
ALLOWED_WITH = [
    ("kill", 0, (PID,)), ("tkill", 0, (PID,)), ("tgkill", 0, (PID,)),  # signals to itself (os.abort, raise)
    ("prlimit64", 0, (0, PID)),  # resource.getrlimit / setrlimit on itself
    ("fcntl", 1, (F_DUPFD, F_GETFD, F_SETFD, F_GETFL, F_SETFL, F_DUPFD_CLOEXEC)),  # no F_SETOWN, no locks
    ("ioctl", 1, (TCGETS, TIOCGWINSZ, FIONCLEX, FIOCLEX)),  # isatty, terminal size, close-on-exec
]

# Landlock (linux/landlock.h): file-system rights by ABI version, the network rights, the scopes.
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 0x1, 0x2, 0x4, 0x8
FS_WRITES = 0x10 | 0x20 | 0x40 | 0x80 | 0x100 | 0x200 | 0x400 | 0x800 | 0x1000  # remove, make ...
FS_REFER, FS_TRUNCATE, FS_IOCTL_DEV = 0x2000, 0x4000, 0x8000
NET_BIND_TCP, NET_CONNECT_TCP = 0x1, 0x2
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 0x1, 0x2
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446  # every arch


def fail(what: str, err: int | None = None) -> None:
    err = ctypes.get_errno() if err is None else err
    sys.stderr.write(f"sandbox: {what} failed: {os.strerror(err) if err else 'unknown error'}\n")
    sys.stderr.flush()
    os._exit(125)


def readable_paths(scratch: str) -> list[tuple[str, bool]]:
    """(path, is a directory) the child may read: the interpreter's own module directories, the system's
    libraries (extension modules load libssl, libffi, libz ...), the loader's cache, the time zone, the
    random and null devices."""
    dirs = [p for p in sys.path if os.path.isdir(p)]
    dirs += ["/usr/lib", "/usr/lib64", "/usr/lib32", "/lib", "/lib64", "/lib32", "/usr/share/zoneinfo",
             os.path.join(sys.base_prefix, "lib")]
    files = ["/etc/ld.so.cache", "/etc/localtime", "/dev/null", "/dev/urandom", "/dev/zero"]
    paths = [(os.path.realpath(d), True) for d in dirs if os.path.isdir(d)]
    paths += [(os.path.realpath(f), False) for f in files if os.path.exists(f)]
    return [(scratch, True)] + sorted(set(paths))


def landlock(libc, scratch: str) -> None:
    abi = libc.syscall(SYS_LANDLOCK_CREATE_RULESET, None, 0, 1)  # LANDLOCK_CREATE_RULESET_VERSION
    if abi < 1:
        fail("landlock (the kernel has no Landlock, or it is disabled)")
    file_rights = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | (FS_TRUNCATE if abi >= 3 else 0)
    file_rights |= FS_IOCTL_DEV if abi >= 5 else 0
    handled = file_rights | FS_READ_DIR | FS_WRITES | (FS_REFER if abi >= 2 else 0)
    if abi >= 6:
        attr = struct.pack("=QQQ", handled, NET_BIND_TCP | NET_CONNECT_TCP, SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL)
    elif abi >= 4:
        attr = struct.pack("=QQ", handled, NET_BIND_TCP | NET_CONNECT_TCP)
    else:
        attr = struct.pack("=Q", handled)
    ruleset = libc.syscall(SYS_LANDLOCK_CREATE_RULESET, ctypes.c_char_p(attr), len(attr), 0)
    if ruleset < 0:
        fail("landlock ruleset")
    read_dir = FS_READ_FILE | FS_READ_DIR
    for path, is_dir in readable_paths(scratch):
        if path == scratch:
            rights = handled & ~FS_EXECUTE & ~FS_IOCTL_DEV
        else:
            rights = read_dir if is_dir else FS_READ_FILE
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        beneath = struct.pack("=Qi", rights, fd)
        if libc.syscall(SYS_LANDLOCK_ADD_RULE, ruleset, 1, ctypes.c_char_p(beneath), 0) != 0:
            fail(f"landlock rule for {path}")
        os.close(fd)
    if libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset, 0) != 0:
        fail("landlock restrict")
    os.close(ruleset)


class ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]


def load_libseccomp():
    """libseccomp, loaded before Landlock hides where it lives."""
    try:
        return ctypes.CDLL("libseccomp.so.2", use_errno=True)
    except OSError:
        fail("loading libseccomp (install libseccomp2)", errno.ENOENT)


def seccomp(lib) -> None:
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.POINTER(ArgCmp)]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    allow, deny, cmp_eq = 0x7FFF0000, 0x00050000 | errno.EPERM, 4  # SCMP_ACT_ALLOW, SCMP_ACT_ERRNO(EPERM)
    ctx = lib.seccomp_init(deny)
    if not ctx:
        fail("seccomp_init")

    def add(name: str, arg: int | None = None, value: int = 0) -> None:
        nr = lib.seccomp_syscall_resolve_name(name.encode())
        if nr < 0:  # not a syscall of this architecture
            return
        cmp = (ArgCmp * 1)(ArgCmp(arg, cmp_eq, value, 0)) if arg is not None else None
        rc = lib.seccomp_rule_add_array(ctypes.c_void_p(ctx), allow, nr, 0 if arg is None else 1, cmp)
        if rc != 0:
            fail(f"seccomp rule for {name}", -rc)

    for name in ALLOWED:
        add(name)
    for name, arg, values in ALLOWED_WITH:
        for value in values:
            add(name, arg, value)
    rc = lib.seccomp_load(ctypes.c_void_p(ctx))
    if rc != 0:
        fail("seccomp_load", -rc)


def drop_capabilities(libc) -> None:
    header = struct.pack("=Ii", 0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = bytes(24)  # effective, permitted, inheritable: all empty, for both 32-bit words
    if libc.capset(ctypes.c_char_p(header), ctypes.c_char_p(data)) != 0:
        fail("dropping capabilities")


def confine(scratch: str, cpu: int, memory: int, fsize: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.chdir(scratch)
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        fail("no_new_privs")
    drop_capabilities(libc)
    libseccomp = load_libseccomp()
    landlock(libc, scratch)
    seccomp(libseccomp)


def main() -> None:
    scratch, code_path = sys.argv[1], sys.argv[2]
    cpu, memory, fsize = map(int, sys.argv[3:6])
    with open(code_path) as f:
        source = f.read()
    confine(scratch, cpu, memory, fsize)
    sys.argv = ["main.py"]
    sys.dont_write_bytecode = True
    try:
        code = compile(source, "main.py", "exec")
        exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit:
        raise
    except BaseException as e:  # the traceback from the code's own frames, as `python main.py` prints it
        import traceback

        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != "main.py":
            tb = tb.tb_next
        traceback.print_exception(type(e), e, tb)
        sys.exit(1)


if __name__ == "__main__":
    main()
