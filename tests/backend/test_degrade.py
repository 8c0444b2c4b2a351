"""Degrade before shedding (backend degrade.py): the gate check, the per-window decision, what a response says."""

from __future__ import annotations

import json

import numpy as np
import pytest

from model_factory.backend.contract import ModelParameters, format_parameters, parse_parameters
from model_factory.backend.operations.degrade import (Degrader, DegradePolicy, DegradeRefused, decide, precision_column,
                                           read_gate)


def _report(min_accuracy=0.99, **rows) -> str:
    results = [{"precision": p, "metric": "cosine", "score": s, "extra": {}} for p, s in rows.items()]
    return json.dumps({"min_accuracy": min_accuracy, "results": results})


def test_a_precision_that_passed_its_gate_is_allowed_with_its_score():
    gate = read_gate(_report(fp16=0.99999, int8=0.9952), "int8")
    assert gate.passed and gate.score == pytest.approx(0.9952) and gate.min_accuracy == 0.99


@pytest.mark.parametrize("text, why", [
    (_report(int8=0.95), "failed its accuracy gate (cosine 0.95 < min_accuracy 0.99)"),
    (_report(int8="nan"), "failed its accuracy gate"),
    (_report(min_accuracy=None, int8=0.999), "has no gate"),
    (_report(fp16=0.9999), "has no result for it"),
    (None, "has no accuracy.json"),
    ("{not json", "does not parse"),
])
def test_a_precision_without_a_passed_gate_is_refused_in_one_line(text, why):
    with pytest.raises(DegradeRefused) as exc:
        read_gate(text, "int8")
    assert why in str(exc.value) and "\n" not in str(exc.value)
    assert str(exc.value).startswith("cannot degrade to int8")


def test_the_worst_metric_and_a_rows_own_verdict_count():
    extra = json.dumps({"min_accuracy": 0.9, "results": [
        {"precision": "int8", "metric": "top1", "score": 0.99, "extra": {"logits_cosine": 0.5}}]})
    with pytest.raises(DegradeRefused, match="0.5 < min_accuracy 0.9"):
        read_gate(extra, "int8")
    said_failed = json.dumps({"min_accuracy": 0.9, "results": [{"precision": "int8", "score": 0.95,
                                                                 "passed": False}]})
    with pytest.raises(DegradeRefused, match="failed its accuracy gate"):
        read_gate(said_failed, "int8")


def test_a_window_degrades_from_its_backlog_on():
    policy = DegradePolicy.of("int8", 0, 64)
    assert policy.backlog == 32  # 0: half of max_batch_size
    assert [decide(policy, n) for n in (1, 31, 32, 64)] == [False, False, True, True]
    assert not decide(None, 64)  # degrading off
    assert DegradePolicy.of("int8", 5, 64).backlog == 5
    assert DegradePolicy.of("int8", 0, 2).backlog == 2  # a lone request is never a backlog
    # Triton's batcher stops a window at a preferred batch size: half of the largest one.
    assert DegradePolicy.of("int8", 0, 64, (8, 16)).backlog == 8
    with pytest.raises(DegradeRefused, match="use one of"):
        DegradePolicy.of("int3", 0, 64)


def test_the_degrader_picks_the_executor_and_the_precision_that_answers():
    primary, cheap = object(), object()
    d = Degrader(DegradePolicy("int8", 4), engine=None, executor=cheap, gate=None, info={})
    assert d.choose(primary, "fp32", 3) == (primary, "fp32")
    assert d.choose(primary, "fp32", 4) == (cheap, "int8")


def test_the_precision_output_is_one_bytes_element_per_row():
    col = precision_column("int8", 3)
    assert col.shape == (3, 1) and col.dtype == np.object_ and col[2, 0] == b"int8"


def test_the_parameters_round_trip_and_are_off_by_default():
    assert parse_parameters({}).degrade_to is None
    assert "degrade_to" not in format_parameters(ModelParameters())
    p = parse_parameters(format_parameters(ModelParameters(degrade_to="int8", degrade_backlog=8)))
    assert (p.degrade_to, p.degrade_backlog) == ("int8", 8)
