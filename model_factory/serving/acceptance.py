"""Accept the engine where it runs: replay a version's golden inputs through the engine the backend would serve.

Verification proves the bytes are the ones that were signed; acceptance proves they compute the right
answer *on this machine*. ``accept_model`` reads the configuration Triton would read, picks and loads
the engine with the backend's own load path (``model_factory.backend.engines.loading.load_for_serving``: same choice,
same files, the tokenizer and the warm-up ``serve`` runs, bytes checked against the verified digests when given), runs ``acceptance/inputs.json``
through it, and scores every output against ``acceptance/outputs.json`` (the FP32 references, paired
by exact output name) with the task's metrics (``accuracy.task_metrics``: one place, keyed by task, the
same the quantize gate uses). The gate is the primary output's worst gated metric (its score and any
further metric the task gates on, e.g. a classifier's logits cosine) against the threshold in
``acceptance.json``.

When the served engine is a reduced-precision ONNX model and it fails, the report also names the
layers where it first departs from the FP32 graph (``build_engines/divergence.py``).
"""

from __future__ import annotations

import contextlib
import io
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from model_factory.build_engines.golden import (ACCEPTANCE_DIR, INPUTS_FILE, OUTPUTS_FILE, SPEC_FILE, AcceptanceSpec,
                                                read_inputs, read_outputs, read_spec)
from model_factory.errors import FactoryError
from model_factory.serving.refusals import one_line


@dataclass(frozen=True)
class OutputScore:
    """One output of the engine against its FP32 reference."""

    name: str
    metric: str
    score: float
    min_cosine: float | None
    max_abs_error: float
    extra: tuple[tuple[str, float], ...] = ()  # further gated metrics of the task, (name, value)

    @property
    def gate_score(self) -> float:
        """The worst of the task's gated metrics (NaN when any is NaN)."""
        values = [self.score] + [v for _, v in self.extra]
        return float("nan") if any(v != v for v in values) else min(values)


@dataclass(frozen=True)
class AcceptanceResult:
    """The verdict for one model version on this machine."""

    model: str
    version: str | None
    passed: bool
    engine: str | None = None  # the backend's engine flavour: tensorrt, torch, onnxruntime
    file: str | None = None  # the engine's file in the version folder
    device: str | None = None  # cpu, cuda:0, ...
    int8_kernels: str | None = None  # INT8 on ONNX Runtime CPU: integer or simulated (Q/DQ in float)
    metric: str | None = None
    threshold: float | None = None
    score: float | None = None
    primary_output: str | None = None
    samples: int = 0
    outputs: tuple[OutputScore, ...] = ()
    reason: str | None = None  # why it failed (below the gate, cannot load, no acceptance data, ...)
    fallbacks: Mapping[str, str] = field(default_factory=dict)
    departures: tuple[Mapping[str, Any], ...] = ()
    # With degrade_to: the degrade engine's own acceptance ({"precision", "file", "score"}), None otherwise.
    degrade: Mapping[str, Any] | None = None
    # text-generation: the agreement generating freely through the batched scheduler (reported; gated for FP32).
    free_running: float | None = None

    @property
    def where(self) -> str:
        """``engine (file) on device``, as the reports print it."""
        if self.engine is None:
            return "-"
        kernels = f", int8 {self.int8_kernels} kernels" if self.int8_kernels else ""
        return f"{self.engine} ({self.file}) on {self.device}{kernels}"

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "version": self.version, "passed": self.passed, "engine": self.engine,
                "file": self.file, "device": self.device, "int8_kernels": self.int8_kernels, "metric": self.metric, "threshold": self.threshold,
                "score": _num(self.score), "primary_output": self.primary_output, "samples": self.samples,
                "outputs": [{"name": o.name, "metric": o.metric, "score": _num(o.score),
                             "min_cosine": _num(o.min_cosine), "max_abs_error": _num(o.max_abs_error),
                             "extra": {k: _num(v) for k, v in o.extra}}
                            for o in self.outputs],
                "reason": self.reason, "fallbacks": dict(self.fallbacks),
                "departures": [dict(d) for d in self.departures]} | (
                    {"degrade": dict(self.degrade)} if self.degrade is not None else {}) | (
                    {"free_running": _num(self.free_running)} if self.free_running is not None else {})


def _num(x: float | None) -> float | str | None:
    if x is None:
        return None
    return float(x) if np.isfinite(x) else str(x)


