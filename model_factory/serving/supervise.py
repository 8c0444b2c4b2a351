"""Watch the Python-backend stubs of a served repository and heal a model whose stub died.

Triton 2.51 does not notice a dead stub on its own: after a ``SIGKILL`` of
``triton_python_backend_stub`` every request fails with ``Stub process ... is not
healthy`` while ``/v2/models/<m>/ready`` still answers 200, so a load balancer keeps
routing to a dead replica. :class:`StubWatch` looks at the server's child processes
(one stub per model instance, named on its command line by the model's ``model.py``);
when a version Triton reports READY has fewer live stubs than the model had once loaded (counted per
version: through a rollout's grace period two versions are loaded; without the repository index, per
model) it

1. unloads the model through the restricted repository API, so readiness turns false
   at once, and waits ``settle_s`` for the dead instance to fail the requests it holds
   (new requests get 404 at once meanwhile), then ends the old load's other stubs (Triton 2.51
   never finishes an unload with a dead instance, and they would keep their copy of the model);
2. verifies the model again against the trust policy ``serve`` started with (the ``reverify``
   callable it is given, :func:`model_factory.serving.digests.reverify_model`): the restarted stub
   loads only bytes that verify, and a model that no longer verifies stays unloaded;
3. loads it again and records how long the model was down (:class:`Recovery`).

While two versions are loaded (a rollout's grace period) and only one's stubs died, only that one is unloaded and
loaded again (:meth:`StubWatch.heal_versions`): the other keeps answering meanwhile.

Processes are read with ``psutil`` (its platforms; the stubs run where Triton runs, on Linux).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from model_factory.errors import FactoryError

STUB_NAME = "triton_python_backend_stub"
# Seconds between unloading a model whose stub died and loading it again (see StubWatch.heal).
SETTLE_S = 5.0


@dataclass(frozen=True)
class StubProcess:
    """A live Python-backend stub: its pid, the model folder it serves and the version."""

    pid: int
    model: str
    version: str = ""


@dataclass(frozen=True)
class Recovery:
    """One heal: which model, when its dead stub was seen, and how it ended."""

    model: str
    detected_at: float  # time.monotonic()
    seconds: float  # from detection to ready again (or to giving up)
    ok: bool
    reason: str = ""


def stub_processes(server_pid: int, repository: Path) -> list[StubProcess]:
    """Live (not zombie) stubs started by ``server_pid`` for models of ``repository`` (read with psutil).

    The stub's first argument is the path of the model's ``model.py``
    (``<repository>/<model>/<version>/model.py``); a stub killed but not reaped by
    Triton stays as a zombie, with no command line, and is not counted.
    """
    import psutil

    repository = Path(repository).resolve()
    try:
        children = psutil.Process(server_pid).children()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []
    stubs = []
    for child in children:
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                continue
            argv = child.cmdline()
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):  # gone, or not ours to read
            continue
        if len(argv) < 2 or Path(argv[0]).name != STUB_NAME:
            continue
        try:
            rel = Path(argv[1]).resolve().relative_to(repository)
        except ValueError:
            continue
        if len(rel.parts) >= 2:
            stubs.append(StubProcess(child.pid, rel.parts[0], rel.parts[1] if len(rel.parts) > 2 else ""))
    return stubs


def stub_counts_by_version(server_pid: int, repository: Path) -> dict[str, dict[str, int]]:
    """Live stubs per model and version."""
    counts: dict[str, dict[str, int]] = {}
    for stub in stub_processes(server_pid, repository):
        per = counts.setdefault(stub.model, {})
        per[stub.version] = per.get(stub.version, 0) + 1
    return counts


def stub_counts(server_pid: int, repository: Path) -> dict[str, int]:
    """Live stubs per model."""
    return {m: sum(per.values()) for m, per in stub_counts_by_version(server_pid, repository).items()}


def stub_pids_by_version(server_pid: int, repository: Path, model: str) -> dict[str, set[int]]:
    """The pids of ``model``'s live stubs, per version."""
    out: dict[str, set[int]] = {}
    for stub in stub_processes(server_pid, repository):
        if stub.model == model:
            out.setdefault(stub.version, set()).add(stub.pid)
    return out


