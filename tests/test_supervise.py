"""The stub watch against real processes that look like Triton's stubs, and a fake server's API.

A "server" here is a Python process that starts the given command lines as its children and never reaps
them (so a killed one stays a zombie, as under Triton); a "stub" is a copy of bash named like Triton's
stub, running the model's ``model.py`` (a shell script here). The real server: tests/integration/test_faults.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from model_factory.errors import FactoryError
from model_factory.serving.supervise import STUB_NAME, StubWatch, pid_alive, stub_counts, stub_processes

_SERVER = """
import json, subprocess, sys, time
pids = [subprocess.Popen(argv).pid for argv in json.loads(sys.argv[1])]
print(json.dumps(pids), flush=True)
time.sleep(300)
"""


class Tree:
    """A repository with models a and b, a stub binary, and the servers started (ended at teardown)."""

    def __init__(self, root: Path) -> None:
        self.repo = root / "repo"
        for m, v in (("a", "1"), ("b", "1"), ("a", "2")):
            (self.repo / m / v).mkdir(parents=True)
            (self.repo / m / v / "model.py").write_text("sleep 300\nexit 0\n")
        (root / "elsewhere" / "b" / "1").mkdir(parents=True)
        (root / "elsewhere" / "b" / "1" / "model.py").write_text("sleep 300\nexit 0\n")
        self.elsewhere = root / "elsewhere"
        self.stub = root / "b" / "python" / STUB_NAME
        self.stub.parent.mkdir(parents=True)
        shutil.copy(shutil.which("bash"), self.stub)
        self.servers: list[subprocess.Popen] = []

    def stub_argv(self, model: str, repo: Path | None = None, version: str = "1") -> list[str]:
        return [str(self.stub), str((repo or self.repo) / model / version / "model.py")]

    def server(self, *argvs: list[str]) -> tuple[int, list[int]]:
        """Start a server with these children; its pid and theirs."""
        proc = subprocess.Popen([sys.executable, "-c", _SERVER, json.dumps(list(argvs))], stdout=subprocess.PIPE,
                                text=True, start_new_session=True)
        self.servers.append(proc)
        pids = json.loads(proc.stdout.readline())
        for pid in pids:  # Popen returns once exec began; the new image's argv shows a moment later
            deadline = time.monotonic() + 30
            while not psutil.Process(pid).cmdline() and time.monotonic() < deadline:
                time.sleep(0.01)
        return proc.pid, pids

    def close(self) -> None:
        for proc in self.servers:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


def kill_and_wait(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while pid_alive(pid) and time.monotonic() < deadline:  # a zombie counts as dead
        time.sleep(0.02)
    assert not pid_alive(pid)


@pytest.fixture
def tree(tmp_path: Path):
    t = Tree(tmp_path)
    yield t
    t.close()


def test_stubs_are_found_by_parent_and_model_path_zombies_and_strangers_are_not(tree) -> None:
    python = [sys.executable, "-c", "import time; time.sleep(300)"]
    server, (a1, a2, b_dead, _python, _outside) = tree.server(
        tree.stub_argv("a"), tree.stub_argv("a"), tree.stub_argv("b"), python, tree.stub_argv("b", tree.elsewhere))
    tree.server(tree.stub_argv("b"))  # another server's stub
    kill_and_wait(b_dead)  # killed, not reaped by its server: a zombie
    assert sorted((s.pid, s.model, s.version) for s in stub_processes(server, tree.repo)) == sorted(
        [(a1, "a", "1"), (a2, "a", "1")])
    assert stub_counts(server, tree.repo) == {"a": 2}
    assert stub_processes(2 ** 22 + 1, tree.repo) == []  # no such server


class FakeServer:
    """The server's admin API (load/unload recorded) over a real process id; its stubs serve from ``repo`` (the
    folder Triton reads: TritonServer.served_repository)."""

    def __init__(self, repo: Path, pid: int) -> None:
        self.served_repository = repo
        self.calls: list[str] = []
        self.load_error: str | None = None
        self.alive = True
        self.ready: dict[str, set[str]] | None = None  # what ready_versions() says (None: it cannot be asked)

        class P:
            def poll(inner):  # noqa: N805 - a stand-in for Popen.poll
                return None if self.alive else 0

        P.pid = pid
        self.process = P()

    def unload_model(self, name: str) -> str | None:
        self.calls.append(f"unload {name}")
        return None

    def load_model(self, name: str, versions: list[int] | None = None) -> str | None:
        self.calls.append(f"load {name}" + (f" versions {versions}" if versions is not None else ""))
        return self.load_error

    def ready_versions(self) -> dict[str, set[str]]:
        if self.ready is None:
            raise OSError("no index")
        return self.ready


def test_a_missing_stub_is_healed_in_order_and_a_model_that_no_longer_verifies_stays_down(tree) -> None:
    server_pid, (_a, b) = tree.server(tree.stub_argv("a"), tree.stub_argv("b"))
    server = FakeServer(tree.repo, server_pid)
    verified: list[str] = []
    reverify = {"with": lambda model: verified.append(model)}
    messages: list[str] = []
    watch = StubWatch(server, ["a", "b"], echo=messages.append, settle_s=0,
                      reverify=lambda model: reverify["with"](model))
    assert watch.expected == {"a": 1, "b": 1}
    assert watch.check() == [] and server.calls == []

    kill_and_wait(b)  # b's stub died
    (rec,) = watch.check()
    assert (rec.model, rec.ok) == ("b", True) and rec.seconds >= 0
    assert server.calls == ["unload b", "load b"] and verified == ["b"]
    assert any("ready again" in m for m in messages)

    def refuse(model):
        raise FactoryError("1/model.onnx changed")

    reverify["with"] = refuse
    server.calls.clear()
    (rec,) = watch.check()  # still no stub for b (the fake server starts none): heal again, and it no longer verifies
    assert not rec.ok and "no longer verifies" in rec.reason and server.calls == ["unload b"]
    assert "b" not in watch.expected and watch.check() == []  # left unloaded, not retried

    kill_and_wait(_a)
    reverify["with"] = lambda model: None
    server.load_error = "failed to load 'a'"
    (rec,) = watch.check()
    assert not rec.ok and "reload failed" in rec.reason


def test_the_old_loads_other_stubs_are_ended_before_the_reload(tree) -> None:
    server_pid, (a1, a2) = tree.server(tree.stub_argv("a"), tree.stub_argv("a"))
    server = FakeServer(tree.repo, server_pid)
    watch = StubWatch(server, ["a"], settle_s=0)
    assert watch.expected == {"a": 2}
    kill_and_wait(a1)
    (rec,) = watch.check()
    assert rec.ok and server.calls == ["unload a", "load a"]
    # A live instance of the old load would keep its copy of the model: it was sent SIGKILL.
    deadline = time.monotonic() + 30
    while pid_alive(a2) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not pid_alive(a2)


def test_nothing_is_healed_when_the_server_itself_is_gone(tree) -> None:
    server_pid, _ = tree.server(tree.stub_argv("a"))
    server = FakeServer(tree.repo, server_pid)
    watch = StubWatch(server, ["a"], settle_s=0)
    server.alive = False
    assert watch.check() == [] and server.calls == []


def test_each_ready_version_is_counted_on_its_own_while_a_rollout_keeps_two_loaded(tree) -> None:
    """Through a rollout's grace period a model has two versions loaded, one stub each here: a dead stub of one is
    healed though the model still has as many stubs as one version needs; a version not READY (loading,
    unloading) is not counted."""
    server_pid, (_a1, a2, _b) = tree.server(tree.stub_argv("a"), tree.stub_argv("a", version="2"),
                                            tree.stub_argv("b"))
    server = FakeServer(tree.repo, server_pid)
    server.ready = {"a": {"1", "2"}, "b": {"1"}}
    watch = StubWatch(server, ["a", "b"], settle_s=0)
    assert watch.expected == {"a": 1, "b": 1}  # stubs per version
    assert watch.check() == []
    kill_and_wait(a2)
    server.ready = {"a": {"1"}, "b": {"1"}}  # version 2 unloading (the undo): its stubs ending is no death
    assert watch.check() == [] and server.calls == []
    server.ready = None  # the index cannot be asked: stubs are counted per model (a: 1, as many as expected)
    assert watch.check() == [] and server.calls == []
    server.ready = {"a": {"1", "2"}, "b": {"1"}}  # version 2 serving without its stub: healed
    (rec,) = watch.check()
    assert rec.model == "a" and server.calls == ["unload a", "load a"]


def test_while_two_versions_are_loaded_only_the_one_whose_stub_died_is_reloaded(tree) -> None:
    """With the model's derived configuration kept (a rollout's grace period), the healthy version is never
    unloaded: a load naming it alone unloads the dead one, the dead one's other stubs are ended, then a load of
    every version loads it anew."""
    server_pid, (a1, _a1b, a2, a2b) = tree.server(tree.stub_argv("a"), tree.stub_argv("a"),
                                                  tree.stub_argv("a", version="2"), tree.stub_argv("a", version="2"))
    server = FakeServer(tree.repo, server_pid)
    server.ready = {"a": {"1", "2"}}
    server.load_configs = {"a": json.dumps({"version_policy": {"specific": {"versions": [1, 2]}}})}
    verified: list[str] = []
    messages: list[str] = []
    watch = StubWatch(server, ["a"], settle_s=0, reverify=verified.append, echo=messages.append)
    assert watch.expected == {"a": 2}
    kill_and_wait(a2)
    (rec,) = watch.check()
    assert rec.ok and server.calls == ["load a versions [1]", "load a"] and verified == ["a"]
    assert any("version 2 died; version 1 keeps serving" in m for m in messages), messages
    deadline = time.monotonic() + 30
    while pid_alive(a2b) and time.monotonic() < deadline:  # the dead version's other stub was ended
        time.sleep(0.02)
    assert not pid_alive(a2b) and pid_alive(a1)  # the healthy version's stub was never touched
    server.calls.clear()
    server.load_error = "failed to load 'a'"
    (rec,) = watch.check()  # version 2 still has no stub here (the fake server starts none)
    assert not rec.ok and "version 2" in rec.reason and server.calls[0] == "load a versions [1]"
