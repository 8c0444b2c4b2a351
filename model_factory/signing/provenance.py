"""Build provenance: a signed in-toto statement with a SLSA v1 predicate, beside the signature.

The build pipeline passes what it knows as a plain mapping (see
:class:`BuildProvenance` for the keys). The statement's subject is the model
version exactly as its signature names it (model folder name and the
signature's root digest), so a provenance file copied from another build or
version does not match. It is signed with the same key as the model and
checked against the same trust policy.

Predicate layout (https://slsa.dev/provenance/v1)::

    buildDefinition.buildType             urn:model-factory:build:v1
    buildDefinition.externalParameters    {recipe, precisions}
    buildDefinition.internalParameters    {toolVersions, recipePath, queueCostModel}
    buildDefinition.resolvedDependencies  source model and calibration data, by sha256
    runDetails.builder                    {id, version: toolVersions}
    runDetails.metadata                   {startedOn, finishedOn}
    runDetails.byproducts                 the accuracy report (inline, with its sha256), the stage
                                          times, and one entry per output file of the signed unit:
                                          {name: path, digest, annotations: {kind: "output",
                                          reproducible}} (TensorRT plans: reproducible false)

Times live here and nowhere in the packaged files, which a rebuild reproduces byte for byte
(``model-factory rebuild --check``).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any, Mapping

from model_factory.errors import FactoryError
from model_factory.signing.manifest import STATEMENT_TYPE

PREDICATE_TYPE = "https://slsa.dev/provenance/v1"
BUILD_TYPE = "urn:model-factory:build:v1"
DEFAULT_BUILDER = "urn:model-factory:builder:local"
OUTPUT_KIND = "output"
# A rebuild gives the same bytes for every packaged file except TensorRT plans (and their metadata,
# which names the plan's digest): the builder picks tactics by timing kernels, so two builds differ.
NOT_REPRODUCIBLE_SUFFIXES = (".plan", ".plan.json")
NOT_REPRODUCIBLE_WHY = "TensorRT plan: the builder picks tactics by timing kernels, so two builds differ"


def reproducible(path: str) -> bool:
    """False for the files a rebuild is known not to reproduce byte for byte (TensorRT plans)."""
    return not path.endswith(NOT_REPRODUCIBLE_SUFFIXES)
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class BuildProvenance:
    """What the build pipeline reports about one build.

    Mapping keys (``from_mapping``): ``source_model_digest`` (sha256 hex, an
    optional ``sha256:`` prefix), ``recipe`` (table), ``tool_versions``
    (name -> version), ``precisions`` (list) are required;
    ``calibration_data_digest``, ``accuracy_report`` (table), ``source_model``
    (a name or URI), ``builder_id``, ``started_on`` and ``finished_on``
    (datetimes or ISO strings) are optional.
    """

    source_model_digest: str
    recipe: Mapping[str, Any] = field(compare=False)
    tool_versions: Mapping[str, str] = field(compare=False)
    precisions: tuple[str, ...]
    calibration_data_digest: str | None = None
    accuracy_report: Mapping[str, Any] | None = field(default=None, compare=False)
    source_model: str | None = None
    builder_id: str = DEFAULT_BUILDER
    started_on: str | None = None
    finished_on: str | None = None
    recipe_path: str | None = None
    queue_cost_model: tuple[float, ...] | None = None
    stage_seconds: Mapping[str, float] | None = field(default=None, compare=False)
    outputs: Mapping[str, str] = field(default_factory=dict, compare=False)  # path -> sha256 (the signer's)
    not_reproducible: tuple[str, ...] = ()
    # The scan of every source file before it was read (build_engines/source_scan.py): verdict, scanner, files.
    source_scan: Mapping[str, Any] | None = field(default=None, compare=False)

    _REQUIRED = ("source_model_digest", "recipe", "tool_versions", "precisions")
    _OPTIONAL = ("calibration_data_digest", "accuracy_report", "source_model", "builder_id", "started_on",
                 "finished_on", "recipe_path", "queue_cost_model", "stage_seconds", "source_scan")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> "BuildProvenance":
        """Validate the pipeline's mapping; a FactoryError names the bad key."""
        if not isinstance(data, Mapping):
            raise FactoryError("provenance must be a mapping of build facts. Fix: pass a dict (see BuildProvenance)")
        allowed = set(cls._REQUIRED) | set(cls._OPTIONAL)
        unknown = sorted(set(data) - allowed)
        if unknown:
            raise FactoryError(f"provenance key {unknown[0]!r} is unknown. Fix: use only {', '.join(sorted(allowed))}")
        for key in cls._REQUIRED:
            if key not in data or data[key] is None:
                raise FactoryError(f"provenance key {key!r} is missing. Fix: pass it from the build pipeline")
        recipe = _jsonable(data["recipe"], "recipe")
        if not isinstance(recipe, dict):
            raise FactoryError("provenance key 'recipe' must be a table (the parsed recipe)")
        tools = data["tool_versions"]
        if not isinstance(tools, Mapping) or not all(isinstance(k, str) and isinstance(v, str)
                                                      for k, v in tools.items()):
            raise FactoryError("provenance key 'tool_versions' must map tool names to version strings")
        precisions = data["precisions"]
        if isinstance(precisions, str) or not all(isinstance(p, str) for p in precisions):
            raise FactoryError("provenance key 'precisions' must be a list of strings such as [\"fp32\", \"fp16\"]")
        report = data.get("accuracy_report")
        if report is not None:
            report = _jsonable(report, "accuracy_report")
            if not isinstance(report, dict):
                raise FactoryError("provenance key 'accuracy_report' must be a table")
        return cls(
            source_model_digest=_digest(data["source_model_digest"], "source_model_digest"),
            recipe=recipe,
            tool_versions=dict(tools),
            precisions=tuple(precisions),
            calibration_data_digest=(None if data.get("calibration_data_digest") is None
                                     else _digest(data["calibration_data_digest"], "calibration_data_digest")),
            accuracy_report=report,
            source_model=_opt_str(data.get("source_model"), "source_model"),
            builder_id=_opt_str(data.get("builder_id"), "builder_id") or DEFAULT_BUILDER,
            started_on=_timestamp(data.get("started_on"), "started_on"),
            finished_on=_timestamp(data.get("finished_on"), "finished_on"),
            recipe_path=_opt_str(data.get("recipe_path"), "recipe_path"),
            queue_cost_model=_floats(data.get("queue_cost_model"), "queue_cost_model"),
            stage_seconds=_jsonable(data.get("stage_seconds"), "stage_seconds"),
            source_scan=_jsonable(data.get("source_scan"), "source_scan"),
        )

    def predicate(self) -> dict[str, Any]:
        """The SLSA v1 provenance predicate."""
        deps: list[dict[str, Any]] = [{"name": "source-model", "digest": {"sha256": self.source_model_digest}}]
        if self.source_model:
            deps[0]["uri"] = self.source_model
        if self.calibration_data_digest:
            deps.append({"name": "calibration-data", "digest": {"sha256": self.calibration_data_digest}})
        metadata = {k: v for k, v in (("startedOn", self.started_on), ("finishedOn", self.finished_on)) if v}
        run: dict[str, Any] = {"builder": {"id": self.builder_id, "version": dict(self.tool_versions)}}
        if metadata:
            run["metadata"] = metadata
        byproducts: list[dict[str, Any]] = []
        if self.accuracy_report is not None:
            report_json = json.dumps(self.accuracy_report, sort_keys=True, separators=(",", ":"))
            byproducts.append({
                "name": "accuracy-report",
                "mediaType": "application/json",
                "digest": {"sha256": hashlib.sha256(report_json.encode()).hexdigest()},
                "annotations": dict(self.accuracy_report),
            })
        if self.source_scan:
            byproducts.append({"name": "source-scan", "annotations": dict(self.source_scan)})
        if self.stage_seconds:
            byproducts.append({"name": "stage-seconds", "annotations": dict(self.stage_seconds)})
        for path in sorted(self.outputs):
            byproducts.append({"name": path, "digest": {"sha256": self.outputs[path]},
                               "annotations": {"kind": OUTPUT_KIND,
                                               "reproducible": path not in self.not_reproducible}})
        if byproducts:
            run["byproducts"] = byproducts
        internal: dict[str, Any] = {"toolVersions": dict(self.tool_versions)}
        if self.recipe_path:
            internal["recipePath"] = self.recipe_path
        if self.queue_cost_model:
            internal["queueCostModel"] = list(self.queue_cost_model)
        return {
            "buildDefinition": {
                "buildType": BUILD_TYPE,
                "externalParameters": {"recipe": dict(self.recipe), "precisions": list(self.precisions)},
                "internalParameters": internal,
                "resolvedDependencies": deps,
            },
            "runDetails": run,
        }


