"""Port picking and start-up of TritonServer, with a stand-in tritonserver (the real one: tests/integration)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from model_factory.serving import triton_process as serve
from model_factory.errors import FactoryError
from model_factory.serving.server import ServerOptions, TritonInstallation, TritonServer, free_ports

# A stand-in for tritonserver: fails like Triton does when a port is taken, as many times as the
# counter file says, then answers the health check on its --http-port until SIGTERM.
FAKE_SERVER = r'''
import http.server, os, signal, sys
args = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
counter = os.environ["FAKE_FAILS_FILE"]
left = int(open(counter).read())
with open(os.environ["FAKE_PORTS_FILE"], "a") as f:
    f.write(f"{args['http-port']},{args['grpc-port']},{args['metrics-port']}\n")
if left > 0:
    open(counter, "w").write(str(left - 1))
    print(os.environ.get("FAKE_MESSAGE", "E1130 Failed to bind: Address already in use"), flush=True)
    sys.exit(1)

class Ready(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/v2/health/ready" else 404)
        self.end_headers()
    def log_message(self, *a):
        pass

signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
http.server.HTTPServer(("127.0.0.1", int(args["http-port"])), Ready).serve_forever()
'''


def test_free_ports_are_distinct_and_avoid_the_given_ones() -> None:
    for _ in range(20):
        ports = free_ports(3)
        assert len(set(ports)) == 3 and all(1024 <= p < 65536 for p in ports)
    taken = free_ports(2)
    assert not set(free_ports(5, avoid=taken)) & set(taken)


def test_given_ports_are_kept_and_the_others_picked_distinct(tmp_path: Path) -> None:
    server = TritonServer(tmp_path, models=[], options=ServerOptions(http_port=18000, grpc_port=0, metrics_port=0))
    o = server.options
    assert o.http_port == 18000 and len({o.http_port, o.grpc_port, o.metrics_port}) == 3


@pytest.fixture
def fake_triton(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    script = tmp_path / "tritonserver.py"
    script.write_text(FAKE_SERVER)
    binary = tmp_path / "tritonserver"
    binary.write_text(f"#!/bin/sh\nexec {sys.executable} {script} \"$@\"\n")
    binary.chmod(0o755)
    fails, ports = tmp_path / "fails", tmp_path / "ports"
    monkeypatch.setattr(serve, "find_tritonserver",
                        lambda _work: TritonInstallation(binary, tmp_path, {**os.environ,
                                                                            "FAKE_FAILS_FILE": str(fails),
                                                                            "FAKE_PORTS_FILE": str(ports)}))
    (tmp_path / "repo").mkdir()
    return tmp_path / "repo", fails, ports


def test_a_port_taken_before_triton_binds_is_picked_again_once(fake_triton) -> None:
    repo, fails, ports = fake_triton
    fails.write_text("1")
    server = TritonServer(repo, models=[], options=ServerOptions(0, 0, 0, startup_timeout_s=20)).start()
    try:
        first, second = ports.read_text().split()
        assert first != second, "the retry must use newly picked ports"
        assert second == f"{server.options.http_port},{server.options.grpc_port},{server.options.metrics_port}"
    finally:
        assert server.stop() == 0


def test_no_second_retry_and_no_retry_for_ports_the_user_chose(fake_triton) -> None:
    repo, fails, ports = fake_triton
    fails.write_text("2")
    with pytest.raises(FactoryError, match="exited with code 1 while starting"):
        TritonServer(repo, models=[], options=ServerOptions(0, 0, 0, startup_timeout_s=20)).start()
    assert len(ports.read_text().split()) == 2
    fails.write_text("1")
    ports.write_text("")
    chosen = free_ports(3)
    with pytest.raises(FactoryError, match="already in use"):
        TritonServer(repo, models=[], options=ServerOptions(*chosen, startup_timeout_s=20)).start()
    assert len(ports.read_text().split()) == 1, "a port the user chose is theirs to fix, not ours to move"


def test_gpu_product_reaches_the_backend_through_the_server_environment(tmp_path: Path) -> None:
    from model_factory.backend.engines.loading import GPU_PRODUCT_ENV as BACKEND_ENV

    pinned = TritonServer(tmp_path, models=[], options=ServerOptions(0, 0, 0, gpu_product="NVIDIA-L4"))
    assert pinned.extra_env[serve.GPU_PRODUCT_ENV] == "NVIDIA-L4" and serve.GPU_PRODUCT_ENV == BACKEND_ENV
    assert serve.GPU_PRODUCT_ENV not in TritonServer(tmp_path, models=[], options=ServerOptions(0, 0, 0)).extra_env


def test_int8_kernels_reach_the_backend_and_acceptance(tmp_path: Path) -> None:
    from model_factory.backend.engines.cpu_features import INT8_KERNELS_ENV

    forced = TritonServer(tmp_path, models=[], options=ServerOptions(0, 0, 0, int8_kernels="simulated"))
    assert forced.extra_env[INT8_KERNELS_ENV] == "simulated" and serve.INT8_KERNELS_ENV == INT8_KERNELS_ENV
    assert INT8_KERNELS_ENV not in TritonServer(tmp_path, models=[], options=ServerOptions(0, 0, 0)).extra_env


def test_a_cost_cache_inside_the_signed_repository_is_refused(tmp_path: Path) -> None:
    from model_factory.errors import FactoryError
    from model_factory.serving.server import ServerOptions, default_cost_cache, start_verified_server

    (tmp_path / "repo" / "m").mkdir(parents=True)
    (tmp_path / "repo" / "m" / "config.pbtxt").write_text('name: "m"\n')
    with pytest.raises(FactoryError, match="inside the repository"):
        start_verified_server(tmp_path / "repo", ServerOptions(0, 0, 0), None, allow_unsigned=True,
                              cost_cache=tmp_path / "repo" / "m" / "cache")
    assert not (tmp_path / "repo" / "m" / "cache").exists()
    assert default_cost_cache().parts[-2:] == ("model-factory", "cost-models")


def test_the_admin_apis_are_restricted_with_a_per_run_key_by_default(tmp_path: Path) -> None:
    from model_factory.serving.server import ADMIN_HEADER, RESTRICTED_APIS

    install = TritonInstallation(Path("/bin/tritonserver"), tmp_path)
    first = TritonServer(tmp_path, models=[], options=ServerOptions(0, 0, 0))
    second = TritonServer(tmp_path, models=[], options=ServerOptions(0, 0, 0))
    assert first.admin_key and second.admin_key and first.admin_key != second.admin_key
    cmd = first.command(install)
    apis = ",".join(RESTRICTED_APIS)
    assert f"--http-restricted-api={apis}:{ADMIN_HEADER}={first.admin_key}" in cmd
    assert f"--grpc-restricted-protocol={apis}:{ADMIN_HEADER}={first.admin_key}" in cmd
    assert first.admin_headers == {ADMIN_HEADER: first.admin_key}
    given = TritonServer(tmp_path, models=[], options=ServerOptions(0, 0, 0, admin_key="k" * 20))
    assert given.admin_key == "k" * 20 and "k" * 20 not in repr(given.options)
    open_ = TritonServer(tmp_path, models=[], options=ServerOptions(0, 0, 0, restrict_admin=False))
    assert not any("restricted" in a for a in open_.command(install)) and open_.admin_headers == {}


def test_the_operator_key_comes_from_a_file_or_the_environment_and_is_checked(tmp_path: Path) -> None:
    from model_factory.serving.server import ADMIN_KEY_ENV, admin_key_from

    key = tmp_path / "admin-key"
    key.write_text("a" * 32 + "\nignored\n")
    assert admin_key_from(key, environ={ADMIN_KEY_ENV: "b" * 32}) == "a" * 32
    assert admin_key_from(None, environ={ADMIN_KEY_ENV: "b" * 32}) == "b" * 32
    assert admin_key_from(None, environ={}) is None
    for bad in ("short", "has:colon" + "x" * 16, "has,comma" + "x" * 16, "has space" + "x" * 16, ""):
        key.write_text(bad)
        with pytest.raises(FactoryError, match="not a usable key.*Fix: generate"):
            admin_key_from(key, environ={})
    key.write_bytes(b"\xff\xfe")
    with pytest.raises(FactoryError, match="cannot read the admin key file"):
        admin_key_from(key, environ={})


def test_a_server_started_by_a_process_killed_outright_goes_with_it(tmp_path: Path) -> None:
    """PR_SET_PDEATHSIG: a parent SIGKILLed (no handler runs) still takes its tritonserver with it."""
    import signal
    import subprocess
    import time

    script = tmp_path / "tritonserver.py"
    script.write_text(FAKE_SERVER)
    binary = tmp_path / "tritonserver"
    binary.write_text(f"#!/bin/sh\nexec {sys.executable} {script} \"$@\"\n")
    binary.chmod(0o755)
    (tmp_path / "fails").write_text("0")
    (tmp_path / "repo").mkdir()
    parent = f"""
import os, sys, time
from pathlib import Path
from model_factory.serving import triton_process as serve
from model_factory.serving.server import ServerOptions, TritonInstallation, TritonServer
env = {{**os.environ, "FAKE_FAILS_FILE": {str(tmp_path / "fails")!r}, "FAKE_PORTS_FILE": {str(tmp_path / "ports")!r}}}
serve.find_tritonserver = lambda _w: TritonInstallation(Path({str(binary)!r}), Path({str(tmp_path)!r}), env)
s = TritonServer(Path({str(tmp_path / "repo")!r}), models=[], options=ServerOptions(0, 0, 0, startup_timeout_s=20)).start()
print(s.process.pid, flush=True)
time.sleep(60)
"""
    proc = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = int(proc.stdout.readline())
        os.kill(child, 0)  # running
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                state = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                break
            if state == "Z":
                break
            time.sleep(0.05)
        else:
            os.kill(child, signal.SIGKILL)  # do not leave the stand-in behind
            pytest.fail("the stand-in tritonserver outlived its SIGKILLed parent")
    finally:
        if proc.poll() is None:
            proc.kill()
