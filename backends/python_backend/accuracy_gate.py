"""The gate a degrade precision passed: a precision's verdict read from the version's ``accuracy.json``.

Packaging refuses a ``degrade_to`` whose precision failed its gate, and the backend's degrade path
(``operations/degrade.py``) and acceptance read the same verdict here. Standard library only, beside
``contract.py`` (whose file names it uses): copied into every model version and run inside Triton's stub.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from .contract import Files

__all__ = ["DegradeRefused", "Gate", "read_gate"]


class DegradeRefused(ValueError):
    """The degrade precision cannot be used (not packaged, failed its gate, no gate): one line saying why."""


@dataclass(frozen=True)
class Gate:
    """One precision's verdict in the version's gate report."""

    precision: str
    metric: str
    score: float  # the gate score: the worst of the precision's metrics
    min_accuracy: float

    @property
    def passed(self) -> bool:
        return math.isfinite(self.score) and self.score >= self.min_accuracy


def _number(value: Any) -> float:
    try:
        return float(value)  # "nan" / "inf" as accuracy.json writes non-finite numbers
    except (TypeError, ValueError):
        return float("nan")


def read_gate(report_text: str | bytes | None, precision: str) -> Gate:
    """``precision``'s gate verdict from ``accuracy.json``'s text; :class:`DegradeRefused` when it did not pass.

    Refused: no report, a report that does not parse, no gate (``min_accuracy`` unset), no row for the
    precision, or a score below the gate (a row's own ``passed: false`` too, as a text-generation report says).
    """
    where = f"{Files.ACCURACY} of the version"
    if report_text is None:
        raise DegradeRefused(f"cannot degrade to {precision}: the version has no {Files.ACCURACY} (no gate result "
                             "to check). Fix: rebuild with the quantize stage's gate, or remove degrade_to")
    try:
        report = json.loads(report_text)
        rows = [r for r in report.get("results", ()) if isinstance(r, dict) and r.get("precision") == precision]
    except (ValueError, AttributeError, TypeError) as exc:
        raise DegradeRefused(f"cannot degrade to {precision}: {where} does not parse ({exc})") from None
    gate = report.get("min_accuracy")
    if gate is None:
        raise DegradeRefused(f"cannot degrade to {precision}: {where} has no gate (quantization.min_accuracy unset), "
                             "so nothing says it is good enough. Fix: set min_accuracy and rebuild, or remove "
                             "degrade_to")
    if not rows:
        raise DegradeRefused(f"cannot degrade to {precision}: {where} has no result for it. Fix: add {precision!r} "
                             "to precisions and rebuild")
    row = rows[0]
    values = [_number(row.get("score"))] + [_number(v) for v in dict(row.get("extra") or {}).values()]
    score = float("nan") if any(v != v for v in values) else min(values)
    result = Gate(precision, str(row.get("metric", "score")), score, _number(gate))
    if not result.passed or row.get("passed") is False:
        raise DegradeRefused(f"cannot degrade to {precision}: it failed its accuracy gate ({result.metric} "
                             f"{result.score:.6g} < min_accuracy {result.min_accuracy:g}); a precision that "
                             "failed its gate never answers. Fix: remove degrade_to, or fix the quantization "
                             "and rebuild")
    return result
