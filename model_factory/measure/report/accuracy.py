"""Section "accuracy": every precision against FP32 and the gate, and for INT8 the layers kept in float.

Read from the version's ``accuracy.json`` (written by the quantize stage,
``build_engines/quantize.py``): ``results`` per precision, and ``search``, the steps of
the mixed-precision search — the sensitivity of every candidate (the score gained when
that node alone runs in float), then the nodes kept in float one at a time with the
score after each, then those given back to INT8.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping

from model_factory.measure.report import plots
from model_factory.measure.report.release import Release

ACCURACY_FILE = "accuracy.json"
SENSITIVITY_SHOWN = 14  # the most sensitive nodes drawn; the table lists every kept one

METRIC_LABELS = {"cosine": "mean cosine", "top1": "top-1 agreement", "token_top1": "token top-1 agreement",
                 "ranking": "ranking agreement", "token_agreement": "greedy token agreement"}


@dataclass(frozen=True)
class PrecisionRow:
    precision: str
    metric: str
    score: float
    min_cosine: float | None
    max_abs_error: float
    samples: int
    passed: bool | None  # None without a gate
    int8_nodes: int
    candidates: int
    extra: tuple[tuple[str, float], ...]
    kv_cache: str = "float"  # a text-generation graph's KV cache: "int8" with quantization.kv_cache = "int8"


@dataclass(frozen=True)
class KeptNode:
    """A node the INT8 search kept in float, and what keeping it bought."""

    node: str
    sensitivity: float | None  # score gained with this node alone in float (search set)
    score_after: float | None  # the search's score once it was kept (cumulative)
    step_gain: float | None  # that score minus the score before it was kept


@dataclass(frozen=True)
class Accuracy:
    present: bool
    gate: float | None = None
    passed: bool | None = None
    heldout: str = ""
    heldout_samples: int = 0
    calibration: str | None = None
    calibration_samples: int = 0
    calibration_method: str | None = None
    scoring: str = ""
    rows: tuple[PrecisionRow, ...] = ()
    kept: tuple[KeptNode, ...] = ()
    given_back: tuple[str, ...] = ()
    search_target: float | None = None
    search_set: str | None = None
    all_int8_score: float | None = None
    candidates: int = 0
    sensitivities: tuple[tuple[str, float], ...] = ()  # every candidate, most sensitive first
    score_plot: str | None = None
    sensitivity_plot: str | None = None


def _num(value: Any) -> float:
    return float(value) if not isinstance(value, str) else float(value)  # "nan"/"inf" strings read back


def short_node(name: str) -> str:
    """A node name without the exporter's common prefix and the op suffix (for plot labels)."""
    out = name
    for prefix in ("/model/encoder/", "/model/", "/"):
        if out.startswith(prefix):
            out = out[len(prefix):]
            break
    return out.rsplit("/", 1)[0] if out.count("/") > 1 else out


def _search(report: Mapping[str, Any]) -> dict[str, Any]:
    steps = list(report.get("search") or ())
    out: dict[str, Any] = {"gain": {}, "kept": [], "back": [], "target": None, "set": None, "all": None}
    previous = None
    for s in steps:
        kind = s.get("step")
        if kind == "search":
            out["target"], out["set"] = s.get("target"), s.get("scored_on")
        elif kind == "all int8":
            out["all"] = previous = _num(s["score"])
        elif kind == "sensitivity":
            out["gain"] = {str(k): _num(v) for k, v in (s.get("gain") or {}).items()}
        elif kind == "keep in float":
            score = _num(s["score"])
            out["kept"].append((str(s["node"]), score, None if previous is None else score - previous))
            previous = score
        elif kind == "back to int8":
            out["back"].append(str(s["node"]))
    return out


