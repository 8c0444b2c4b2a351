"""The accuracy report: metrics, JSON round trip, rendering and the gate."""

from __future__ import annotations

import json

import numpy as np
import pytest

from model_factory.build_engines.accuracy import (
    AccuracyGateError,
    AccuracyReport,
    PrecisionAccuracy,
    check_gate,
    compare,
    primary_output,
    ranking_agreement,
    score_correlation,
    task_metrics,
)
from model_factory.errors import FactoryError


def _report(min_accuracy=0.99, int8_score=0.995):
    return AccuracyReport(
        model="m", task="embedding", output="embedding", heldout_source="/data/h.txt", heldout_samples=40,
        heldout_note="held-out file h.txt", calibration_source="/data/c.txt", calibration_samples=100,
        calibration_method="minmax", overlap=0, min_accuracy=min_accuracy,
        results=(PrecisionAccuracy("fp16", "cosine", 0.99999, 1e-4, 40, 0.9999),
                 PrecisionAccuracy("int8", "cosine", int8_score, 0.03, 40, 0.98,
                                   float_nodes=("/layer.0/output/dense/MatMul",), int8_nodes=47, candidates=48)),
        search=({"step": "all int8", "score": 0.98},))


def test_cosine_metrics():
    ref = np.array([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
    cand = np.array([[1.0, 0.0], [0.0, -2.0], [1.0, 1.1]])
    metric, score, min_cos, max_abs = compare(ref, cand, "embedding")
    per = [1.0, -1.0, 2.1 / (np.sqrt(2) * np.sqrt(1 + 1.21))]
    assert metric == "cosine"
    assert score == pytest.approx(np.mean(per))
    assert min_cos == pytest.approx(-1.0)
    assert max_abs == pytest.approx(4.0)


def test_cosine_flattens_each_sample():
    ref = np.ones((2, 3, 4))
    metric, score, min_cos, max_abs = compare(ref, ref.copy(), "generic")
    assert (metric, score, min_cos, max_abs) == ("cosine", pytest.approx(1.0), pytest.approx(1.0), 0.0)


def test_top1_agreement_for_classifiers():
    ref = np.array([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7], [0.6, 0.4]])
    cand = np.array([[0.2, 0.8], [0.4, 0.6], [0.3, 0.7], [0.9, 0.1]])
    metric, score, min_cos, max_abs, extra = task_metrics(ref, cand, "classification")
    assert (metric, score) == ("top1", 0.75)
    assert max_abs == pytest.approx(0.4)
    # The cosine of the logits is reported and gated beside the top-1 agreement.
    cos = (ref * cand).sum(1) / (np.linalg.norm(ref, axis=1) * np.linalg.norm(cand, axis=1))
    assert dict(extra) == {"logits_cosine": pytest.approx(cos.mean())} and min_cos == pytest.approx(cos.min())


def test_gate_applies_to_every_metric_of_a_classifier(tmp_path):
    # Top-1 agrees everywhere but the logits drifted: the cosine alone fails the gate.
    result = PrecisionAccuracy("int8", "top1", 1.0, 0.5, 10, 0.9, extra=(("logits_cosine", 0.95),))
    report = AccuracyReport("m", "classification", "logits", "h", 10, "n", None, 0, None, 0, 0.99, (result,))
    assert report.failures == (result,) and result.gate_score == 0.95
    text = report.render()
    assert "top-1 agree" in text and "logits cos" in text and "FAIL" in text
    again = AccuracyReport.read(report.write(tmp_path / "a.json"))
    assert again.results[0].extra == (("logits_cosine", 0.95),) and not again.passed


def test_token_top1_counts_real_tokens_only():
    ref = np.zeros((2, 3, 2))
    ref[..., 0] = 1.0  # label 0 everywhere
    cand = ref.copy()
    cand[0, 1] = [0.0, 1.0]  # a real token flips
    cand[1, 2] = [0.0, 9.0]  # a padding token flips: not counted
    mask = np.array([[1, 1, 1], [1, 1, 0]])
    metric, score, _min_cos, max_abs, extra = task_metrics(ref, cand, "token-classification", mask=mask)
    assert (metric, extra) == ("token_top1", ())
    assert score == pytest.approx(4 / 5) and max_abs == pytest.approx(1.0)


def test_reranker_ranking_per_query_and_correlation():
    ref = np.array([[3.0], [2.0], [1.0], [5.0], [4.0], [0.5]])
    cand = np.array([[3.1], [0.9], [1.0], [5.0], [4.2], [0.1]])  # query a: one of 3 pairs swapped
    groups = ["a", "a", "a", "b", "b", "c"]  # c has one passage: not ranked
    metric, score, min_cos, _max_abs, extra = task_metrics(ref, cand, "reranker", groups=groups)
    assert metric == "ranking" and min_cos is None
    assert score == pytest.approx((2 / 3 + 1.0) / 2)
    assert dict(extra)["correlation"] == pytest.approx(np.corrcoef(ref.ravel(), cand.ravel())[0, 1])
    assert ranking_agreement(ref, ref, groups) == 1.0 and ranking_agreement(ref, ref, list("abcdef")) is None
    assert score_correlation(ref, np.full_like(ref, np.nan)) == -1.0


def test_non_finite_output_scores_badly():
    ref = np.ones((2, 3))
    cand = np.array([[1.0, 1.0, 1.0], [np.nan, 1.0, 1.0]])
    _metric, score, min_cos, max_abs = compare(ref, cand, "embedding")
    assert min_cos == -1.0 and score < 0.5 and max_abs == float("inf")


def test_shape_mismatch_is_an_error():
    with pytest.raises(FactoryError, match="shape"):
        compare(np.ones((2, 3)), np.ones((2, 4)), "embedding")


def test_primary_output():
    assert primary_output("embedding", ["last_hidden_state", "embedding"]) == "embedding"
    assert primary_output("classification", ["logits", "embedding"]) == "logits"
    assert primary_output("embedding", ["out"]) == "out"
    assert primary_output("token-classification", ["logits", "probabilities"]) == "logits"
    assert primary_output("reranker", ["score"]) == "score"
    assert primary_output("generic", ["y", "logits"]) == "y"  # a generic model is scored on its first output


def test_report_round_trips_through_json(tmp_path):
    report = _report()
    path = report.write(tmp_path / "accuracy.json")
    data = json.loads(path.read_text())
    assert data["passed"] is True
    assert data["results"][1]["float_nodes"] == ["/layer.0/output/dense/MatMul"]
    back = AccuracyReport.read(path)
    assert back == report
    assert back.result("int8").float_nodes == ("/layer.0/output/dense/MatMul",)
    assert path.stat().st_mode & 0o044  # readable by others


def test_render_shows_scores_kept_nodes_and_gate():
    text = _report().render()
    for needle in ("fp16", "0.999990", "int8", "0.995000", "47/48", "pass", "kept in float (1)",
                   "/layer.0/output/dense/MatMul", "overlap with held-out: 0", "min_accuracy 0.99 -> passed"):
        assert needle in text, needle


def test_gate_passes_without_threshold_and_above_it(tmp_path):
    check_gate(_report(min_accuracy=None, int8_score=0.5), tmp_path / "a.json")
    check_gate(_report(min_accuracy=0.99, int8_score=0.99), tmp_path / "a.json")


def test_gate_failure_carries_the_rendered_report(tmp_path):
    report = _report(min_accuracy=0.999, int8_score=0.995)
    assert not report.passed and [r.precision for r in report.failures] == ["int8"]
    with pytest.raises(AccuracyGateError) as exc:
        check_gate(report, tmp_path / "accuracy.json")
    msg = str(exc.value)
    assert isinstance(exc.value, FactoryError)
    assert "int8 0.99500 below quantization.min_accuracy 0.999" in msg
    assert "FAIL" in msg and "Accuracy of m vs FP32" in msg and str(tmp_path / "accuracy.json") in msg
    assert exc.value.report is report


def test_non_finite_numbers_stay_valid_json(tmp_path):
    report = AccuracyReport("m", "embedding", "embedding", "h", 2, "n", None, 0, None, 0, 0.99,
                            (PrecisionAccuracy("fp16", "cosine", float("nan"), float("inf"), 2, -1.0),))
    path = report.write(tmp_path / "accuracy.json")
    data = json.loads(path.read_text())  # strict JSON: no bare NaN/Infinity
    assert data["results"][0]["max_abs_error"] == "inf" and data["passed"] is False
    back = AccuracyReport.read(path).result("fp16")
    assert back.max_abs_error == float("inf") and np.isnan(back.score)


def test_unreadable_report(tmp_path):
    p = tmp_path / "accuracy.json"
    p.write_text("{")
    with pytest.raises(FactoryError, match="re-run the quantize stage"):
        AccuracyReport.read(p)


def test_rendered_report_has_no_trailing_spaces():
    """The report goes into build logs: no line padded out to the table's width."""
    assert all(line == line.rstrip() for line in _report().render().splitlines())
