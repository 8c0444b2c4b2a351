"""Chunked prefill on the real Triton server: one tiny Llama served twice, ``prefill_chunk_tokens`` 32 and off; long
prompts sent while short requests decode give the same tokens on both (greedy and seeded), and the chunked model's
metrics count its chunks and the steps that ran them."""

from __future__ import annotations

import concurrent.futures
import random
import time

import pytest

from tests.generative_repository import generate_ids, metric_sum, served_variants

pytestmark = pytest.mark.integration

CHUNKED, WHOLE = "tiny_llm_chunked", "tiny_llm_whole"
SHORT = 480  # tokens each short request decodes


@pytest.fixture(scope="module")
def server(tiny_llm, tmp_path_factory):
    hf, onnx_dir = tiny_llm
    with served_variants(hf, onnx_dir, tmp_path_factory.mktemp("chunked-repo"),
                         {CHUNKED: dict(memory_budget_mib=256, max_active_sequences=8, prefill_chunk_tokens=32),
                          WHOLE: dict(memory_budget_mib=256, max_active_sequences=8, prefill_chunk_tokens=0)}) as srv:
        yield srv


def test_long_prompts_among_decoding_streams_give_the_same_tokens_chunked_and_count_the_chunks(server):
    rng = random.Random(9)
    # The short requests decode long enough to outlast the head start and the long prompts' chunks (their prefill is
    # whole once no stream decodes), with a second's head start: on a loaded CI machine 0.2 s was not always enough,
    # and on a calm fast one 160 tokens each were done within the second (no chunk then).
    shorts = [{"prompt_ids": [rng.randrange(3, 2000) for _ in range(6)], "max_tokens": SHORT, "min_tokens": SHORT}
              for _ in range(4)]
    longs = [{"prompt_ids": [rng.randrange(3, 2000) for _ in range(300 + 13 * i)], "max_tokens": 12,
              "min_tokens": 12, **extra} for i, extra in enumerate(({}, {"temperature": 0.8, "seed": 3}, {}))]
    got = {}
    for model in (CHUNKED, WHOLE):
        with concurrent.futures.ThreadPoolExecutor(len(shorts) + len(longs)) as pool:
            running = [pool.submit(generate_ids, server, model, b) for b in shorts]
            time.sleep(1.0)  # the streams decode when the long prompts arrive
            got[model] = [f.result() for f in running + [pool.submit(generate_ids, server, model, b) for b in longs]]
    assert got[CHUNKED] == got[WHOLE]
    assert all(len(ids) == SHORT for ids in got[CHUNKED][:4]) and all(len(ids) == 12 for ids in got[CHUNKED][4:])
    deadline = time.monotonic() + 15  # the instance sends its metrics about once a second
    want = len(longs)  # each long prompt split at least once (exact chunk counts: tests/backend/test_chunked_prefill.py)
    while time.monotonic() < deadline and metric_sum(server, "prefill_chunks_total", CHUNKED) < want:
        time.sleep(0.5)
    assert metric_sum(server, "prefill_chunks_total", CHUNKED) >= want
    assert metric_sum(server, "chunked_prefill_steps_total", CHUNKED) >= 1
    assert metric_sum(server, "prefill_chunks_total", WHOLE) == 0
