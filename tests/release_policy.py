"""A repository released under one key and a key policy that trusts it (the rollout and prompt serving tests)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any


def released_policy(repo: Path, keys: Any, root: Path) -> tuple[Path, list]:
    """Release 1 of ``repo`` with ``keys``' one key in every role, and the key policy under ``root`` that trusts that
    key and reads the release's root (state under ``root / "state"``); returns ``(policy, role keys)`` for later
    releases."""
    from model_factory.demo import write_key_policy
    from model_factory.signing.release import KeyFile, add_release, init_release

    k = [KeyFile(keys.private_key)]
    release_root = init_release(repo, k, {"targets": [keys.public_key], "snapshot": [keys.public_key],
                                          "timestamp": [keys.public_key]})
    assert add_release(repo, k, k, k) == 1
    policy = write_key_policy(root / "policy.toml", [keys.public_key], require_provenance=False)
    shutil.copy(release_root, root / "release-root.json")
    with policy.open("a") as f:
        f.write(f'[release]\nroot = "release-root.json"\nstate_dir = "{root / "state"}"\n')
    return policy, k
