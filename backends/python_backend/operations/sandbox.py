"""Walls around a process that reads or serves a model from outside: Landlock for files, seccomp for syscalls.

Standard library only (``ctypes``): it lives in the backend, which imports nothing of ours, and the build
uses it through :mod:`model_factory.sandbox`. What a walled process may touch is decided by the kernel,
not by the code it runs:

* **Landlock** (``landlock_create_ruleset``/``add_rule``/``restrict_self``): the process and everything it
  starts may read only the paths in :attr:`Walls.read` and write (create, remove, truncate) only beneath
  :attr:`Walls.write`. Nothing may be executed (``execve`` of any file is refused). From ABI 4 on, TCP bind
  and connect are refused too; from ABI 6 on, abstract UNIX sockets and signals to processes outside.
* **seccomp** (a classic BPF filter, ``prctl(PR_SET_SECCOMP)``): ``socket(AF_INET | AF_INET6 | AF_PACKET)``
  and ``io_uring_setup`` fail with EACCES; syscalls of another ABI (x32, i386) are refused. With
  ``no_new_processes`` (a serving stub) also ``fork``, ``vfork``, ``clone`` without ``CLONE_THREAD`` and
  ``execve``/``execveat`` (threads still start: ``clone3`` answers ENOSYS, and glibc then uses ``clone``).

Both are one-way: once applied they cannot be lifted by the process, and they hold for its children.
Where the kernel lacks one, :func:`support` says which and why, and :func:`apply` applies what exists (or,
with ``required``, raises :class:`SandboxUnavailable`). No dependency: ``python3-seccomp``/``pyseccomp``
need libseccomp's headers or a system package a venv does not see; ``landlock`` on PyPI wraps the same
three syscalls.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct
from dataclasses import dataclass, field
from pathlib import Path


# --- Landlock (include/uapi/linux/landlock.h) ---------------------------------------------------------------
_SYS = {"x86_64": (444, 445, 446), "aarch64": (444, 445, 446)}
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_ABI1 = (1 << 13) - 1  # EXECUTE .. MAKE_SYM
FS_REFER, FS_TRUNCATE, FS_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
NET_BIND_TCP, NET_CONNECT_TCP = 1, 2
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1, 2
FILE_RIGHTS = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV  # what a rule on a file may grant

# --- seccomp (include/uapi/linux/seccomp.h, filter.h, audit.h) ----------------------------------------------
_PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 38, 22, 2
_RET_ALLOW, _RET_ERRNO = 0x7FFF0000, 0x00050000
_LD_W_ABS, _JEQ_K, _JGE_K, _RET_K = 0x20, 0x15, 0x35, 0x06
# machine -> (AUDIT_ARCH, __NR_socket, __NR_io_uring_setup)
_SECCOMP_ARCH = {"x86_64": (0xC000003E, 41, 425), "aarch64": (0xC00000B7, 198, 425)}
AF_INET, AF_INET6, AF_PACKET = 2, 10, 17


@dataclass(frozen=True)
class Support:
    """What this kernel offers: the Landlock ABI (0: none) and whether seccomp filters work; why not."""

    landlock_abi: int
    seccomp: bool
    missing: tuple[str, ...] = ()

    @property
    def complete(self) -> bool:
        return self.landlock_abi > 0 and self.seccomp

    def describe(self) -> str:
        """What the walls are made of here, or why there are none: 'Landlock ABI 7, seccomp'."""
        parts = ([f"Landlock ABI {self.landlock_abi}"] if self.landlock_abi else []) + (["seccomp"] if self.seccomp
                                                                                      else [])
        return ", ".join(parts) if parts else "none: " + "; ".join(self.missing)


class SandboxUnavailable(RuntimeError):
    """The walls were required and this kernel lacks Landlock or seccomp."""


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def landlock_abi() -> tuple[int, str | None]:
    """The kernel's Landlock ABI version, or 0 and why there is none."""
    if platform.system() != "Linux":
        return 0, f"Landlock is Linux only (this is {platform.system()})"
    nrs = _SYS.get(platform.machine())
    if nrs is None:
        return 0, f"no Landlock syscall numbers known for {platform.machine()}"
    libc = _libc()
    abi = libc.syscall(ctypes.c_long(nrs[0]), None, ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_RULESET_VERSION))
    if abi < 0:
        err = ctypes.get_errno()
        why = {errno.ENOSYS: "this kernel has no Landlock (before 5.13, or built without it)",
               errno.EOPNOTSUPP: "Landlock is built in but not enabled (add landlock to the lsm= boot list)"}
        return 0, why.get(err, f"landlock_create_ruleset failed: {os.strerror(err)}")
    return int(abi), None


