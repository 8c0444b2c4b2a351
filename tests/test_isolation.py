"""Build stages in a child process: progress, results and errors come back; a dead child is named."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from model_factory.errors import FactoryError
from model_factory.isolation import run_isolated


def _stage(n: int, progress=None) -> dict:
    progress(f"working on {n}")
    return {"pid": os.getpid(), "double": 2 * n, "path": Path("/x")}


def _failing_stage(progress=None) -> None:
    progress("about to fail")
    raise FactoryError("the model is wrong. Fix: give another one")


def _dying_stage(progress=None) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _gate_failure(tmp: Path, progress=None) -> None:
    from model_factory.build_engines.accuracy import AccuracyGateError, AccuracyReport

    report = AccuracyReport("m", "embedding", "embedding", "held.txt", 4, "note", None, 0, None, 0, 0.99)
    raise AccuracyGateError("accuracy gate failed", report, tmp / "accuracy.json")


def test_a_stage_runs_in_another_process_and_reports_back() -> None:
    said: list[str] = []
    out = run_isolated(_stage, 21, progress=said.append)
    assert out["double"] == 42 and out["path"] == Path("/x") and out["pid"] != os.getpid()
    assert said == ["working on 21"]


def test_errors_come_back_as_raised(tmp_path: Path) -> None:
    said: list[str] = []
    with pytest.raises(FactoryError, match="the model is wrong. Fix: give another one"):
        run_isolated(_failing_stage, progress=said.append)
    assert said == ["about to fail"]
    from model_factory.build_engines.accuracy import AccuracyGateError

    with pytest.raises(AccuracyGateError) as info:  # with its report, as the CLI prints it
        run_isolated(_gate_failure, tmp_path)
    assert info.value.report.model == "m" and info.value.report_path == tmp_path / "accuracy.json"


def test_a_killed_stage_is_a_clean_error() -> None:
    with pytest.raises(FactoryError, match=r"the export stage process ended without a result \(killed by SIGKILL, "
                                           r"most likely because the system ran out of memory\)\. Fix: free memory"):
        run_isolated(_dying_stage, what="export stage")
