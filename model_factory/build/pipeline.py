"""The build pipeline: export → quantize → build-engine → package → sign, composed from the stages.

Each stage is a library function that a test can call alone; this module only
wires them together in order and hands each the part of the recipe it needs.
"""

from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from model_factory.backend.contract import Files, onnx_file
from model_factory.recipe import Recipe

Progress = Callable[[str], None]


@dataclass(frozen=True)
class BuildResult:
    """What ``build`` produced."""

    model_dir: Path
    version_dir: Path
    artifacts: dict[str, Path]
    accuracy: dict[str, Any] | None
    engines: tuple[str, ...]
    signature: Path | None
    seconds: dict[str, float] = field(default_factory=dict)
    # What the version folder holds (top-level entries, folders with a trailing '/'): the build's summary.
    files: tuple[str, ...] = ()
    # One line per stage the recipe asked for and the build skipped, with why and the fix.
    skipped: tuple[str, ...] = ()


def folder_listing(version_dir: Path) -> tuple[str, ...]:
    """The top-level entries of a version folder, sorted, folders marked with a trailing '/'."""
    return tuple(sorted(p.name + ("/" if p.is_dir() else "") for p in Path(version_dir).iterdir()))


def engines_skipped_line(precisions: Any) -> str | None:
    """The line that says TensorRT engines the recipe enables are not built here, or None when they can be."""
    from model_factory.build_engines.tensorrt import tensorrt_available

    if tensorrt_available() is not None:
        return None
    plans = ", ".join(f"model.{p}.plan" for p in precisions)
    return (f"[build-engine] skipped: {plans} not built: neither tensorrt nor tensorrt_rtx imports here "
            "(the model serves with ONNX Runtime or torch). Fix: pip install 'model-factory[tensorrt-rtx]' "
            "(or NVIDIA's tensorrt) to build them, or set [tensorrt] enabled = false to skip them quietly")


def _timed(seconds: dict[str, float], name: str, say: Progress, fn: Callable[[], Any]) -> Any:
    say(f"[{name}] started")
    t0 = time.perf_counter()
    out = fn()
    seconds[name] = round(time.perf_counter() - t0, 2)
    say(f"[{name}] done in {seconds[name]:.1f} s")
    return out


def build(recipe: Recipe, *, progress: Progress | None = None, signer: Any = None,
          min_accuracy: float | None = None, engines: bool | None = None,
          parameters: dict[str, str] | None = None, isolate: bool = False, sandbox: str = "auto") -> BuildResult:
    """Run every stage for ``recipe``.

    ``engines`` forces TensorRT engine builds on (True) or off (False); by
    default they are built when the recipe enables them. ``signer`` (a
    ``model_factory.signing.SignerConfig``) signs the packaged version before
    it goes live. A second build of the same recipe (same work folder) while
    one runs is refused at once (:mod:`model_factory.locking`). With ``isolate`` the heavy stages
    (export, quantize, engines) each run in a child process (:mod:`model_factory.isolation`), so the
    build's peak memory is its largest stage's: ``model-factory build`` does this. Isolated stages run in a
    sandbox (:mod:`model_factory.build.walls`): ``sandbox="auto"`` where the kernel offers it (said in one line
    where it does not), ``"require"`` refuses a machine without it, ``"off"`` runs them unwalled.

    Nothing packaged depends on this machine's speed (the queue bound is derived where the model is
    served), so a rebuild (:mod:`model_factory.build.rebuild`) gives the same bytes.
    """
    from model_factory.locking import exclusive

    with exclusive(recipe.work_dir, f"a build of {recipe.name}"):
        return _build(recipe, progress=progress, signer=signer, min_accuracy=min_accuracy, engines=engines,
                      parameters=parameters, isolate=isolate, sandbox=sandbox)