def seccomp_available() -> tuple[bool, str | None]:
    if platform.system() != "Linux" or platform.machine() not in _SECCOMP_ARCH:
        return False, f"no seccomp filter for {platform.system()} {platform.machine()}"
    try:
        actions = Path("/proc/sys/kernel/seccomp/actions_avail").read_text().split()
    except OSError:
        return False, "this kernel has no seccomp filters (/proc/sys/kernel/seccomp missing)"
    return ("errno" in actions and "allow" in actions), (None if "errno" in actions else "seccomp lacks errno")


def support() -> Support:
    abi, why = landlock_abi()
    sec, sec_why = seccomp_available()
    return Support(abi, sec, tuple(w for w in (why, sec_why) if w))


@dataclass(frozen=True)
class Walls:
    """What a sandboxed process may touch: paths to read, paths to write beneath (read implied)."""

    read: tuple[str, ...]
    write: tuple[str, ...]
    read_files: tuple[str, ...] = ("/dev/urandom", "/dev/random")  # single files, read only (/etc/ld.so.cache)
    rw_files: tuple[str, ...] = ("/dev/null",)  # single files read and written (no create)
    what: str = "stage"
    exec_allowed: bool = False
    tmpdir: str | None = None  # the process's TMPDIR and HOME (beneath ``write``)
    no_new_processes: bool = False  # seccomp also refuses fork, vfork, exec and clone but a thread's
    # IP sockets stay allowed (a serving stub that exports OpenTelemetry spans over OTLP/HTTP: serve --trace-endpoint).
    ip_sockets: bool = False
    notes: tuple[str, ...] = field(default=(), compare=False)

    def describe(self) -> str:
        return (f"reads only the source, the Python environment, the data files and system libraries; writes only "
                f"beneath {', '.join(self.write)}; no network sockets; runs no other program")


def _rule(libc: ctypes.CDLL, nr: int, ruleset: int, path: str, access: int) -> bool:
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return False  # a path that does not exist grants nothing
    try:
        if not os.path.isdir(path):
            access &= FILE_RIGHTS
        attr = struct.pack("=Qi", access, fd)  # struct landlock_path_beneath_attr is packed
        buf = ctypes.create_string_buffer(attr, len(attr))
        if libc.syscall(ctypes.c_long(nr), ctypes.c_int(ruleset), ctypes.c_int(_RULE_PATH_BENEATH), buf,
                        ctypes.c_uint32(0)) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"landlock_add_rule({path}): {os.strerror(err)}")
        return True
    finally:
        os.close(fd)


