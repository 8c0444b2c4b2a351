"""Speculative decoding on the real Triton server: one tiny Llama served twice, ``speculative = "prompt_lookup"`` and
off; requests sent one at a time (speculation drafts while one sequence decodes) give the same tokens on both (greedy
and seeded), and the speculating model's metrics count its drafts and the tokens accepted."""

from __future__ import annotations

import json
import random
import time
import urllib.request

import pytest

from tests.generative_repository import layout_generative_model

pytestmark = pytest.mark.integration

SPECULATING, PLAIN = "tiny_llm_speculating", "tiny_llm_plain"


@pytest.fixture(scope="module")
def server(tiny_llm, tmp_path_factory):
    from model_factory.serving.server import ServerOptions, TritonServer

    hf, onnx_dir = tiny_llm
    repo = tmp_path_factory.mktemp("speculative-repo")
    layout_generative_model(hf, onnx_dir, repo, SPECULATING, memory_budget_mib=256, max_active_sequences=4,
                            speculative="prompt_lookup", num_speculative_tokens=5)
    layout_generative_model(hf, onnx_dir, repo, PLAIN, memory_budget_mib=256, max_active_sequences=4)
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
    got = {model: [_generate(server, model, b) for b in bodies] for model in (SPECULATING, PLAIN)}
    assert got[SPECULATING] == got[PLAIN]
    assert all(len(ids) == 40 for ids in got[SPECULATING])
    deadline = time.monotonic() + 15  # the instance sends its metrics about once a second
    while time.monotonic() < deadline and _metric(server, "spec_decode_num_accepted_tokens_total", SPECULATING) < 1:
        time.sleep(0.5)
    drafted = _metric(server, "spec_decode_num_draft_tokens_total", SPECULATING)
    accepted = _metric(server, "spec_decode_num_accepted_tokens_total", SPECULATING)
    assert 0 < accepted <= drafted and _metric(server, "spec_decode_num_drafts_total", SPECULATING) >= 1
    assert _metric(server, "spec_decode_num_draft_tokens_total", PLAIN) == 0
