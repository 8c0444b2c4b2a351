"""Rebuild a model version from its signed provenance and compare it, file by file.

The provenance (``<model>/<version>.provenance.sig``) records the recipe as parsed, where the
recipe file was (its relative paths point from there), the inputs' digests (source model,
calibration data), the measured queue cost model and the digest of every output file of the
signed unit. ``rebuild_check`` builds the same recipe again into a temporary folder, with that
cost model, and compares:

* the inputs found now against the digests the provenance names (changed inputs are reported
  first: they explain any difference that follows);
* every output listed in the provenance against the rebuilt file of the same path; a missing,
  extra or different file is named. TensorRT plans (and their ``.plan.json``) are the known
  exception: listed as not compared, with the reason, never silently skipped.

What it proves: the signed ONNX files, config.pbtxt, tokenizer, acceptance data and metadata
are what this recipe and these inputs give, so nobody swapped a file and re-signed it with an
honest-looking provenance. It needs the same tool versions (they are in the provenance and
are compared too) and the inputs at the recorded places.

A prompt template's version (``build/prompt.py``) is packaged again from its prompt recipe on the
files of its base version that the repository holds now: its source is the digest of the base
pins its ``prompt.json`` records, so a base whose chat template or tokenizer changed is an input
change.
"""

from __future__ import annotations

import copy
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from model_factory.errors import FactoryError
from model_factory.signing import layout
from model_factory.signing.provenance import NOT_REPRODUCIBLE_WHY, OUTPUT_KIND, PREDICATE_TYPE

Progress = Callable[[str], None]


@dataclass(frozen=True)
class RebuildReport:
    """The verdict of one rebuild: ``differences`` and ``input_changes`` empty means identical."""

    model: str
    version: int
    identical: tuple[str, ...]
    differences: tuple[str, ...]
    not_compared: tuple[str, ...]  # "path: why" for the known exceptions (TensorRT plans)
    input_changes: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.differences and not self.input_changes


@dataclass(frozen=True)
class _Recorded:
    recipe: dict[str, Any]
    recipe_path: Path
    outputs: dict[str, tuple[str, bool]]  # path -> (sha256, reproducible)
    source_digest: str | None
    calibration_digest: str | None
    tool_versions: dict[str, str]


def _read_provenance(model_dir: Path, version: int, recipe_path: Path | None) -> _Recorded:
    from model_factory.signing.bundle import parse_bundle
    from model_factory.signing.manifest import parse_statement

    prov = layout.provenance_path(model_dir, version)
    sig = layout.signature_path(model_dir, version)
    if not prov.is_file():
        raise FactoryError(f"{model_dir.name} version {version} has no signed provenance ({prov.name}), so there is "
                           "nothing to rebuild from. Fix: build it with model-factory build --sign-key ...")
    statement = parse_bundle(prov.read_bytes()).statement()
    if statement.get("predicateType") != PREDICATE_TYPE:
        raise FactoryError(f"{prov} is not a SLSA provenance statement")
    if sig.is_file():
        # The provenance must be the one of this signature (same model, same root digest).
        root = parse_statement(parse_bundle(sig.read_bytes()).statement()).root_digest
        subject = (statement.get("subject") or [{}])[0]
        if subject.get("name") != model_dir.name or (subject.get("digest") or {}).get("sha256") != root:
            raise FactoryError(f"{prov.name} is not the provenance of {sig.name} (another build or version). "
                               "Fix: verify the repository (model-factory verify) and re-sign this version")
    predicate = statement.get("predicate") or {}
    definition = predicate.get("buildDefinition") or {}
    internal = definition.get("internalParameters") or {}
    recipe = (definition.get("externalParameters") or {}).get("recipe")
    if not isinstance(recipe, dict):
        raise FactoryError(f"{prov.name} records no recipe, so the build cannot be repeated")
    outputs = {}
    for item in (predicate.get("runDetails") or {}).get("byproducts") or []:
        notes = item.get("annotations") if isinstance(item, dict) else None
        if isinstance(notes, dict) and notes.get("kind") == OUTPUT_KIND:
            digest = item.get("digest") if isinstance(item.get("digest"), dict) else {}
            if not isinstance(item.get("name"), str) or not isinstance(digest.get("sha256"), str):
                raise FactoryError(f"{prov.name} has an output entry without a name or sha256: it is damaged")
            outputs[item["name"]] = (digest["sha256"], bool(notes.get("reproducible", True)))
    if not outputs:
        raise FactoryError(f"{prov.name} lists no output digests (it was written by an older model-factory), so "
                           "a rebuild has nothing to compare with. Fix: build and sign the version again with "
                           "this release (model-factory build --sign-key ...)")
    where = recipe_path or (Path(internal["recipePath"]) if internal.get("recipePath") else None)
    if where is None:
        raise FactoryError(f"{prov.name} does not say where the recipe file was, and its relative paths (calibration "
                           "data, source model) start there. Fix: pass --recipe PATH (the recipe file of the build)")
    deps = {d.get("name"): (d.get("digest") or {}).get("sha256")
            for d in definition.get("resolvedDependencies") or [] if isinstance(d, dict)}
    return _Recorded(recipe, Path(where), outputs,
                     deps.get("source-model"), deps.get("calibration-data"),
                     dict(internal.get("toolVersions") or {}))