def _apply_landlock(walls: Walls, abi: int) -> None:
    libc = _libc()
    create, add, restrict = _SYS[platform.machine()]
    fs = FS_ABI1 | (FS_REFER if abi >= 2 else 0) | (FS_TRUNCATE if abi >= 3 else 0) | (FS_IOCTL_DEV if abi >= 5 else 0)
    net = (NET_BIND_TCP | NET_CONNECT_TCP) if abi >= 4 else 0
    scoped = (SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL) if abi >= 6 else 0
    attr = struct.pack("=QQQ", fs, net, scoped)[: 8 if abi < 4 else 16 if abi < 6 else 24]
    buf = ctypes.create_string_buffer(attr, len(attr))
    ruleset = libc.syscall(ctypes.c_long(create), buf, ctypes.c_size_t(len(attr)), ctypes.c_uint32(0))
    if ruleset < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"landlock_create_ruleset: {os.strerror(err)}")
    try:
        read = FS_READ_FILE | FS_READ_DIR | (FS_EXECUTE if walls.exec_allowed else 0)
        for p in walls.read:
            _rule(libc, add, ruleset, p, read)
        for p in walls.read_files:
            _rule(libc, add, ruleset, p, FS_READ_FILE)
        for p in walls.rw_files:
            _rule(libc, add, ruleset, p, FS_READ_FILE | FS_WRITE_FILE | (FS_TRUNCATE if abi >= 3 else 0)
                  | (FS_IOCTL_DEV if abi >= 5 and p.startswith("/dev/") else 0))
        for p in walls.write:
            _rule(libc, add, ruleset, p, fs & ~(0 if walls.exec_allowed else FS_EXECUTE))
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(err)}")
        if libc.syscall(ctypes.c_long(restrict), ctypes.c_int(ruleset), ctypes.c_uint32(0)) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"landlock_restrict_self: {os.strerror(err)}")
    finally:
        os.close(ruleset)


_CLONE_THREAD = 0x00010000
_JSET_K = 0x45
# machine -> (fork, vfork, clone, clone3, execve, execveat); aarch64 has no fork/vfork syscalls (-1)
_PROCESS_NRS = {"x86_64": (57, 58, 56, 435, 59, 322), "aarch64": (-1, -1, 220, 435, 221, 281)}


def syscall_filter(machine: str | None = None, no_new_processes: bool = False, ip_sockets: bool = False) -> bytes:
    """The seccomp BPF program: no AF_INET/AF_INET6/AF_PACKET socket, no io_uring, no foreign-ABI syscalls;
    with ``no_new_processes`` no fork/vfork/exec and no clone but a thread's; with ``ip_sockets`` AF_INET and
    AF_INET6 sockets are allowed (AF_PACKET never)."""
    machine = machine or platform.machine()
    arch, nr_socket, nr_uring = _SECCOMP_ARCH[machine]
    deny = _RET_ERRNO | errno.EACCES
    enosys = _RET_ERRNO | errno.ENOSYS
    # Built with symbolic targets, resolved to relative jumps below.
    prog: list[tuple[int, object, object, int]] = [
        (_LD_W_ABS, 0, 0, 4),                    # arch
        (_JEQ_K, 0, "deny", arch),               # another ABI (i386 via int 0x80): refused
        (_LD_W_ABS, 0, 0, 0),                    # syscall number
        (_JGE_K, "deny", 0, 0x40000000),         # x32 ABI
        (_JEQ_K, "socket", 0, nr_socket),
        (_JEQ_K, "deny", 0, nr_uring),           # io_uring's SOCKET op would bypass this filter
    ]
    if no_new_processes:
        fork, vfork, clone, clone3, execve, execveat = _PROCESS_NRS[machine]
        for nr in (fork, vfork, execve, execveat):
            if nr >= 0:
                prog.append((_JEQ_K, "deny", 0, nr))
        prog.append((_JEQ_K, "enosys", 0, clone3))  # glibc falls back to clone(), whose flags we can read
        prog.append((_JEQ_K, "clone", 0, clone))
    prog.append((_RET_K, 0, 0, _RET_ALLOW))
    labels = {"socket": len(prog)}
    prog += [(_LD_W_ABS, 0, 0, 16),              # socket's domain (args[0], low 32 bits)
             *(() if ip_sockets else ((_JEQ_K, "deny", 0, AF_INET), (_JEQ_K, "deny", 0, AF_INET6))),
             (_JEQ_K, "deny", 0, AF_PACKET),
             (_RET_K, 0, 0, _RET_ALLOW)]         # UNIX sockets, netlink: allowed
    if no_new_processes:
        labels["clone"] = len(prog)
        prog += [(_LD_W_ABS, 0, 0, 16),          # clone's flags (args[0], low 32 bits)
                 (_JSET_K, "allow", "deny", _CLONE_THREAD)]
    labels["allow"] = len(prog)
    prog.append((_RET_K, 0, 0, _RET_ALLOW))
    labels["deny"] = len(prog)
    prog.append((_RET_K, 0, 0, deny))
    labels["enosys"] = len(prog)
    prog.append((_RET_K, 0, 0, enosys))

    def target(i: int, t: object) -> int:
        return labels[t] - (i + 1) if isinstance(t, str) else int(t)  # type: ignore[arg-type]

    return b"".join(struct.pack("=HBBI", code, target(i, jt), target(i, jf), k)
                    for i, (code, jt, jf, k) in enumerate(prog))


