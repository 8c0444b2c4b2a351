"""The rendered verify steps, run for real: the chart's init container and the KServe storage container.

The command, args, environment and mounts come from the rendered manifests; each mount path
is mapped to a local folder (the volume's contents: the signed MiniLM repository at the
chart's <product>/trt-<version> sub-path, the trust policy and key from the rendered
ConfigMap and Secret). A good repository exits 0; one changed byte exits non-zero.
"""

from __future__ import annotations

import functools
import http.server
import os
import shutil
import subprocess
import sys
import tarfile
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from .helm_render import KSERVE, find, render, write_projected

pytest.importorskip("helm_python", reason="pip install 'model-factory[test]' (helm-python-sdk renders the chart)")
pytestmark = pytest.mark.slow

BIN = str(Path(sys.executable).parent)


@pytest.fixture(scope="module")
def signed(tmp_path_factory, minilm_recipe, package_signed):
    """The session's MiniLM export packaged and signed with provenance, and the public key's PEM."""
    from model_factory.signing import generate_keypair

    root = tmp_path_factory.mktemp("fleet-signed")
    repo = root / "repository"
    keys = generate_keypair(root / "keys")
    recipe = replace(minilm_recipe, repository=replace(minilm_recipe.repository, path=repo))
    package_signed(recipe, keys)
    return repo, recipe.name, keys.public_key.read_text()


@functools.lru_cache(maxsize=None)
def _rendered(public_pem: str) -> str:
    return yaml.safe_dump_all([d for text in render({"trust": {"files": {"release.pub": public_pem}}}).values()
                               for d in yaml.safe_load_all(text) if d])


def materialize_volumes(docs: list[dict], pod: dict, root: Path, repo: Path, repo_name: str) -> dict[str, Path]:
    """volume name -> a local folder with what the volume would hold in the cluster."""
    out: dict[str, Path] = {}
    for vol in pod["volumes"]:
        folder = root / "volumes" / vol["name"]
        folder.mkdir(parents=True)
        if "persistentVolumeClaim" in vol:
            # The claim as the factory Jobs leave it: <product>/trt-<version>/<model>/...
            sub = next(m["subPath"] for c in pod["containers"] for m in c["volumeMounts"] if m["name"] == vol["name"])
            shutil.copytree(repo / repo_name, folder / sub / repo_name)
        write_projected(docs, vol, folder)
        out[vol["name"]] = folder
    return out


def run_container(container: dict, volumes: dict[str, Path], scratch: Path) -> subprocess.CompletedProcess:
    """Run a rendered container's command/args here, its mount paths mapped onto the local volumes."""
    mapping = {}
    for m in container["volumeMounts"]:
        mapping[m["mountPath"]] = volumes[m["name"]] / m.get("subPath", "")
    mapping.setdefault("/tmp", scratch)

    def local(arg: str) -> str:
        for path in sorted(mapping, key=len, reverse=True):
            if arg == path or arg.startswith(path + "/"):
                return str(mapping[path]) + arg[len(path):]
        return arg

    argv = [local(a) for a in container["command"] + container.get("args", [])]
    env = {e["name"]: local(e["value"]) for e in container.get("env", []) if "value" in e}
    env["PATH"] = BIN + os.pathsep + os.environ.get("PATH", "")
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)


