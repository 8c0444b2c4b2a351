"""Accuracy of reduced-precision models against FP32, and the gate.

Every FP16/INT8 model is scored against the FP32 export on *held-out* inputs
(never the calibration set):

* embeddings and generic outputs: cosine similarity per sample (mean and min)
  and the largest absolute difference;
* sequence classifiers: top-1 agreement with FP32 **and** the mean cosine of
  the logits, both gated;
* token classifiers: top-1 agreement per real token (padding never counts);
* rerankers: the agreement of the ranking per query (the share of passage
  pairs of one query that FP32 and the candidate order alike) **and** the
  correlation of the scores, both gated.

The report is written beside the artifacts as ``accuracy.json`` and rendered
for the terminal with rich. ``quantization.min_accuracy`` turns it into a gate:
a precision scoring below it fails the build with the report in the message.
"""

from __future__ import annotations

import io
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from model_factory.build_engines.calibration import Feeds, batches
from model_factory.errors import FactoryError
from model_factory.fileio import atomic_file

REPORT_NAME = "accuracy.json"
EVAL_BATCH = 16


class AccuracyGateError(FactoryError):
    """A reduced-precision model scored below ``quantization.min_accuracy``; the message holds the report."""

    def __init__(self, message: str, report: "AccuracyReport", report_path: Path) -> None:
        super().__init__(message)
        self.report = report
        self.report_path = report_path

    def __reduce__(self):  # noqa: ANN204 - pickled whole: the build runs the quantize stage in a child process
        return (type(self), (str(self), self.report, self.report_path))


@dataclass(frozen=True)
class PrecisionAccuracy:
    """How one precision compares with FP32 on the held-out set."""

    precision: str
    metric: str  # "cosine" (embeddings, generic), "top1" (classification), "token_top1", "ranking" (reranker)
    score: float  # the task's primary metric
    max_abs_error: float
    samples: int
    min_cosine: float | None = None
    float_nodes: tuple[str, ...] = ()  # INT8 only: quantizable nodes kept in float
    int8_nodes: int = 0
    candidates: int = 0
    # Further metrics the gate also applies to, (name, value): ("logits_cosine", ...) for classifiers,
    # ("correlation", ...) for rerankers.
    extra: tuple[tuple[str, float], ...] = ()

    @property
    def mean_cosine(self) -> float | None:
        return self.score if self.metric == "cosine" else dict(self.extra).get("logits_cosine")

    @property
    def gate_score(self) -> float:
        """The number the gate and the mixed-precision search compare with the target: the worst metric."""
        values = [self.score] + [v for _, v in self.extra]
        return float("nan") if any(v != v for v in values) else min(values)


