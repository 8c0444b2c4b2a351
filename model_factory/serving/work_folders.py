"""The temporary folders a server works in, and the ones a server killed outright left behind.

A server keeps a work folder in the temporary folder (``TMPDIR``): the Python backend's copy, the log, the
candidates' repository and the served repository, which holds a copy of every served version's files
(``served_view.py``): for a large model, gigabytes. ``serve`` removes it however it ends in an ordinary way; one
killed outright (``SIGKILL``, the out-of-memory killer) cannot, and every such crash left its copy behind (9.7 GB
of them on one machine after a few benchmarks stopped by hand).

So each folder is owned through a lock: an ``flock`` on ``<folder>/.owner``, taken before the file gets that
name (a folder with an ``.owner`` is locked for as long as its owner lives), held by the process that made it
and passed on to the ``tritonserver`` it starts (the descriptor is inherited, and a lock lasts until its last
holder is gone), and released by the kernel however they end. A server that starts removes the folders of its
kind whose lock it can take: nobody holds them. A folder without ``.owner`` (being made this moment, or made by
an earlier model-factory), one of another user, and anything that is not a plain folder are left alone.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from pathlib import Path

OWNER = ".owner"


def make_owned(prefix: str) -> tuple[Path, int]:
    """A new folder in the temporary folder, named ``<prefix>…``, and the descriptor that holds its lock (keep it
    open for as long as the folder is used: :func:`release`)."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    fresh = folder / f"{OWNER}.{os.getpid()}"
    fd = os.open(fresh, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        os.replace(fresh, folder / OWNER)
    except BaseException:
        os.close(fd)
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return folder, fd


def release(folder: Path, fd: int) -> None:
    """Remove ``folder`` (made by :func:`make_owned`), then let its lock go."""
    try:
        shutil.rmtree(folder, ignore_errors=True)
    finally:
        try:
            os.close(fd)
        except OSError:
            pass


def sweep_stale(prefix: str | tuple[str, ...], where: Path | None = None) -> list[Path]:
    """Remove the folders named ``<prefix>…`` (any of them, when a tuple: one scan) in ``where`` (the temporary
    folder) whose owner is gone: this user's, with an ``.owner`` whose lock can be taken. Returns what was removed."""
    where = Path(where or tempfile.gettempdir())
    uid = os.getuid()
    removed: list[Path] = []
    try:
        entries = list(os.scandir(where))
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(prefix):
            continue
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat(follow_symlinks=False).st_uid != uid:
                continue
            fd = os.open(Path(entry.path) / OWNER, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:  # no owner file (being made, or an older layout), or gone meanwhile
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # held: its server (or the tritonserver it started) still runs
                continue
            # Ours now: a second sweeper cannot take it while the folder goes.
            shutil.rmtree(entry.path, ignore_errors=True)
            if not os.path.lexists(entry.path):
                removed.append(Path(entry.path))
        finally:
            os.close(fd)
    return removed