def provenance_statement(model_name: str, root_digest: str, build: BuildProvenance) -> dict[str, Any]:
    """The in-toto statement: subject = the signed model version, predicate = SLSA provenance."""
    return {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": model_name, "digest": {"sha256": root_digest}}],
        "predicateType": PREDICATE_TYPE,
        "predicate": build.predicate(),
    }


def check_statement(statement: Mapping[str, Any], model_name: str, root_digest: str,
                    builder_ids: tuple[str, ...] = ()) -> list[str]:
    """Reasons a signed provenance statement does not belong to this model version (empty = fine)."""
    if statement.get("_type") != STATEMENT_TYPE or statement.get("predicateType") != PREDICATE_TYPE:
        return [f"provenance is not an in-toto statement with predicate {PREDICATE_TYPE}"]
    subjects = statement.get("subject")
    if not isinstance(subjects, list) or len(subjects) != 1 or not isinstance(subjects[0], dict):
        return ["provenance must name exactly one subject"]
    subject = subjects[0]
    reasons = []
    digest = subject.get("digest") if isinstance(subject.get("digest"), dict) else {}
    if subject.get("name") != model_name or digest.get("sha256") != root_digest:
        reasons.append("provenance is for another build or version (its subject does not match the signed model "
                       "version). Fix: re-sign this version with its own provenance")
    predicate = statement.get("predicate")
    if not isinstance(predicate, dict):
        return reasons + ["provenance has no predicate"]
    build_def = predicate.get("buildDefinition")
    deps = build_def.get("resolvedDependencies") if isinstance(build_def, dict) else None
    if not isinstance(deps, list) or not any(isinstance(d, dict) and d.get("name") == "source-model"
                                             and isinstance(d.get("digest"), dict)
                                             and _HEX64.match(str(d["digest"].get("sha256"))) for d in deps):
        reasons.append("provenance does not record the source model digest")
    run = predicate.get("runDetails")
    builder = run.get("builder") if isinstance(run, dict) else None
    builder_id = builder.get("id") if isinstance(builder, dict) else None
    if builder_ids and builder_id not in builder_ids:
        reasons.append(f"provenance builder {builder_id!r} is not allowed by the trust policy "
                       f"({', '.join(builder_ids)})")
    return reasons