def network_filter(machine: str | None = None) -> bytes:
    """The build stages' filter: no network sockets (see :func:`syscall_filter`)."""
    return syscall_filter(machine)


def _apply_seccomp(no_new_processes: bool = False, ip_sockets: bool = False) -> None:
    libc = _libc()
    prog = syscall_filter(no_new_processes=no_new_processes, ip_sockets=ip_sockets)
    filt = ctypes.create_string_buffer(prog, len(prog))
    fprog = struct.pack("=HxxxxxxQ", len(prog) // 8, ctypes.addressof(filt))  # struct sock_fprog
    fbuf = ctypes.create_string_buffer(fprog, len(fprog))
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(err)}")
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, fbuf, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_SECCOMP): {os.strerror(err)}")


# What any walled process of ours reads besides its own folders: system libraries, /proc/self, the CPU and
# GPU topology in /sys (OpenMP, ONNX Runtime's device discovery, CUDA).
SYSTEM_READ = ("/usr/lib", "/usr/lib64", "/usr/local/lib", "/usr/local/cuda", "/lib", "/lib64", "/usr/share/zoneinfo",
               "/sys/devices", "/sys/bus/pci", "/sys/fs/cgroup", "/proc/self", "/proc/thread-self",
               "/proc/driver/nvidia")
SYSTEM_FILES = ("/etc/ld.so.cache", "/etc/localtime", "/proc/cpuinfo", "/proc/meminfo", "/proc/stat",
                "/proc/sys/kernel/osrelease", "/dev/urandom", "/dev/random")
# The folders of the package this module belongs to, wherever pyproject's package-dir put them.
PACKAGES = ("model_factory", "model_factory.build_engines", "model_factory.backend", "model_factory.cli")


def python_paths() -> list[str]:
    """The interpreter's install, the venv, every import-path folder and the package's own folders."""
    import importlib.util
    import sys
    import sysconfig

    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    paths |= {v for v in sysconfig.get_paths().values() if v}
    paths |= {p for p in sys.path if p and Path(p).exists()}
    for name in PACKAGES:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        paths |= set(getattr(spec, "submodule_search_locations", None) or [])
    paths.add(str(Path(sys.executable).resolve().parent.parent))  # the executable may be a link elsewhere
    return sorted(paths)


def gpu_devices() -> list[str]:
    """The GPU's device files (read, written and ioctl'ed by CUDA)."""
    return sorted(str(p) for p in Path("/dev").glob("nvidia*") if not p.is_dir())


_ACTIVE: Walls | None = None


def active() -> Walls | None:
    """The walls this process is inside, or None."""
    return _ACTIVE


def apply(walls: Walls, required: bool = False) -> Support:
    """Put this process (and all it starts) inside ``walls``; what the kernel lacked is skipped, or refused."""
    global _ACTIVE
    have = support()
    if required and not have.complete:
        raise SandboxUnavailable("; ".join(have.missing))
    if walls.tmpdir:
        import tempfile

        Path(walls.tmpdir).mkdir(parents=True, exist_ok=True)
        os.environ["TMPDIR"] = walls.tmpdir
        tempfile.tempdir = None  # found again from TMPDIR
        # A private home: libraries that keep caches or ids there (ONNX Runtime's telemetry id under
        # ~/.cache) write inside the walls instead of failing loudly outside them.
        os.environ["HOME"] = os.environ["XDG_CACHE_HOME"] = walls.tmpdir
    if have.landlock_abi:
        _apply_landlock(walls, have.landlock_abi)
    if have.seccomp:
        _apply_seccomp(walls.no_new_processes, walls.ip_sockets)
    _ACTIVE = walls
    return have


