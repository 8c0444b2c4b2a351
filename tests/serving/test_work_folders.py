"""Work folders owned through a lock: a live owner's (or its child's) is kept, a killed owner's is removed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from model_factory.serving.work_folders import OWNER, make_owned, release, sweep_stale

PREFIX = "mf-test-work-"

# A process that makes an owned folder in TMPDIR, optionally starts a child that inherits the lock (as
# tritonserver does), prints the folder (and the child's pid), then waits to be killed.
_OWNER = textwrap.dedent("""
    import subprocess, sys, time
    from model_factory.serving.work_folders import make_owned
    folder, fd = make_owned(sys.argv[1])
    child = None
    if sys.argv[2] == "child":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], pass_fds=(fd,))
    print(folder, child.pid if child else 0, flush=True)
    time.sleep(600)
""")


def _owner(tmp: Path, child: bool) -> tuple[subprocess.Popen, Path, int]:
    proc = subprocess.Popen([sys.executable, "-c", _OWNER, PREFIX, "child" if child else "none"],
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "TMPDIR": str(tmp)})
    folder, child_pid = proc.stdout.readline().split()
    return proc, Path(folder), int(child_pid)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.fixture()
def tmp(tmp_path: Path) -> Path:
    where = tmp_path / "tmp"
    where.mkdir()
    return where


def test_a_folder_is_kept_while_its_owner_lives_and_removed_once_it_was_killed(tmp: Path) -> None:
    proc, folder, _ = _owner(tmp, child=False)
    try:
        (folder / "repository").mkdir()
        (folder / "repository" / "weights.bin").write_bytes(b"x" * 4096)
        assert (folder / OWNER).is_file()
        assert sweep_stale(PREFIX, tmp) == [] and folder.is_dir()
        proc.kill()
        proc.wait(timeout=10)
        assert sweep_stale(PREFIX, tmp) == [folder]
        assert not folder.exists()
    finally:
        _kill(proc.pid)
        proc.wait(timeout=10)


def test_a_child_that_inherited_the_lock_keeps_the_folder_after_its_parent_died(tmp: Path) -> None:
    proc, folder, child = _owner(tmp, child=True)
    try:
        proc.kill()
        proc.wait(timeout=10)
        assert sweep_stale(PREFIX, tmp) == [] and folder.is_dir(), "the folder went while tritonserver still ran"
        _kill(child)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{child}").exists() and time.monotonic() < deadline:  # the child is reparented: init reaps it
            time.sleep(0.05)
        assert sweep_stale(PREFIX, tmp) == [folder]
    finally:
        _kill(child)
        _kill(proc.pid)
        proc.wait(timeout=10)


def test_folders_without_an_owner_links_and_other_names_are_left_alone(tmp: Path, tmp_path: Path,
                                                                       monkeypatch) -> None:
    unowned = tmp / f"{PREFIX}unowned"  # being made this moment, or an earlier model-factory's
    unowned.mkdir()
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / OWNER).write_text("1\n")
    (tmp / f"{PREFIX}link").symlink_to(target)
    other = tmp / "someone-else-work"
    other.mkdir()
    (other / OWNER).write_text("1\n")
    plain = tmp / f"{PREFIX}file"
    plain.write_text("not a folder")
    assert sweep_stale(PREFIX, tmp) == []
    assert unowned.is_dir() and target.is_dir() and (target / OWNER).is_file() and other.is_dir() and plain.is_file()

    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr("tempfile.tempdir", None)  # gettempdir() reads TMPDIR again
    folder, fd = make_owned(PREFIX)
    assert folder.parent == tmp and sweep_stale(PREFIX, tmp) == [] and folder.is_dir(), "our own live folder"
    release(folder, fd)
    assert not folder.exists()
