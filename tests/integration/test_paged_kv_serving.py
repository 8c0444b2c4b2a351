"""Paged KV admission on the real Triton server: one tiny Llama served twice under a budget of about five sequences
of 256 tokens, ``kv_admission`` paged and reserve; eight such requests sent at once give transformers' tokens on both,
the paged model preempting for the blocks its sequences grow into (the reserving one never does), and its KV block
gauges on /metrics."""

from __future__ import annotations

import concurrent.futures
import json
import random
import time
import urllib.request

import pytest

from tests.generative_repository import agree_until_tie, layout_generative_model, reference_greedy

pytestmark = pytest.mark.integration

PAGED, RESERVE = "tiny_llm_paged", "tiny_llm_reserve"
TOKENS = 250


@pytest.fixture(scope="module")
def server(tiny_llm, tmp_path_factory):
    from model_factory.serving.server import ServerOptions, TritonServer

    hf, onnx_dir = tiny_llm
    repo = tmp_path_factory.mktemp("paged-repo")
    # 2 MiB less the tiny model's 1.3 MiB of weights: about twenty 64-token pages of its 8 head rows. No prefix cache:
    # its kept prefixes would hold blocks once the requests are done (counted in kv_cache_blocks_used).
    for name, admission in ((PAGED, "paged"), (RESERVE, "reserve")):
        layout_generative_model(hf, onnx_dir, repo, name, memory_budget_mib=2, max_active_sequences=8,
                                prefill_chunk_tokens=0, prefix_caching="off", kv_admission=admission)
    srv = TritonServer(repo, options=ServerOptions(0, 0, 0)).start()
    assert not srv.load_errors, srv.load_errors
    yield srv
    assert srv.stop() == 0, srv.log_tail(30)


def _generate(srv, model: str, body: dict) -> list[int]:
    req = urllib.request.Request(f"http://{srv.http_url}/v2/models/{model}/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        out = json.loads(r.read())
    ids = out["output_ids"]
    return ids if isinstance(ids, list) else [ids]


def _metrics(srv, model: str) -> dict[str, float]:
    text = urllib.request.urlopen(srv.metrics_url, timeout=5).read().decode()
    got: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("model_factory_") and f'model="{model}"' in line:
            name = line.split("{", 1)[0][len("model_factory_"):]
            got[name] = got.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return got


def test_paged_admission_serves_the_same_tokens_preempting_for_blocks(server, tiny_llm):
    hf, _ = tiny_llm
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 2000) for _ in range(6)] for _ in range(8)]
    bodies = [{"prompt_ids": p, "max_tokens": TOKENS, "min_tokens": TOKENS} for p in prompts]
    got = {}
    for model in (PAGED, RESERVE):
        with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
            got[model] = list(pool.map(lambda b: _generate(server, model, b), bodies))
    ref = reference_greedy(hf, prompts, [TOKENS] * len(prompts))
    for model in (PAGED, RESERVE):
        for ids, (want, tie) in zip(got[model], ref):
            assert len(ids) == TOKENS and agree_until_tie(ids, want, tie), model
    deadline = time.monotonic() + 15  # the instance sends its metrics about once a second
    while time.monotonic() < deadline and not _metrics(server, PAGED).get("preemptions_total"):
        time.sleep(0.5)
    paged, reserve = _metrics(server, PAGED), _metrics(server, RESERVE)
    assert paged.get("preemptions_total", 0) >= 1 and reserve.get("preemptions_total", 0) == 0
    assert paged["kv_cache_blocks_used"] == 0 and paged["kv_cache_blocks_free"] > 0  # all done: every block back
    assert reserve["kv_cache_blocks_free"] == 0  # whole reservations: no blocks
    log = server.log_tail(5000)
    assert "KV admission paged (blocks of 16 tokens)" in log and "KV admission reserves prompt + max_tokens" in log