def _sandbox_says(sandbox: str, isolate: bool, say: Progress) -> bool:
    """Whether the stages get walls; the one line that says so (or why not); a refusal under "require"."""
    from model_factory.errors import FactoryError

    if sandbox not in ("auto", "require", "off"):
        raise FactoryError(f"sandbox={sandbox!r}. Fix: pass auto, require or off")
    if sandbox == "off":
        if isolate:
            say("[sandbox] off (--no-sandbox): the stages run with every right of this user")
        return False
    if not isolate:
        if sandbox == "require":
            raise FactoryError("a sandboxed build needs its stages in child processes. Fix: build with "
                               "isolate=True (model-factory build does)")
        return False
    from model_factory.sandbox import support, support_line

    have = support()
    if sandbox == "require" and not have.complete:
        raise FactoryError(f"--require-sandbox: {'; '.join(have.missing)}, so the build stages cannot be walled in. "
                           "Fix: build on a Linux kernel with Landlock (5.13+, in the lsm= list) and seccomp, or drop "
                           "--require-sandbox")
    say(support_line(have))
    return have.landlock_abi > 0 or have.seccomp


def run_stage(recipe: Recipe, name: str, fn: Callable[..., Any], *args: Any, progress: Progress | None = None,
              sandbox: str = "auto", **kwargs: Any) -> Any:
    """One build stage alone (``model-factory export``, ``quantize``, ``build-engine``), as ``build`` runs it: in a
    child process behind the stage's walls (:mod:`model_factory.build.walls`), where the kernel offers them (said in
    one line); ``sandbox`` as :func:`build`'s (``"off"``: unwalled, the ``--no-sandbox`` escape). Every command that
    runs a source's code (a torch factory, a model's own modules) runs it here."""
    from model_factory.build.walls import stage_walls
    from model_factory.isolation import run_isolated

    say = progress or (lambda _m: None)
    walled = _sandbox_says(sandbox, True, say)
    return run_isolated(fn, *args, progress=say, what=f"{name} stage",
                        walls=stage_walls(recipe, name) if walled else None,
                        require_sandbox=sandbox == "require", **kwargs)