def instance_of(config: Any) -> tuple[str, int]:
    """Triton's instance kind for the first instance group (KIND_AUTO: GPU when one is visible), and the device."""
    from model_factory.backend.memory.pool import cuda_device_count

    groups = list(config.instance_group)
    kind = groups[0].kind if groups else 0
    name = type(config).DESCRIPTOR.fields_by_name["instance_group"].message_type.fields_by_name["kind"] \
        .enum_type.values_by_number[kind].name
    gpus = list(groups[0].gpus) if groups else []
    device_id = int(gpus[0]) if gpus else 0
    if name == "KIND_GPU":
        return "GPU", device_id
    if name == "KIND_AUTO":
        return ("GPU" if cuda_device_count() > 0 else "CPU"), device_id
    return "CPU", device_id


def served_version(model_dir: Path, config: Any) -> str:
    """The version Triton serves: the highest of the config's specific versions, else the highest folder."""
    wanted = list(config.version_policy.specific.versions) if config.HasField("version_policy") else []
    if wanted:
        return str(max(wanted))
    versions = [int(p.name) for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit()]
    if not versions:
        raise FactoryError(f"{model_dir} has no version folder. Fix: run model-factory package")
    return str(max(versions))


def engine_settings(config: Any) -> Any:
    """The backend's settings for a parsed ``config.pbtxt`` (what the backend reads at load)."""
    from google.protobuf import json_format

    from model_factory.backend.settings import parse_settings

    return parse_settings(json_format.MessageToDict(config, preserving_proto_field_name=True))


@contextlib.contextmanager
def gpu_product_env(product: str | None, int8_kernels: str | None = None):
    """The backend reads the GPU product (and INT8 kernels) the server was started with from its environment:
    set them alike."""
    from model_factory.backend.engines.cpu_features import INT8_KERNELS_ENV
    from model_factory.backend.engines.loading import GPU_PRODUCT_ENV

    with _env(INT8_KERNELS_ENV, int8_kernels):
        with _env(GPU_PRODUCT_ENV, product):
            yield


