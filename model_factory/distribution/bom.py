"""A CycloneDX 1.7 bill of materials for one model version, written into the version folder before signing.

What it holds:

* the model as a ``machine-learning-model`` component with its model card: task, architecture, inputs
  and outputs (from ``config.pbtxt``), the calibration and held-out data (``data`` components, by
  sha256), and the accuracy gate's result per precision as quantitative analysis;
* every file of the signed unit as a ``file`` component with its sha256 (the same digests the
  signature lists; the BOM itself is the one file it cannot list);
* the tools and packages of the build (``library`` components) from the provenance's tool versions;
* trust per tensor (:mod:`model_factory.signing.tensors`): the source's tensors (name, dtype, shape, sha256)
  under the source ancestor, with the scan of its files (``model-factory:source-scan`` properties), and the
  initializers of each built ONNX file under the model, one ``data`` component each.

The JSON is built here (cyclonedx-python-lib has no model-card classes) and validated with that
library's own JSON-schema validator. ``<v>/bom.cdx.json`` lives in the version folder, so the version's
signature covers it.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import importlib.util
import json
import uuid
from pathlib import Path
from typing import Any, Mapping

from model_factory.errors import FactoryError, require

BOM_FILE = "bom.cdx.json"
SPEC_VERSION = "1.7"


def _sha(hex_digest: str) -> list[dict[str, str]]:
    return [{"alg": "SHA-256", "content": hex_digest.removeprefix("sha256:")}]


def _io_items(model_dir: Path) -> tuple[list[dict[str, str]], list[dict[str, str]], str | None]:
    """Inputs, outputs (as ``name: TYPE [dims]``) and the platform from config.pbtxt."""
    try:
        from google.protobuf import text_format
        from tritonclient.grpc import model_config_pb2
    except ImportError:
        return [], [], None
    config = model_config_pb2.ModelConfig()
    try:
        text_format.Parse((model_dir / "config.pbtxt").read_text(), config)
    except (OSError, text_format.ParseError):
        return [], [], None

    def fmt(t: Any) -> dict[str, str]:
        dtype = model_config_pb2.DataType.Name(t.data_type).removeprefix("TYPE_")
        return {"format": f"{t.name}: {dtype} [{', '.join(map(str, t.dims))}]"}

    return [fmt(i) for i in config.input], [fmt(o) for o in config.output], config.backend or config.platform or None


def _metrics(report: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """The accuracy gate's result per precision, as CycloneDX performance metrics."""
    out = []
    for r in (report or {}).get("results") or []:
        if not isinstance(r, Mapping):
            continue
        precision = str(r.get("precision", "?"))
        gate = (report or {}).get("min_accuracy")
        values = [r.get("score"), *dict(r.get("extra") or {}).values()]
        try:
            worst = min(float(v) for v in values)
        except (TypeError, ValueError):
            worst = float("nan")
        passed = "" if gate is None else (" (gate passed)" if worst >= float(gate) else " (gate failed)")
        out.append({"type": f"{r.get('metric', 'score')} vs FP32", "value": str(r.get("score")),
                    "slice": f"precision={precision}{passed}"})
        for name, value in dict(r.get("extra") or {}).items():
            out.append({"type": f"{name} vs FP32", "value": str(value), "slice": f"precision={precision}"})
    return out


def _heldout(recipe: Mapping[str, Any], recipe_path: str | None) -> tuple[str, str] | None:
    """(name, sha256) of the held-out data file named by the recipe, when it can be read here."""
    name = ((recipe or {}).get("quantization") or {}).get("heldout_data")
    if not name:
        return None
    p = Path(name)
    if not p.is_absolute() and recipe_path:
        p = Path(recipe_path).parent / p
    try:
        return str(name), hashlib.sha256(p.read_bytes()).hexdigest()
    except OSError:
        return None


def _scan_properties(scan: Mapping[str, Any] | None) -> list[dict[str, str]]:
    """The source scan's verdict as properties: one summary, then one per file that holds a pickle."""
    if not scan:
        return []
    from model_factory.build_engines.source_scan import PICKLE_KINDS, scan_summary

    props = [{"name": "model-factory:source-scan", "value": scan_summary(scan)}]
    for f in scan.get("files") or []:
        if f.get("kind") in PICKLE_KINDS:
            props.append({"name": f"model-factory:source-scan:{f.get('path')}",
                          "value": f"{f.get('kind')} {f.get('verdict')}; imports {', '.join(f.get('imports') or [])}"})
    return props


