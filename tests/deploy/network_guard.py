"""Make any attempt of Python code to reach the network fail loudly, and say who tried.

Two ways to use it:

* in a child Python: run it with ``env=guarded_env()`` (which puts
  :data:`SITE_DIR` first on ``PYTHONPATH``); that folder's ``sitecustomize.py``
  installs the guard before any other code runs;
* in the current process: :func:`install` / :func:`uninstall` (or
  :func:`guarded`, a context manager).

Once installed, ``socket.socket.connect``/``connect_ex``/``sendto`` to an
address that is not loopback, and ``socket.getaddrinfo``/``gethostbyname``/
``gethostbyname_ex`` of a name other than ``localhost``, print
``network_guard: blocked ...`` with the Python stack of the caller to stderr,
append the same record to the file named by ``$NETWORK_GUARD_LOG`` (if set),
and raise :class:`NetworkBlocked`, an ``OSError`` (ENETUNREACH) so code that
handles being offline still behaves as it would offline. Unix sockets and
numeric look-ups pass. ``$NETWORK_GUARD_ALLOW`` (comma-separated hosts) adds
exceptions.

What it cannot see: sockets opened by C code that never calls back into
Python (grpc's core, ONNX Runtime's telemetry, curl). For those, run the
command in a network namespace (``netns.run_in_netns``), which blocks all of it
but does not say who tried.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import os
import socket
import sys
import traceback
from pathlib import Path
from typing import Any, Iterator, Mapping

SITE_DIR = Path(__file__).resolve().parent / "guard_site"
LOG_ENV = "NETWORK_GUARD_LOG"
ALLOW_ENV = "NETWORK_GUARD_ALLOW"
_LOCAL_NAMES = {"localhost", "localhost.", "ip6-localhost", "ip6-loopback"}

_originals: dict[str, Any] = {}


class NetworkBlocked(OSError):
    """A network access the guard refused."""

    def __init__(self, what: str) -> None:
        super().__init__(errno.ENETUNREACH, f"network_guard: blocked {what}")


def _allowed_extra() -> set[str]:
    return {h.strip() for h in os.environ.get(ALLOW_ENV, "").split(",") if h.strip()}


def is_local_host(host: Any) -> bool:
    """True for loopback and unspecified addresses, ``localhost`` and ``$NETWORK_GUARD_ALLOW`` hosts."""
    if host is None:
        return True
    if isinstance(host, bytes):
        host = host.decode("ascii", "replace")
    host = str(host)
    if host == "<broadcast>":
        return False
    if host == "" or host.lower() in _LOCAL_NAMES or host in _allowed_extra():
        return True
    try:
        addr = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False  # a name other than localhost: resolving it is itself network traffic
    mapped = getattr(addr, "ipv4_mapped", None)
    if mapped is not None:
        addr = mapped
    return addr.is_loopback or addr.is_unspecified


def _is_numeric(host: Any) -> bool:
    try:
        ipaddress.ip_address(str(host).split("%", 1)[0])
        return True
    except ValueError:
        return False


def _block(what: str) -> None:
    stack = "".join(traceback.format_stack()[:-2])
    record = f"network_guard: blocked {what} (pid {os.getpid()})\n{stack}"
    sys.stderr.write(record)
    sys.stderr.flush()
    log = os.environ.get(LOG_ENV)
    if log:
        with open(log, "a", encoding="utf-8") as f:
            f.write(record + "\n")
    raise NetworkBlocked(what)


def _check_address(sock: socket.socket, address: Any, verb: str) -> None:
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return  # AF_UNIX and friends stay on this machine
    host = address[0] if isinstance(address, tuple) and address else address
    if not is_local_host(host):
        _block(f"{verb} to {address!r}")


def _connect(self: socket.socket, address: Any) -> Any:
    _check_address(self, address, "connect")
    return _originals["connect"](self, address)


def _connect_ex(self: socket.socket, address: Any) -> Any:
    _check_address(self, address, "connect_ex")
    return _originals["connect_ex"](self, address)


def _sendto(self: socket.socket, data: Any, *args: Any) -> Any:
    address = args[-1] if args else None
    if address is not None:
        _check_address(self, address, "sendto")
    return _originals["sendto"](self, data, *args)


def _getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
    if not (is_local_host(host) or _is_numeric(host)):
        _block(f"getaddrinfo({host!r})")
    return _originals["getaddrinfo"](host, *args, **kwargs)


def _gethostbyname(host: Any) -> Any:
    if not (is_local_host(host) or _is_numeric(host)):
        _block(f"gethostbyname({host!r})")
    return _originals["gethostbyname"](host)


def _gethostbyname_ex(host: Any) -> Any:
    if not (is_local_host(host) or _is_numeric(host)):
        _block(f"gethostbyname_ex({host!r})")
    return _originals["gethostbyname_ex"](host)


_PATCHES = {
    "connect": (socket.socket, _connect),
    "connect_ex": (socket.socket, _connect_ex),
    "sendto": (socket.socket, _sendto),
    "getaddrinfo": (socket, _getaddrinfo),
    "gethostbyname": (socket, _gethostbyname),
    "gethostbyname_ex": (socket, _gethostbyname_ex),
}


def installed() -> bool:
    """Whether the guard is active in this process."""
    return socket.socket.connect is _connect and socket.getaddrinfo is _getaddrinfo


def install() -> None:
    """Patch the socket module (idempotent)."""
    if installed():
        return
    for name, (owner, patched) in _PATCHES.items():
        _originals[name] = getattr(owner, name)
        setattr(owner, name, patched)


def uninstall() -> None:
    """Restore the socket module as it was before :func:`install`."""
    for name, (owner, _patched) in _PATCHES.items():
        if name in _originals:
            setattr(owner, name, _originals.pop(name))


@contextlib.contextmanager
def guarded() -> Iterator[None]:
    """The guard for the duration of a ``with`` block (in this process)."""
    was = installed()
    install()
    try:
        yield
    finally:
        if not was:
            uninstall()


def guarded_env(env: Mapping[str, str] | None = None, log: str | os.PathLike[str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with the guard's site folder first on PYTHONPATH."""
    out = dict(os.environ if env is None else env)
    out["PYTHONPATH"] = os.pathsep.join(p for p in (str(SITE_DIR), out.get("PYTHONPATH", "")) if p)
    if log is not None:
        out[LOG_ENV] = str(log)
    return out
