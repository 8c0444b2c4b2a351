"""The stub watch against a fake /proc and a fake server (the real server: tests/integration/test_faults.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from model_factory.serving import triton_process as serve
from model_factory.errors import FactoryError
from model_factory.serving.supervise import STUB_NAME, StubWatch, stub_counts, stub_processes

SERVER_PID = 4242


def _proc(root: Path, pid: int, ppid: int, argv: list[str], state: str = "S") -> None:
    d = root / str(pid)
    d.mkdir(parents=True)
    (d / "stat").write_text(f"{pid} ({Path(argv[0]).name if argv else 'x'}) {state} {ppid} 1 1 0 -1\n")
    (d / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + (b"\0" if argv else b""))


def _stub(repo: Path, model: str) -> list[str]:
    return [f"/b/python/{STUB_NAME}", str(repo / model / "1" / "model.py"), "shm", "1048576", "1048576",
            str(SERVER_PID), "/b/python", "336", f"{model}_0_0", "DEFAULT"]


@pytest.fixture
def tree(tmp_path: Path):
    repo, proc = tmp_path / "repo", tmp_path / "proc"
    for m in ("a", "b"):
        (repo / m / "1").mkdir(parents=True)
    proc.mkdir()
    (proc / "self").mkdir()  # not a pid: skipped
    return repo, proc


def test_stubs_are_found_by_parent_and_model_path_zombies_and_strangers_are_not(tree) -> None:
    repo, proc = tree
    _proc(proc, 10, SERVER_PID, _stub(repo, "a"))
    _proc(proc, 11, SERVER_PID, _stub(repo, "a"))
    _proc(proc, 12, SERVER_PID, _stub(repo, "b"), state="Z")  # killed, not reaped by Triton
    _proc(proc, 13, 999, _stub(repo, "b"))  # another server's stub
    _proc(proc, 14, SERVER_PID, ["/usr/bin/python3", "x.py"])  # not a stub
    _proc(proc, 15, SERVER_PID, _stub(repo.parent / "elsewhere", "b"))  # outside the repository
    assert sorted((s.pid, s.model) for s in stub_processes(SERVER_PID, repo, proc)) == [(10, "a"), (11, "a")]
    assert stub_counts(SERVER_PID, repo, proc) == {"a": 2}


class FakeServer:
    def __init__(self, repo: Path) -> None:
        self.repository = repo
        self.calls: list[str] = []
        self.load_error: str | None = None
        self.alive = True

        class P:
            pid = SERVER_PID

            def poll(inner):  # noqa: N805 - a stand-in for Popen.poll
                return None if self.alive else 0

        self.process = P()

    def unload_model(self, name: str) -> str | None:
        self.calls.append(f"unload {name}")
        return None

    def load_model(self, name: str) -> str | None:
        self.calls.append(f"load {name}")
        return self.load_error


def test_a_missing_stub_is_healed_in_order_and_a_model_that_no_longer_verifies_stays_down(tree, monkeypatch) -> None:
    repo, proc = tree
    _proc(proc, 10, SERVER_PID, _stub(repo, "a"))
    _proc(proc, 20, SERVER_PID, _stub(repo, "b"))
    server = FakeServer(repo)
    verified: list[str] = []
    reverify = {"with": lambda model: verified.append(model)}
    messages: list[str] = []
    watch = StubWatch(server, ["a", "b"], echo=messages.append, proc=proc, settle_s=0,
                      reverify=lambda model: reverify["with"](model))
    assert watch.expected == {"a": 1, "b": 1}
    assert watch.check() == [] and server.calls == []

    import shutil

    shutil.rmtree(proc / "20")  # b's stub died
    (rec,) = watch.check()
    assert (rec.model, rec.ok) == ("b", True) and rec.seconds >= 0
    assert server.calls == ["unload b", "load b"] and verified == ["b"]
    assert any("ready again" in m for m in messages)

    def refuse(model):
        raise FactoryError("1/model.onnx changed")

    reverify["with"] = refuse
    server.calls.clear()
    (rec,) = watch.check()  # still no stub for b: heal again, and this time it no longer verifies
    assert not rec.ok and "no longer verifies" in rec.reason and server.calls == ["unload b"]
    assert "b" not in watch.expected and watch.check() == []  # left unloaded, not retried

    shutil.rmtree(proc / "10")
    reverify["with"] = lambda model: None
    server.load_error = "failed to load 'a'"
    (rec,) = watch.check()
    assert not rec.ok and "reload failed" in rec.reason


def test_nothing_is_healed_when_the_server_itself_is_gone(tree) -> None:
    repo, proc = tree
    _proc(proc, 10, SERVER_PID, _stub(repo, "a"))
    server = FakeServer(repo)
    watch = StubWatch(server, ["a"], proc=proc, settle_s=0)
    server.alive = False
    assert watch.check() == [] and server.calls == []