def _built_tensors(model_dir: Path, version: int) -> list[dict[str, Any]]:
    """The initializers of every ONNX file in the version folder, as BOM data components."""
    from model_factory.signing.tensors import bom_components, onnx_manifest

    out: list[dict[str, Any]] = []
    for onnx_path in sorted((Path(model_dir) / str(version)).glob("*.onnx")):
        if importlib.util.find_spec("onnx") is None:
            break
        try:
            tensors = onnx_manifest(onnx_path)
        except Exception:  # not a graph onnx parses (a placeholder file): the file's own digest still stands
            continue
        out += bom_components(tensors, "tensor:")
    return out


def build_bom(model_dir: Path, version: int, facts: Mapping[str, Any] | None,
              digests: Mapping[str, str] | None = None, source_tensors: Any = ()) -> dict[str, Any]:
    """The BOM of ``model_dir`` version ``version``; ``facts`` are the provenance's (``BuildProvenance`` keys).

    ``digests`` (relpath -> sha256 hex) are computed from the files when not given. ``source_tensors``
    (:class:`~model_factory.signing.tensors.TensorDigest`) are the source's, when the build read them.
    """
    from model_factory.signing.tensors import bom_components
    from model_factory import __version__
    from model_factory.signing import layout
    from model_factory.signing.digests import file_tasks, hash_tasks

    model_dir = Path(model_dir)
    facts = dict(facts or {})
    own = f"{version}/{BOM_FILE}"
    if digests is None:
        files = [p for p in layout.scan_unit(model_dir, version).files if p != own]
        digests = hash_tasks(file_tasks(model_dir, files))
    try:
        meta = json.loads((model_dir / str(version) / "metadata.json").read_text())
    except (OSError, ValueError):
        meta = {}
    model, ref = model_dir.name, f"model:{model_dir.name}@{version}"
    inputs, outputs, backend = _io_items(model_dir)
    recipe = facts.get("recipe") or {}
    data_components, data_refs = [], []
    calibration = facts.get("calibration_data_digest") or ((meta.get("build") or {}).get("quantization") or {}).get(
        "calibration_digest")
    # The recipe's folder is where its relative paths point: the provenance records it (metadata.json keeps only
    # the file's name, so that two builds in two folders give the same bytes).
    held = _heldout(recipe, facts.get("recipe_path") or meta.get("recipe"))
    for kind, name, digest in (("calibration", ((recipe.get("quantization") or {}).get("calibration_data")
                                                or "calibration data"), calibration),
                               ("held-out", held[0] if held else None, held[1] if held else None)):
        if digest:
            bom_ref = f"data:{kind}"
            data_refs.append({"ref": bom_ref})
            data_components.append({"type": "data", "bom-ref": bom_ref, "name": str(name), "hashes": _sha(digest),
                                    "description": f"{kind} data of the accuracy gate (by digest; not shipped)"})
    source = facts.get("source_model") or (meta.get("source") or {}).get("package") or "source model"
    parameters: dict[str, Any] = {"task": str(meta.get("task") or recipe.get("model", {}).get("task") or "unknown"),
                                  "architectureFamily": "transformer",
                                  "modelArchitecture": f"{source} exported to ONNX, served by Triton ({backend})"}
    if data_refs:
        parameters["datasets"] = data_refs
    if inputs:
        parameters["inputs"] = inputs
    if outputs:
        parameters["outputs"] = outputs
    card: dict[str, Any] = {"modelParameters": parameters}
    metrics = _metrics(facts.get("accuracy_report"))
    if metrics:
        card["quantitativeAnalysis"] = {"performanceMetrics": metrics}
    model_component: dict[str, Any] = {
        "type": "machine-learning-model", "bom-ref": ref, "name": model, "version": str(version),
        "description": f"{model} version {version}, precisions {', '.join(facts.get('precisions') or [])}",
        "modelCard": card,
    }
    built_tensors = _built_tensors(model_dir, version)
    if built_tensors:
        model_component["components"] = built_tensors
    if facts.get("source_model_digest"):
        ancestor: dict[str, Any] = {"type": "machine-learning-model", "bom-ref": "model:source", "name": str(source),
                                    "hashes": _sha(str(facts["source_model_digest"]))}
        scan = _scan_properties(facts.get("source_scan") or (meta.get("build") or {}).get("source_scan"))
        if scan:
            ancestor["properties"] = scan
        if source_tensors:
            ancestor["components"] = bom_components(list(source_tensors), "tensor:source:")
        model_component["pedigree"] = {"ancestors": [ancestor]}
    file_components = [{"type": "file", "bom-ref": f"file:{p}", "name": p, "hashes": _sha(d)}
                       for p, d in sorted(digests.items())]
    tools = facts.get("tool_versions") or meta.get("tools") or {}
    libraries = [{"type": "library", "bom-ref": f"pkg:{n}", "name": str(n), "version": str(v)}
                 for n, v in sorted(tools.items()) if v]
    return {
        "$schema": "http://cyclonedx.org/schema/bom-1.7.schema.json",
        "bomFormat": "CycloneDX", "specVersion": SPEC_VERSION, "version": 1,
        "serialNumber": f"urn:uuid:{uuid.uuid4()}",
        "metadata": {"timestamp": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds").replace("+00:00",
                                                                                                          "Z"),
                     "tools": {"components": [{"type": "application", "name": "model-factory",
                                               "version": __version__}]},
                     "component": {"type": "machine-learning-model", "bom-ref": f"{ref}#bom", "name": model,
                                   "version": str(version)}},
        "components": [model_component, *file_components, *data_components, *libraries],
        "dependencies": [{"ref": ref, "dependsOn": [c["bom-ref"] for c in file_components + data_components
                                                    + libraries]}],
    }