@contextlib.contextmanager
def _env(name: str, value: str | None):
    """``os.environ[name] = value`` for the block (nothing when value is None)."""
    if not value:
        yield
        return
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def accept_model(model_dir: Path, *, digests: Mapping[str, str] | None = None, instance_kind: str | None = None,
                 device_id: int | None = None, layers: bool = True, gpu_product: str | None = None,
                 int8_kernels: str | None = None) -> AcceptanceResult:
    """Accept the served version of ``model_dir`` on this machine (never raises for a failing engine).

    ``digests`` (``relpath -> sha256``, as ``serve`` hands to the backend) makes every file read here
    (acceptance data and engine) be checked against the verified bytes. ``instance_kind`` / ``device_id``
    override what ``config.pbtxt`` says (``GPU``/``CPU``); ``gpu_product`` is ``serve --gpu-product``'s
    (only plans built on that GPU product count); ``int8_kernels`` is ``serve --int8-kernels``'s.
    """
    from model_factory.backend.integrity import read_checked
    from model_factory.backend.engines.loading import load_for_serving
    from model_factory.build.repository import read_config

    model_dir = Path(model_dir)
    name = model_dir.name
    config = read_config(model_dir)
    version = served_version(model_dir, config)
    from model_factory.backend.contract import PROMPT, TEXT_GENERATION

    task = config.parameters["task"].string_value if "task" in config.parameters else None
    if task == PROMPT:  # a prompt template: its signed definition fills in (prompt_acceptance)
        from model_factory.serving.prompt_acceptance import accept_prompt

        return AcceptanceResult(name, version, **accept_prompt(model_dir, version, digests))
    if task == TEXT_GENERATION:  # golden continuations replayed instead of golden outputs
        from model_factory.serving.generative_acceptance import accept_generative

        try:
            settings = engine_settings(config)
        except Exception as exc:  # noqa: BLE001 - a configuration the backend refuses: that is the verdict
            return AcceptanceResult(name, version, False, reason=one_line(exc))
        return AcceptanceResult(name, version, **accept_generative(model_dir, version, settings, digests,
                                                                   instance_of(config)))
    try:
        settings = engine_settings(config)
        kind, dev = instance_of(config)
        kind, dev = instance_kind or kind, dev if device_id is None else device_id
        rel = f"{version}/{ACCEPTANCE_DIR}"
        if not (model_dir / rel / SPEC_FILE).is_file():
            return AcceptanceResult(name, version, False, reason=(
                f"no acceptance data ({rel}/{SPEC_FILE}): repackage with a recipe that names "
                "quantization.heldout_data (or calibration_data)"))
        spec = read_spec(read_checked(model_dir, f"{rel}/{SPEC_FILE}", _d(digests)))
        inputs = read_inputs(read_checked(model_dir, f"{rel}/{INPUTS_FILE}", _d(digests)))
        references = read_outputs(read_checked(model_dir, f"{rel}/{OUTPUTS_FILE}", _d(digests)))
    except FactoryError as exc:
        return AcceptanceResult(name, version, False, reason=str(exc))
    except Exception as exc:  # an unreadable or tampered file: refuse, with the reason
        return AcceptanceResult(name, version, False, reason=f"{type(exc).__name__}: {exc}")
    try:
        # Serve's own load path (backend initialize()): engine, tokenizer and warm-up; what fails here fails there.
        with gpu_product_env(gpu_product, int8_kernels):
            engine, info, _tokenizer = load_for_serving(model_dir / version, settings, kind, dev, digests=_d(digests))
    except Exception as exc:  # the model would not load in Triton either: that is the verdict
        return AcceptanceResult(name, version, False, metric=spec.metric, threshold=spec.threshold,
                                primary_output=spec.primary_output,
                                reason=f"the model does not load here ({kind} instance): {one_line(exc)}")
    where = dict(engine=info.get("flavour"), file=info.get("file"),
                 device=info.get("device") or ("cpu" if info.get("flavour") == "onnxruntime" else f"cuda:{dev}"),
                 int8_kernels=info.get("int8_kernels"),
                 fallbacks={k: v for k, v in info.items() if k.startswith("fallback_from_")})
    try:
        got = _run(engine, inputs, settings, spec)
    except Exception as exc:
        return AcceptanceResult(name, version, False, metric=spec.metric, threshold=spec.threshold,
                                primary_output=spec.primary_output, **where,
                                reason=f"the engine fails on the acceptance inputs: {type(exc).__name__}: {exc}")
    finally:
        engine.close()
    result = score(name, version, spec, references, got, where, inputs)
    if not result.passed and layers and result.score is not None:
        result = _with_departures(result, model_dir / version, inputs, spec)
    if result.passed and settings.degrade_to:
        with gpu_product_env(gpu_product, int8_kernels):
            result = _accept_degrade(result, model_dir, version, settings, (kind, dev), digests, spec, inputs,
                                     references)
    return result


def _accept_degrade(result: AcceptanceResult, model_dir: Path, version: str, settings: Any, where: tuple[str, int],
                    digests: Mapping[str, str] | None, spec: AcceptanceSpec, inputs: Sequence[Mapping[str, np.ndarray]],
                    references: Sequence[Mapping[str, np.ndarray]]) -> AcceptanceResult:
    """The degrade engine (``degrade_to``) accepted on this machine too: its gate in accuracy.json, its load, its
    golden outputs against the same threshold. A failure fails the model (the backend would degrade to it)."""
    import dataclasses

    from model_factory.backend.operations.degrade import DegradeRefused, degrade_settings, read_gate, report_text
    from model_factory.backend.engines.loading import load_for_serving

    precision = settings.degrade_to
    try:
        read_gate(report_text(model_dir, version, _d(digests)), precision)
        cheap = degrade_settings(settings, precision)
        engine, info, _tokenizer = load_for_serving(model_dir / version, cheap, where[0], where[1],
                                                    digests=_d(digests))
    except DegradeRefused as exc:  # its own one line: no gate, or a failed one
        return dataclasses.replace(result, passed=False, reason=f"degrade_to {precision}: {exc}")
    except Exception as exc:  # noqa: BLE001 - an engine that does not load here: the verdict
        return dataclasses.replace(result, passed=False, reason=f"degrade_to {precision}: {one_line(exc)}")
    try:
        got = _run(engine, inputs, cheap, spec)
    except Exception as exc:  # noqa: BLE001
        return dataclasses.replace(result, passed=False, reason=(
            f"degrade_to {precision}: the engine fails on the acceptance inputs: {type(exc).__name__}: {exc}"))
    finally:
        engine.close()
    cheap_result = score(result.model, version, spec, references, got, {}, inputs)
    said = {"precision": precision, "file": info.get("file"), "score": _num(cheap_result.score)}
    if not cheap_result.passed:
        return dataclasses.replace(result, passed=False, degrade=said,
                                   reason=f"degrade_to {precision} ({info.get('file')}): {cheap_result.reason}")
    return dataclasses.replace(result, degrade=said)