def _build(recipe: Recipe, *, progress: Progress | None, signer: Any, min_accuracy: float | None,
           engines: bool | None, parameters: dict[str, str] | None, isolate: bool = False,
           sandbox: str = "auto") -> BuildResult:
    from model_factory.build_engines.export import export_model
    from model_factory.build_engines.golden import write_acceptance_data
    from model_factory.build.loadcheck import check_packaged
    from model_factory.build.repository import package_model, queue_policy_note

    import datetime as dt

    say = progress or (lambda _m: None)
    note = queue_policy_note(recipe)
    if note:
        say(note)

    walled = _sandbox_says(sandbox, isolate, say)

    def stage(name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if isolate:
            from model_factory.build.walls import stage_walls
            from model_factory.isolation import run_isolated

            walls = stage_walls(recipe, name) if walled else None
            return run_isolated(fn, *args, progress=say, what=f"{name} stage", walls=walls,
                                require_sandbox=sandbox == "require", **kwargs)
        return fn(*args, progress=say, **kwargs)

    started_on = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    seconds: dict[str, float] = {}
    if recipe.is_generative:
        return _build_generative(recipe, stage, say, signer, min_accuracy, parameters, started_on, seconds, engines)
    exported = _timed(seconds, "export", say, lambda: stage("export", export_model, recipe))
    say(f"[export] max abs error vs source: {exported.max_abs_error:.3g} (tolerance {exported.tolerance:g})")
    artifacts: dict[str, Path] = {Files.ONNX: exported.onnx_path}
    extra: list[Path] = [exported.onnx_path.parent / Files.EXPORT_REPORT]
    accuracy = None
    models = {"fp32": exported.onnx_path}
    build_info: dict[str, Any] = {"export": {"max_abs_error": exported.max_abs_error, "opset": exported.opset},
                                  "source_digest": exported.source_digest, "source_scan": exported.source_scan}
    if exported.torchscript_path is not None:
        # The torch engine's file (export.torchscript = true) travels like the other engine files.
        artifacts[exported.torchscript_path.name] = exported.torchscript_path
        build_info["export"]["torchscript"] = {"file": exported.torchscript_path.name,
                                               "max_abs_error": exported.torchscript_max_abs_error}
    if set(recipe.precisions) - {"fp32"}:
        from model_factory.build_engines.quantize import quantize_model

        q = _timed(seconds, "quantize", say, lambda: stage("quantize", quantize_model, recipe, exported,
                                                           min_accuracy=min_accuracy))
        models = dict(q.models)
        for precision, path in q.models.items():
            if precision != "fp32":
                artifacts[onnx_file(precision)] = path
        seven_bit = q.models.get("int8", Path()).parent / Files.INT8_7BIT
        if "int8" in q.models and seven_bit.is_file():  # kept when it passed the gate (build_engines/int8_7bit.py)
            artifacts[Files.INT8_7BIT] = seven_bit
        extra.append(q.report_path)
        say(q.report.render())
        accuracy = q.report.to_dict() if hasattr(q.report, "to_dict") else None
        build_info["quantization"] = {"float_nodes": list(q.float_nodes),
                                      "calibration_digest": q.calibration_digest}
    built_engines: list[str] = []
    skipped: list[str] = []
    want_engines = engines if engines is not None else recipe.tensorrt.enabled
    # Enabled by the recipe on a machine without TensorRT: said in one line, not a failure (--engines forces it).
    no_trt = engines_skipped_line(models) if want_engines and engines is None else None
    if no_trt:
        say(no_trt)
        skipped.append(no_trt)
    elif want_engines:
        from model_factory.build_engines.tensorrt import build_engines

        results = _timed(seconds, "build-engine", say, lambda: stage("build-engine", build_engines, recipe, models))
        for e in results:
            artifacts[e.plan_path.name] = e.plan_path
            artifacts[e.metadata_path.name] = e.metadata_path
            built_engines.append(e.precision)
    # Stage times are not packaged (a rebuild would differ): the provenance and BuildResult carry them.
    # No queue bound is measured here: "auto" is derived where the model is served (serving/queue_bound.py).
    sign: Callable[[Path], Path] | None = None
    if signer is not None:
        from model_factory.signing import sign_model_version

        def sign_staged(staged: Path) -> Path:
            # Signs the staged model folder before it replaces the old one (package_model).
            provenance = provenance_for(recipe, build_info, accuracy, started_on, seconds)
            # The BOM goes into the version folder first, so the signature covers it (needs [distribution]).
            if importlib.util.find_spec("cyclonedx") is not None:
                from model_factory.distribution.bom import write_bom

                from model_factory.signing.tensors import source_manifest

                # The source's tensors, one digest each (streamed from its safetensors): trust per tensor.
                write_bom(staged, recipe.version, provenance, source_tensors=source_manifest(recipe))
            return _timed(seconds, "sign", say, lambda: sign_model_version(staged, recipe.version, signer,
                                                                           provenance=provenance))

        sign = sign_staged

    def package() -> Any:
        golden = write_acceptance_data(recipe, exported.onnx_path, exported.tokenizer_dir,
                                       recipe.work_dir / "acceptance", progress=say)
        return package_model(recipe, artifacts, tokenizer_dir=exported.tokenizer_dir, extra_files=extra,
                             parameters=parameters, build_info=build_info, sign=sign,
                             acceptance_dir=golden, check=check_packaged)

    packaged = _timed(seconds, "package", say, package)
    signature = None
    if signer is not None:
        from model_factory.signing.layout import signature_path

        signature = signature_path(packaged.model_dir, recipe.version)
    return BuildResult(packaged.model_dir, packaged.version_dir, artifacts, accuracy, tuple(built_engines),
                       signature, seconds, folder_listing(packaged.version_dir), tuple(skipped))


def _signer_for(recipe: Recipe, signer: Any, build_info: dict[str, Any], accuracy: dict[str, Any] | None,
                started_on: str, seconds: dict[str, float], say: Progress) -> Callable[[Path], Path] | None:
    """Sign a staged model folder (BOM first, so the signature covers it), or None without a signer."""
    if signer is None:
        return None
    from model_factory.signing import sign_model_version

    def sign_staged(staged: Path) -> Path:
        provenance = provenance_for(recipe, build_info, accuracy, started_on, seconds)
        if importlib.util.find_spec("cyclonedx") is not None:
            from model_factory.distribution.bom import write_bom

            write_bom(staged, recipe.version, provenance)
        return _timed(seconds, "sign", say, lambda: sign_model_version(staged, recipe.version, signer,
                                                                       provenance=provenance))
    return sign_staged


def _build_generative(recipe: Recipe, stage: Callable[..., Any], say: Progress, signer: Any,
                      min_accuracy: float | None, parameters: dict[str, str] | None, started_on: str,
                      seconds: dict[str, float], engines: bool | None = None) -> BuildResult:
    """text-generation: export (builder + transformers check) → INT8/INT4 behind the gate → TensorRT (when enabled
    and installed) → package → sign."""
    from model_factory.build.generative import layout_generative_version
    from model_factory.build_engines.causal_lm import export_causal_lm

    original = recipe
    gguf_info: dict[str, Any] | None = None
    if recipe.source.kind == "gguf":
        # The source stage: the GGUF read (behind the walls, scanned first) into the Hugging Face folder every later
        # stage reads; the GGUF's sha256 stays the build's source digest (provenance, BOM).
        from model_factory.build_engines.gguf_source import convert_gguf
        from model_factory.recipe.gguf import converted

        gguf_info = _timed(seconds, "source", say, lambda: stage("source", convert_gguf, recipe))
        recipe = converted(recipe)
    exported = _timed(seconds, "export", say, lambda: stage("export", export_causal_lm, recipe))
    export_dir = exported.onnx_path.parent
    artifacts: dict[str, Path] = {Files.ONNX: exported.onnx_path}
    extra: list[Path] = [export_dir / Files.EXPORT_REPORT]
    build_info: dict[str, Any] = {"export": {"max_abs_error": exported.max_abs_error, "opset": exported.opset,
                                             "exporter": "onnxruntime-genai model builder"},
                                  "source_digest": exported.source_digest}
    if gguf_info is not None:
        build_info["source_scan"] = gguf_info.pop("source_scan", None)
        build_info["gguf"] = gguf_info
    accuracy = None
    if set(recipe.precisions) - {"fp32"}:
        from model_factory.build_engines.lm_quantize import quantize_causal_lm

        q = _timed(seconds, "quantize", say, lambda: stage("quantize", quantize_causal_lm, recipe, exported,
                                                           min_accuracy=min_accuracy))
        for precision, path in q.models.items():
            if precision != "fp32":
                artifacts[onnx_file(precision)] = path
        extra.append(q.report_path)
        carried = q.report_path.parent / "gguf_carry.json"  # precision gguf: what each MatMul carries
        if carried.is_file():
            extra.append(carried)
        say(q.report.render())
        accuracy = q.report.to_dict()
        build_info["quantization"] = {"float_nodes": list(q.float_nodes), "calibration_digest": q.calibration_digest}
    skipped: list[str] = []
    built_engines: list[str] = []
    want_engines = engines if engines is not None else recipe.tensorrt.enabled
    # As for every model: enabled on a machine without TensorRT is one line, not a failure (--engines forces it).
    no_trt = engines_skipped_line({"fp32": exported.onnx_path}) if want_engines and engines is None else None
    if no_trt:
        say(no_trt)
        skipped.append(no_trt)
    elif want_engines:
        # TensorRT's parser has no GroupQueryAttention: the plan is built from a standard-op export of the folder
        # (build_engines/lm_tensorrt.py), checked against transformers first. The ONNX Runtime graphs still serve.
        from model_factory.build_engines.lm_tensorrt import build_lm_engines

        results = _timed(seconds, "build-engine", say, lambda: stage("build-engine", build_lm_engines, recipe,
                                                                     export_dir))
        for e in results:
            artifacts[e.plan_path.name] = e.plan_path
            artifacts[e.metadata_path.name] = e.metadata_path
            built_engines.append(e.precision)
        from model_factory.build_engines.lm_tensorrt import plan_precisions

        skipped += [f"[build-engine] skipped: the {p} TensorRT plan (its weight-only graph missed the token-agreement "
                    "gate: the line above)" for p in plan_precisions(recipe.precisions)[0] if p not in built_engines]
    sign = _signer_for(original, signer, build_info, accuracy, started_on, seconds, say)
    packaged = _timed(seconds, "package", say, lambda: layout_generative_version(
        recipe, artifacts, export_dir=export_dir, extra_files=tuple(extra), build_info=build_info, sign=sign,
        parameters=parameters))
    signature = None
    if signer is not None:
        from model_factory.signing.layout import signature_path

        signature = signature_path(packaged.model_dir, recipe.version)
    return BuildResult(packaged.model_dir, packaged.version_dir, artifacts, accuracy, tuple(built_engines), signature,
                       seconds, folder_listing(packaged.version_dir), tuple(skipped))


def provenance_for(recipe: Recipe, build_info: dict[str, Any], accuracy: dict[str, Any] | None,
                   started_on: str | None = None, stage_seconds: dict[str, float] | None = None) -> dict[str, Any]:
    """The build facts the signed provenance statement records (``signing.BuildProvenance`` keys).

    Besides the recipe and the inputs' digests: the recipe file (its folder is where its relative paths point)
    and the stage times, so that ``model-factory rebuild --check`` can rebuild from it. The outputs' digests are added by the signer, which hashes them anyway.
    """
    import datetime as dt

    from model_factory.build.repository import tool_versions

    facts: dict[str, Any] = {
        "source_model_digest": build_info["source_digest"],
        "source_model": str(recipe.source.gguf or recipe.source.path) if recipe.source.path else recipe.source.factory,
        "recipe": dict(recipe.raw),
        "tool_versions": tool_versions(),
        "precisions": list(recipe.precisions),
        "finished_on": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }
    if build_info.get("source_scan"):
        facts["source_scan"] = dict(build_info["source_scan"])
    calibration = (build_info.get("quantization") or {}).get("calibration_digest")
    if calibration:
        facts["calibration_data_digest"] = calibration
    if accuracy:
        facts["accuracy_report"] = accuracy
    if started_on:
        facts["started_on"] = started_on
    if recipe.recipe_path is not None:
        facts["recipe_path"] = str(Path(recipe.recipe_path).resolve())
    if stage_seconds:
        facts["stage_seconds"] = dict(stage_seconds)
    return facts


def package_existing(recipe: Recipe, progress: Progress | None = None) -> Any:
    """Package the artifacts earlier stages left in the recipe's work dir (``model-factory package``)."""
    from model_factory.build_engines.golden import write_acceptance_data
    from model_factory.build.repository import package_model, queue_policy_note
    from model_factory.build_engines.quantize import quantized_models

    export_dir = recipe.work_dir / "export"
    if recipe.is_generative:
        from model_factory.build.generative import layout_generative_version
        from model_factory.recipe.gguf import converted

        recipe = converted(recipe)
        artifacts = {onnx_file(p): path for p, path in quantized_models(recipe).items()}
        reports = [p for p in (export_dir / Files.EXPORT_REPORT, recipe.work_dir / "quantize" / "accuracy.json")
                   if p.is_file()]
        return layout_generative_version(recipe, artifacts, export_dir=export_dir, extra_files=tuple(reports))
    note = queue_policy_note(recipe)
    if note and progress is not None:
        progress(note)
    # Refuses models whose accuracy gate failed, and missing stages, with the command to run.
    models = quantized_models(recipe)
    artifacts: dict[str, Path] = {onnx_file(p): path for p, path in models.items()}
    if "int8" in models and (models["int8"].parent / Files.INT8_7BIT).is_file():
        artifacts[Files.INT8_7BIT] = models["int8"].parent / Files.INT8_7BIT
    extra = [p for p in (export_dir / Files.EXPORT_REPORT,) if p.is_file()]
    for torch_file in (export_dir / Files.EXPORTED_PROGRAM, export_dir / Files.TORCHSCRIPT):
        if torch_file.is_file():  # the program; a trace only in a work dir from before torch.export
            artifacts[torch_file.name] = torch_file
            break
    quant_dir = recipe.work_dir / "quantize"
    extra += sorted(quant_dir.glob("*.json")) if quant_dir.is_dir() else []
    engine_dir = recipe.work_dir / "engines"
    if engine_dir.is_dir():
        for plan in sorted(engine_dir.glob("model.*.plan")):
            artifacts[plan.name] = plan
            meta = plan.with_name(plan.name + Files.PLAN_METADATA_SUFFIX)
            if meta.is_file():
                artifacts[meta.name] = meta
    tok = export_dir / Files.TOKENIZER_DIR
    tokenizer_dir = tok if tok.is_dir() else None
    golden = write_acceptance_data(recipe, export_dir / Files.ONNX, tokenizer_dir, recipe.work_dir / "acceptance",
                                   progress=progress)
    from model_factory.build.loadcheck import check_packaged

    return package_model(recipe, artifacts, tokenizer_dir=tokenizer_dir, extra_files=extra,
                         acceptance_dir=golden, check=check_packaged)
