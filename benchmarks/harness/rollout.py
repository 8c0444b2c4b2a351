"""What the rollout benchmarks share: a released repository's policy, and watching a rollout's states."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any, Callable


def release_and_policy(root: Path, repo: Path, private_key: Path, public_key: Path, *,
                       require_provenance: bool = True) -> tuple[list, Path]:
    """Start ``repo``'s release (one key for every role) and write ``root/policy.toml`` trusting it, its
    ``[release]`` state under ``root/state``. Returns the role keys (for later ``add_release``) and the policy."""
    from model_factory.demo import write_key_policy
    from model_factory.signing.release import KeyFile, add_release, init_release

    k = [KeyFile(private_key)]
    release_root = init_release(repo, k, {r: [public_key] for r in ("targets", "snapshot", "timestamp")})
    add_release(repo, k, k, k)
    policy = write_key_policy(root / "policy.toml", [public_key], require_provenance=require_provenance)
    shutil.copy(release_root, root / "release-root.json")
    with policy.open("a") as f:
        f.write(f'[release]\nroot = "release-root.json"\nstate_dir = "{root / "state"}"\n')
    return k, policy


def stubs_by_version(server: Any, model: str) -> dict[str, set[int]]:
    """The pids of ``model``'s live stubs per version on a started TritonServer."""
    from model_factory.serving.supervise import stub_pids_by_version

    return stub_pids_by_version(server.process.pid, server.served_repository, model)


def wait_stubs_ended(server: Any, model: str, version: str, timeout: float) -> None:
    """Wait until no stub of ``model``'s ``version`` runs (an unloaded version's stubs end once their requests are
    answered), or ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while stubs_by_version(server, model).get(version) and time.monotonic() < deadline:
        time.sleep(0.05)


def kept_sentence(before: set[int], after: set[int]) -> str:
    """Whether v1's stubs after the undo are those it had before the rollout (v1 never loaded again)."""
    if after == before:
        return "v1's stubs after the undo are the same processes as before the rollout (v1 was never loaded again)"
    return f"v1's stubs after the undo differ from those before the rollout ({sorted(before)} -> {sorted(after)})"


def watch_rollout(control: Any, model: str, until: set[str], timeout: float,
                  say: Callable[[str], None]) -> dict[str, float]:
    """Poll the rollout's state until one of ``until``; the monotonic time each state was first seen."""
    seen: dict[str, float] = {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = control.status(model)
        if status is not None and status.state not in seen:
            seen[status.state] = time.monotonic()
            say(f"state {status.state} (mirrored {status.mirrored})")
            if status.state in until:
                break
        time.sleep(0.02)
    return seen


class LoadInOwnSession:
    """A load generator (``start()``, ``join()``, ``results``, ``errors``, other lists named in ``keep``) run in a
    child process in a session of its own, as clients on other machines would be.

    The server runs in the session of the process that started it (``TritonServer.start``), and Linux's
    autogroup scheduler shares the CPU between sessions as equals before any nice value counts: client threads
    inside the benchmark's process would rank level with the server's threads, and the rollout's nice-19 work
    (in that process too) would no longer be what the benchmark isolates. Timestamps are ``time.monotonic()``,
    one clock for every process."""

    def __init__(self, factory: Callable[..., Any], *args: Any, keep: tuple[str, ...] = ("results", "errors")) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self._stop = ctx.Event()
        self._recv, send = ctx.Pipe(duplex=False)
        self._keep = keep
        self._proc = ctx.Process(target=_run_load, args=(factory, args, keep, self._stop, send), daemon=True,
                                 name="bench-load")

    def start(self) -> "LoadInOwnSession":
        self._proc.start()
        return self

    def join(self, timeout: float = 600.0) -> None:
        self._stop.set()
        if not self._recv.poll(timeout):
            self._proc.kill()
            raise RuntimeError(f"the load process sent no results within {timeout:g} s")
        for name, value in zip(self._keep, self._recv.recv()):
            setattr(self, name, value)
        self._proc.join(timeout=30)


def _run_load(factory: Callable[..., Any], args: tuple, keep: tuple[str, ...], stop: Any, send: Any) -> None:
    import os

    os.setsid()  # a session, so an autogroup, of its own
    load = factory(*args).start()
    stop.wait()
    load.join()
    send.send(tuple(getattr(load, name) for name in keep))
