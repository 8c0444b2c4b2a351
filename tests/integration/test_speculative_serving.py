"""Speculative decoding on the real Triton server: one tiny Llama served twice, ``speculative = "prompt_lookup"`` and
off; requests sent one at a time (speculation drafts while one sequence decodes) give the same tokens on both (greedy
and seeded), and the speculating model's metrics count its drafts and the tokens accepted."""

from __future__ import annotations

import json
import random
import time

import pytest

from tests.generative_repository import generate_ids, metric_sum, served_variants

pytestmark = pytest.mark.integration

SPECULATING, PLAIN = "tiny_llm_speculating", "tiny_llm_plain"


@pytest.fixture(scope="module")
def server(tiny_llm, tmp_path_factory):
    hf, onnx_dir = tiny_llm
    with served_variants(hf, onnx_dir, tmp_path_factory.mktemp("speculative-repo"),
                         {SPECULATING: dict(memory_budget_mib=256, max_active_sequences=4,
                                            speculative="prompt_lookup", num_speculative_tokens=5),
                          PLAIN: dict(memory_budget_mib=256, max_active_sequences=4)}) as srv:
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
