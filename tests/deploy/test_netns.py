"""Self-test of the network-namespace helper: loopback works inside, nothing else does."""

from __future__ import annotations

import json
import os
import sys

import pytest

from .netns import netns_available, netns_command, run_in_netns

ok, why = netns_available()
pytestmark = pytest.mark.skipif(not ok, reason=f"network namespaces unavailable: {why}")

# The probe refuses to try an outside address unless the namespace really has only `lo`,
# so even a broken set-up could not send a packet. 192.0.2.1 is TEST-NET-1 (RFC 5737),
# a non-private address reserved for documentation: nobody answers there anyway.
PROBE = r"""
import json, os, socket, threading
out = {"netns": os.readlink("/proc/self/ns/net"), "interfaces": sorted(n for _, n in socket.if_nameindex())}
assert out["interfaces"] == ["lo"], out

srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
def echo():
    conn, _ = srv.accept(); conn.sendall(conn.recv(16)); conn.close()
threading.Thread(target=echo, daemon=True).start()
with socket.create_connection(srv.getsockname(), timeout=5) as c:
    c.sendall(b"ping"); out["loopback_echo"] = c.recv(16).decode()

try:
    socket.create_connection(("192.0.2.1", 443), timeout=5).close(); out["outside"] = "connected"
except OSError as exc:
    out["outside"] = exc.errno
try:
    socket.getaddrinfo("pypi.org", 443); out["dns"] = "resolved"
except OSError as exc:
    out["dns"] = type(exc).__name__
print(json.dumps(out))
"""


def test_loopback_works_and_outside_is_unreachable() -> None:
    proc = run_in_netns([sys.executable, "-c", PROBE], timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["netns"] != os.readlink("/proc/self/ns/net"), "the command ran in this process's namespace"
    assert out["interfaces"] == ["lo"]
    assert out["loopback_echo"] == "ping"
    assert out["outside"] == 101  # ENETUNREACH: no route, so nothing was sent
    assert out["dns"] == "gaierror"


def test_exit_code_output_env_and_cwd_pass_through(tmp_path) -> None:
    proc = run_in_netns(["sh", "-c", 'echo "$GREETING from $(pwd)"; echo oops >&2; exit 3'],
                        env={"GREETING": "hello", "PATH": os.environ["PATH"]}, cwd=tmp_path)
    assert proc.returncode == 3
    assert proc.stdout.strip() == f"hello from {tmp_path}"
    assert proc.stderr.strip() == "oops"
    assert proc.args == ["sh", "-c", 'echo "$GREETING from $(pwd)"; echo oops >&2; exit 3']


def test_each_call_gets_a_new_namespace() -> None:
    a = run_in_netns(["readlink", "/proc/self/ns/net"], check=True).stdout
    b = run_in_netns(["readlink", "/proc/self/ns/net"], check=True).stdout
    assert a != b


def test_command_argv_is_not_reinterpreted_by_the_shell() -> None:
    proc = run_in_netns(["printf", "%s|", "a b", "$HOME", "; exit 9"], check=True)
    assert proc.stdout == "a b|$HOME|; exit 9|"


def test_empty_command_is_rejected() -> None:
    with pytest.raises(ValueError):
        netns_command([])