def blocked_by_walls(exc: BaseException) -> OSError | None:
    """The permission error in ``exc``'s chain (what the walls refuse looks like this), or None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.EACCES, errno.EPERM):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


# --- a serving stub walls itself in after it has loaded ---------------------------------------------------

SERVE_ENV = "MODEL_FACTORY_SERVE_SANDBOX"  # "off": no walls (measurements, a kernel that breaks them)
TEST_HOOK_ENV = "MODEL_FACTORY_SANDBOX_TEST_HOOK"  # tests only: a Python file run inside the walls after load


def serving_walls(version_dir: Path, scratch: Path, writable: tuple[str, ...] = (),
                  readable_files: tuple[str, ...] = (), ip_sockets: bool = False) -> Walls:
    """What a loaded stub may touch: read its model folder (the version folder, with the backend's code,
    and config.pbtxt), the Python environment, Triton's Python backend and system libraries; write only
    ``scratch`` (and ``writable``: the learned-cost cache); the shared memory Triton talks through; the GPU's
    device files. No new process, no network socket."""
    import sys

    model_dir = Path(version_dir).resolve().parent
    read = {str(model_dir), *python_paths(), *SYSTEM_READ}
    utils = sys.modules.get("triton_python_backend_utils")
    if utils is not None and getattr(utils, "__file__", None):
        read.add(str(Path(utils.__file__).resolve().parent))  # Triton's Python backend folder
    return Walls(read=tuple(sorted(read)), write=tuple(sorted({str(scratch), "/dev/shm", *writable})),
                 read_files=tuple(sorted({*SYSTEM_FILES, *readable_files})),
                 rw_files=("/dev/null", *gpu_devices()), what="serving stub", tmpdir=str(scratch),
                 no_new_processes=True, ip_sockets=ip_sockets)


def wall_in_stub(version_dir: Path, writable: tuple[str, ...] = (), readable_files: tuple[str, ...] = (),
                 environ: "dict[str, str] | None" = None, ip_sockets: bool = False) -> str:
    """Wall this stub in (unless ``MODEL_FACTORY_SERVE_SANDBOX=off``); what it is, for the load log and
    ``/metrics``: ``on (Landlock ABI 7, seccomp)``, ``off (...)``. ``ip_sockets``: the stub exports trace spans
    over OTLP/HTTP, so IP sockets stay open to it (said in the state)."""
    import tempfile

    env = os.environ if environ is None else environ
    if env.get(SERVE_ENV, "").lower() in ("off", "0", "false"):
        return f"off ({SERVE_ENV}=off)"
    have = support()
    if not (have.landlock_abi or have.seccomp):
        return f"off ({'; '.join(have.missing)})"
    hook_path = env.get(TEST_HOOK_ENV)
    hook = Path(hook_path).read_text() if hook_path else None  # read before the walls hide it
    # Inside the server's own work folder where there is one (removed with it): a walled stub cannot remove its
    # scratch from the shared temporary folder (Landlock grants no removal in its parent), so one left there
    # per stub start would pile up.
    from ..batching.idle_cores import RUNTIME_DIR_ENV

    runtime = env.get(RUNTIME_DIR_ENV, "").strip()
    parent = Path(runtime) / "stub-scratch" if runtime and Path(runtime).is_dir() else None
    if parent is not None:
        parent.mkdir(exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="mf-stub-", dir=parent))
    for folder in writable:  # a folder the stub will write into later (the cost cache) must exist to be granted
        Path(folder).mkdir(parents=True, exist_ok=True)
    apply(serving_walls(version_dir, scratch, writable, readable_files, ip_sockets=ip_sockets))
    state = f"on ({have.describe()}{'; IP sockets allowed for the trace exporter' if ip_sockets else ''})"
    if hook is not None:
        exec(compile(hook, hook_path, "exec"), {"__name__": "sandbox_test_hook", "scratch": str(scratch),
                                                "version_dir": str(version_dir), "sandbox": state})
    return state