def _digest(value: Any, key: str) -> str:
    if not isinstance(value, str):
        raise FactoryError(f"provenance key {key!r} must be a sha256 hex string")
    v = value.lower().removeprefix("sha256:")
    if not _HEX64.match(v):
        raise FactoryError(f"provenance key {key!r} is not a sha256 hex digest: {value!r}. "
                           "Fix: pass hashlib.sha256(...).hexdigest()")
    return v


def _floats(value: Any, key: str) -> tuple[float, ...] | None:
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                  for x in value):
        raise FactoryError(f"provenance key {key!r} must be a list of numbers")
    return tuple(float(x) for x in value)


def _opt_str(value: Any, key: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise FactoryError(f"provenance key {key!r} must be a string")
    return value


def _timestamp(value: Any, key: str) -> str | None:
    if value is None:
        return None
    if isinstance(value, dt.datetime):
        value = value if value.tzinfo else value.replace(tzinfo=dt.timezone.utc)
        return value.astimezone(dt.timezone.utc).isoformat().replace("+00:00", "Z")
    if isinstance(value, str):
        try:
            dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            raise FactoryError(f"provenance key {key!r} is not an ISO 8601 time: {value!r}") from None
        return value
    raise FactoryError(f"provenance key {key!r} must be a datetime or an ISO 8601 string")


def _jsonable(value: Any, where: str) -> Any:
    """A JSON-ready copy: paths and dates become strings, tuples lists; anything else is an error."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise FactoryError(f"provenance {where} holds {value!r}, which JSON cannot carry")
        return value
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, (dt.datetime, dt.date, dt.time)):
        return value.isoformat()
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise FactoryError(f"provenance {where} has a non-string key {k!r}")
            out[k] = _jsonable(v, f"{where}.{k}")
        return out
    if isinstance(value, (list, tuple)):
        return [_jsonable(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise FactoryError(f"provenance {where} holds a {type(value).__name__}, which is not JSON data. "
                       "Fix: pass plain tables, lists, strings and numbers")
