"""Parallel sha256 of files and byte ranges.

The digest scheme is model_signing v1.0's default: one plain sha256 per file
(``"method": "files"``). A single sha256 is a sequential chain and cannot be
split across cores, so a large file is never hashed by several threads. What
runs in parallel instead:

* across files (and across shards, for bundles made in model_signing's
  ``"shards"`` mode): a thread pool, largest task first. hashlib releases the
  GIL for updates larger than 2 KiB and ``readinto`` releases it while reading,
  so threads use every core without processes or copies between them;
* within a large file, when cores would otherwise be idle (fewer files than
  cores): the read of chunk k+1 overlaps the hashing of chunk k (a reader
  thread and a small ring of reusable buffers), which hides the read time,
  about a tenth of the total for files in the page cache.

Only the standard library is used here: the Python backend imports this module
inside Triton's stub.
"""

from __future__ import annotations

import errno
import hashlib
import os
import queue
import stat
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

CHUNK = 1 << 20
# Below this size a reader thread costs more than the read time it hides.
PIPELINE_THRESHOLD = 32 << 20
_NEVER = 1 << 62


@dataclass(frozen=True)
class HashTask:
    """The byte range ``[start, end)`` of ``path``, reported under ``name``."""

    name: str
    path: Path
    start: int
    end: int
    file_size: int | None = None  # when known: the file must still have this size after hashing

    @property
    def size(self) -> int:
        return self.end - self.start


def default_workers() -> int:
    """One hashing thread per core (hashing is CPU-bound once files are cached)."""
    return max(1, min(32, os.cpu_count() or 1))


def _pread(fd: int, view: memoryview, pos: int) -> int:
    """Read into ``view`` at offset ``pos``; returns the byte count (0 at end of file)."""
    if hasattr(os, "preadv"):
        return os.preadv(fd, [view], pos)
    data = os.pread(fd, len(view), pos)  # pragma: no cover - platforms without preadv
    view[: len(data)] = data
    return len(data)


def _hash_simple(fd: int, start: int, end: int) -> str:
    h = hashlib.sha256()
    # A buffer per task, sized to it: measured faster than one long-lived buffer per thread
    # (glibc then serves it from the heap rather than a fresh mapping), and a small file
    # does not pay for zeroing a whole chunk.
    buf = memoryview(bytearray(min(CHUNK, max(end - start, 1))))
    pos = start
    while pos < end:
        n = _pread(fd, buf[: min(len(buf), end - pos)], pos)
        if n == 0:
            # The file shrank while being hashed: the digest is of what is there, and
            # the comparison with the signed digest reports the change.
            break
        h.update(buf[:n])
        pos += n
    return h.hexdigest()


def _hash_pipelined(fd: int, start: int, end: int, depth: int = 4) -> str:
    """sha256 of a range, reading ahead in a second thread while this one hashes."""
    free: queue.Queue[bytearray] = queue.Queue()
    for _ in range(depth + 1):
        free.put(bytearray(CHUNK))
    full: queue.Queue[tuple[bytearray, int] | BaseException | None] = queue.Queue(depth)
    stop = threading.Event()

    def reader() -> None:
        try:
            pos = start
            while pos < end and not stop.is_set():
                buf = free.get()
                n = _pread(fd, memoryview(buf)[: min(CHUNK, end - pos)], pos)
                if n == 0:
                    break
                full.put((buf, n))
                pos += n
            full.put(None)
        except BaseException as exc:  # handed over to the hashing thread, which re-raises it
            full.put(exc)

    thread = threading.Thread(target=reader, name="mf-hash-reader", daemon=True)
    thread.start()
    h = hashlib.sha256()
    try:
        while True:
            item = full.get()
            if item is None:
                break
            if isinstance(item, BaseException):
                raise item
            buf, n = item
            h.update(memoryview(buf)[:n])
            free.put(buf)
    finally:
        # On an early exit (an interrupt) the reader may wait for a free buffer or a
        # free slot: keep feeding and draining until it has seen ``stop``.
        stop.set()
        while thread.is_alive():
            try:
                full.get_nowait()
            except queue.Empty:
                free.put(bytearray(CHUNK))
            thread.join(timeout=0.01)
    return h.hexdigest()


