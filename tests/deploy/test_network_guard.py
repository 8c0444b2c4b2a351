"""The network guard blocks non-loopback access, says who tried, and leaves loopback alone."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading

import pytest

from . import network_guard
from .netns import netns_available, run_in_netns

# TEST-NET-1 (RFC 5737): reserved for documentation; the guard refuses before any packet.
OUTSIDE = ("192.0.2.1", 80)


@pytest.fixture
def guard():
    assert not network_guard.installed()
    network_guard.install()
    try:
        assert network_guard.installed()
        yield network_guard
    finally:
        network_guard.uninstall()
    assert not network_guard.installed()


def _echo_server() -> tuple[socket.socket, tuple[str, int]]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def serve() -> None:
        conn, _ = srv.accept()
        conn.sendall(conn.recv(16))
        conn.close()

    threading.Thread(target=serve, daemon=True).start()
    return srv, srv.getsockname()


@pytest.mark.parametrize("host, local", [
    ("127.0.0.1", True), ("127.8.9.10", True), ("::1", True), ("::ffff:127.0.0.1", True), ("localhost", True),
    ("0.0.0.0", True), ("", True), (None, True),
    ("192.0.2.1", False), ("10.1.2.3", False), ("::ffff:192.0.2.1", False), ("pypi.org", False),
    ("<broadcast>", False),
])
def test_is_local_host(host, local) -> None:
    assert network_guard.is_local_host(host) is local


def test_allow_list_from_environment(monkeypatch) -> None:
    monkeypatch.setenv(network_guard.ALLOW_ENV, "testhost.internal, 192.0.2.7")
    assert network_guard.is_local_host("testhost.internal")
    assert network_guard.is_local_host("192.0.2.7")
    assert not network_guard.is_local_host("192.0.2.8")


def test_outside_connect_is_blocked_with_the_callers_stack(guard, capsys) -> None:
    with socket.socket() as s, pytest.raises(network_guard.NetworkBlocked) as info:
        s.connect(OUTSIDE)
    assert info.value.errno == 101 and isinstance(info.value, OSError)
    err = capsys.readouterr().err
    assert "network_guard: blocked connect to ('192.0.2.1', 80)" in err
    assert "test_outside_connect_is_blocked_with_the_callers_stack" in err  # who tried


def test_name_lookups_are_blocked_but_localhost_and_numbers_pass(guard, capsys) -> None:
    with pytest.raises(network_guard.NetworkBlocked):
        socket.getaddrinfo("pypi.org", 443)
    with pytest.raises(network_guard.NetworkBlocked):
        socket.gethostbyname("pypi.org")
    with pytest.raises(network_guard.NetworkBlocked):
        socket.create_connection(("pypi.org", 443), timeout=1)
    assert socket.getaddrinfo("localhost", 80)
    assert socket.getaddrinfo("192.0.2.1", 80)  # numeric: no DNS; connecting is what is blocked
    assert capsys.readouterr().err.count("network_guard: blocked") == 3


def test_udp_sendto_outside_is_blocked(guard) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s, pytest.raises(network_guard.NetworkBlocked):
        s.sendto(b"x", ("192.0.2.1", 53))


def test_loopback_still_works(guard) -> None:
    srv, addr = _echo_server()
    with srv, socket.create_connection(addr, timeout=5) as c:
        c.sendall(b"ping")
        assert c.recv(16) == b"ping"


def test_guarded_context_manager_restores() -> None:
    before = socket.socket.connect
    with network_guard.guarded():
        assert network_guard.installed()
    assert socket.socket.connect is before


def _run_child(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", code]
    if netns_available()[0]:  # a second fence: even without the guard nothing could leave
        return run_in_netns(cmd, env=env, timeout=60)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)


def test_sitecustomize_guards_a_child_and_logs_who_tried(tmp_path) -> None:
    log = tmp_path / "guard.log"
    code = """
import socket, sys, threading, urllib.request
assert sys.modules["network_guard"].installed(), "guard not installed by sitecustomize"
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
threading.Thread(target=lambda: (lambda c: (c.sendall(c.recv(4)), c.close()))(srv.accept()[0]), daemon=True).start()
with socket.create_connection(srv.getsockname(), timeout=5) as c:
    c.sendall(b"ping"); assert c.recv(4) == b"ping"
print("loopback ok")
def fetch_index():
    urllib.request.urlopen("http://192.0.2.1/simple/", timeout=5)
try:
    fetch_index()
except OSError as exc:
    print("blocked:", exc)
"""
    proc = _run_child(code, network_guard.guarded_env(log=log))
    assert proc.returncode == 0, proc.stderr
    assert "loopback ok" in proc.stdout
    assert "blocked:" in proc.stdout and "network_guard: blocked connect to ('192.0.2.1', 80)" in proc.stdout
    # The printed stack and the log both name the caller and the library it went through.
    for text in (proc.stderr, log.read_text()):
        assert "fetch_index" in text
        assert "http/client.py" in text


def test_without_the_guard_the_child_is_unguarded() -> None:
    env = network_guard.guarded_env()
    env["PYTHONPATH"] = ""
    proc = subprocess.run([sys.executable, "-c", "import sys; print('network_guard' in sys.modules)"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "False"