def _d(digests: Mapping[str, str] | None) -> dict[str, str] | None:
    return None if digests is None else dict(digests)


def _run(engine: Any, inputs: Sequence[Mapping[str, np.ndarray]], settings: Any,
         spec: AcceptanceSpec) -> list[dict[str, np.ndarray]]:
    from model_factory.backend.batching.grouping import profile_for_length

    profile = 0
    if spec.sequence_length is not None and settings.sequence_buckets:
        profile = profile_for_length(spec.sequence_length, settings.sequence_buckets)
    out = []
    for feeds in inputs:
        batch = {}
        for name in engine.input_names:
            if name in feeds:
                batch[name] = feeds[name]
            elif name == "token_type_ids" and "input_ids" in feeds:  # as the backend fills it
                batch[name] = np.zeros_like(feeds["input_ids"])
            else:
                raise FactoryError(f"the engine takes input {name!r}, which the acceptance data lacks "
                                   f"(it has {sorted(feeds)})")
        out.append(engine.run(batch, profile))
    return out


def score(model: str, version: str | None, spec: AcceptanceSpec, references: Sequence[Mapping[str, np.ndarray]],
          got: Sequence[Mapping[str, np.ndarray]], where: Mapping[str, Any] | None = None,
          inputs_of: Sequence[Mapping[str, np.ndarray]] | None = None) -> AcceptanceResult:
    """Score ``got`` against ``references`` output by output (exact names) and apply the gate."""
    from model_factory.build_engines.accuracy import task_metrics

    where = dict(where or {})
    base = dict(metric=spec.metric, threshold=spec.threshold, primary_output=spec.primary_output,
                samples=spec.samples, **where)
    names = list(references[0]) if references else []
    produced = set(got[0]) if got else set()
    missing = [n for n in names if n not in produced]
    mask = None
    if spec.task == "token-classification" and references and "attention_mask" in (inputs_of or [{}])[0]:
        mask = np.concatenate([np.asarray(i["attention_mask"]) for i in inputs_of])
    scores = []
    for n in names:
        if n in missing:
            continue
        ref = np.concatenate([np.asarray(r[n], np.float64) for r in references])
        cand = np.concatenate([np.asarray(g[n], np.float64) for g in got])
        try:
            if n == spec.primary_output:
                metric, value, min_cos, max_abs, extra = task_metrics(ref, cand, spec.task, mask,
                                                                      None if spec.groups is None else list(spec.groups))
            else:  # the other outputs are shown, compared by cosine, and not gated
                metric, value, min_cos, max_abs, extra = task_metrics(ref, cand, "embedding")
        except FactoryError as exc:
            return AcceptanceResult(model, version, False, reason=f"output {n!r}: {exc}", **base)
        scores.append(OutputScore(n, metric, value, min_cos, max_abs, tuple(extra)))
    if spec.primary_output in missing:
        return AcceptanceResult(model, version, False, outputs=tuple(scores), reason=(
            f"the engine does not produce {spec.primary_output!r} (it gives {sorted(produced)}); outputs are "
            "paired by exact name"), **base)
    primary = next(s for s in scores if s.name == spec.primary_output)
    gate = primary.gate_score
    passed = bool(gate >= spec.threshold)  # NaN fails
    shown = ", ".join([f"{primary.metric} {primary.score:.6f}"] + [f"{k} {v:.6f}" for k, v in primary.extra])
    reason = None if passed else f"{shown} on {primary.name}: below the gate {spec.threshold:g}"
    return AcceptanceResult(model, version, passed, score=gate, outputs=tuple(scores), reason=reason, **base)


def _with_departures(result: AcceptanceResult, version_dir: Path, inputs: Sequence[Mapping[str, np.ndarray]],
                     spec: AcceptanceSpec) -> AcceptanceResult:
    """Name the layers where a failing reduced-precision ONNX engine first departs from model.onnx."""
    import dataclasses

    served = result.file or ""
    if result.engine != "onnxruntime" or served == "model.onnx" or not served.endswith(".onnx"):
        return result
    if not (version_dir / "model.onnx").is_file():
        return dataclasses.replace(result, reason=(
            f"{result.reason} (no FP32 model.onnx in the version folder to compare layers with: package with "
            "[repository] keep_all_precisions = true, or see the build's departures.json)"))
    try:
        from model_factory.build_engines.divergence import first_departures

        found = first_departures(version_dir / "model.onnx", version_dir / served, inputs[0], spec.threshold)
    except Exception as exc:  # the report is a diagnosis; failing to make it must not hide the verdict
        return dataclasses.replace(result, reason=f"{result.reason} (layer comparison failed: {exc})")
    if not found:
        return result
    return dataclasses.replace(result, departures=tuple(d.to_dict() for d in found), reason=(
        f"{result.reason}; first departs from FP32 at " + ", ".join(d.describe() for d in found)))


