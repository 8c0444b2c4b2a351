"""Quantize stage: FP16 and INT8 (explicit Q/DQ) ONNX models, scored against FP32.

FP16
    ``onnxruntime.transformers.float16.convert_float_to_float16`` with the graph
    inputs and outputs kept in their types; normalisations and reductions (the
    parts whose accumulation overflows or loses precision in half) stay in float.

INT8
    Explicit QuantizeLinear/DequantizeLinear pairs, the form TensorRT consumes
    in a strongly typed build: symmetric (zero point 0), weights per output
    channel, activations per tensor, and only on the inputs of MatMul, Gemm and
    Conv. Tensors computed from mask inputs alone (graph inputs whose name
    contains "mask") are never quantized: an additive mask holds float min and
    quantizing it wrecks the model. Other readers of a quantized tensor (the
    residual Add, say) keep reading the float tensor. Activation
    ranges come from the calibration data with the recipe's method: ``minmax``,
    ``percentile`` (99.99th of |x|) or ``entropy`` (KL-divergence threshold as
    in TensorRT's calibrator). Ranges are computed once; graph variants are then
    cheap to build.

Automatic mixed precision
    When the all-INT8 model misses the target (``min_accuracy``, or 0.99 when
    the recipe sets no gate), every candidate node's sensitivity is measured
    (the score with only that node in float), and the most harmful nodes are
    kept in float one at a time until the target is met; a last pass returns to
    INT8 any kept node the target does not need. The search scores on a slice of
    the *calibration* set and aims a little above the target (0.99 -> 0.992);
    the report and the gate use the held-out set only. One "switchable" model
    (``Where(switch, DQ(Q(x)), x)`` per input) serves every variant of the
    search from a single ONNX Runtime session.

Scoring
    INT8 models are run with Q/DQ simulated in float (ONNX Runtime with basic
    graph optimizations), which is what TensorRT's INT8 GEMMs compute; ORT's own
    fused int8 CPU kernels saturate on AVX2 machines without VNNI and would
    misjudge the model (see :func:`~model_factory.build_engines.accuracy.ort_session`).

``quant_pre_process`` is not used: its symbolic shape inference fails on these
exports (see docs/environment.md).
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from model_factory.build_engines.accuracy import (  # noqa: F401 - AccuracyGateError is part of this API
    REPORT_NAME,
    AccuracyGateError,
    AccuracyReport,
    Evaluator,
    PrecisionAccuracy,
    check_gate,
    ort_session,
    primary_output,
)
from model_factory.build_engines.calibration import (
    DataSplit,
    Feeds,
    InputEncoder,
    batches,
    input_types,
    sample_count,
    split_data,
)
from model_factory.build_engines.export import ExportResult, check_onnx_file, onnxruntime_session
from model_factory.build_engines.golden import DEFAULT_THRESHOLD
from model_factory.errors import FactoryError, InternalError, require
from model_factory.fileio import atomic_dir, digest_path
from model_factory.memory import release_memory
from model_factory.build_engines import onnx_files
from model_factory.progress import Steps
from model_factory.recipe import Recipe

# The stage's parts, one module each; their names stay importable from here.
from model_factory.build_engines.fp16 import FP16_FLOAT_OPS, convert_fp16, convert_fp16_graph  # noqa: F401,E402
from model_factory.build_engines.mixed_precision import SwitchScorer, search_mixed_precision  # noqa: F401,E402
from model_factory.build_engines.qdq import (CALIB_BATCH, HIST_BINS, INT8_MAX, PERCENTILE, QUANTIZABLE_OPS,  # noqa: F401,E402
                                             Candidate, QdqBuilder, _entropy_threshold, _initializers,
                                             _mask_only_tensors, _node_names, _run_extra, _save_beside, calibrate,
                                             find_candidates, toposort)

DEPARTURES_NAME = "departures.json"  # where a failing precision first departs from FP32, per layer
SEARCH_SAMPLES = 16
# A reranker's search scores rankings per query: 16 pairs are only four queries of four passages, too few
# to tell a node that flips a ranking from one that does not. Pairs are short and cheap to score.
SEARCH_SAMPLES_RERANKER = 64
# The search never sees the held-out set, so it aims a little above the gate: a fifth of the way from the
# target to a perfect score (0.99 -> 0.992). Without it a search that just crosses 0.99 on 16 samples
# passes or fails the held-out gate by chance.
SEARCH_MARGIN = 0.2




def search_target(target: float) -> float:
    """The score the mixed-precision search aims for on its own samples, for a held-out ``target``."""
    return min(1.0, target + SEARCH_MARGIN * (1.0 - target))


@dataclass(frozen=True)
class QuantizeResult:
    """What the quantize stage produced."""

    models: dict[str, Path]  # precision -> ONNX file ("fp32" is the export's own file)
    report: AccuracyReport
    report_path: Path
    float_nodes: tuple[str, ...]  # INT8 candidates kept in float by mixed precision
    calibration_digest: str | None


def quantize_model(recipe: Recipe, export: ExportResult, out_dir: Path | None = None,
                   progress: Callable[[str], None] | None = None, min_accuracy: float | None = None) -> QuantizeResult:
    """Produce the recipe's FP16/INT8 models from the FP32 export, score them and apply the gate.

    Writes ``model.fp16.onnx``, ``model.int8.onnx`` (as requested) and ``accuracy.json`` into ``out_dir``
    (default ``recipe.work_dir / "quantize"``) atomically. When a precision misses the gate the folder is
    still written (the report is the evidence) and :class:`AccuracyGateError` is raised.
    """
    if recipe.is_generative:  # weight-only INT8/INT4 behind the perplexity and agreement gate
        from model_factory.build_engines.lm_quantize import quantize_causal_lm

        return quantize_causal_lm(recipe, export, out_dir, progress, min_accuracy)
    say = progress or (lambda _msg: None)
    out_dir = Path(out_dir or recipe.work_dir / "quantize")
    q = recipe.quantization
    gate = min_accuracy if min_accuracy is not None else q.min_accuracy
    if gate is not None and not 0 < gate <= 1:
        raise FactoryError(f"min_accuracy {gate} is outside (0, 1]. Fix: give a number such as 0.99")
    wanted = [p for p in recipe.precisions if p != "fp32"]
    models: dict[str, Path] = {"fp32": Path(export.onnx_path)}
    # The data is checked first: a missing file should not wait for a model load.
    split: DataSplit | None = split_data(q, need_calibration="int8" in wanted) if wanted else None
    base = check_onnx_file(Path(export.onnx_path))  # graph only: the weights stay in the export's data file
    base_dir = Path(export.onnx_path).parent
    ref_session = onnxruntime_session(export.onnx_path)
    output = primary_output(recipe.task, [o.name for o in ref_session.get_outputs()])
    if split is None:
        report = AccuracyReport(recipe.name, recipe.task, output, "", 0, "only fp32 requested: nothing to compare",
                                None, 0, None, 0, gate)
        with atomic_dir(out_dir) as tmp:
            report.write(tmp / REPORT_NAME)
        return QuantizeResult(models, report, out_dir / REPORT_NAME, (), None)

    encoder = InputEncoder(input_types(ref_session), export.tokenizer_dir, recipe.shapes.max_sequence_length)
    check_task_data(recipe.task, split)
    say(f"held-out: {split.note}")
    evaluator = Evaluator(ref_session, encoder.encode(split.heldout), recipe.task, output, split.heldout.groups())
    if recipe.task == "reranker" and evaluator.groups is not None and not any(
            evaluator.groups.count(g) > 1 for g in set(evaluator.groups)):
        raise FactoryError(f"quantization.heldout_data: no query in {split.heldout.source} has two passages, so the "
                           "ranking per query cannot be scored. Fix: give several passages per query in the held-out "
                           ".jsonl (one {\"query\": ..., \"passage\": ...} per line)")
    calib_feeds = search_eval = None
    if "int8" in wanted:
        assert split.calibration is not None
        calib_feeds = encoder.encode(split.calibration)
        if q.mixed_precision:
            groups = split.calibration.groups()
            n_search = SEARCH_SAMPLES_RERANKER if recipe.task == "reranker" else SEARCH_SAMPLES
            search_eval = Evaluator(ref_session, {k: v[:n_search] for k, v in calib_feeds.items()},
                                    evaluator.task, evaluator.output, None if groups is None else groups[:n_search])
    # Every FP32 output the scores need is computed: the reference session's weights can go.
    del ref_session
    release_memory()
    results: list[PrecisionAccuracy] = []
    float_nodes: tuple[str, ...] = ()
    search_steps: list[dict[str, Any]] = []
    calibration_digest = split.calibration.digest if split.calibration is not None and "int8" in wanted else None
    seven_bit: dict[str, Any] | None = None
    with atomic_dir(out_dir) as tmp:
        if "fp16" in wanted:
            say("converting to FP16")
            m16, converted = convert_fp16_graph(base)
            # FP16 weights are converted from the export's data file as they are written, never all in memory.
            onnx_files.save(m16, tmp / "model.fp16.onnx", base_dir=base_dir, consume=True, convert=converted)
            del m16
            release_memory()
            onnx_files.check(tmp / "model.fp16.onnx")
            results.append(evaluator.score(onnxruntime_session(tmp / "model.fp16.onnx"), "fp16"))
            release_memory()
            models["fp16"] = out_dir / "model.fp16.onnx"
        if "int8" in wanted:
            assert split.calibration is not None
            res, float_nodes, search_steps = _int8(recipe, base, Path(export.onnx_path), calib_feeds, search_eval,
                                                   evaluator, gate, tmp, say)
            results.append(res)
            models["int8"] = out_dir / "model.int8.onnx"
            seven_bit = _int8_7bit(tmp, evaluator, gate, say)
        report = AccuracyReport(
            model=recipe.name, task=recipe.task, output=output,
            heldout_source=str(split.heldout.source), heldout_samples=evaluator.samples, heldout_note=split.note,
            calibration_source=str(split.calibration.source) if split.calibration is not None else None,
            calibration_samples=len(split.calibration) if split.calibration is not None else 0,
            calibration_method=q.method if "int8" in wanted else None, overlap=split.overlap,
            min_accuracy=gate, results=tuple(results), search=tuple(search_steps))
        report.write(tmp / REPORT_NAME)
        (tmp / "quantize.json").write_text(json.dumps({
            "input_digest": digest_path(Path(export.onnx_path)), "calibration_digest": calibration_digest,
            "models": {p: path.name for p, path in models.items() if p != "fp32"},
            "float_nodes": list(float_nodes),
            **({"int8_7bit": seven_bit} if seven_bit is not None else {}),
        }, indent=2) + "\n")
    report_path = out_dir / REPORT_NAME
    say("accuracy vs FP32: " + "; ".join(
        f"{r.precision} {r.metric} {r.score:.5f}" + "".join(f", {k} {v:.5f}" for k, v in r.extra)
        + (f" ({len(r.float_nodes)} of {r.candidates} kept in float)" if r.float_nodes else "")
        for r in report.results))
    check_gate(report, report_path, _departure_report(report, export.onnx_path, out_dir, evaluator.feeds))
    return QuantizeResult(models, report, report_path, float_nodes, calibration_digest)


def _int8_7bit(tmp: Path, evaluator: Evaluator, gate: float | None,
               say: Callable[[str], None]) -> dict[str, Any]:
    """The INT8 model's 7-bit weight form (:mod:`.int8_7bit`), scored like INT8; kept only when it passes the gate.

    It is what ONNX Runtime's integer kernels run on CPUs without VNNI/AMX. Its score goes to ``quantize.json``,
    not into the gate: a 7-bit form below the gate only means such CPUs run INT8 simulated in float (or FP32).
    """
    from model_factory.backend.contract import Files
    from model_factory.build_engines.int8_7bit import write_7bit

    path, changed = write_7bit(tmp / "model.int8.onnx", tmp / Files.INT8_7BIT)
    res = evaluator.score(ort_session(path, simulate_qdq=True), "int8")
    release_memory()
    passed = gate is None or res.gate_score >= gate
    if not passed:
        for f in onnx_files.files_of(path):
            f.unlink()
    say(f"int8 with 7-bit weights (integer kernels without VNNI/AMX): {res.metric} {res.gate_score:.5f}, "
        + ("kept" if passed else f"below the gate {gate:g}: not kept (such CPUs run INT8 simulated in float)"))
    return {"file": Files.INT8_7BIT if passed else None, "metric": res.metric, "score": res.gate_score,
            "passed": passed, "weights_changed": changed}


def _departure_report(report: AccuracyReport, fp32: Path, out_dir: Path, feeds: Feeds) -> str:
    """For each precision below the gate: the layers where it first departs from FP32 (also written as JSON)."""
    if report.passed:
        return ""
    from model_factory.build_engines.divergence import first_departures, render_departures

    texts, table = [], {}
    for r in report.failures:
        try:
            found = first_departures(Path(fp32), out_dir / f"model.{r.precision}.onnx", feeds,
                                     float(report.min_accuracy or DEFAULT_THRESHOLD))
        except Exception as exc:  # a diagnosis: failing to make it must not hide the gate's verdict
            texts.append(f"{r.precision}: per-layer comparison failed ({type(exc).__name__}: {exc})")
            continue
        table[r.precision] = [d.to_dict() for d in found]
        texts.append(render_departures(r.precision, found))
    if table:
        (out_dir / DEPARTURES_NAME).write_text(json.dumps(table, indent=2) + "\n")
    return "\n".join(texts)


def check_task_data(task: str, split: DataSplit) -> None:
    """Refuse data of the wrong kind for the task: a reranker is calibrated and scored on (query, passage) pairs."""
    for what, samples in (("quantization.calibration_data", split.calibration),
                          ("quantization.heldout_data", split.heldout)):
        if samples is None or not samples.is_text:
            continue
        if task == "reranker" and not samples.is_pairs:
            raise FactoryError(f"{what}: a reranker scores (query, passage) pairs, but {samples.source.name} holds "
                               "single texts. Fix: give a .jsonl with one {\"query\": ..., \"passage\": ...} per "
                               "line")
        if task != "reranker" and samples.is_pairs:
            raise FactoryError(f"{what}: {samples.source.name} holds (query, passage) pairs, which only a reranker "
                               "reads. Fix: give single texts (.txt, or .jsonl with \"text\"), or set "
                               "model.task = \"reranker\"")


def _int8(recipe: Recipe, base: Any, fp32_path: Path, calib_feeds: Feeds, search_eval: Evaluator | None,
          evaluator: Evaluator, gate: float | None, tmp: Path,
          say: Callable[[str], None]) -> tuple[PrecisionAccuracy, tuple[str, ...], list[dict[str, Any]]]:
    q = recipe.quantization
    onnx = require("onnx", "onnx")
    model = onnx.ModelProto()
    model.CopyFrom(base)
    _node_names(model)
    candidates, skipped = find_candidates(model)
    if not candidates:
        raise FactoryError("the model has no MatMul/Gemm/Conv that INT8 can quantize. Fix: drop int8 from the "
                           "recipe's precisions")
    n = sample_count(calib_feeds)
    base_dir = fp32_path.parent
    with tempfile.TemporaryDirectory(prefix=".calibrate-", dir=tmp) as work_s:  # gone before tmp is committed
        work = Path(work_s)
        # Working models (calibration outputs, the search's switchable model) are graph files in `work`
        # whose float weights stay in the export's data file, linked beside them: never copied.
        if onnx_files.data_file(fp32_path).is_file():
            onnx_files.hardlink_or_copy(onnx_files.data_file(fp32_path), work / onnx_files.data_file(fp32_path).name)
        t0 = time.perf_counter()
        say(f"calibrating {len(candidates)} nodes on {n} samples ({q.method})")
        amax = calibrate(model, [a for c in candidates for a in c.activations], calib_feeds, q.method, work, say)
        say(f"calibrated in {time.perf_counter() - t0:.1f}s")
        release_memory()
        builder = QdqBuilder(model, candidates, amax, base_dir)
        names = [c.node for c in candidates]
        kept: list[str] = []
        steps: list[dict[str, Any]] = []
        if q.mixed_precision:
            assert search_eval is not None
            target = search_target(gate if gate is not None else DEFAULT_THRESHOLD)
            scorer = SwitchScorer(builder, search_eval, work)
            kept, steps = search_mixed_precision(names, scorer, target, say)
            steps.insert(0, {"step": "search", "gate": gate, "target": target, "scored_on":
                             f"first {search_eval.samples} calibration samples (Q/DQ simulated in float)",
                             "evaluations": scorer.calls})
            del scorer
            release_memory()
        final = builder.build([x for x in names if x not in kept])
        del builder
    path = tmp / "model.int8.onnx"
    # The float weights INT8 keeps stream from the export's data file; the INT8 ones from memory.
    onnx_files.save(final, path, base_dir=base_dir, consume=True)
    del final
    release_memory()
    onnx_files.check(path)
    res = evaluator.score(ort_session(path, simulate_qdq=True), "int8")
    release_memory()
    res = dataclasses.replace(res, float_nodes=tuple(kept), int8_nodes=len(names) - len(kept), candidates=len(names))
    if skipped:
        steps.insert(0, {"step": "not candidates", "nodes": skipped})
    return res, tuple(kept), steps


def load_export(recipe: Recipe) -> ExportResult:
    """The export stage's result as it lies in ``recipe.work_dir / "export"`` (for stand-alone commands)."""
    export_dir = recipe.work_dir / "export"
    onnx_path, info_path = export_dir / "model.onnx", export_dir / "export.json"
    if not onnx_path.is_file() or not info_path.is_file():
        raise FactoryError(f"{onnx_path} (with export.json) is missing. Fix: run model-factory export on the "
                           "recipe first")
    try:
        info = json.loads(info_path.read_text())
        tok = export_dir / "tokenizer"
        return ExportResult(onnx_path, float(info["max_abs_error"]), float(info["tolerance"]),
                            tok if tok.is_dir() else None, str(info["source_digest"]), int(info["opset"]),
                            tuple(info["inputs"]), tuple(info["outputs"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise FactoryError(f"{info_path} is unreadable ({exc}). Fix: run model-factory export again") from exc


def quantize_existing(recipe: Recipe, min_accuracy: float | None = None,
                      progress: Callable[[str], None] | None = None) -> QuantizeResult:
    """``model-factory quantize``: quantize the export already in the recipe's work dir."""
    return quantize_model(recipe, load_export(recipe), progress=progress, min_accuracy=min_accuracy)


def quantized_models(recipe: Recipe) -> dict[str, Path]:
    """The recipe's models as earlier stages left them in its work dir; refuses models that failed the gate."""
    export_onnx = recipe.work_dir / "export" / "model.onnx"
    if not export_onnx.is_file():
        raise FactoryError(f"{export_onnx} is missing. Fix: run model-factory export on the recipe first")
    models = {"fp32": export_onnx}
    quant_dir = recipe.work_dir / "quantize"
    wanted = [p for p in recipe.precisions if p != "fp32"]
    if not wanted:
        return models
    report_path = quant_dir / REPORT_NAME
    if not report_path.is_file():
        raise FactoryError(f"{report_path} is missing. Fix: run model-factory quantize on the recipe first")
    if recipe.is_generative:  # its own report shape: each row carries its verdict
        failed = {r["precision"] for r in json.loads(report_path.read_text())["results"] if not r["passed"]}
    else:
        failed = {r.precision for r in AccuracyReport.read(report_path).failures}
    for p in wanted:
        path = quant_dir / f"model.{p}.onnx"
        if not path.is_file():
            raise FactoryError(f"{path} is missing. Fix: run model-factory quantize on the recipe first")
        if p in failed:
            raise FactoryError(f"the {p} model failed the accuracy gate ({report_path}). Fix: see the report, "
                               "change the quantization settings and run model-factory quantize again")
        models[p] = path
    return models