def _unit_digests(model_dir: Path, version: int) -> dict[str, str]:
    from model_factory.signing.digests import file_tasks, hash_tasks

    scan = layout.scan_unit(model_dir, version)
    return hash_tasks(file_tasks(model_dir, scan.files))


BOM_FILE = "bom.cdx.json"  # distribution.bom.BOM_FILE (not imported: rebuild needs no [distribution] extra)


def _compare(recorded: Mapping[str, tuple[str, bool]], rebuilt: Mapping[str, str]) -> tuple[list, list, list]:
    identical, differences, not_compared = [], [], []
    for path in sorted(set(recorded) | set(rebuilt)):
        if path in recorded and not recorded[path][1]:
            not_compared.append(f"{path}: {NOT_REPRODUCIBLE_WHY}")
        elif path.endswith("/" + BOM_FILE) and path not in rebuilt:
            # Written at signing from the provenance (build times): an unsigned rebuild has none to compare.
            not_compared.append(f"{path}: written at signing from the provenance, which a rebuild does not sign")
        elif path not in rebuilt:
            differences.append(f"{path}: in the signed version, not produced by the rebuild")
        elif path not in recorded:
            differences.append(f"{path}: produced by the rebuild, not in the signed version")
        elif recorded[path][0] != rebuilt[path]:
            differences.append(f"{path}: differs (sha256 {recorded[path][0][:16]}... signed, {rebuilt[path][:16]}... "
                               "rebuilt)")
        else:
            identical.append(path)
    return identical, differences, not_compared