def hash_task(task: HashTask, pipeline_threshold: int = PIPELINE_THRESHOLD) -> str:
    """sha256 hex digest of one task's byte range (read ahead in a second thread when large)."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)
    fd = os.open(task.path, flags)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(task.path))
        if task.size >= pipeline_threshold:
            digest = _hash_pipelined(fd, task.start, task.end)
        else:
            digest = _hash_simple(fd, task.start, task.end)
        # A file that grew (or shrank) meanwhile would otherwise be judged by a prefix.
        if task.file_size is not None and os.fstat(fd).st_size != task.file_size:
            raise OSError(errno.EAGAIN, "the file changed size while it was hashed", str(task.path))
        return digest
    finally:
        os.close(fd)


def hash_tasks(tasks: Iterable[HashTask], workers: int | None = None,
               pipeline_threshold: int = PIPELINE_THRESHOLD,
               errors: dict[str, str] | None = None) -> dict[str, str]:
    """Hash every task in parallel; returns ``name -> sha256 hex``.

    Tasks are started largest first so that one big file does not start last
    and leave the other cores idle at the end. Read-ahead threads are used
    only when there are fewer tasks than workers: otherwise every core is
    already hashing, and an extra thread per file would only compete for them.

    A file that cannot be read raises OSError, unless ``errors`` is given:
    then its task is left out of the result and ``errors[name]`` says why.
    """
    ordered = sorted(tasks, key=lambda t: t.size, reverse=True)
    names = [t.name for t in ordered]
    if len(set(names)) != len(names):
        raise ValueError("hash task names must be unique")
    workers = workers or default_workers()
    threshold = pipeline_threshold if len(ordered) < workers else _NEVER

    def one(task: HashTask) -> str | None:
        try:
            return hash_task(task, threshold)
        except OSError as exc:
            if errors is None:
                raise
            errors[task.name] = exc.strerror or str(exc)
            return None

    if workers == 1 or len(ordered) <= 1:
        digests = [one(t) for t in ordered]
    else:
        with ThreadPoolExecutor(max_workers=min(workers, len(ordered)), thread_name_prefix="mf-hash") as pool:
            digests = list(pool.map(one, ordered))
    return {n: d for n, d in zip(names, digests) if d is not None}


def file_tasks(root: Path, relpaths: Iterable[str]) -> list[HashTask]:
    """One whole-file task per relative path under ``root`` (model_signing's "files" mode)."""
    tasks = []
    for rel in relpaths:
        path = root / rel
        size = os.lstat(path).st_size
        tasks.append(HashTask(rel, path, 0, size, size))
    return tasks


def shard_tasks(root: Path, relpaths: Iterable[str], shard_size: int) -> list[HashTask]:
    """Shard tasks named ``path:start:end`` (model_signing's "shards" mode).

    As in model_signing, an empty file has no shard at all (so that mode
    cannot cover empty files; the verifier reports them).
    """
    if shard_size <= 0:
        raise ValueError(f"shard size must be positive, got {shard_size}")
    tasks = []
    for rel in relpaths:
        path = root / rel
        size = os.lstat(path).st_size
        for start in range(0, size, shard_size):
            end = min(start + shard_size, size)
            tasks.append(HashTask(f"{rel}:{start}:{end}", path, start, end, size))
    return tasks


def sha256_file(path: Path) -> str:
    """sha256 hex digest of one whole file."""
    return hash_task(HashTask(str(path), Path(path), 0, os.lstat(path).st_size))


def root_digest(digests_in_order: Iterable[str]) -> str:
    """model_signing's subject digest: sha256 over the raw bytes of each digest, in order."""
    h = hashlib.sha256()
    for hexdigest in digests_in_order:
        h.update(bytes.fromhex(hexdigest))
    return h.hexdigest()
