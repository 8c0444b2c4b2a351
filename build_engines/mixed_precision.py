"""Automatic mixed precision: which INT8 candidates to keep in float, searched on one switchable session."""

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

from model_factory.build_engines.accuracy import Evaluator, ort_session
from model_factory.build_engines.qdq import QdqBuilder, _save_beside
from model_factory.progress import Steps


class SwitchScorer:
    """Scores any INT8 subset through one switchable model and one ORT session."""

    def __init__(self, builder: QdqBuilder, evaluator: Evaluator, work: Path) -> None:
        model, self.switches = builder.build_switchable()
        path = work / "switchable.onnx"
        _save_beside(model, path)
        del model
        self.session = ort_session(path, simulate_qdq=True)
        self.evaluator = evaluator
        self.calls = 0

    def __call__(self, int8_nodes: Iterable[str]) -> float:
        on = set(int8_nodes)
        flags = {sw: np.array(node in on) for node, sw in self.switches.items()}
        self.calls += 1
        return self.evaluator.score(self.session, "int8", extra_feeds=flags).gate_score


def search_mixed_precision(names: Sequence[str], score: Callable[[Iterable[str]], float], target: float,
                           say: Callable[[str], None] = lambda _m: None) -> tuple[list[str], list[dict[str, Any]]]:
    """The nodes to keep in float so that ``score`` (of the INT8 node set) meets ``target``.

    1. Sensitivity: for every node, the score with that node alone in float.
    2. Keep the most harmful node in float, re-score, and repeat until the target is met.
    3. Give back: every kept node that the target does not need returns to INT8 (least harmful first),
       so as many nodes as the target allows stay in INT8.

    Returns the float nodes (most harmful first) and the steps taken (for the report). When even all
    candidates in float miss the target, every node is returned and the gate decides.
    """
    names = list(names)
    steps: list[dict[str, Any]] = []
    current = score(names)
    steps.append({"step": "all int8", "float_nodes": 0, "score": current})
    if current >= target:
        return [], steps
    all_int8 = current
    say(f"all-INT8 scores {all_int8:.5f} < {target:g}: measuring the sensitivity of {len(names)} nodes")
    steps_done = Steps(say, "  sensitivity, nodes measured", len(names))
    gain = {}
    for n in names:
        gain[n] = score([x for x in names if x != n]) - all_int8
        steps_done.step()
    ranked = sorted(names, key=lambda n: (-gain[n], names.index(n)))
    steps.append({"step": "sensitivity", "gain": {n: gain[n] for n in ranked}})
    kept: list[str] = []
    for n in ranked:
        kept.append(n)
        current = score([x for x in names if x not in kept])
        steps.append({"step": "keep in float", "node": n, "float_nodes": len(kept), "score": current})
        say(f"  kept {n} in float: {current:.5f}")
        if current >= target:
            break
    if current < target:
        return kept, steps
    for n in sorted(kept, key=lambda n: gain[n]):
        trial = [x for x in kept if x != n]
        s = score([x for x in names if x not in trial])
        if s >= target:
            kept, current = trial, s
            steps.append({"step": "back to int8", "node": n, "float_nodes": len(kept), "score": s})
            say(f"  {n} back to INT8: {s:.5f}")
    return kept, steps


# --------------------------------------------------------------------------- the stage
