"""Section "trust": who signed the version, when, the policy's verdict, the provenance and acceptance.

Without ``--policy`` the signature's claims are shown as read from the bundle, marked
unverified; with it, ``model_factory.signing.verify_model_version`` gives the verdict
(and the signer's name in the policy). Acceptance on this machine is either run here
(``accept_model``) or read from a file ``model-factory accept --json`` wrote.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from model_factory.errors import FactoryError
from model_factory.measure.report.release import Release


@dataclass(frozen=True)
class Verdict:
    policy: str
    ok: bool
    signer: str | None
    reasons: tuple[str, ...]
    files: int


@dataclass(frozen=True)
class Acceptance:
    source: str  # "run here" or the file it was read from
    passed: bool
    engine: str | None
    device: str | None
    metric: str | None
    score: float | None
    threshold: float | None
    samples: int
    reason: str | None


@dataclass(frozen=True)
class Trust:
    signed: bool
    signature_file: str | None = None
    signer: str | None = None  # "key hint 1a2b…" or "certificate CN=…" (as the bundle names it)
    key_hint: str | None = None
    certificate_subject: str | None = None
    signed_files: int = 0
    root_digest: str | None = None
    signature_written: str | None = None  # the file's modification time (not itself signed)
    problem: str | None = None  # the bundle could not be read
    provenance: bool = False
    builder: str | None = None
    started_on: str | None = None
    finished_on: str | None = None
    dependencies: tuple[tuple[str, str, str | None], ...] = ()  # (name, sha256, uri)
    recipe_json: str | None = None
    verdict: Verdict | None = None
    acceptance: Acceptance | None = None


def _mtime(path: Path) -> str:
    import datetime as dt

    return dt.datetime.fromtimestamp(path.stat().st_mtime, dt.timezone.utc).isoformat(timespec="seconds")


def _provenance(path: Path) -> dict[str, Any]:
    from model_factory.signing.bundle import parse_bundle

    if not path.is_file():
        return {}
    predicate = parse_bundle(path.read_bytes()).statement().get("predicate") or {}
    definition = predicate.get("buildDefinition") or {}
    run = predicate.get("runDetails") or {}
    meta = run.get("metadata") or {}
    deps = tuple((str(d.get("name")), str((d.get("digest") or {}).get("sha256")), d.get("uri"))
                 for d in definition.get("resolvedDependencies") or ())
    recipe = (definition.get("externalParameters") or {}).get("recipe")
    return {"provenance": True, "builder": (run.get("builder") or {}).get("id"), "started_on": meta.get("startedOn"),
            "finished_on": meta.get("finishedOn"), "dependencies": deps,
            "recipe_json": json.dumps(recipe, indent=2, sort_keys=True) if recipe is not None else None}


def collect(release: Release, policy: Path | None = None,
            acceptance: Sequence[Mapping[str, Any]] | None = None, acceptance_source: str = "") -> Trust:
    """Read the signature and provenance of ``release``; verify against ``policy`` when given."""
    from model_factory.signing.bundle import parse_bundle
    from model_factory.signing.certificates import name_of
    from model_factory.signing.layout import provenance_path, signature_path
    from model_factory.signing.manifest import parse_statement

    sig = signature_path(release.model_dir, release.version)
    fields: dict[str, Any] = {"signed": sig.is_file()}
    if sig.is_file():
        fields.update(signature_file=sig.name, signature_written=_mtime(sig))
        try:
            bundle = parse_bundle(sig.read_bytes())
            manifest = parse_statement(bundle.statement())
            leaf = bundle.leaf_certificate()
            fields.update(key_hint=bundle.key_hint, certificate_subject=name_of(leaf) if leaf else None,
                          signed_files=len(manifest.files()), root_digest=manifest.root_digest)
            fields["signer"] = (f"certificate {name_of(leaf)}" if leaf else
                                f"key with hint {bundle.key_hint}" if bundle.key_hint else "a key (no hint)")
            fields.update(_provenance(provenance_path(release.model_dir, release.version)))
        except FactoryError as exc:
            fields["problem"] = f"the signature files cannot be read: {exc}"
    if policy is not None:
        from model_factory.signing import load_policy, verify_model_version

        r = verify_model_version(release.model_dir, release.version, load_policy(policy))
        fields["verdict"] = Verdict(str(policy), r.ok, r.signer, tuple(r.reasons), r.files)
    if acceptance:
        record = next((a for a in acceptance if a.get("model") == release.model
                       and str(a.get("version")) == str(release.version)), None)
        if record is not None:
            fields["acceptance"] = Acceptance(
                source=acceptance_source, passed=bool(record.get("passed")), engine=record.get("engine"),
                device=record.get("device"), metric=record.get("metric"),
                score=None if record.get("score") is None else float(record["score"]),
                threshold=record.get("threshold"), samples=int(record.get("samples") or 0),
                reason=record.get("reason"))
    return Trust(**fields)


def run_acceptance(repo: Path, models: Sequence[str]) -> list[dict[str, Any]]:
    """Accept each model's served version on this machine (``model-factory accept``), as JSON records."""
    from model_factory.serving.acceptance import accept_model

    return [accept_model(Path(repo) / m).to_dict() for m in models]


def read_acceptance(path: Path) -> list[dict[str, Any]]:
    """Records written by ``model-factory accept --json`` (a list, or one record)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise FactoryError(f"cannot read acceptance results {path}: {exc}. Fix: pass the file that "
                           "model-factory accept --json wrote") from exc
    records = data if isinstance(data, list) else [data]
    if not all(isinstance(r, dict) and "model" in r and "passed" in r for r in records):
        raise FactoryError(f"{path} does not hold model-factory accept --json records. Fix: pass that command's "
                           "output")
    return records