def validate_bom(doc: Mapping[str, Any] | str) -> None:
    """Validate with cyclonedx-python-lib's CycloneDX 1.7 JSON schema; a FactoryError names the first error."""
    require("cyclonedx", "distribution")
    from cyclonedx.schema import SchemaVersion
    from cyclonedx.validation.json import JsonStrictValidator

    text = doc if isinstance(doc, str) else json.dumps(doc)
    error = JsonStrictValidator(SchemaVersion.V1_7).validate_str(text)
    if error is not None:
        raise FactoryError(f"the BOM is not valid CycloneDX {SPEC_VERSION}: {str(error)[:300]}")


def write_bom(model_dir: Path, version: int, facts: Mapping[str, Any] | None, source_tensors: Any = ()) -> Path:
    """Write ``<model_dir>/<version>/bom.cdx.json`` (validated), before the version is signed."""
    doc = build_bom(model_dir, version, facts, source_tensors=source_tensors)
    validate_bom(doc)
    path = Path(model_dir) / str(version) / BOM_FILE
    tmp = path.with_name(f".{BOM_FILE}.tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(path)
    return path


def facts_from_provenance(statement: Mapping[str, Any]) -> dict[str, Any]:
    """The BOM's facts back from a signed provenance statement (for versions signed without a BOM)."""
    predicate = statement.get("predicate") or {}
    build = predicate.get("buildDefinition") or {}
    run = predicate.get("runDetails") or {}
    deps = {d.get("name"): d for d in build.get("resolvedDependencies") or [] if isinstance(d, dict)}
    report = next((b.get("annotations") for b in run.get("byproducts") or []
                   if isinstance(b, dict) and b.get("name") == "accuracy-report"), None)
    return {"tool_versions": (build.get("internalParameters") or {}).get("toolVersions") or {},
            "recipe": (build.get("externalParameters") or {}).get("recipe") or {},
            "precisions": (build.get("externalParameters") or {}).get("precisions") or [],
            "source_model": (deps.get("source-model") or {}).get("uri"),
            "source_model_digest": ((deps.get("source-model") or {}).get("digest") or {}).get("sha256"),
            "calibration_data_digest": ((deps.get("calibration-data") or {}).get("digest") or {}).get("sha256"),
            "recipe_path": (build.get("internalParameters") or {}).get("recipePath"),
            "accuracy_report": report,
            "source_scan": next((b.get("annotations") for b in run.get("byproducts") or []
                                 if isinstance(b, dict) and b.get("name") == "source-scan"), None)}


def read_bom(repo: Path, model: str, version: int | None = None) -> tuple[str, bool]:
    """The BOM of a version as JSON text, and whether it is the signed file (else built now from the provenance)."""
    from model_factory.signing import layout
    from model_factory.signing.bundle import parse_bundle

    model_dir = Path(repo) / model
    if not model_dir.is_dir():
        raise FactoryError(f"{model_dir} does not exist. Fix: pass the repository and a model name in it")
    versions = layout.model_entries(model_dir).versions
    if not versions:
        raise FactoryError(f"model {model} has no version folder. Fix: build it first")
    version = max(versions) if version is None else version
    if version not in versions:
        raise FactoryError(f"model {model} has no version {version}. Fix: pass one of {list(versions)}")
    path = model_dir / str(version) / BOM_FILE
    if path.is_file():
        return path.read_text(), True
    facts: dict[str, Any] = {}
    prov = layout.provenance_path(model_dir, version)
    if prov.is_file():
        facts = facts_from_provenance(parse_bundle(prov.read_bytes()).statement())
    doc = build_bom(model_dir, version, facts)
    validate_bom(doc)
    return json.dumps(doc, indent=2) + "\n", False