@dataclass(frozen=True)
class AccuracyReport:
    """The accuracy of every reduced precision of one model, and whether the gate passed."""

    model: str
    task: str
    output: str
    heldout_source: str
    heldout_samples: int
    heldout_note: str
    calibration_source: str | None
    calibration_samples: int
    calibration_method: str | None
    overlap: int  # samples in both calibration and held-out sets (0 by construction)
    min_accuracy: float | None
    results: tuple[PrecisionAccuracy, ...] = ()
    search: tuple[Mapping[str, Any], ...] = field(default=(), compare=False)  # mixed-precision steps
    scoring: str = ("ONNX Runtime CPU; INT8 with Q/DQ simulated in float, as TensorRT computes it "
                    "(not ORT's int8 kernels)")

    @property
    def failures(self) -> tuple[PrecisionAccuracy, ...]:
        if self.min_accuracy is None:
            return ()
        return tuple(r for r in self.results if not (r.gate_score >= self.min_accuracy))  # NaN fails too

    @property
    def passed(self) -> bool:
        return not self.failures

    def result(self, precision: str) -> PrecisionAccuracy:
        for r in self.results:
            if r.precision == precision:
                return r
        raise KeyError(precision)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types; a non-finite number (an FP16 overflow, say) becomes the string "inf"/"nan"."""
        d = asdict(self)
        d["results"] = [_finite(asdict(r)) | {"float_nodes": list(r.float_nodes),
                                              "extra": {k: _finite({"v": v})["v"] for k, v in r.extra}}
                        for r in self.results]
        d["search"] = [_finite(dict(s)) for s in self.search]
        d["passed"] = self.passed
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "AccuracyReport":
        fields = {k: v for k, v in d.items() if k not in ("results", "search", "passed")}
        results = []
        for r in d.get("results", ()):
            r = dict(r) | {"float_nodes": tuple(r.get("float_nodes", ())),
                           "extra": tuple((k, float(v)) for k, v in dict(r.get("extra") or {}).items())}
            for key in ("score", "max_abs_error", "min_cosine"):
                if isinstance(r.get(key), str):
                    r[key] = float(r[key])
            results.append(PrecisionAccuracy(**r))
        return cls(**fields, results=tuple(results), search=tuple(d.get("search", ())))

    def write(self, path: Path) -> Path:
        """Write the report as JSON, atomically."""
        with atomic_file(path) as f:
            json.dump(self.to_dict(), f, indent=2, allow_nan=False)
            f.write("\n")
        return path

    @classmethod
    def read(cls, path: Path) -> "AccuracyReport":
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, ValueError, TypeError) as exc:
            raise FactoryError(f"cannot read the accuracy report {path}: {exc}. Fix: re-run the quantize stage") from exc

    def render(self, width: int = 110) -> str:
        """The report as terminal text (rich table), also used in the gate's error message."""
        from rich.console import Console
        from rich.table import Table

        title = f"Accuracy of {self.model} vs FP32 ({self.output}, {self.heldout_samples} held-out samples)"
        table = Table(title=title, title_justify="left")
        table.add_column("precision")
        metric = self.results[0].metric if self.results else ("top1" if self.task == "classification" else "cosine")
        extras = list(dict.fromkeys(k for r in self.results for k, _ in r.extra))
        table.add_column(METRIC_LABELS.get(metric, metric), justify="right")
        for name in extras:
            table.add_column(METRIC_LABELS.get(name, name), justify="right")
        table.add_column("min cos", justify="right")
        table.add_column("max abs err", justify="right")
        table.add_column("INT8 nodes", justify="right")
        table.add_column("gate", justify="center")
        for r in self.results:
            ok = "-" if self.min_accuracy is None else ("pass" if r.gate_score >= self.min_accuracy else "FAIL")
            values = dict(r.extra)
            table.add_row(r.precision, f"{r.score:.6f}", *(f"{values[n]:.6f}" if n in values else "-" for n in extras),
                          "-" if r.min_cosine is None else f"{r.min_cosine:.6f}",
                          f"{r.max_abs_error:.3g}", f"{r.int8_nodes}/{r.candidates}" if r.candidates else "-", ok)
        console = Console(file=io.StringIO(), width=width, record=True, color_system=None, force_terminal=False)
        console.print(table)
        lines = [f"held-out: {self.heldout_note}", f"scored with: {self.scoring}"]
        if self.calibration_source:
            lines.append(f"calibration: {self.calibration_samples} samples of {self.calibration_source} "
                         f"({self.calibration_method}); overlap with held-out: {self.overlap}")
        for r in self.results:
            if r.float_nodes:
                lines.append(f"{r.precision}: kept in float ({len(r.float_nodes)}): " + ", ".join(r.float_nodes))
        if self.min_accuracy is not None:
            lines.append(f"gate: min_accuracy {self.min_accuracy:g} -> " + ("passed" if self.passed else "FAILED"))
        for line in lines:
            console.print(line, highlight=False, markup=False, soft_wrap=True)
        return "\n".join(line.rstrip() for line in console.export_text().rstrip().splitlines())


METRIC_LABELS = {"cosine": "mean cos", "top1": "top-1 agree", "token_top1": "token top-1",
                 "ranking": "rank agree", "logits_cosine": "logits cos", "correlation": "score corr"}


def _finite(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, float) and not np.isfinite(v) else v) for k, v in d.items()}


