"""Serve in a sandbox, on the real server: each stub walls itself in after it has loaded.

A test-only hook (MODEL_FACTORY_SANDBOX_TEST_HOOK, run by the stub inside its walls) tries what a poisoned
model would: read a file outside its folder, run a shell, open a socket, fork. Each is refused, the model
still serves, and /metrics and the load log say the sandbox is on.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from model_factory.backend.operations import sandbox

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not sandbox.support().complete,
                                 reason=f"this kernel lacks the sandbox: {sandbox.support().missing}")]

HOOK = '''
import os, socket, subprocess
import triton_python_backend_utils as pb_utils

def attempt(name, fn):
    try:
        fn()
        said = "allowed"
    except OSError as exc:
        said = f"refused errno={exc.errno}"
    pb_utils.Logger.log_info(f"sandbox-hook {name}: {said}")

attempt("secret", lambda: open(SECRET).read())
attempt("passwd", lambda: open("/etc/passwd").read())
attempt("shell", lambda: subprocess.run(["/bin/sh", "-c", "true"], check=True))
attempt("fork", lambda: os._exit(0) if os.fork() == 0 else None)
attempt("socket", lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM))
attempt("write-beside-model", lambda: open(os.path.join(version_dir, "planted.txt"), "w").write("x"))
attempt("scratch", lambda: open(os.path.join(scratch, "ok.txt"), "w").write("x"))
attempt("own-config", lambda: open(os.path.join(version_dir, "..", "config.pbtxt")).read())
pb_utils.Logger.log_info(f"sandbox-scratch {scratch}")
'''


def test_a_sandboxed_stub_refuses_files_shells_and_sockets_and_still_serves(minilm_repository, tmp_path: Path) -> None:
    from model_factory.measure import bench
    from model_factory.measure.client import embed_texts
    from model_factory.serving.server import ServerOptions, TritonServer

    secret = tmp_path / "secret.txt"
    secret.write_text("not for the model")
    hook = tmp_path / "hook.py"
    hook.write_text(f"SECRET = {str(secret)!r}\n" + HOOK)
    log = tmp_path / "triton.log"
    server = TritonServer(minilm_repository, options=ServerOptions(0, 0, 0, log_verbose=1), log_file=log,
                          env={sandbox.TEST_HOOK_ENV: str(hook)}).start()
    try:
        emb = embed_texts(server.grpc_url, "minilm", ["a walled-in model still answers"], protocol="grpc")
        assert emb.shape == (1, 384) and np.isclose(np.linalg.norm(emb), 1.0, atol=1e-5)
        info = [s.labels for s in bench.scrape_metrics(server.metrics_url) if s.name == "model_factory_engine_info"]
        assert info and all(x["sandbox"].startswith("on (Landlock ABI ") and "seccomp" in x["sandbox"]
                            for x in info), info
    finally:
        assert server.stop() == 0
    text = log.read_text()
    said = {}
    for line in text.splitlines():
        if "sandbox-hook " in line:
            name, _, verdict = line.split("sandbox-hook ", 1)[1].partition(": ")
            said[name] = verdict.strip().rstrip('"')  # Triton quotes each log message
    assert said == {"secret": "refused errno=13", "passwd": "refused errno=13", "shell": "refused errno=13",
                    "fork": "refused errno=13", "socket": "refused errno=13",
                    "write-beside-model": "refused errno=13", "scratch": "allowed", "own-config": "allowed"}, said
    assert "sandbox on (Landlock ABI" in text
    # Each stub's scratch lies in the server's work folder, removed with it: never left in the shared /tmp.
    scratches = [line.split("sandbox-scratch ", 1)[1].strip().rstrip('"') for line in text.splitlines()
                 if "sandbox-scratch " in line]
    assert scratches and all(Path(p).parent == Path(server.work_dir) / "stub-scratch" for p in scratches), scratches
    assert not (minilm_repository / "minilm" / "1" / "planted.txt").exists()
