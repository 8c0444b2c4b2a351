"""Walls around a process that reads a model from outside: Landlock for files, seccomp for network sockets.

A build stage (export, quantize, engine build) runs a source's code and parses its files; what it may
touch is decided here, by the kernel, not by the code it runs:

* **Landlock** (``landlock_create_ruleset``/``add_rule``/``restrict_self``, called through ``ctypes``):
  the process and everything it starts may read only the paths in :attr:`Walls.read` and write (create,
  remove, truncate) only beneath :attr:`Walls.write`. Nothing may be executed (no shell, no helper
  binary: ``execve`` of any file is refused). From ABI 4 on, TCP bind and connect are refused too;
  from ABI 6 on, abstract UNIX sockets and signals to processes outside the walls.
* **seccomp** (a classic BPF filter, ``prctl(PR_SET_SECCOMP)``): ``socket(AF_INET | AF_INET6 |
  AF_PACKET, ...)`` and ``io_uring_setup`` fail with EACCES; syscalls of another ABI (x32, i386) are
  refused. Every other syscall is allowed: the filter keeps the network out, not the model's compute.

Both are one-way: once applied they cannot be lifted by the process, and they hold for its children.
Where the kernel lacks one, :func:`support` says which and why, and :func:`apply` applies what exists
(or, with ``required``, refuses). No dependency: ``python3-seccomp``/``pyseccomp`` need libseccomp's
headers or a system package a venv does not see; ``landlock`` on PyPI wraps the same three syscalls.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct
from dataclasses import dataclass, field
from pathlib import Path

from model_factory.errors import FactoryError

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

    def line(self) -> str:
        """One line: what the sandbox is here."""
        if self.complete:
            return (f"[sandbox] on: Landlock ABI {self.landlock_abi} (files) and seccomp (no network sockets) "
                    "wall in export, quantize and engine build")
        return (f"[sandbox] off here: {'; '.join(self.missing)}. The stages run with every right of this user. "
                "Fix: build on a Linux kernel with Landlock (5.13+, enabled in the lsm= list) and seccomp, or pass "
                "--require-sandbox to refuse such machines")


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


def network_filter(machine: str | None = None) -> bytes:
    """The seccomp BPF program: no AF_INET/AF_INET6/AF_PACKET socket, no io_uring, no foreign-ABI syscalls."""
    arch, nr_socket, nr_uring = _SECCOMP_ARCH[machine or platform.machine()]
    deny = _RET_ERRNO | errno.EACCES
    prog = [
        (_LD_W_ABS, 0, 0, 4),            # 0: arch
        (_JEQ_K, 1, 0, arch),            # 1: ours -> 3
        (_RET_K, 0, 0, deny),            # 2: another ABI (i386, via int 0x80): refused
        (_LD_W_ABS, 0, 0, 0),            # 3: syscall number
        (_JGE_K, 8, 0, 0x40000000),      # 4: x32 ABI -> 13
        (_JEQ_K, 2, 0, nr_socket),       # 5: socket -> 8
        (_JEQ_K, 6, 0, nr_uring),        # 6: io_uring_setup (its SOCKET op would bypass this filter) -> 13
        (_RET_K, 0, 0, _RET_ALLOW),      # 7
        (_LD_W_ABS, 0, 0, 16),           # 8: socket's domain (args[0], low 32 bits)
        (_JEQ_K, 3, 0, AF_INET),         # 9  -> 13
        (_JEQ_K, 2, 0, AF_INET6),        # 10 -> 13
        (_JEQ_K, 1, 0, AF_PACKET),       # 11 -> 13
        (_RET_K, 0, 0, _RET_ALLOW),      # 12: UNIX sockets, netlink: allowed
        (_RET_K, 0, 0, deny),            # 13
    ]
    return b"".join(struct.pack("=HBBI", *ins) for ins in prog)


def _apply_seccomp() -> None:
    libc = _libc()
    prog = network_filter()
    filt = ctypes.create_string_buffer(prog, len(prog))
    fprog = struct.pack("=HxxxxxxQ", len(prog) // 8, ctypes.addressof(filt))  # struct sock_fprog
    fbuf = ctypes.create_string_buffer(fprog, len(fprog))
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(err)}")
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, fbuf, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_SECCOMP): {os.strerror(err)}")


_ACTIVE: Walls | None = None


def active() -> Walls | None:
    """The walls this process is inside, or None."""
    return _ACTIVE


def apply(walls: Walls, required: bool = False) -> Support:
    """Put this process (and all it starts) inside ``walls``; what the kernel lacked is skipped, or refused."""
    global _ACTIVE
    have = support()
    if required and not have.complete:
        raise FactoryError(f"the build sandbox is required but {'; '.join(have.missing)}. Fix: build on a Linux "
                           "kernel with Landlock and seccomp, or drop --require-sandbox")
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
        _apply_seccomp()
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
