"""A LoRA adapter entry through the registry (distribution/adapters.py): released, pushed and pulled as any signed
version, and pulled only onto the base version it was built on; one whose base DEST lacks, or holds with other bytes,
is refused by name before DEST changes. On the real registry (Debian's docker-registry on 127.0.0.1)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from model_factory.distribution.push_pull import pull, push
from model_factory.errors import FactoryError


@pytest.fixture
def adapter_repo(tmp_path, oci_keys):
    """``llm`` version 1 (a fake base) and ``support`` version 1, an adapter entry tied to llm 1's bytes; both signed."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "signing"))
    from signing_helpers import build_model

    from model_factory.backend.lora_contract import ADAPTER_SPEC, ADAPTER_WEIGHTS, AdapterSpec
    from model_factory.build_engines.lora import base_digests
    from model_factory.signing import SignerConfig, sign_model_version

    repo = tmp_path / "repo"
    build_model(repo / "llm", (1,))
    (repo / "llm" / "1" / "generation.json").write_text('{"family": "llama"}')
    vdir = repo / "support" / "1"
    vdir.mkdir(parents=True)
    np.savez(vdir / ADAPTER_WEIGHTS, **{"layers.0.attn.qkv_proj.A": np.ones((4, 2), np.float32),
                                       "layers.0.attn.qkv_proj.B": np.ones((2, 6), np.float32)})
    spec = AdapterSpec("support", 1, "llm", 1, base_digests(repo / "llm" / "1"), 2, ("layers.0.attn.qkv_proj",),
                       (vdir / ADAPTER_WEIGHTS).stat().st_size)
    (vdir / ADAPTER_SPEC).write_text(spec.to_json())
    for model in ("llm", "support"):
        sign_model_version(repo / model, 1, SignerConfig(oci_keys["trusted"][0]))
    return repo


def test_an_adapter_is_pushed_and_pulled_onto_its_base(registry, adapter_repo, oci_keys, reg_options, tmp_path):
    dest = tmp_path / "dest"
    for model in ("llm", "support"):
        push(adapter_repo, model, f"oci://{registry.host}/models/{model}:1", options=reg_options)
    ref = f"oci://{registry.host}/models/support:1"
    with pytest.raises(FactoryError, match="adapter support version 1 was built for llm version 1, which .* does not "
                                           "hold. Fix: pull that base version first"):
        pull(ref, dest, oci_keys["policy"], options=reg_options)
    assert not (dest / "support").exists()
    pull(f"oci://{registry.host}/models/llm:1", dest, oci_keys["policy"], options=reg_options)
    got = pull(ref, dest, oci_keys["policy"], options=reg_options)
    assert got.model == "support" and got.signer == "key:release"
    spec = json.loads((dest / "support" / "1" / "adapter.json").read_text())
    assert spec["base"] == "llm" and not (dest / "support" / "config.pbtxt").exists()
    assert (dest / "support" / "1.sig").is_file()  # verified there as any version: serve checks it again


def test_an_adapter_for_another_base_is_refused_by_name(registry, adapter_repo, oci_keys, reg_options, tmp_path):
    push(adapter_repo, "support", f"oci://{registry.host}/models/support:1", options=reg_options)
    dest = tmp_path / "dest"
    (dest / "llm" / "1").mkdir(parents=True)  # llm version 1 of another build: other weights under the same name
    for f in ("model.onnx", "generation.json"):
        (dest / "llm" / "1" / f).write_bytes((adapter_repo / "llm" / "1" / f).read_bytes())
    (dest / "llm" / "1" / "model.onnx").write_bytes(b"another base's weights")
    with pytest.raises(FactoryError) as err:
        pull(f"oci://{registry.host}/models/support:1", dest, oci_keys["policy"], options=reg_options)
    assert "adapter support version 1 was built for llm version 1 whose model.onnx differs" in str(err.value)
    assert "it is another base" in str(err.value) and "Fix: " in str(err.value)
    assert not (dest / "support").exists()  # DEST as it was


def test_a_released_adapter_passes_the_release_check_of_a_fleet(registry, adapter_repo, oci_keys, reg_options,
                                                                  tmp_path):
    pytest.importorskip("tuf", reason="pip install 'model-factory[sign]' (python-tuf)")
    import shutil

    from cryptography.hazmat.primitives.asymmetric import ec

    from model_factory.signing.release import KeyFile, add_release, init_release
    from signing_helpers import write_key, write_pub

    keys, pubs = {}, {}
    for label in ("root", "targets", "online"):
        k = ec.generate_private_key(ec.SECP256R1())
        keys[label] = KeyFile(write_key(k, tmp_path / f"{label}.pem"))
        pubs[label] = write_pub(k, tmp_path / f"{label}.pub")
    init_release(adapter_repo, [keys["root"]], {"targets": [pubs["targets"]], "snapshot": [pubs["online"]],
                                                "timestamp": [pubs["online"]]})
    assert add_release(adapter_repo, [keys["targets"]], [keys["online"]], [keys["online"]]) == 1
    listed = json.loads((adapter_repo / ".release" / "targets.json").read_text())["signed"]["targets"]
    assert listed["support/1.sig"]["custom"]["model"] == "support"  # the adapter is in the release
    trust = tmp_path / "trust"
    trust.mkdir()
    shutil.copy(adapter_repo / ".release" / "1.root.json", trust / "release-root.json")
    policy = trust / "policy.toml"
    policy.write_text(f'version = 1\n[[keys]]\nname = "release"\npath = "{oci_keys["trusted"][1]}"\n'
                      f'[release]\nroot = "release-root.json"\nstate_dir = "{tmp_path / "state"}"\nmin_version = 1\n')
    dest = tmp_path / "dest"
    for model in ("llm", "support"):
        pushed = push(adapter_repo, model, f"oci://{registry.host}/rel/{model}:1", options=reg_options)
        assert set(pushed.referrers) == {"signature", "release"}
        pull(f"oci://{registry.host}/rel/{model}:1", dest, policy, options=reg_options)
    assert (dest / "support" / "1" / "adapter.npz").is_file() and (dest / ".release" / "targets.json").is_file()
