"""A stub whose server died is ended by its watch, even when none of its threads can run; a stub whose server
lives is left alone, and the watch ends with it."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

BACKEND = Path(__file__).resolve().parents[2] / "backends" / "python_backend" / "operations"

# The "server": starts the "stub", prints its pid, reaps it when it ends (as Triton does), then sleeps until killed.
SERVER = """
import subprocess, sys, time
stub = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2], sys.argv[3]])
print(stub.pid, flush=True)
stub.wait()
time.sleep(120)
"""
# The "stub": starts its watch, says so, then blocks in C (as a stub waiting on a dead server's futex does).
STUB = """
import sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import orphan_watch
assert orphan_watch.watch_parent(0.05)
Path(sys.argv[2]).write_text("watched")
time.sleep(120)
"""


def _start(tmp_path: Path) -> tuple[subprocess.Popen, psutil.Process]:
    marker = tmp_path / "watched"
    server = subprocess.Popen([sys.executable, "-c", SERVER, STUB, str(BACKEND), str(marker)], stdout=subprocess.PIPE,
                              text=True)
    stub = psutil.Process(int(server.stdout.readline()))
    deadline = time.monotonic() + 20
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert marker.exists()
    return server, stub


def _watches(stub: psutil.Process) -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["cmdline"]) if f"/proc/{stub.pid}/stat" in " ".join(p.info["cmdline"] or [])]


def test_the_stub_of_a_killed_server_is_ended(tmp_path: Path) -> None:
    server, stub = _start(tmp_path)
    assert _watches(stub)
    server.send_signal(signal.SIGKILL)
    server.wait(timeout=10)
    gone, alive = psutil.wait_procs([stub], timeout=10)
    assert not alive
    time.sleep(0.3)
    assert not _watches(stub)  # the watch ended with it


def test_the_stub_of_a_live_server_is_left_and_its_watch_ends_with_it(tmp_path: Path) -> None:
    server, stub = _start(tmp_path)
    try:
        time.sleep(0.5)
        assert stub.is_running() and stub.status() != psutil.STATUS_ZOMBIE
        watches = _watches(stub)
        assert watches
        stub.kill()  # the stub ends (an unload): its watch goes too
        psutil.wait_procs(watches, timeout=10)
        assert not [w for w in watches if w.is_running() and w.status() != psutil.STATUS_ZOMBIE]
    finally:
        server.kill()
        server.wait(timeout=10)
