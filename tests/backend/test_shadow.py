"""The shadow mirror's scoring and tallies (the BLS path runs on the real server: tests/integration/test_rollout_serving.py)."""

from __future__ import annotations

import json

import numpy as np

from model_factory.backend.shadow import Tally, agreement, control_path, tally_path


def test_identical_outputs_agree_fully_and_integer_outputs_are_not_scored() -> None:
    emb = np.random.default_rng(0).normal(size=(3, 8)).astype(np.float32)
    served = {"embeddings": emb, "truncated_tokens": np.array([0, 1, 0])}
    assert agreement(served, {"embeddings": emb.copy(), "truncated_tokens": np.array([5, 5, 5])}) == 1.0


def test_the_lowest_row_cosine_is_the_score() -> None:
    a = np.array([[1.0, 0.0], [0.0, 1.0]], dtype=np.float32)
    b = np.array([[1.0, 0.0], [1.0, 1.0]], dtype=np.float32)  # second row at 45 degrees
    assert abs(agreement({"e": a}, {"e": b}) - np.cos(np.pi / 4)) < 1e-6


def test_a_missing_wrongly_shaped_or_non_finite_candidate_output_scores_0() -> None:
    a = np.ones((1, 4), dtype=np.float32)
    assert agreement({"e": a}, {}) == 0.0
    assert agreement({"e": a}, {"e": np.ones((1, 5), dtype=np.float32)}) == 0.0
    assert agreement({"e": a}, {"e": np.array([[1, np.nan, 1, 1]], dtype=np.float32)}) == 0.0


def test_classification_also_needs_the_same_top_1() -> None:
    served = {"logits": np.array([[2.0, 1.9]], dtype=np.float32)}
    flipped = {"logits": np.array([[1.9, 2.0]], dtype=np.float32)}  # cosine ~1, top-1 differs
    assert agreement(served, flipped) > 0.99
    assert agreement(served, flipped, classification=True) == 0.0


def test_a_tally_keeps_the_five_worst_by_input_hash_and_counts_errors(tmp_path) -> None:
    t = Tally("r1")
    for i, score in enumerate([0.9, 0.2, 1.0, 0.5, 0.7, 0.1, 0.95]):
        t.add(score, f"h{i}")
    t.add(0.0, "herr", error="RuntimeError: boom")
    d = t.to_dict()
    assert d["mirrored"] == 8 and d["errors"] == 1 and d["min_score"] == 0.0
    assert [w["input_hash"] for w in d["worst"]] == ["herr", "h5", "h1", "h3", "h4"]
    assert tally_path(tmp_path, "m", "m_0/0").name == "m.m_0_0.tally.json"  # no path separator from a name
    assert control_path(tmp_path, "m").name == "m.json"
    json.dumps(d)


def test_a_candidate_stub_runs_at_the_lowest_cpu_priority_and_a_served_one_does_not() -> None:
    import subprocess
    import sys

    code = ("import os, sys; from model_factory.backend.shadow import yield_cores_if_candidate as y; "
            "print(y(sys.argv[1]), os.nice(0))")
    import os

    for name, want in (("minilm__candidate", "True 19"), ("minilm", f"False {os.nice(0)}")):  # as inherited
        out = subprocess.run([sys.executable, "-c", code, name], capture_output=True, text=True, check=True)
        assert out.stdout.split() == want.split(), (name, out.stdout, out.stderr)