def ort_session(path: Path, simulate_qdq: bool = False) -> Any:
    """An ONNX Runtime CPU session (telemetry off) to score a model with.

    ``simulate_qdq`` keeps Q/DQ nodes as float arithmetic (basic graph optimizations only), which is what
    TensorRT's INT8 GEMMs compute. With ORT's extended optimizations the Q/DQ pairs fuse into ORT's own
    int8 CPU kernels, which on AVX2 machines without VNNI saturate 16-bit intermediate sums (u8s8) and
    score a model lower than the engine it will become.
    """
    from model_factory.build_engines.export import onnxruntime_session

    return onnxruntime_session(path, basic_optimizations=simulate_qdq)


def primary_output(task: str, output_names: Sequence[str]) -> str:
    """The output the report scores: ``embedding`` for embedding models, ``score`` for rerankers,
    ``logits`` for classifiers, else the first output."""
    want = {"embedding": "embedding", "reranker": "score", "classification": "logits",
            "token-classification": "logits"}.get(task)
    return want if want in output_names else output_names[0]


def run_outputs(session: Any, feeds: Feeds, output: str, batch_size: int = EVAL_BATCH,
                extra_feeds: Feeds | None = None) -> np.ndarray:
    """Run ``session`` over ``feeds`` in batches and stack one output (float64).

    ``extra_feeds`` are passed unchanged with every batch (e.g. the switches of a search model).
    """
    extra = extra_feeds or {}
    outs = [np.asarray(session.run([output], b | extra)[0], dtype=np.float64) for b in batches(feeds, batch_size)]
    return np.concatenate(outs, axis=0)


def _cosines(ref: np.ndarray, cand: np.ndarray) -> np.ndarray:
    """Cosine per row of two 2-D arrays; a row with NaN/inf in the candidate scores -1."""
    ref_n, cand_n = np.linalg.norm(ref, axis=1), np.linalg.norm(cand, axis=1)
    with np.errstate(all="ignore"):
        cos = np.sum(ref * cand, axis=1) / (ref_n * cand_n)
    cos = np.where((ref_n == 0) | (cand_n == 0), np.where((ref_n == 0) & (cand_n == 0), 1.0, 0.0), cos)
    return np.where(np.isfinite(cand).all(axis=1) & np.isfinite(cos), np.clip(cos, -1.0, 1.0), -1.0)


def score_correlation(reference: np.ndarray, candidate: np.ndarray) -> float:
    """Pearson correlation of two score vectors (1.0 when both are constant and equal)."""
    ref, cand = reference.ravel(), candidate.ravel()
    if not np.isfinite(cand).all():
        return -1.0
    if ref.size < 2 or np.std(ref) == 0 or np.std(cand) == 0:
        return 1.0 if np.allclose(ref, cand) else 0.0
    return float(np.corrcoef(ref, cand)[0, 1])


def ranking_agreement(reference: np.ndarray, candidate: np.ndarray, groups: Sequence[Any]) -> float | None:
    """Mean over queries of the share of passage pairs the candidate orders as the reference does.

    ``groups`` names each sample's query; queries with one passage are not ranked. Pairs that the
    reference scores equal are left out. None when no query has two passages.
    """
    ref, cand = reference.ravel(), candidate.ravel()
    by_query: dict[Any, list[int]] = {}
    for i, g in enumerate(groups):
        by_query.setdefault(g, []).append(i)
    per_query = []
    for idx in by_query.values():
        if len(idx) < 2:
            continue
        r, c = ref[idx], cand[idx]
        dr = np.sign(r[:, None] - r[None, :])
        dc = np.sign(c[:, None] - c[None, :])
        upper = np.triu(np.ones(dr.shape, dtype=bool), k=1) & (dr != 0)
        if upper.any():
            per_query.append(float(np.mean(dr[upper] == dc[upper])) if np.isfinite(c).all() else 0.0)
    return float(np.mean(per_query)) if per_query else None


