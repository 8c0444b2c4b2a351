"""The shadow mirror's scoring and tallies (the BLS path runs on the real server: tests/integration/test_rollout_serving.py)."""

from __future__ import annotations

import json

import numpy as np

from model_factory.backend.operations.shadow import Tally, agreement, control_path, tally_path


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

    code = ("import os, sys; from model_factory.backend.operations.shadow import yield_cores_if_candidate as y; "
            "print(y(sys.argv[1]), os.nice(0))")
    import os

    for name, want in (("minilm__candidate", "True 19"), ("minilm", f"False {os.nice(0)}")):  # as inherited
        out = subprocess.run([sys.executable, "-c", code, name], capture_output=True, text=True, check=True)
        assert out.stdout.split() == want.split(), (name, out.stdout, out.stderr)


def test_token_agreement_counts_the_same_tokens_from_the_first_over_the_longer_continuation() -> None:
    from model_factory.backend.operations.shadow import token_agreement

    assert token_agreement([5, 6, 7, 8], np.array([5, 6, 7, 8], dtype=np.int32)) == 1.0
    assert token_agreement([], []) == 1.0
    assert token_agreement([5, 6, 7, 8], [5, 6, 9, 8]) == 0.5  # departs at the third: the fourth does not count
    assert token_agreement([5, 6], [5, 6, 7, 8]) == 0.5  # the candidate went on where the served one stopped
    assert token_agreement([5, 6, 7, 8], [5]) == 0.25
    assert token_agreement([1, 2], [3, 2]) == 0.0


def test_a_generate_request_read_back_from_its_mirrored_inputs_is_the_same_request() -> None:
    from model_factory.backend.contract import GenerationSpec
    from model_factory.backend.generation.requests import read_generate_request, request_inputs

    spec = GenerationSpec(family="llama", num_layers=1, num_attention_heads=1, num_kv_heads=1, head_dim=4,
                          hidden_size=4, vocab_size=100, max_context=64, eos_token_ids=(2,))
    sent = {"prompt_ids": np.array([3, 4, 5], dtype=np.int32), "max_tokens": np.array([7], dtype=np.int32),
            "temperature": np.array([0.7], dtype=np.float32), "seed": np.array([11], dtype=np.int64),
            "top_k": np.array([5], dtype=np.int32), "stop": np.array([b"END", b"\n\n"], dtype=np.object_),
            "repetition_penalty": np.array([1.2], dtype=np.float32), "stream": np.array([True])}
    req = read_generate_request(sent.get, None, spec, 64)
    again = read_generate_request(request_inputs(req).get, None, spec, 64)
    assert again.prompt_ids == req.prompt_ids and again.params == req.params
    assert req.stream and not again.stream  # mirrored as one non-streamed request
    import json

    sent["sampling_parameters"] = np.array([json.dumps({"presence_penalty": 0.5, "frequency_penalty": -1,
                                                        "logit_bias": {"7": 3}, "stop_token_ids": [9]}).encode()],
                                           dtype=np.object_)
    req = read_generate_request(sent.get, None, spec, 64)
    again = read_generate_request(request_inputs(req).get, None, spec, 64)
    assert again.params == req.params and req.params.logit_bias == ((7, 3.0),)
