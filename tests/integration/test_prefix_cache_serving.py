"""Prefix caching on the real Triton server: one tiny Llama served twice, ``prefix_caching`` at its default (on for
FP32) and off; a document asked several questions, one after another and then all at once, greedy and seeded, gives
the same tokens on both, and the cached model's metrics count the hits."""

from __future__ import annotations

import concurrent.futures
import random
import time

import pytest

from tests.generative_repository import generate_ids, metric_sum, served_variants

pytestmark = pytest.mark.integration

CACHED, PLAIN = "tiny_llm_cached", "tiny_llm_plain"


@pytest.fixture(scope="module")
def server(tiny_llm, tmp_path_factory):
    hf, onnx_dir = tiny_llm
    with served_variants(hf, onnx_dir, tmp_path_factory.mktemp("prefix-repo"),
                         {CACHED: dict(memory_budget_mib=256, max_active_sequences=8),
                          PLAIN: dict(memory_budget_mib=256, max_active_sequences=8, prefix_caching="off")}) as srv:
        yield srv


def test_questions_on_one_document_give_the_same_tokens_with_the_cache_and_count_its_hits(server):
    rng = random.Random(5)
    document = [rng.randrange(3, 2000) for _ in range(90)]
    questions = [[rng.randrange(3, 2000) for _ in range(rng.randrange(2, 12))] for _ in range(6)]
    bodies = [{"prompt_ids": document + q, "max_tokens": 16, "min_tokens": 16, **extra}
              for q in questions for extra in ({}, {"temperature": 0.8, "seed": 21})]
    # One after another (each finds the one before it kept), then all at once (copies from kept or running slots).
    one_by_one = {m: [generate_ids(server, m, b) for b in bodies] for m in (CACHED, PLAIN)}
    assert one_by_one[CACHED] == one_by_one[PLAIN]
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        together = list(pool.map(lambda b: generate_ids(server, CACHED, b), bodies))
    assert together == one_by_one[PLAIN]
    deadline = time.monotonic() + 15  # the instance sends its metrics about once a second
    while (time.monotonic() < deadline and metric_sum(server, "prefix_cache_queried_tokens_total", CACHED)
           < 2 * len(bodies) * len(document)):
        time.sleep(0.5)
    time.sleep(1.5)
    hits = metric_sum(server, "prefix_cache_hit_tokens_total", CACHED)
    queried = metric_sum(server, "prefix_cache_queried_tokens_total", CACHED)
    assert hits >= (len(bodies) - 1) * 80 and queried >= 2 * len(bodies) * len(document)
    assert metric_sum(server, "prefix_cache_hit_tokens_total", PLAIN) == 0
    assert metric_sum(server, "prefix_cache_blocks", CACHED) >= 1
