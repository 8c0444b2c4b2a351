"""A version's own config.pbtxt and the model's derived one (signing/model_config.py, layout.carries_own_config).

Fast and on fake models; the documented upgrade end to end (build --key, release add) is tests/build/test_upgrade.py.
"""

from __future__ import annotations

from pathlib import Path

from model_factory.signing import SignerConfig, load_policy, sign_model_version, signed_digests, verify_repository
from model_factory.signing.layout import other_version_ignores, scan_unit
from model_factory.signing.model_config import served_versions

from signing_helpers import build_model


def _config(versions: str, batch: int = 8) -> bytes:
    return (f'name: "encoder"\nbackend: "python"\nmax_batch_size: {batch}\n'
            f'version_policy {{\n  {versions}\n}}\n').encode()


def _package(model_dir: Path, version: int, key: Path, batch: int = 8) -> None:
    """As packaging does: the version's folder, its own config.pbtxt, the model's written from it; then signed."""
    build_model(model_dir, (version,))
    config = _config(f"specific {{\n    versions: {version}\n  }}", batch)
    (model_dir / str(version) / "config.pbtxt").write_bytes(config)
    (model_dir / "config.pbtxt").write_bytes(config)
    sign_model_version(model_dir, version, SignerConfig(key))


def _verdicts(repo: Path, policy: Path) -> dict[int, tuple[bool, tuple[str, ...]]]:
    return {r.version: (r.ok, r.reasons) for r in verify_repository(repo, load_policy(policy))}


def test_a_version_with_its_own_config_leaves_the_model_s_out_of_its_unit(tmp_path: Path, keys) -> None:
    model_dir = tmp_path / "repo" / "encoder"
    _package(model_dir, 1, keys["trusted"].private)
    assert "config.pbtxt" not in scan_unit(model_dir, 1).files and "1/config.pbtxt" in scan_unit(model_dir, 1).files
    assert "config.pbtxt" in other_version_ignores(model_dir, 1)
    assert set(signed_digests(model_dir, 1)) >= {"1/config.pbtxt"} and "config.pbtxt" not in signed_digests(model_dir, 1)
    legacy = build_model(tmp_path / "legacy" / "encoder", (1,))  # packaged before: no copy of its own
    assert "config.pbtxt" in scan_unit(legacy, 1).files and "config.pbtxt" not in other_version_ignores(legacy, 1)


def test_a_new_version_keeps_the_others_verifying_and_a_tampered_config_fails_the_version_it_serves(
        tmp_path: Path, keys, key_policy) -> None:
    repo = tmp_path / "repo"
    model_dir = repo / "encoder"
    _package(model_dir, 1, keys["trusted"].private)
    _package(model_dir, 2, keys["trusted"].private, batch=16)  # rewrites the model's config.pbtxt
    policy = key_policy()
    assert _verdicts(repo, policy) == {1: (True, ()), 2: (True, ())}

    v2 = (model_dir / "2" / "config.pbtxt").read_bytes()
    (model_dir / "config.pbtxt").write_bytes(v2.replace(b"max_batch_size: 16", b"max_batch_size: 64"))
    verdicts = _verdicts(repo, policy)
    assert verdicts[1] == (True, ()) and not verdicts[2][0]
    assert verdicts[2][1] == ("config.pbtxt serves version 2 but is not its signed configuration (2/config.pbtxt): "
                              "it was changed after packaging. Fix: copy 2/config.pbtxt over it, or rebuild the "
                              "version",)

    v1 = (model_dir / "1" / "config.pbtxt").read_bytes()
    (model_dir / "config.pbtxt").write_bytes(v1 + b'parameters {\n  key: "engine"\n  value { string_value: "torch" }\n}\n')
    verdicts = _verdicts(repo, policy)
    assert not verdicts[1][0] and verdicts[2] == (True, ())
    (model_dir / "config.pbtxt").write_bytes(b"backend: {")  # serves what? Nobody can tell: every version fails
    assert [ok for ok, _ in _verdicts(repo, policy).values()] == [False, False]
    (model_dir / "config.pbtxt").write_bytes(v1)  # version 1's own configuration serves version 1, as signed
    assert _verdicts(repo, policy) == {1: (True, ()), 2: (True, ())}

    # The version's own copy is signed with it; removing it puts the model's config.pbtxt back in its unit.
    (model_dir / "1" / "config.pbtxt").write_bytes(v1.replace(b"max_batch_size: 8", b"max_batch_size: 9"))
    ok, reasons = _verdicts(repo, policy)[1]
    assert not ok and reasons[0].startswith("file 1/config.pbtxt changed")
    (model_dir / "1" / "config.pbtxt").unlink()
    ok, reasons = _verdicts(repo, policy)[1]
    # (the model's config.pbtxt is version 1's bytes here: the verifier reads the removal as a move)
    assert not ok and reasons == ("file 1/config.pbtxt was renamed to config.pbtxt (same content, path not signed)",)


def test_served_versions_follows_triton_s_version_policy() -> None:
    available = [1, 2, 3]
    assert served_versions(_config("specific {\n    versions: 1\n    versions: 3\n  }"), available) == {1, 3}
    assert served_versions(_config("latest {\n    num_versions: 2\n  }"), available) == {2, 3}
    assert served_versions(_config("all {\n  }"), available) == {1, 2, 3}
    assert served_versions(b'name: "encoder"\n', available) == {3}
    assert served_versions(b"backend: {", available) is None
