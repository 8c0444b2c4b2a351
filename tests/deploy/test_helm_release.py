"""The chart with signed releases: the state volume (emptyDir or a shared claim) rendered and validated, and
the rendered verify init container run for real: the current release passes, a rolled-back repository fails
with the attack named, and a brand-new pod (empty state) is held by the floor from the chart values."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import yaml
from cryptography.hazmat.primitives.asymmetric import ec

from .helm_render import find, objects, render, schema_errors, write_projected

pytest.importorskip("helm_python", reason="pip install 'model-factory[test]' (helm-python-sdk renders the chart)")
pytest.importorskip("tuf", reason="pip install 'model-factory[sign]' (python-tuf)")

STATE = "/var/lib/model-factory/release"
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "signing"))
from signing_helpers import build_model, write_key, write_pub  # noqa: E402


def _mounts(container: dict) -> dict[str, dict]:
    return {m["name"]: m for m in container["volumeMounts"]}


@pytest.mark.parametrize("values_set, volume", [("release-emptydir", {"emptyDir": {}}),
                                                ("release-shared-claim",
                                                 {"persistentVolumeClaim": {"claimName": "release-state"}})])
def test_state_volume_reaches_verify_and_serve(values_set: str, volume: dict) -> None:
    docs = objects(values_set)
    pod = find(docs, "Deployment")["spec"]["template"]["spec"]
    assert {k: v for k, v in {v["name"]: v for v in pod["volumes"]}["release-state"].items() if k != "name"} == volume
    for c in [c for c in pod["initContainers"] if c["name"] == "verify"] + pod["containers"]:
        mount = _mounts(c)["release-state"]
        assert mount["mountPath"] == STATE and not mount.get("readOnly")
    data = find(docs, "ConfigMap", "mf-model-factory-trust-policy")["data"]
    policy = data["policy.toml"]
    assert f'state_dir = "{STATE}"' in policy and 'root = "release-root.json"' in policy
    assert "release-root.json" in data
    trust = {v["name"]: v for v in pod["volumes"]}["trust"]["projected"]["sources"][0]["configMap"]["items"]
    assert {"key": "release-root.json", "path": "release-root.json"} in trust


def test_the_oci_source_pulls_with_the_same_release_state_that_verify_and_serve_use() -> None:
    pod = find(objects("oci-release"), "Deployment")["spec"]["template"]["spec"]
    users = [c for c in pod["initContainers"] if c["name"] in ("pull-0", "verify")] + pod["containers"]
    assert [c["name"] for c in users] == ["pull-0", "verify", "server"]
    for c in users:
        mount = _mounts(c)["release-state"]
        assert mount["mountPath"] == STATE and not mount.get("readOnly")


def test_factory_jobs_get_the_root_but_not_the_state() -> None:
    for job in [d for d in objects("release-shared-claim") if d["kind"] == "Job"]:
        spec = job["spec"]["template"]["spec"]
        assert "release-state" not in {v["name"] for v in spec["volumes"]}
        items = {v["name"]: v for v in spec["volumes"]}["trust"]["projected"]["sources"][0]["configMap"]["items"]
        assert {"key": "release-root.json", "path": "release-root.json"} in items


def test_release_values_are_checked() -> None:
    assert "existingClaim" in schema_errors({"release": {"enabled": True, "root": "{}",
                                                         "state": {"type": "persistentVolumeClaim"}}})
    assert "minVersion" in schema_errors({"release": {"minVersion": 0}})
    with pytest.raises(Exception, match="release.root"):
        render({"release": {"enabled": True}})


def _key(d: Path, label: str) -> tuple[Path, Path]:
    k = ec.generate_private_key(ec.SECP256R1())
    return write_key(k, d / f"{label}.pem"), write_pub(k, d / f"{label}.pub")


def _volumes(docs: list[dict], pod: dict, root: Path, repo: Path) -> dict[str, Path]:
    """volume name -> local folder: the repository at the claim's sub-path, the rendered trust files, empty dirs."""
    out = {}
    for vol in pod["volumes"]:
        folder = root / vol["name"]
        folder.mkdir(parents=True, exist_ok=True)
        if vol["name"] == "models":
            sub = next(m["subPath"] for c in pod["containers"] for m in c["volumeMounts"] if m["name"] == "models")
            shutil.copytree(repo, folder / sub)
        write_projected(docs, vol, folder)
        out[vol["name"]] = folder
    # The policy names the state volume's mount path: point it at this pod's local folder, as
    # run_container does for the paths in a command line.
    policy = out["trust"] / "policy.toml"
    policy.write_text(policy.read_text().replace(STATE, str(out["release-state"])))
    return out


def test_init_container_refuses_a_rolled_back_repository(tmp_path: Path) -> None:
    from model_factory.signing import SignerConfig, sign_model_version, sign_repository
    from model_factory.signing.release import KeyFile, add_release, init_release

    from .test_helm_verify import run_container

    keys = tmp_path / "keys"
    keys.mkdir()
    (model_key, model_pub), (release_key, release_pub) = _key(keys, "model"), _key(keys, "release")
    repo = tmp_path / "repo"
    build_model(repo / "encoder", (1,))
    signer = SignerConfig(model_key)
    sign_repository(repo, signer)
    k = [KeyFile(release_key)]
    root = init_release(repo, k, {r: [release_pub] for r in ("targets", "snapshot", "timestamp")})
    add_release(repo, k, k, k)
    release1 = tmp_path / "release-1"
    shutil.copytree(repo, release1)
    build_model(repo / "encoder", (2,))
    sign_model_version(repo / "encoder", 2, signer)
    add_release(repo, k, k, k)

    def pod_for(min_version: int) -> tuple[list[dict], dict]:
        values = {"trust": {"policy": 'version = 1\n[[keys]]\nname = "release"\npath = "release.pub"\n',
                            "files": {"release.pub": model_pub.read_text()}},
                  "release": {"enabled": True, "root": root.read_text(), "minVersion": min_version}}
        docs = [d for text in render(values).values() for d in yaml.safe_load_all(text) if d]
        return docs, find(docs, "Deployment")["spec"]["template"]["spec"]

    docs, pod = pod_for(1)
    verify = next(c for c in pod["initContainers"] if c["name"] == "verify")
    volumes = _volumes(docs, pod, tmp_path / "pod-a", repo)
    good = run_container(verify, volumes, tmp_path)
    assert good.returncode == 0, good.stdout + good.stderr
    assert (volumes["release-state"] / "timestamp.json").is_file()

    # The volume is rolled back to release 1; the same pod (its emptyDir kept) restarts its init container.
    sub = next(volumes["models"].glob("*/*"))
    shutil.rmtree(sub)
    shutil.copytree(release1, sub)
    bad = run_container(verify, volumes, tmp_path)
    assert bad.returncode != 0 and "rollback attack" in bad.stdout, bad.stdout + bad.stderr

    # A brand-new pod has an empty state volume: release 1 passes with the default floor (what a fresh
    # pod is not protected against) and is refused once the chart's floor is release 2.
    docs, pod = pod_for(1)
    fresh = _volumes(docs, pod, tmp_path / "pod-b", release1)
    assert run_container(verify, fresh, tmp_path).returncode == 0
    docs, pod = pod_for(2)
    verify = next(c for c in pod["initContainers"] if c["name"] == "verify")
    floor = _volumes(docs, pod, tmp_path / "pod-c", release1)
    held = run_container(verify, floor, tmp_path)
    assert held.returncode != 0 and "below the floor" in held.stdout, held.stdout + held.stderr
