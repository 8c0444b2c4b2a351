"""benchmarks/bench_structured.py's served comparison: the request bodies both servers get, and what a run counts from
the streamed answers (a fake OpenAI server streaming fixed texts: valid, invalid against the schema, not JSON, cut)."""

from __future__ import annotations

import json
import threading

import pytest

pytest.importorskip("jsonschema")
aiohttp = pytest.importorskip("aiohttp")

from benchmarks import bench_structured as bs  # noqa: E402

VALID = json.dumps({"records": [{"name": "a", "score": 3, "kind": "beta"}, {"name": "b", "score": 0, "kind": "alpha"}]})
# parses, but one record only (minItems 2), and a score above the maximum
INVALID = json.dumps({"records": [{"name": "a", "score": 5000, "kind": "beta"}]})


def test_the_guided_body_carries_the_schema_and_the_free_one_an_exact_length():
    guided = bs.served_request("m", [11, 12], 7, None)
    assert guided["structured_outputs"]["json"] == bs.SCHEMA and guided["max_tokens"] == bs.MAX_TOKENS
    assert "min_tokens" not in guided and "ignore_eos" not in guided and guided["seed"] == 7
    free = bs.served_request("m", [11, 12], 7, 42)
    assert "structured_outputs" not in free
    assert (free["max_tokens"], free["min_tokens"], free["ignore_eos"]) == (42, 42, True)
    assert guided["prompt"] == free["prompt"] == [11, 12] and guided["stream"] and free["stream"]


@pytest.fixture()
def fake_server():
    """An OpenAI-shaped /v1/completions streaming, for each request in turn, one of ANSWERS in two chunks, then a
    usage event: guided requests get the answers, free ones exactly their max_tokens."""
    from aiohttp import web

    answers = [(VALID, "stop"), (INVALID, "stop"), ("{not json", "stop"), ('{"records": [', "length")]
    seen: list[dict] = []

    async def completions(request):
        body = await request.json()
        seen.append(body)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if "structured_outputs" in body:
            text, reason = answers[(len([b for b in seen if "structured_outputs" in b]) - 1) % len(answers)]
            tokens = len(text)
        else:
            text, reason, tokens = "x" * body["max_tokens"], "length", body["max_tokens"]
        half = len(text) // 2
        for piece, finish in ((text[:half], None), (text[half:], reason)):
            event = {"choices": [{"index": 0, "text": piece, "finish_reason": finish}]}
            await resp.write(f"data: {json.dumps(event)}\n\n".encode())
        usage = {"choices": [], "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": tokens}}
        await resp.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        return resp

    import asyncio

    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}", seen
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def test_a_guided_run_counts_valid_parsed_and_cut_answers_and_the_free_run_makes_their_lengths(fake_server):
    url, seen = fake_server
    guided, lengths = bs.served_run(url, "m", 6294, 1, None, seed=1)  # 1 stream x STREAMS[1] (4) requests
    assert bs.STREAMS[1] == 4
    assert (guided["stop"], guided["length"], guided["parsed"], guided["valid"]) == (3, 1, 2, 1)
    assert guided["tokens"] == len(VALID) + len(INVALID) + len("{not json") + len('{"records": [')
    assert [lengths[(0, k)] for k in range(4)] == [len(VALID), len(INVALID), len("{not json"), len('{"records": [')]
    free, _ = bs.served_run(url, "m", 6294, 1, lengths, seed=1)
    assert free["tokens"] == guided["tokens"] and free["length"] == 0 and free["no_usage"] == 0
    # the same prompts (the in-process run's) and seeds, with and without the schema
    guided_bodies = [b for b in seen if "structured_outputs" in b]
    free_bodies = [b for b in seen if "structured_outputs" not in b]
    assert [b["prompt"] for b in guided_bodies] == [b["prompt"] for b in free_bodies]
    assert [b["prompt"] for b in guided_bodies] == [bs.draw_prompts(1, 4, 6294, 1)[(0, k)] for k in range(4)]
    assert [b["seed"] for b in guided_bodies] == [b["seed"] for b in free_bodies] == [1000, 1001, 1002, 1003]


def test_the_served_section_has_a_row_per_server_and_level():
    cell = {"free": {"tokens/s": 10.0, "length": 0, "no_usage": 0},
            "guided": {"tokens/s": 9.0, "valid": 4, "parsed": 4, "stop": 4, "length": 0, "no_usage": 0}}
    runs = [{"who": who, "precision": "fp32", "engine": who + " engine", "start_s": 3.0, "header": "Run X.",
             "cells": [{"streams": s, "round": r, "ratio": 0.9, **cell} for s in bs.STREAMS for r in (1, 2)]}
            for who in ("ours", "vllm")]
    section = bs.served_section(runs)
    assert section.startswith(bs.SERVED_START) and section.endswith(bs.SERVED_END)
    rows = [line for line in section.splitlines() if line.startswith("| ours") or line.startswith("| vllm")]
    assert len(rows) == 2 * len(bs.STREAMS)
    assert "| ours fp32 | 8 x 3 | 10.0 / 10.0 | 9.0 / 9.0 | **0.90x** (0.90 / 0.90) | 8 / 8 / 8 (0) |" in rows
    assert "vllm engine" in section