def task_metrics(reference: np.ndarray, candidate: np.ndarray, task: str, mask: np.ndarray | None = None,
                 groups: Sequence[Any] | None = None) -> tuple[str, float, float | None, float, tuple]:
    """``(metric, score, min_cosine, max_abs_error, extra)`` of ``candidate`` against ``reference``.

    ``mask`` ([samples, length], token classifiers) marks the real tokens; ``groups`` (rerankers) names the
    query of each sample. ``extra`` holds further gated metrics as ``(name, value)`` pairs.
    """
    if reference.shape != candidate.shape:
        raise FactoryError(f"the reduced-precision model's output has shape {candidate.shape}, FP32 gives "
                           f"{reference.shape}. Fix: this is a conversion bug; keep this precision out of the recipe")
    if task == "token-classification" and mask is not None and reference.ndim == 3:
        real = np.asarray(mask).astype(bool)
        ref_t, cand_t = reference[real], candidate[real]  # [real tokens, labels]
        max_abs = float(np.max(np.abs(ref_t - cand_t))) if ref_t.size else 0.0
        if not np.isfinite(cand_t).all():
            max_abs = float("inf")
        agree = float(np.mean(np.argmax(ref_t, axis=-1) == np.argmax(cand_t, axis=-1))) if ref_t.size else 1.0
        cos = _cosines(ref_t, cand_t)
        return "token_top1", agree, float(np.min(cos)) if cos.size else None, max_abs, ()
    max_abs = float(np.max(np.abs(reference - candidate))) if reference.size else 0.0
    if not np.isfinite(candidate).all():
        max_abs = float("inf")
    if task == "reranker":
        corr = score_correlation(reference, candidate)
        ranking = ranking_agreement(reference, candidate, groups) if groups is not None else None
        if ranking is None:  # no query with two passages: only the correlation can be scored
            return "correlation", corr, None, max_abs, ()
        return "ranking", ranking, None, max_abs, (("correlation", corr),)
    ref = reference.reshape(reference.shape[0], -1)
    cand = candidate.reshape(candidate.shape[0], -1)
    cos = _cosines(ref, cand)
    if task == "classification":
        agree = float(np.mean(np.argmax(ref, axis=-1) == np.argmax(cand, axis=-1)))
        return "top1", agree, float(np.min(cos)), max_abs, (("logits_cosine", float(np.mean(cos))),)
    return "cosine", float(np.mean(cos)), float(np.min(cos)), max_abs, ()


def compare(reference: np.ndarray, candidate: np.ndarray, task: str) -> tuple[str, float, float | None, float]:
    """``(metric, score, min_cosine, max_abs_error)`` of ``candidate`` against ``reference`` (see task_metrics)."""
    return task_metrics(reference, candidate, task)[:4]


class Evaluator:
    """Scores models against FP32 on one fixed feed set; the FP32 outputs are computed once.

    ``groups`` (rerankers) names the query of each sample, for the ranking agreement; token classifiers
    are scored on the tokens the feeds' ``attention_mask`` marks.
    """

    def __init__(self, reference_session: Any, feeds: Feeds, task: str, output: str,
                 groups: Sequence[Any] | None = None) -> None:
        self.feeds = feeds
        self.task = task
        self.output = output
        self.groups = list(groups) if groups is not None else None
        self.mask = feeds.get("attention_mask") if task == "token-classification" else None
        self.reference = run_outputs(reference_session, feeds, output)

    @property
    def samples(self) -> int:
        return int(self.reference.shape[0])

    def score(self, session: Any, precision: str, extra_feeds: Feeds | None = None, **extra: Any) -> PrecisionAccuracy:
        got = run_outputs(session, self.feeds, self.output, extra_feeds=extra_feeds)
        metric, score, min_cos, max_abs, more = task_metrics(self.reference, got, self.task, self.mask, self.groups)
        return PrecisionAccuracy(precision, metric, score, max_abs, self.samples, min_cos, extra=more, **extra)


def check_gate(report: AccuracyReport, report_path: Path, details: str = "") -> None:
    """Raise :class:`AccuracyGateError` with the rendered report (and ``details``) when a precision misses the gate."""
    if report.passed:
        return
    worst = ", ".join(f"{r.precision} {r.gate_score:.5f}" for r in report.failures)
    where = f"{details}\n" if details else ""
    raise AccuracyGateError(
        f"accuracy gate failed: {worst} below quantization.min_accuracy {report.min_accuracy:g} "
        f"(report: {report_path}).\n{report.render()}\n{where}Fix: enable quantization.mixed_precision, try "
        "quantization.method = \"percentile\" or \"entropy\", give more representative calibration data, or drop "
        "the failing precision from the recipe", report, report_path)
