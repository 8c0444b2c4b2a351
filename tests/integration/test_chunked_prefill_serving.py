"""Chunked prefill on the real Triton server: one tiny Llama served twice, ``prefill_chunk_tokens`` 32 and off; long
prompts sent while short requests decode give the same tokens on both (greedy and seeded), and the chunked model's
metrics count its chunks and the steps that ran them."""

from __future__ import annotations

import concurrent.futures
import json
import random
import time
import urllib.request

import pytest

from tests.generative_repository import layout_generative_model

pytestmark = pytest.mark.integration

CHUNKED, WHOLE = "tiny_llm_chunked", "tiny_llm_whole"


@pytest.fixture(scope="module")
def server(tiny_llm, tmp_path_factory):
    from model_factory.serving.server import ServerOptions, TritonServer

    hf, onnx_dir = tiny_llm
    repo = tmp_path_factory.mktemp("chunked-repo")
    layout_generative_model(hf, onnx_dir, repo, CHUNKED, memory_budget_mib=256, max_active_sequences=8,
                            prefill_chunk_tokens=32)
    layout_generative_model(hf, onnx_dir, repo, WHOLE, memory_budget_mib=256, max_active_sequences=8,
                            prefill_chunk_tokens=0)
    srv = TritonServer(repo, options=ServerOptions(0, 0, 0)).start()
    assert not srv.load_errors, srv.load_errors
    yield srv
    assert srv.stop() == 0, srv.log_tail(30)


def _generate(srv, model: str, body: dict) -> list[int]:
    req = urllib.request.Request(f"http://{srv.http_url}/v2/models/{model}/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        out = json.loads(r.read())
    ids = out["output_ids"]
    return ids if isinstance(ids, list) else [ids]


def _metric(srv, name: str, model: str) -> float:
    text = urllib.request.urlopen(srv.metrics_url, timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(f"model_factory_{name}{{") and f'model="{model}"' in line)


def test_long_prompts_among_decoding_streams_give_the_same_tokens_chunked_and_count_the_chunks(server):
    rng = random.Random(9)
    # The short requests decode long enough to outlast the long prompts' chunks (their prefill is whole once no
    # stream decodes), with a second's head start: on a loaded CI machine 0.2 s was not always enough.
    shorts = [{"prompt_ids": [rng.randrange(3, 2000) for _ in range(6)], "max_tokens": 160, "min_tokens": 160}
              for _ in range(4)]
    longs = [{"prompt_ids": [rng.randrange(3, 2000) for _ in range(300 + 13 * i)], "max_tokens": 12,
              "min_tokens": 12, **extra} for i, extra in enumerate(({}, {"temperature": 0.8, "seed": 3}, {}))]
    got = {}
    for model in (CHUNKED, WHOLE):
        with concurrent.futures.ThreadPoolExecutor(len(shorts) + len(longs)) as pool:
            running = [pool.submit(_generate, server, model, b) for b in shorts]
            time.sleep(1.0)  # the streams decode when the long prompts arrive
            got[model] = [f.result() for f in running + [pool.submit(_generate, server, model, b) for b in longs]]
    assert got[CHUNKED] == got[WHOLE]
    assert all(len(ids) == 160 for ids in got[CHUNKED][:4]) and all(len(ids) == 12 for ids in got[CHUNKED][4:])
    deadline = time.monotonic() + 15  # the instance sends its metrics about once a second
    want = len(longs)  # each long prompt split at least once (exact chunk counts: tests/backend/test_chunked_prefill.py)
    while time.monotonic() < deadline and _metric(server, "prefill_chunks_total", CHUNKED) < want:
        time.sleep(0.5)
    assert _metric(server, "prefill_chunks_total", CHUNKED) >= want
    assert _metric(server, "chunked_prefill_steps_total", CHUNKED) >= 1
    assert _metric(server, "prefill_chunks_total", WHOLE) == 0
