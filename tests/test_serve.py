"""Port picking and start-up of TritonServer, with a stand-in tritonserver (the real one: tests/integration)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from model_factory import serve
from model_factory.errors import FactoryError
from model_factory.serve import ServerOptions, TritonInstallation, TritonServer, free_ports

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
    from model_factory.backend.loading import GPU_PRODUCT_ENV as BACKEND_ENV

    pinned = TritonServer(tmp_path, models=[], options=ServerOptions(0, 0, 0, gpu_product="NVIDIA-L4"))
    assert pinned.extra_env[serve.GPU_PRODUCT_ENV] == "NVIDIA-L4" and serve.GPU_PRODUCT_ENV == BACKEND_ENV
    assert serve.GPU_PRODUCT_ENV not in TritonServer(tmp_path, models=[], options=ServerOptions(0, 0, 0)).extra_env


def test_a_cost_cache_inside_the_signed_repository_is_refused(tmp_path: Path) -> None:
    from model_factory.errors import FactoryError
    from model_factory.serve import ServerOptions, default_cost_cache, start_verified_server

    (tmp_path / "repo" / "m").mkdir(parents=True)
    (tmp_path / "repo" / "m" / "config.pbtxt").write_text('name: "m"\n')
    with pytest.raises(FactoryError, match="inside the repository"):
        start_verified_server(tmp_path / "repo", ServerOptions(0, 0, 0), None, allow_unsigned=True,
                              cost_cache=tmp_path / "repo" / "m" / "cache")
    assert not (tmp_path / "repo" / "m" / "cache").exists()
    assert default_cost_cache().parts[-2:] == ("model-factory", "cost-models")