class StubWatch:
    """A thread that polls the stubs of ``models`` every ``interval_s`` and heals a model whose stub died.

    ``server`` is a started :class:`model_factory.serving.triton_process.TritonServer` (its admin key opens
    the repository API; its loads carry the configuration this deployment derived). ``reverify(model)``
    verifies a model again before it is reloaded and raises FactoryError when it no longer verifies
    (None: the server runs without a policy, nothing to re-verify). ``echo`` reports each heal. Use as a
    context manager or call start()/stop().
    """

    def __init__(self, server: Any, models: list[str] | tuple[str, ...], interval_s: float = 1.0,
                 echo: Callable[[str], None] | None = None,
                 settle_s: float = SETTLE_S, reverify: Callable[[str], None] | None = None,
                 events: Any = None) -> None:
        self.server = server
        self.events = events  # a backend.events.EventLog (serve --events): each heal is a decision event
        self.reverify = reverify
        self.interval_s = interval_s
        self.settle_s = settle_s
        self.echo = echo or (lambda _msg: None)
        self.recoveries: list[Recovery] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # What "healthy" means: the stubs each version of a model had once loaded (one version at the start).
        self.expected = {m: max(per.values()) for m, per in (self._counts() or {}).items()
                         if m in set(models) and per}
        self.healing: str | None = None

    def _counts(self) -> dict[str, dict[str, int]] | None:
        """Live stubs per model and version; None when the server itself is not running (nothing to heal then)."""
        process = self.server.process
        if process is None or process.poll() is not None:
            return None
        return stub_counts_by_version(process.pid, self.server.served_repository)

    def _ready(self) -> dict[str, set[str]] | None:
        """The versions Triton reports READY per model; None when it cannot be asked."""
        try:
            return self.server.ready_versions()
        except Exception:  # noqa: BLE001 - the index is a refinement: without it, stubs are counted per model
            return None

    def check(self) -> list[Recovery]:
        """One poll: heal every watched model one of whose ready versions has fewer live stubs than expected
        (while a rollout keeps the previous version loaded beside the new one, each is counted on its own; a
        version loading or unloading is not counted); return the heals."""
        done: list[Recovery] = []
        before = self._ready()
        counts = self._counts()
        if counts is None:  # the server is gone: serve reports that itself
            return done
        after = self._ready()
        # READY in both looks, so READY when the stubs were counted (a version still loading is not yet READY).
        ready = ({m: v & after.get(m, set()) for m, v in before.items()}
                 if before is not None and after is not None else None)
        for model, want in list(self.expected.items()):
            if self._stop.is_set():
                break
            per = counts.get(model, {})
            versions = (ready or {}).get(model)
            if versions:
                dead = sorted((v for v in versions if per.get(v, 0) < want), key=_version_key)
                healthy = sorted((v for v in versions if v not in dead), key=_version_key)
                if dead and healthy and model in getattr(self.server, "load_configs", {}):
                    done.append(self.heal_versions(model, dead, healthy))
                elif dead:
                    done.append(self.heal(model))
            elif sum(per.values()) < want:
                done.append(self.heal(model))
        return done

    def heal_versions(self, model: str, dead: list[str], healthy: list[str]) -> Recovery:
        """Reload only the versions of ``model`` whose stub died while others serve (a rollout's grace period: the
        previous version and the new one loaded together): a load naming the healthy versions alone unloads the
        dead ones (the healthy ones stay as they are and answer every request meanwhile), then, verified again,
        a load naming them all loads the dead ones anew. Their old stubs are ended in between, as :meth:`heal`
        does."""
        start = time.monotonic()
        self.healing = model
        self.echo(f"model {model}: a backend stub of version {', '.join(dead)} died; version "
                  f"{', '.join(healthy)} keeps serving while it is unloaded, re-verified and loaded again")
        try:
            old = self._stub_pids(model, dead)
            error = self.server.load_model(model, versions=[int(v) for v in healthy])
            if error:
                return self._done(model, start, False, f"unloading version {', '.join(dead)} failed: {error}")
            unloaded = time.monotonic()
            try:
                if self.reverify is not None:
                    self.reverify(model)
            except FactoryError as exc:
                return self._done(model, start, False, f"no longer verifies, version {', '.join(dead)} left "
                                  f"unloaded: {exc}")
            self._stop.wait(max(0.0, unloaded + self.settle_s - time.monotonic()))
            for pid in old & self._stub_pids(model, dead):
                _kill(pid)
            error = self.server.load_model(model)  # every version its configuration names, the dead ones anew
            if error:
                from model_factory.serving.refusals import load_error_line

                return self._done(model, start, False, f"reloading version {', '.join(dead)} failed: "
                                  f"{load_error_line(error)}")
            return self._done(model, start, True)
        finally:
            self.healing = None

    def heal(self, model: str) -> Recovery:
        """Unload ``model`` (not ready from now on), verify it again, load it again."""
        start = time.monotonic()
        self.healing = model
        self.echo(f"model {model}: its backend stub died; unloading, re-verifying and reloading it")
        try:
            old = self._stub_pids(model)
            error = self.server.unload_model(model)
            if error:
                return self._done(model, start, False, f"unload failed: {error}")
            unloaded = time.monotonic()
            try:
                if self.reverify is not None:
                    self.reverify(model)
            except FactoryError as exc:
                return self._done(model, start, False, f"no longer verifies, left unloaded: {exc}")
            # Let the dead instance fail the requests it holds before the new one loads: Triton 2.51 answers
            # them one execution at a time (about 1 s each), and a load started meanwhile holds the rest
            # until it finishes (tens of seconds: a hang for those clients).
            self._stop.wait(max(0.0, unloaded + self.settle_s - time.monotonic()))
            # The old load's other instances: with one of its stubs dead Triton 2.51 never finishes that
            # unload, and the live stubs would stay, each holding a copy of the model, for the server's life.
            # They have answered what they held by now (unloaded, they get no new requests).
            for pid in old & self._stub_pids(model):  # never a pid the system gave to someone else meanwhile
                _kill(pid)
            error = self.server.load_model(model)
            if error:
                from model_factory.serving.refusals import load_error_line

                return self._done(model, start, False, f"reload failed: {load_error_line(error)}")
            return self._done(model, start, True)
        finally:
            self.healing = None

    def _stub_pids(self, model: str, versions: list[str] | None = None) -> set[int]:
        """The pids of ``model``'s live stubs (of ``versions`` only, when given)."""
        return {s.pid for s in stub_processes(self.server.process.pid, self.server.served_repository)
                if s.model == model and (versions is None or s.version in versions)}

    def _done(self, model: str, start: float, ok: bool, reason: str = "") -> Recovery:
        rec = Recovery(model, start, time.monotonic() - start, ok, reason)
        self.recoveries.append(rec)
        if self.events is not None:
            self.events.emit("stub_healed" if ok else "stub_not_healed",
                             {"healed_model": model, "seconds": round(rec.seconds, 3), **({"why": reason} if reason else {})})
        if ok:
            self.echo(f"model {model}: ready again after {rec.seconds:.1f} s")
        else:
            self.echo(f"model {model}: not healed ({reason})")
            self.expected.pop(model, None)  # nothing more to watch: it stays unloaded
        return rec

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check()
            except OSError as exc:  # the server's port went away: report, keep watching
                self.echo(f"stub watch: {exc}")

    def start(self) -> "StubWatch":
        self._thread = threading.Thread(target=self._run, name="mf-stub-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(self.interval_s * 2, 1.0) + 60)

    def __enter__(self) -> "StubWatch":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _version_key(version: str) -> tuple[int, str]:
    return (int(version), version) if version.isdigit() else (-1, version)


def _kill(pid: int) -> None:
    """SIGKILL ``pid`` if it still runs (it may have exited, or been reaped, meanwhile)."""
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:  # someone else's process: it exists
        return True
