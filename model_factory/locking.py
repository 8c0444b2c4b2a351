"""Exclusive locks for the stages that write one model: two builds of one recipe never interleave.

A lock is an ``flock`` on a small hidden file beside what it guards, taken without waiting: a
second writer is refused at once with a one-line error naming the holder's pid. The kernel releases
the lock when its holder exits, however it exits (``SIGKILL`` included), so a crash never leaves a
stale lock behind.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from model_factory.errors import FactoryError


def lock_path(target: Path) -> Path:
    """The lock file of ``target`` (a hidden sibling: ``<parent>/.<name>.lock``)."""
    target = Path(target)
    return target.parent / f".{target.name}.lock"


@contextmanager
def exclusive(target: Path, what: str) -> Iterator[None]:
    """Hold the lock of ``target`` for the block; FactoryError at once if another process holds it.

    ``what`` names the job in the message (e.g. "a build of minilm"). Not re-entrant: a process that
    already holds the lock of ``target`` is refused like any other.
    """
    import fcntl

    path = lock_path(target)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise FactoryError(f"{what} is already running (pid {holder}, lock {path}). Fix: wait for it to "
                               "finish, or stop it; two writers of one model are never interleaved") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock
