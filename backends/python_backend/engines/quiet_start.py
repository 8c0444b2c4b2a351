"""A quiet start: a stub loaded beside live traffic (a rollout's switch) loads its engine at the lowest CPU priority.

A switch loads the new version's instances while the old ones serve every request on the same cores. Each new
stub's load (the model's bytes hashed, ONNX Runtime's sessions built, the tokenizer, a warm-up run per bucket) is
about 0.6 CPU-seconds; at the normal priority it took that from live traffic in the two seconds the load took (on
2 cores the p99 of those seconds was 1.9-2.8x the p99 before). Quietly, the load runs in a thread of its own at
nice 19: it takes the cores traffic leaves, so it lasts longer on a busy machine and costs live requests little.

Linux keeps a nice value per thread, a thread inherits its creator's, and an unprivileged process cannot raise a
thread's priority back. So only the loading thread is lowered: the stub's main thread, which runs ``execute()``,
stays at the normal priority, and so must every thread that serves later. ONNX Runtime starts a session's intra-op
pool when the session is made; a session with a pool (more than one thread) is therefore made by a worker thread
that the main thread started before anything was lowered (:func:`at_normal_priority`). A session of one thread has
no pool: it computes on the caller's thread, the main one. The tokenizer's rayon pool starts on its first batch,
which is never a load's (serving starts it, on the main thread).

The rollout asks for it with a control file, ``<runtime dir>/shadow/<model>.quiet`` (:func:`request_path`), written
before the switch's load and removed after; the undo and a healed stub start at the normal priority (capacity is
what they restore). Only CPU instances start quietly: a GPU engine's streams are started inside the load and would
inherit the low priority. A text-generation model's quiet load (``generate_model``) reads, hashes and warms up its
graph on the quiet thread (its session made here, pool and all); its engine loop, watcher and response thread start
on the main thread after it.
"""

from __future__ import annotations

import queue
import threading
from pathlib import Path
from typing import Any, Callable, TypeVar

T = TypeVar("T")

_active: "_NormalWorker | None" = None  # the worker of the quiet start in progress (one per stub: loads are serial)


def request_path(folder: Path, model: str) -> Path:
    """The control file that asks ``model``'s next instances for a quiet start (written by the rollout)."""
    return Path(folder) / f"{model}.quiet"


def requested(folder: Path | None, model: str) -> bool:
    """Whether the rollout asked ``model``'s instances loading now to start quietly."""
    return folder is not None and request_path(folder, model).is_file()


class _NormalWorker:
    """A thread at the priority of the thread that made it, running what it is handed, until closed."""

    def __init__(self) -> None:
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="mf-normal-priority", daemon=True)
        self._thread.start()  # started here, by the caller: it inherits the caller's (normal) priority

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, box, done = job
            try:
                box["value"] = fn()
            except BaseException as exc:  # noqa: BLE001 - handed back to the caller, raised there
                box["error"] = exc
            done.set()

    def call(self, fn: Callable[[], T]) -> T:
        box: dict[str, Any] = {}
        done = threading.Event()
        self._jobs.put((fn, box, done))
        done.wait()
        if "error" in box:
            raise box["error"]
        return box["value"]

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join()


def in_quiet_start() -> bool:
    """Whether a quiet start is under way in this process (its load calls this from the quiet thread)."""
    return _active is not None


def at_normal_priority(fn: Callable[[], T]) -> T:
    """``fn()`` on a thread of the normal priority: inside a quiet start on its worker, else here. For what starts
    threads that outlive the load (an ONNX Runtime session with an intra-op pool)."""
    worker = _active
    return fn() if worker is None else worker.call(fn)


def run_quietly(fn: Callable[[], T], lower: Callable[[], bool] | None = None) -> tuple[T, bool]:
    """``(fn(), lowered)``: ``fn`` run in a thread of its own at the lowest CPU priority, waited for here (the caller,
    the stub's main thread, keeps its priority). ``lowered`` False: the priority could not be lowered (not Linux),
    and ``fn`` ran at the normal one. Exceptions from ``fn`` are raised here."""
    global _active
    if lower is None:
        from ..batching.idle_cores import yield_cores as lower
    worker = _NormalWorker()
    box: dict[str, Any] = {}

    def quiet() -> None:
        try:
            box["lowered"] = lower()
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - raised in the caller
            box["error"] = exc

    _active = worker
    try:
        thread = threading.Thread(target=quiet, name="mf-quiet-start", daemon=True)
        thread.start()
        thread.join()
    finally:
        _active = None
        worker.close()  # gone before the stub walls itself in: no thread outlives the load unwalled
    if "error" in box:
        raise box["error"]
    return box["value"], bool(box.get("lowered"))