def accept_repository(repository: Path, model: str | None = None, **kwargs: Any) -> list[AcceptanceResult]:
    """Accept every model of ``repository`` (or just ``model``)."""
    from model_factory.build.repository import discover_models

    repository = Path(repository)
    if not repository.is_dir():
        raise FactoryError(f"model repository {repository} does not exist. Fix: run model-factory build first")
    from model_factory.distribution.adapters import is_adapter_entry

    adapters = sorted(p.name for p in repository.iterdir() if p.is_dir() and not p.name.startswith(".")
                      and is_adapter_entry(p))
    models = sorted(discover_models(repository) + adapters)
    if model is not None:
        if model not in models:
            raise FactoryError(f"{repository} has no model {model!r} (it has {', '.join(models) or 'none'}). Fix: "
                               "name one of those with --model")
        models = [model]
    if not models:
        raise FactoryError(f"{repository} holds no model folders with a config.pbtxt. Fix: run model-factory build")
    return [accept_model(repository / m, **kwargs) if m not in adapters else _adapter(repository / m, kwargs)
            for m in models]


def _adapter(model_dir: Path, kwargs: Mapping[str, Any]) -> AcceptanceResult:
    from model_factory.serving.adapter_acceptance import accept_adapter

    return AcceptanceResult(model_dir.name, **accept_adapter(model_dir, kwargs.get("digests")))


def render(results: Sequence[AcceptanceResult], width: int = 120) -> str:
    """The acceptance table (one row per output of every model), then each failure's reason."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Acceptance on this machine (engine outputs vs FP32 references)", title_justify="left")
    for col in ("model", "engine", "device", "output", "metric", "score", "min cos", "max abs err", "gate"):
        table.add_column(col, justify="right" if col in ("score", "min cos", "max abs err") else "left")
    for r in results:
        kernels = f", int8 {r.int8_kernels}" if r.int8_kernels else ""
        where = (f"{r.engine} ({r.file}{kernels})" if r.engine else "-", r.device or "-")
        if not r.outputs:  # a model scored as a whole (text generation: token agreement), or one that failed first
            table.add_row(f"{r.model}/{r.version}", *where, r.primary_output or "-", r.metric or "-",
                          "-" if r.score is None else f"{r.score:.6f}", "-", "-", "pass" if r.passed else "FAIL")
        for o in r.outputs:
            gate = ("pass" if r.passed else "FAIL") if o.name == r.primary_output else "-"
            table.add_row(f"{r.model}/{r.version}", *where, o.name, o.metric, f"{o.score:.6f}",
                          "-" if o.min_cosine is None else f"{o.min_cosine:.6f}", f"{o.max_abs_error:.3g}", gate)
    console = Console(file=io.StringIO(), width=width, record=True, color_system=None, force_terminal=False)
    console.print(table)
    for r in results:
        line = (f"{r.model}: PASS ({r.metric} >= {r.threshold:g} on {r.primary_output}, {r.samples} samples)"
                if r.passed else f"{r.model}: FAIL: {r.reason}")
        console.print(line, highlight=False, markup=False, soft_wrap=True)
        for k, v in r.fallbacks.items():
            console.print(f"  {k.replace('_', ' ')}: {v}", highlight=False, markup=False, soft_wrap=True)
        if r.free_running is not None:
            console.print(f"  generating freely, batched: {r.free_running:.4f} of the reference's tokens before its "
                          "first difference (reported; gated for fp32)", highlight=False, markup=False,
                          soft_wrap=True)
        if r.degrade is not None:  # the engine a backlog degrades to, accepted with the same gate
            console.print(f"  degrade_to {r.degrade['precision']}: {r.degrade['file']}, {r.metric} "
                          f"{r.degrade['score']}", highlight=False, markup=False, soft_wrap=True)
    return console.export_text().rstrip()
