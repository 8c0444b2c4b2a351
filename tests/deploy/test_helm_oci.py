"""The chart's `oci` source: init containers pull and verify from a registry, then verify and serve read the result.

Rendered by the real Helm engine and validated like every values set (test_helm.py); here the pull
containers' shape, and their command run for real against the test registry (Distribution 2.8 with
TLS and htpasswd) with the chart's paths mapped onto a temporary folder.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from .helm_render import find, objects, schema_errors

pytest.importorskip("helm_python", reason="pip install 'model-factory[test]' (helm-python-sdk renders the chart)")

REFS = ["oci://registry.models.svc:5000/models/minilm:1", "oci://registry.models.svc:5000/models/bge:3"]


def _containers(spec: dict, init: bool) -> dict[str, dict]:
    return {c["name"]: c for c in spec["initContainers" if init else "containers"]}


def test_oci_source_pulls_each_reference_then_verifies() -> None:
    docs = objects("oci")
    spec = find(docs, "Deployment")["spec"]["template"]["spec"]
    inits = _containers(spec, init=True)
    assert list(inits) == ["pull-0", "pull-1", "verify"]
    pull = inits["pull-0"]
    assert pull["command"] == ["model-factory", "pull", REFS[0], "/work/repository", "--policy",
                               "/etc/model-factory/trust/policy.toml", "--ca-file",
                               "/etc/model-factory/registry-ca/ca.pem", "--registry-config",
                               "/etc/model-factory/registry-auth/config.json"]
    assert inits["pull-1"]["command"][2] == REFS[1]
    mounts = {m["mountPath"]: m for m in pull["volumeMounts"]}
    assert mounts["/work"]["name"] == "models" and "readOnly" not in mounts["/work"]
    assert mounts["/etc/model-factory/trust"]["readOnly"] is True
    # verify and serve read what pull wrote, read-only.
    for c in (inits["verify"], _containers(spec, init=False)["server"]):
        m = {x["mountPath"]: x for x in c["volumeMounts"]}["/models"]
        assert m["subPath"] == "repository" and m["readOnly"] is True
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert "emptyDir" in volumes["models"]
    assert volumes["registry-auth"]["secret"]["items"] == [{"key": ".dockerconfigjson", "path": "config.json"}]
    assert volumes["registry-ca"]["secret"]["secretName"] == "registry-ca"
    egress = find(docs, "NetworkPolicy")["spec"]["egress"]
    assert [[p["port"] for p in rule["ports"]] for rule in egress] == [[5000], [53, 53]]


def test_oci_source_needs_references_of_the_right_form() -> None:
    assert "references" in schema_errors({"repository": {"source": "oci"}})
    assert schema_errors({"repository": {"source": "oci", "oci": {"references": ["registry:5000/models/minilm:1"]}}})
    assert not schema_errors({"repository": {"source": "oci", "oci": {"references": REFS[:1]}}})


def test_the_init_command_pulls_and_verifies_from_the_test_registry(registry, fake_repo, oci_keys, tmp_path) -> None:
    """The rendered pull command, with the pod's paths mapped here, against the real test registry."""
    from model_factory.distribution.push_pull import push
    from model_factory.distribution.registry import RegistryOptions

    ref = f"oci://{registry.host}/models/enc:2"
    push(fake_repo, "enc", ref, version=2, options=RegistryOptions(config=registry.config, ca_file=registry.ca))
    docs = objects("oci")
    spec = find(docs, "Deployment")["spec"]["template"]["spec"]
    inits = _containers(spec, init=True)
    work = tmp_path / "work"
    paths = {"/work": str(work), "/etc/model-factory/trust/policy.toml": str(oci_keys["policy"]),
             "/etc/model-factory/registry-ca/ca.pem": str(registry.ca),
             "/etc/model-factory/registry-auth/config.json": str(registry.config), REFS[0]: ref}

    def local(command: list[str]) -> list[str]:
        out = []
        for arg in command:
            for pod_path, here in paths.items():
                arg = here + arg[len(pod_path):] if arg.startswith(pod_path) else arg
            out.append(arg)
        return [str(Path(sys.executable).with_name("model-factory")), *out[1:]]

    pulled = subprocess.run(local(inits["pull-0"]["command"]), capture_output=True, text=True, timeout=300)
    assert pulled.returncode == 0, pulled.stderr
    assert (work / "repository" / "enc" / "2.sig").is_file()
    # The verify init container then reads /models = <volume>/repository.
    paths["/models"] = str(work / "repository")
    verified = subprocess.run(local(inits["verify"]["command"]), capture_output=True, text=True, timeout=300)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert '"ok": true' in verified.stdout


def test_kserve_oci_examples_validate_and_the_storage_container_pulls_and_verifies(registry, fake_repo, oci_keys,
                                                                                    tmp_path) -> None:
    """The `model-factory+oci://` storage container's script, run here with KServe's two arguments."""
    import os
    import shutil

    import yaml

    from model_factory.distribution.push_pull import push
    from model_factory.distribution.registry import RegistryOptions

    from .helm_render import KSERVE, KUBE_VERSIONS, validate_object

    docs = {}
    for path in sorted((KSERVE / "oci").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            validate_object(doc, KUBE_VERSIONS[0])
            docs[doc["kind"]] = doc
    assert docs["InferenceService"]["spec"]["predictor"]["model"]["storageUri"].startswith("model-factory+oci://")
    runtime = yaml.safe_load((KSERVE / "servingruntime.yaml").read_text())
    assert "model-factory-registry" in {v["name"] for v in runtime["spec"]["volumes"]}
    container = docs["ClusterStorageContainer"]["spec"]["container"]
    assert {m["name"] for m in container["volumeMounts"]} <= {v["name"] for v in runtime["spec"]["volumes"]}

    ref = f"oci://{registry.host}/kserve/enc:2"
    push(fake_repo, "enc", ref, version=2, options=RegistryOptions(config=registry.config, ca_file=registry.ca))
    dest = tmp_path / "mnt" / "models"
    dest.mkdir(parents=True)
    env = {**os.environ, "MODEL_FACTORY_POLICY": str(oci_keys["policy"]), "MODEL_FACTORY_REGISTRY_CA": str(registry.ca),
           "DOCKER_CONFIG": str(registry.config.parent),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    run = subprocess.run([*container["command"], f"model-factory+{ref}", str(dest)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert sorted(p.name for p in dest.iterdir()) == ["enc"] and (dest / "enc" / "2.sig").is_file()
    # A foreign signer: the init container fails and /mnt/models stays empty.
    from model_factory.signing import SignerConfig, sign_model_version

    other = tmp_path / "other"
    shutil.copytree(fake_repo, other)
    sign_model_version(other / "enc", 2, SignerConfig(oci_keys["foreign"][0]))
    push(other, "enc", f"oci://{registry.host}/kserve/foreign:2", version=2,
         options=RegistryOptions(config=registry.config, ca_file=registry.ca))
    dest2 = tmp_path / "mnt2" / "models"
    dest2.mkdir(parents=True)
    run = subprocess.run([*container["command"], f"model-factory+oci://{registry.host}/kserve/foreign:2", str(dest2)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "not trusted" in run.stderr
    assert not list(dest2.iterdir())