def rebuild_check(version_dir: Path, *, recipe_path: Path | None = None, progress: Progress | None = None,
                  keep: Path | None = None, isolate: bool = False, policy: Path | None = None) -> RebuildReport:
    """Rebuild ``<repo>/<model>/<version>`` from its provenance in a temporary folder and compare.

    ``recipe_path`` replaces the recipe file the provenance names (only its folder is used: the recipe
    itself comes from the signed provenance). ``keep`` copies the rebuilt model folder there. With
    ``policy`` (a trust policy file) the version is verified first, and a failure stops here.
    """
    from model_factory.build.pipeline import build
    from model_factory.build.repository import tool_versions
    from model_factory.recipe import parse_recipe

    version_dir = Path(version_dir)
    if not version_dir.is_dir() or not layout.is_version_name(version_dir.name):
        raise FactoryError(f"{version_dir} is not a model version folder. Fix: pass REPO/MODEL/VERSION, such as "
                           "model_repository/minilm/1")
    model_dir, version = version_dir.parent, int(version_dir.name)
    if policy is not None:
        from model_factory.signing import load_policy, verify_model_version

        verdict = verify_model_version(model_dir, version, load_policy(policy))
        if not verdict.ok:
            raise FactoryError(f"{model_dir.name} version {version} fails verification, so its provenance is not "
                               f"trusted: {'; '.join(verdict.reasons)}")
    recorded = _read_provenance(model_dir, version, recipe_path)
    input_changes = [f"tool {name}: {was} at the build, {now} here" for name, was, now in
                     ((n, v, tool_versions().get(n)) for n, v in sorted(recorded.tool_versions.items())) if was != now]
    from model_factory.recipe.prompt import is_prompt_recipe

    with tempfile.TemporaryDirectory(prefix="mf-rebuild-") as tmp:
        data = copy.deepcopy(recorded.recipe)
        data.setdefault("repository", {})["path"] = str(Path(tmp) / "model_repository")
        if is_prompt_recipe(data):  # a prompt template: packaged again on its base's files as they are now
            rebuilt_dir, facts = _rebuild_prompt(data, recorded, model_dir, version)
        else:
            recipe = parse_recipe(data, recorded.recipe_path.parent, recorded.recipe_path)
            _same_unit(recipe.name, recipe.version, model_dir, version)
            result = build(recipe, progress=progress, isolate=isolate)
            rebuilt_dir, facts = result.model_dir, _rebuilt_inputs(result)
        rebuilt = _unit_digests(rebuilt_dir, version)
        if keep is not None:
            shutil.copytree(rebuilt_dir, Path(keep) / model_dir.name, dirs_exist_ok=True)
    for what, was, now in (("source model", recorded.source_digest, facts.get("source")),
                           ("calibration data", recorded.calibration_digest, facts.get("calibration"))):
        if was != now:
            input_changes.append(f"{what}: sha256 {str(was)[:16]}... at the build, {str(now)[:16]}... now")
    identical, differences, not_compared = _compare(recorded.outputs, rebuilt)
    return RebuildReport(model_dir.name, version, tuple(identical), tuple(differences), tuple(not_compared),
                         tuple(input_changes))


def _same_unit(name: str, built_version: int, model_dir: Path, version: int) -> None:
    if name != model_dir.name or built_version != version:
        raise FactoryError(f"the provenance's recipe builds {name} version {built_version}, not "
                           f"{model_dir.name} version {version}")


def _rebuild_prompt(data: dict[str, Any], recorded: _Recorded, model_dir: Path,
                    version: int) -> tuple[Path, dict[str, str | None]]:
    """A prompt version packaged again (``build/prompt.py``) into the recipe's temporary repository, on the files of
    its base version that ``model_dir``'s repository holds now (their digests are its source: a base whose chat
    template or tokenizer changed since is an input change)."""
    import hashlib
    import json

    from model_factory.backend.contract import Files
    from model_factory.build.prompt import BASE_FILES, package_prompt
    from model_factory.recipe.prompt import parse_prompt_recipe

    recipe = parse_prompt_recipe(data, recorded.recipe_path.parent, recorded.recipe_path)
    _same_unit(recipe.name, recipe.version, model_dir, version)
    base_src = model_dir.parent / recipe.base_model
    base_dst = recipe.repository / recipe.base_model
    for rel in (Files.CONFIG, *(f"{recipe.base_version}/{f}" for f in BASE_FILES)):
        if (base_src / rel).is_file():
            (base_dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(base_src / rel, base_dst / rel)
    result = package_prompt(recipe)
    base = json.loads((result.version_dir / Files.PROMPT).read_text(encoding="utf-8"))["base"]
    return result.model_dir, {"source": hashlib.sha256(json.dumps(base, sort_keys=True).encode()).hexdigest(),
                              "calibration": recorded.calibration_digest}


def _rebuilt_inputs(result: Any) -> dict[str, str | None]:
    import json

    from model_factory.build.repository import METADATA_FILE

    meta = json.loads((result.version_dir / METADATA_FILE).read_text())
    build_info = meta.get("build") or {}
    return {"source": build_info.get("source_digest"),
            "calibration": (build_info.get("quantization") or {}).get("calibration_digest")}
