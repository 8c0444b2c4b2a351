"""Speculative decoding on the real Triton server: one tiny Llama served three times, ``speculative = "prompt_lookup"``,
off, and ``speculative = "draft"`` with its INT4 graph packaged beside the FP32 one (a recipe's ``[serving]``);
requests sent one at a time (speculation drafts while one sequence decodes) give the same tokens on all (greedy and
seeded), and the speculating models' metrics count their drafts and the tokens accepted."""

from __future__ import annotations

import json
import random
import time

import pytest

from tests.generative_repository import generate_ids, metric_sum, served_variants

pytestmark = pytest.mark.integration

SPECULATING, PLAIN, DRAFTING = "tiny_llm_speculating", "tiny_llm_plain", "tiny_llm_drafting"


@pytest.fixture(scope="module")
def server(tiny_llm, tmp_path_factory):
    hf, onnx_dir = tiny_llm
    with served_variants(hf, onnx_dir, tmp_path_factory.mktemp("speculative-repo"),
                         {SPECULATING: dict(memory_budget_mib=256, max_active_sequences=4,
                                            speculative="prompt_lookup", num_speculative_tokens=5),
                          PLAIN: dict(memory_budget_mib=256, max_active_sequences=4),
                          # Built from a recipe whose [serving] says speculative = "draft" with the int4 graph.
                          DRAFTING: dict(memory_budget_mib=256, max_active_sequences=4, draft="int4")}) as srv:
        yield srv


def test_requests_give_the_same_tokens_speculating_and_count_the_drafts(server):
    rng = random.Random(4)
    bodies = []
    for i in range(3):
        phrase = [rng.randrange(3, 2000) for _ in range(8)]
        prompt = phrase + [rng.randrange(3, 2000) for _ in range(16)] + phrase + phrase[:4]
        # A repetition penalty under 1 makes the random-weight model's output loop: prompt lookup drafts it.
        sampling = {"repetition_penalty": 0.7} if i < 2 else {"repetition_penalty": 0.5, "temperature": 0.2,
                                                               "seed": 3}
        bodies.append({"prompt_ids": prompt, "max_tokens": 40, "min_tokens": 40,
                       "sampling_parameters": json.dumps(sampling)})
    got = {model: [generate_ids(server, model, b) for b in bodies] for model in (SPECULATING, PLAIN)}
    assert got[SPECULATING] == got[PLAIN]
    assert all(len(ids) == 40 for ids in got[SPECULATING])
    deadline = time.monotonic() + 15  # the instance sends its metrics about once a second
    while time.monotonic() < deadline and metric_sum(server, "spec_decode_num_accepted_tokens_total", SPECULATING) < 1:
        time.sleep(0.5)
    drafted = metric_sum(server, "spec_decode_num_draft_tokens_total", SPECULATING)
    accepted = metric_sum(server, "spec_decode_num_accepted_tokens_total", SPECULATING)
    assert 0 < accepted <= drafted and metric_sum(server, "spec_decode_num_drafts_total", SPECULATING) >= 1
    assert metric_sum(server, "spec_decode_num_draft_tokens_total", PLAIN) == 0


def test_a_draft_graph_packaged_beside_the_served_one_drafts_and_the_tokens_are_plain_decodings(server):
    rng = random.Random(8)
    bodies = [{"prompt_ids": [rng.randrange(3, 2000) for _ in range(rng.randrange(6, 30))], "max_tokens": 24,
               "min_tokens": 24, "sampling_parameters": json.dumps(sampling)}
              for sampling in ({}, {}, {"temperature": 0.7, "seed": 5})]
    got = {model: [generate_ids(server, model, b) for b in bodies] for model in (DRAFTING, PLAIN)}
    assert got[DRAFTING] == got[PLAIN]
    deadline = time.monotonic() + 15  # the instance sends its metrics about once a second
    while time.monotonic() < deadline and metric_sum(server, "spec_decode_num_drafts_total", DRAFTING) < 1:
        time.sleep(0.5)
    drafted = metric_sum(server, "spec_decode_num_draft_tokens_total", DRAFTING)
    assert drafted >= 4 and 0 <= metric_sum(server, "spec_decode_num_accepted_tokens_total", DRAFTING) <= drafted
    log = server.log_file.read_text(errors="replace")
    assert f"model-factory backend: {DRAFTING} generates" in log and "speculative decoding by the int4 graph" in log