def test_init_container_command_passes_a_good_repository_and_fails_a_tampered_one(signed, tmp_path: Path) -> None:
    repo, name, public_pem = signed
    docs = list(yaml.safe_load_all(_rendered(public_pem)))
    pod = find(docs, "Deployment")["spec"]["template"]["spec"]
    verify = next(c for c in pod["initContainers"] if c["name"] == "verify")
    volumes = materialize_volumes(docs, pod, tmp_path, repo, name)

    good = run_container(verify, volumes, tmp_path)
    assert good.returncode == 0, good.stdout + good.stderr
    assert '"ok": true' in good.stdout and f'"model": "{name}"' in good.stdout

    onnx = next((volumes["models"]).rglob("1/model.onnx"))
    data = bytearray(onnx.read_bytes())
    data[len(data) // 2] ^= 0x01
    onnx.write_bytes(bytes(data))
    bad = run_container(verify, volumes, tmp_path)
    assert bad.returncode != 0
    assert '"ok": false' in bad.stdout and "model.onnx" in bad.stdout


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # noqa: ANN002
        pass


@pytest.fixture
def http_folder(tmp_path: Path):
    """A plain HTTP server on loopback serving ``tmp_path / 'www'`` (the in-network store)."""
    www = tmp_path / "www"
    www.mkdir()
    handler = functools.partial(_Quiet, directory=str(www))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield www, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_kserve_storage_container_verifies_what_it_downloads(signed, tmp_path: Path, http_folder) -> None:
    """KServe calls the storage container with (storageUri, /mnt/models): good -> models there; tampered -> none."""
    repo, name, public_pem = signed
    www, base = http_folder
    csc = next(d for d in yaml.safe_load_all((KSERVE / "clusterstoragecontainer.yaml").read_text()))
    container = dict(csc["spec"]["container"])
    trust = tmp_path / "trust"
    trust.mkdir()
    docs = list(yaml.safe_load_all(_rendered(public_pem)))
    (trust / "policy.toml").write_text(find(docs, "ConfigMap", "mf-model-factory-trust-policy")["data"]["policy.toml"])
    (trust / "release.pub").write_text(public_pem)
    with tarfile.open(www / "repository.tar", "w") as tar:
        tar.add(repo / name, arcname=name)
    tampered = www / "tampered.tar"
    shutil.copy(www / "repository.tar", tampered)
    with tarfile.open(tampered, "a") as tar:  # a later member with the same name replaces the config
        extra = tmp_path / "config.pbtxt"
        extra.write_text((repo / name / "config.pbtxt").read_text() + "\n# changed\n")
        tar.add(extra, arcname=f"{name}/config.pbtxt")

    for uri, ok in ((f"model-factory+{base}/repository.tar", True), (f"model-factory+{base}/tampered.tar", False)):
        dest = tmp_path / ("mnt-good" if ok else "mnt-bad")
        dest.mkdir()
        container["args"] = [uri, "/mnt/models"]
        volumes = {"model-factory-trust": trust, "kserve-provision-location": dest, "tmp": tmp_path}
        container["volumeMounts"] = csc["spec"]["container"]["volumeMounts"] + [
            {"name": "kserve-provision-location", "mountPath": "/mnt/models"}]
        proc = run_container(container, volumes, tmp_path)
        if ok:
            assert proc.returncode == 0, proc.stdout + proc.stderr
            assert (dest / name / "config.pbtxt").is_file()
        else:
            assert proc.returncode != 0 and "failed verification" in proc.stderr
            assert not any(dest.iterdir())


@pytest.mark.integration
def test_the_server_container_command_serves_what_verified(signed, tmp_path: Path) -> None:
    """The rendered server command (serve with the policy, GPU product, admin key) on the real Triton."""
    import signal
    import time
    import urllib.request

    from model_factory.serving.server import free_ports

    repo, name, public_pem = signed
    http, grpc, metrics = free_ports(3)
    docs = [d for text in render({"trust": {"files": {"release.pub": public_pem}},
                                  "ports": {"http": http, "grpc": grpc, "metrics": metrics},
                                  "serve": {"adminKey": {"enabled": True, "value": "fleet-admin-key-0123456789"}}}
                                 ).values() for d in yaml.safe_load_all(text) if d]
    pod = find(docs, "Deployment")["spec"]["template"]["spec"]
    server = next(c for c in pod["containers"] if c["name"] == "server")
    assert "--admin-key-file" in server["command"] and "--gpu-product" in server["command"]
    volumes = materialize_volumes(docs, pod, tmp_path, repo, name)
    (volumes["admin-key"] / "admin-key").write_text(find(docs, "Secret", "mf-model-factory-admin-key")
                                                    ["stringData"]["admin-key"])
    mapping = {m["mountPath"]: volumes[m["name"]] / m.get("subPath", "") for m in server["volumeMounts"]
               if m["mountPath"] not in ("/tmp", "/dev/shm")}
    argv = []
    for arg in server["command"]:
        hit = next((p for p in sorted(mapping, key=len, reverse=True) if arg == p or arg.startswith(p + "/")), None)
        argv.append(str(mapping[hit]) + arg[len(hit):] if hit else arg)
    env = {**os.environ, **{e["name"]: e["value"] for e in server["env"] if "value" in e}, "HOME": str(tmp_path),
           "PATH": BIN + os.pathsep + os.environ.get("PATH", "")}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    started = threading.Event()  # serve printed its banner: start-up over, a SIGTERM is an ordinary stop

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("Ctrl-C to stop."):
                started.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 240
        ready = False
        while time.monotonic() < deadline and proc.poll() is None and not ready:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/models/{name}/ready", timeout=2) as r:
                    ready = r.status == 200
            except OSError:
                time.sleep(1)
        # Triton answers ready as the model's load ends, a moment before serve's own start-up does.
        assert ready and started.wait(60), "".join(lines) if proc.poll() is not None else "not ready in time"
        # The startup/readiness/liveness probes' paths answer on the rendered port.
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            path = server[probe]["httpGet"]["path"]
            with urllib.request.urlopen(f"http://127.0.0.1:{http}{path}", timeout=5) as r:
                assert r.status == 200, probe
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=5) as r:
            assert b"nv_inference_queue_duration_us" in r.read()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        reader.join(timeout=30)
    out = "".join(lines)
    assert proc.returncode == 0, out
    assert f"serving {name}" in out
