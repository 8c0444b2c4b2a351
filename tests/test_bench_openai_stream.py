"""benchmarks/harness/openai_stream: the one reader of a streamed OpenAI answer, and bench_generate's counts from it,
against a local aiohttp server sending server-sent events as our front and vLLM do."""

from __future__ import annotations

import asyncio
import json

import pytest

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402


def _events(pieces: list[str]) -> list[str]:
    out = [json.dumps({"choices": [{"index": 0, "text": p, "finish_reason": None}]}) for p in pieces[:-1]]
    out.append(json.dumps({"choices": [{"index": 0, "text": pieces[-1], "finish_reason": "length"}]}))
    out.append(json.dumps({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": len(pieces)}}))
    return [f"data: {e}\n\n" for e in out] + ["data: [DONE]\n\n"]


async def _serve(pieces: list[str], seen: list[dict]):
    async def completions(request):
        seen.append(await request.json())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b": keep-alive comment\n\n")
        for event in _events(pieces):
            await resp.write(event.encode())
            await asyncio.sleep(0.001)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


def test_stream_completion_reads_each_event_its_text_finish_and_usage():
    from benchmarks.harness.openai_stream import stream_completion

    async def run():
        seen: list[dict] = []
        runner, url = await _serve(["He", "llo", " there"], seen)
        try:
            async with aiohttp.ClientSession() as session:
                return await stream_completion(session, url, {"model": "m", "prompt": [1, 2], "stream": True}), seen
        finally:
            await runner.cleanup()

    read, seen = asyncio.run(run())
    assert seen == [{"model": "m", "prompt": [1, 2], "stream": True}]
    assert read.text == "Hello there" and read.chunks == 3 and read.finish_reason == "length"
    assert read.usage_of("completion_tokens") == 3 and read.usage_of("prompt_tokens") == 5
    assert read.ttft is not None and read.ttft > 0 and list(read.times) == sorted(read.times)


def test_bench_generate_counts_tokens_and_first_tokens_through_the_reader():
    from benchmarks import bench_generate as bg

    async def run():
        seen: list[dict] = []
        runner, url = await _serve(["a", "b", "c", "d"], seen)
        try:
            return await bg._drive(url, "llm", [[1, 2, 3], [4, 5]]), seen
        finally:
            await runner.cleanup()

    out, seen = asyncio.run(run())
    assert [s["prompt"] for s in sorted(seen, key=lambda b: len(b["prompt"]))] == [[4, 5], [1, 2, 3]]
    assert all(b["ignore_eos"] and b["stream"] for b in seen)
    assert out["tokens"] == 8 and len(out["ttfts"]) == 2 and all(t > 0 for t in out["ttfts"])
    assert [s["chunks"] for s in out["streams"]] == [4, 4]


def test_on_event_sees_each_event_as_it_arrives_and_a_cancelled_reader_keeps_them():
    """bench_chunked_prefill closes its streams mid-way: what each saw until then is in its record."""
    from benchmarks import bench_chunked_prefill as bc
    from benchmarks.harness.openai_stream import stream_completion

    async def run():
        seen: list[dict] = []
        runner, url = await _serve([f"t{i}" for i in range(400)], seen)
        try:
            async with aiohttp.ClientSession() as session:
                events: list[tuple[float, str]] = []
                whole = await stream_completion(session, url, {"model": "m", "prompt": [1], "stream": True},
                                                on_event=lambda at, text: events.append((at, text)))
                record: dict = {}
                task = asyncio.create_task(bc._stream(session, url, "m", [1], 400, record))
                while len(record.get("times", [])) < 5:
                    await asyncio.sleep(0.001)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return whole, events, record
        finally:
            await runner.cleanup()

    whole, events, record = asyncio.run(run())
    assert [t for _, t in events] == list(whole.pieces) and tuple(at for at, _ in events) == whole.times
    assert 5 <= len(record["times"]) < 400 and record["text"] == "".join(f"t{i}" for i in range(len(record["times"])))
    assert record["sent"] <= record["times"][0]
