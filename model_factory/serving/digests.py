"""The verified-digests table: what ``serve`` verified, handed to the backend through a file outside the repository.

``serve`` verifies every model against the trust policy, then writes ``model -> version -> relpath ->
sha256`` to a file the backend reads at each load (``MODEL_FACTORY_VERIFIED_DIGESTS``,
``backends/python_backend/integrity.py``): a file swapped after verification is refused at load. The
stub watch re-verifies a model before reloading it (:func:`reverify_model`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from model_factory.errors import FactoryError
from model_factory.fileio import atomic_file

Table = dict[str, dict[str, dict[str, str]]]


@dataclass(frozen=True)
class VerifiedDigests:
    """Where the table lives and what it was verified against (the policy re-verification uses)."""

    repository: Path
    path: Path
    policy: Any  # model_factory.signing.policy.TrustPolicy


def verified_table(repository: Path, results: Iterable[Any], policy: Any) -> Table:
    """``model -> version -> relpath -> sha256`` for every version that passed verification.

    Each map comes from a full verification against the policy (so files are hashed twice at start):
    reading the signature files again without the policy would let a self-consistent but unsigned
    bundle swapped in after the first pass through.
    """
    from model_factory.signing import signed_digests

    table: Table = {}
    for r in results:
        if r.ok and r.version is not None:
            table.setdefault(r.model, {})[str(r.version)] = signed_digests(Path(repository) / r.model, r.version, policy)
    return table


def write_table(path: Path, table: Table) -> None:
    """Write the table atomically (the backend never reads half of it)."""
    with atomic_file(Path(path)) as f:
        f.write(json.dumps(table))


def read_table(path: Path) -> Table:
    return json.loads(Path(path).read_text())


def reverify_model(digests: VerifiedDigests, model: str) -> None:
    """Verify ``model`` again against the policy ``serve`` started with, and make the result the digests the
    backend checks at its next load. Raises FactoryError (with every reason) when it no longer verifies,
    and then removes the model from the table, so no load of it can succeed.
    """
    from model_factory.signing import signed_digests

    table = read_table(digests.path)
    versions = sorted(table.get(model, {}))
    try:
        if not versions:
            raise FactoryError(f"{model} was not verified when the server started")
        fresh = {v: signed_digests(digests.repository / model, int(v), digests.policy) for v in versions}
    except FactoryError:
        table.pop(model, None)
        write_table(digests.path, table)
        raise
    table[model] = fresh
    write_table(digests.path, table)