def collect(release: Release) -> Accuracy:
    """Read the section from ``accuracy.json``; ``present`` is False when the version has none."""
    report = release.read_json(ACCURACY_FILE)
    if not report or not report.get("results"):
        return Accuracy(present=False)
    gate = report.get("min_accuracy")
    rows = []
    for r in report["results"]:
        extra = tuple((str(k), _num(v)) for k, v in (r.get("extra") or {}).items())
        score = _num(r["score"])
        worst = min([score] + [v for _, v in extra])
        rows.append(PrecisionRow(
            precision=r["precision"], metric=r.get("metric", "cosine"), score=score,
            min_cosine=None if r.get("min_cosine") is None else _num(r["min_cosine"]),
            max_abs_error=_num(r.get("max_abs_error", math.nan)), samples=int(r.get("samples", 0)),
            # A text-generation row carries its own verdict (two gates: agreement and perplexity ratio).
            passed=bool(r["passed"]) if "passed" in r else (None if gate is None else bool(worst >= gate)),
            int8_nodes=int(r.get("int8_nodes", 0)),
            candidates=int(r.get("candidates", 0)), extra=extra, kv_cache=str(r.get("kv_cache") or "float")))
    search = _search(report)
    int8 = next((r for r in report["results"] if r["precision"] == "int8"), None)
    final_float = list(int8.get("float_nodes") or ()) if int8 else []
    steps = {n: (score, gain) for n, score, gain in search["kept"]}
    kept = tuple(KeptNode(n, search["gain"].get(n), *steps.get(n, (None, None))) for n in final_float)
    acc = Accuracy(
        present=True, gate=gate, passed=report.get("passed"), heldout=str(report.get("heldout_note") or ""),
        heldout_samples=int(report.get("heldout_samples", 0)), calibration=report.get("calibration_source"),
        calibration_samples=int(report.get("calibration_samples", 0)),
        calibration_method=report.get("calibration_method"), scoring=str(report.get("scoring") or ""),
        rows=tuple(rows), kept=kept, given_back=tuple(search["back"]), search_target=search["target"],
        search_set=search["set"], all_int8_score=search["all"],
        candidates=int(int8.get("candidates", 0)) if int8 else 0,
        sensitivities=tuple(sorted(search["gain"].items(), key=lambda kv: -kv[1])))
    return dataclasses.replace(acc, score_plot=score_plot(acc),
                               sensitivity_plot=sensitivity_plot(acc) if acc.sensitivities else None)


def score_plot(acc: Accuracy) -> str:
    """Each precision's score (dot) and worst sample (bar end) against the gate (line)."""
    rows = list(acc.rows)
    with plots.figure(8.0, 0.55 + 0.45 * len(rows)) as (fig, ax):
        lows = [r.min_cosine if r.min_cosine is not None else r.score for r in rows]
        floor = min(lows + ([acc.gate] if acc.gate is not None else []))
        span = max(1.0 - floor, 1e-4)
        left = max(floor - 0.25 * span, 0.0)
        ys = list(range(len(rows)))[::-1]
        for y, r, low in zip(ys, rows, lows):
            color = plots.COLORS[0] if r.passed is not False else plots.GATE_COLOR
            ax.plot([low, r.score], [y, y], color=color, linewidth=4, alpha=0.35, solid_capstyle="butt")
            ax.plot([r.score], [y], "o", color=color, markersize=7)
            ax.annotate(f"{r.score:.5f}", (r.score, y), xytext=(0, 7), textcoords="offset points", ha="center",
                        fontsize=8)
        if acc.gate is not None:
            ax.axvline(acc.gate, color=plots.GATE_COLOR, linestyle="--", linewidth=1.2)
            ax.annotate(f"gate {acc.gate:g}", (acc.gate, 1.0), xycoords=("data", "axes fraction"), xytext=(3, -10),
                        textcoords="offset points", color=plots.GATE_COLOR, fontsize=8)
        ax.set_yticks(ys, [r.precision.upper() + (" (KV INT8)" if r.kv_cache == "int8" else "") for r in rows])
        ax.set_xlim(left, 1.0 + 0.05 * span)
        ax.set_ylim(-0.7, len(rows) - 0.3)
        metric = METRIC_LABELS.get(rows[0].metric, rows[0].metric) if rows else "score"
        ax.set_xlabel(f"{metric} vs FP32 on {acc.heldout_samples} held-out samples (bar: worst sample)")
        ax.set_title("Accuracy per precision against the gate")
        return plots.to_svg(fig, "accuracy per precision against the gate")


def sensitivity_plot(acc: Accuracy) -> str:
    """The most sensitive INT8 candidates (score gained with the node alone in float); kept ones marked."""
    kept = {k.node for k in acc.kept}
    shown = list(acc.sensitivities[:SENSITIVITY_SHOWN])
    with plots.figure(8.0, 0.7 + 0.2 * len(shown)) as (fig, ax):
        ys = list(range(len(shown)))[::-1]
        colors = [plots.KEPT_COLOR if n in kept else plots.QUIET_COLOR for n, _ in shown]
        ax.barh(ys, [g for _, g in shown], color=colors, height=0.7)
        ax.set_yticks(ys, [short_node(n) + ("  (kept in float)" if n in kept else "") for n, _ in shown], fontsize=7.5)
        ax.set_xlabel("score gained with this node alone in float (search set)")
        ax.set_title(f"INT8 sensitivity: {len(shown)} most sensitive of {len(acc.sensitivities)} nodes")
        ax.grid(axis="y", visible=False)
        return plots.to_svg(fig, "INT8 sensitivity per layer")
