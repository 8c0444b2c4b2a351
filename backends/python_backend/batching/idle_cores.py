"""Lending idle cores: a lone request runs on every core, a loaded server keeps the cores split.

Each CPU instance is its own stub process, with its share of the cores as ONNX Runtime threads (two
single-thread instances on 2 cores serve load best). A lone client then computes on one core while the
others sleep. With lending, an instance also holds a second session with a thread per core (spinning off)
and runs it when its window is a single request (Triton's batcher had nothing else queued) and no other
CPU instance of the server is computing; otherwise the run keeps the instance's own share. Under load
windows hold several requests and the instances are busy, so nearly every run keeps the split.

"Computing now" is a lock on one byte of a file that every instance of one server opens (the byte at the
instance's process id), held for its whole ``execute()`` (its Python work holds a core too). Asking is a
non-blocking shared lock on every other byte. The kernel drops a process's locks when it exits, so an
instance that crashed never keeps cores lent or taken. A borrowed run also holds byte 0: an instance
that starts computing meanwhile waits for it to end (one request on every core, a few milliseconds)
instead of running beside it, where three threads on two cores slowed both. Runs on
borrowed cores are not fed to the cost model, which prices the loaded case. The file lives in
``MODEL_FACTORY_RUNTIME_DIR`` (``serve`` points it at the server's private work folder) or else in
``/dev/shm``, named after the server's process id.

Measured side by side: benchmarks/bench_int8_cpu.py (RESULTS.md, "INT8 on the CPU").

The other way round, :func:`yield_cores` makes work beside live traffic (a rollout's) take only idle cores.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

RUNTIME_DIR_ENV = "MODEL_FACTORY_RUNTIME_DIR"


def yield_cores() -> bool:
    """Run the calling thread at the lowest CPU priority (nice 19) for good: work beside live traffic (a rollout's
    thread, its acceptance child, a candidate's stub) takes only the cores that traffic leaves. Linux keeps a nice
    value per thread, and the threads this one starts afterwards inherit it. True when lowered."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # not Linux, or not allowed: nothing changes
        return False
    return True


def ledger_path(environ: dict[str, str] | None = None, server_pid: int | None = None) -> Path:
    """The file every CPU instance of this server shares: in the runtime folder ``serve`` gives, else in
    ``/dev/shm`` (or the temp folder), named after the server (the stub's parent process)."""
    env = os.environ if environ is None else environ
    folder = env.get(RUNTIME_DIR_ENV, "").strip()
    if folder and os.path.isdir(folder) and os.access(folder, os.W_OK):
        base = Path(folder)
    elif os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        base = Path("/dev/shm")
    else:
        base = Path(tempfile.gettempdir())
    return base / f"model-factory-cpu-busy-{server_pid if server_pid is not None else os.getppid()}"


class BusyLedger:
    """Which CPU instances of one server are computing now (one byte lock per instance process)."""

    def __init__(self, path: Path, me: int | None = None) -> None:
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        self._me = os.getpid() if me is None else int(me)
        self._depth = 0

    def _ranges(self) -> tuple[tuple[int, int], ...]:
        # (length, start) of every byte but ours; length 0 runs to the end of any file.
        return ((self._me, 0), (0, self._me + 1)) if self._me > 0 else ((0, 1),)

    def others_busy(self) -> bool:
        """Whether another instance holds its byte now (is computing)."""
        taken = []
        try:
            for length, start in self._ranges():
                try:
                    fcntl.lockf(self._fd, fcntl.LOCK_SH | fcntl.LOCK_NB, length, start)
                except OSError:
                    return True
                taken.append((length, start))
            return False
        finally:
            for length, start in taken:
                fcntl.lockf(self._fd, fcntl.LOCK_UN, length, start)

    @contextmanager
    def busy(self) -> Iterator[None]:
        """Mark this instance as computing for the block (re-entrant)."""
        if self._depth == 0:
            fcntl.lockf(self._fd, fcntl.LOCK_EX, 1, self._me)
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, self._me)

    @contextmanager
    def borrowing(self) -> Iterator[None]:
        """Mark a run on borrowed cores (byte 0, which no process id takes) for the block."""
        fcntl.lockf(self._fd, fcntl.LOCK_EX, 1, 0)
        try:
            yield
        finally:
            fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, 0)

    def wait_for_borrower(self) -> None:
        """Return once no run on borrowed cores is in progress (at once, nearly always)."""
        fcntl.lockf(self._fd, fcntl.LOCK_SH, 1, 0)
        fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, 0)

    def close(self) -> None:
        """Close the file (dropping this instance's lock)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def lending_plan(cpus: int, own_threads: int, instances: int, pinned: bool, model_bytes: int,
                 limit_bytes: int) -> tuple[int | None, str]:
    """``(wide threads or None, why)``: whether an instance lends and borrows idle cores.

    Only when the cores are split between several CPU instances (``cpu_threads`` not pinned), there are
    cores to borrow, and the model is small enough that a second session's weights are cheap.
    """
    if pinned:
        return None, "cpu_threads is pinned"
    if instances < 2:
        return None, "one CPU instance has every core already"
    if cpus <= own_threads:
        return None, "no cores to borrow"
    if model_bytes >= limit_bytes:
        return None, f"the model ({model_bytes >> 20} MiB) is past {limit_bytes >> 20} MiB: one session only"
    return cpus, f"borrows idle cores: {cpus} threads when no other instance computes"
