"""The model's ``config.pbtxt`` as derived from the served version's own signed copy.

Packaging writes a model's configuration twice: ``<model>/config.pbtxt``, which Triton reads, and
``<model>/<version>/config.pbtxt``, signed with the version (:mod:`model_factory.signing.layout`). The model's
file names the version it serves in its ``version_policy``, so each build rewrites it; it is outside every
version's unit that carries its own copy, which keeps the versions built before verifying. What protects it is
this check: for each version the model's ``config.pbtxt`` serves, it must be that version's signed copy, byte for
byte. A tampered file (other parameters, another instance count, another backend) therefore fails the version it
would serve, and a file that serves an older version is that version's own signed configuration.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from model_factory.signing import layout


def served_versions(text: bytes, available: Iterable[int]) -> frozenset[int] | None:
    """The versions a configuration's ``version_policy`` serves out of ``available`` (Triton's rule: ``specific``
    names them, ``all`` every one, ``latest`` the highest ``num_versions``, none the latest one); None when the
    text does not parse as a Triton model configuration."""
    try:
        from google.protobuf import text_format
        from tritonclient.grpc import model_config_pb2

        config = text_format.Parse(text.decode("utf-8"), model_config_pb2.ModelConfig())
    except Exception:  # noqa: BLE001 - any unreadable configuration serves an unknown set
        return None
    versions = sorted(set(available))
    policy = config.version_policy
    kind = policy.WhichOneof("policy_choice") if config.HasField("version_policy") else None
    if kind == "specific":
        return frozenset(int(v) for v in policy.specific.versions)
    if kind == "all":
        return frozenset(versions)
    n = int(policy.latest.num_versions) if kind == "latest" else 1
    return frozenset(versions[-n:] if n > 0 else [])


def derived_config_reasons(model_dir: Path, version: int) -> list[str]:
    """Why the model's ``config.pbtxt`` cannot stand for ``version`` (which carries its own): it serves this version
    but is not its signed copy. Empty when it is the copy, when it serves other versions only (their verification
    holds it to theirs), when there is none, or when it is not a regular file (the unit's scan reports that)."""
    model_dir = Path(model_dir)
    if not layout.carries_own_config(model_dir, version):
        return []
    top = model_dir / layout.CONFIG
    if top.is_symlink() or not top.is_file():
        return []
    try:
        text, own = top.read_bytes(), layout.own_config_path(model_dir, version).read_bytes()
    except OSError as exc:
        return [f"cannot read {layout.CONFIG}: {exc.strerror or exc}"]
    if text == own:
        return []
    served = served_versions(text, layout.model_entries(model_dir).versions)
    if served is None:
        return [f"{layout.CONFIG} does not parse as a Triton model configuration, and it is not version {version}'s "
                f"signed copy ({version}/{layout.CONFIG}). Fix: copy {version}/{layout.CONFIG} over it (or rebuild)"]
    if version not in served:
        return []
    return [f"{layout.CONFIG} serves version {version} but is not its signed configuration ({version}/{layout.CONFIG}): "
            f"it was changed after packaging. Fix: copy {version}/{layout.CONFIG} over it, or rebuild the version"]
