"""A 2 GB+ weight file through the registry: chunked upload, resumed after the pushing process is killed; the pull
streams it to disk with bounded memory (its peak RSS is measured in a child process)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

RSS_BOUND_MIB = 400  # the pulling process: Python, oras, requests and a few MiB of buffers, never the layer
SIZE = (2 << 30) + 12345  # just past 2 GiB: an odd size, so the last chunk is partial
CHUNK = 256 << 20

_KILLED_PUSH = """
import os, signal, sys
from pathlib import Path
from model_factory.distribution.push_pull import push
from model_factory.distribution.registry import RegistryOptions
repo, ref, config, ca, state = sys.argv[1:6]
def progress(what, done, total):
    if "chunked" in what and done >= 3 * {chunk}:
        os.kill(os.getpid(), signal.SIGKILL)  # killed right after the third chunk was acknowledged
push(Path(repo), "big", ref, options=RegistryOptions(config=Path(config), ca_file=Path(ca), chunk_size={chunk},
     state_dir=Path(state)), progress=progress)
"""


_PULL = """
import sys
from pathlib import Path
from model_factory.distribution.push_pull import pull
from model_factory.distribution.registry import RegistryOptions
ref, dest, policy, config, ca = sys.argv[1:6]
pull(ref, Path(dest), Path(policy), options=RegistryOptions(config=Path(config), ca_file=Path(ca) if ca else None,
     plain_http=not ca))
# VmHWM: this process's own peak (ru_maxrss would carry over the forking parent's peak across exec on Linux).
print(next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")))  # KiB
"""


def pull_peak_rss_mib(ref: str, dest: Path, policy: Path, options) -> float:
    """``model-factory pull``'s work in a child process; its peak resident memory (VmHWM) in MiB."""
    proc = subprocess.run([sys.executable, "-c", _PULL, ref, str(dest), str(policy), str(options.config),
                           str(options.ca_file or "")], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return int(proc.stdout.split()[-1]) / 1024


def test_two_gib_layer_chunked_and_resumed_after_a_kill(registry, oci_keys, tmp_path):
    sys.path.insert(0, str(Path(__file__).parents[1] / "signing"))
    from signing_helpers import build_model

    from model_factory.distribution.push_pull import pull, push
    from model_factory.distribution.registry import RegistryOptions
    from model_factory.signing import SignerConfig, sign_model_version

    repo = tmp_path / "repo"
    build_model(repo / "big", (1,))
    weights = repo / "big" / "1" / "model.onnx.data"
    with open(weights, "wb") as f:  # sparse: costs no disk here, and streams as zeros with a marker at the end
        f.truncate(SIZE - 16)
        f.seek(SIZE - 16)
        f.write(b"end-of-weights!!")
    sign_model_version(repo / "big", 1, SignerConfig(oci_keys["trusted"][0]))
    ref = f"oci://{registry.host}/large/big:1"
    state = tmp_path / "upload-state"
    proc = subprocess.run([sys.executable, "-c", _KILLED_PUSH.format(chunk=CHUNK), str(repo), ref,
                           str(registry.config), str(registry.ca), str(state)], capture_output=True, timeout=600)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    assert list(state.glob("*.json")), "the upload session was recorded"

    sent: list[int] = []
    options = RegistryOptions(config=registry.config, ca_file=registry.ca, chunk_size=CHUNK, state_dir=state)
    push(repo, "big", ref, options=options,
         progress=lambda what, done, total: sent.append(done) if "chunked" in what else None)
    assert sent[0] == 4 * CHUNK and sent[-1] == SIZE  # resumed after the three acknowledged chunks
    assert not list(state.glob("*.json"))

    peak_mib = pull_peak_rss_mib(ref, tmp_path / "dest", oci_keys["policy"], options)
    assert peak_mib < RSS_BOUND_MIB, f"pulling a 2 GiB layer peaked at {peak_mib:.0f} MiB"
    pulled = tmp_path / "dest" / "big" / "1" / "model.onnx.data"
    assert pulled.stat().st_size == SIZE
    with open(pulled, "rb") as f:
        f.seek(SIZE - 16)
        assert f.read() == b"end-of-weights!!"
    os.remove(pulled)
