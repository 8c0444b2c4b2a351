"""No network, proven: the whole demo (build, sign, verify, serve, answer) inside a loopback-only namespace.

The demo builds the packaged MiniLM recipe (export, FP16, INT8 with calibration, package), signs it,
verifies it, serves it on the bundled Triton and answers requests over HTTP and gRPC. It runs in a
fresh network namespace with only `lo` (nothing can leave the machine) and with the Python network
guard installed (any non-loopback attempt from Python prints who tried and fails). HF_HUB_OFFLINE and
TRANSFORMERS_OFFLINE are unset, so nothing is kept offline by a flag: the code itself never tries.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from .netns import netns_available, run_in_netns
from .network_guard import guarded_env

ok, why = netns_available()
pytestmark = [pytest.mark.integration, pytest.mark.skipif(not ok, reason=f"network namespaces unavailable: {why}")]


def test_demo_runs_with_no_network(tmp_path: Path) -> None:
    log = tmp_path / "guard.log"
    env = guarded_env(log=log)
    for flag in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        env.pop(flag, None)
    cli = Path(sys.executable).parent / "model-factory"
    proc = run_in_netns([str(cli), "demo", "--workdir", str(tmp_path / "demo")], env=env, timeout=900)
    output = proc.stdout + proc.stderr
    blocked = log.read_text() if log.exists() else ""
    assert not blocked, f"something tried to reach the network:\n{blocked}"
    assert "network_guard: blocked" not in output
    assert proc.returncode == 0, output[-4000:]
    assert "verify minilm/1: OK" in output
    assert "http: embedding shape [3, 384]" in output and "grpc: embedding shape [3, 384]" in output
    assert (tmp_path / "demo" / "model_repository" / "minilm" / "1.sig").is_file()
