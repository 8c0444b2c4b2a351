"""serving/openai_api: a client that goes away mid-stream. The frontend ends the stream quietly (no handler traceback in
its log) and closes its upstream request, which is how Triton learns to cancel the generation. The upstream here is a
local aiohttp server sending ``generate_stream`` events in bursts, as Triton does when tokens arrive faster than the
frontend writes them."""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import threading
import time

import pytest

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402

EVENTS = 20000


class BurstingTriton:
    """``/v2/models/llm/generate_stream``: EVENTS token events, 50 to a write; ``closed`` set when the frontend's
    connection to it went away before the last."""

    def __init__(self) -> None:
        self.closed = threading.Event()
        self.port = 0
        ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self._thread.start()
        assert ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)

        async def stream(request):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            event = json.dumps({"text_output": "x", "index": 0, "num_output_tokens": 1})
            try:
                for _ in range(EVENTS // 50):
                    await resp.write(f"data: {event}\n\n".encode() * 50)
                    await asyncio.sleep(0.001)
            except (ConnectionError, asyncio.CancelledError):
                self.closed.set()
                raise
            await resp.write_eof()
            return resp

        async def serve():
            app = web.Application()
            app.router.add_post("/v2/models/llm/generate_stream", stream)
            self._runner = web.AppRunner(app, handler_cancellation=True)
            await self._runner.setup()
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]
            ready.set()

        self._loop.run_until_complete(serve())
        self._loop.run_forever()

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)


def test_a_client_gone_mid_stream_ends_it_quietly_and_closes_the_upstream_request(caplog):
    from model_factory.serving.openai_api import OpenAIFrontend, ServedModel

    caplog.set_level(logging.WARNING)
    fake = BurstingTriton()
    try:
        with OpenAIFrontend(f"127.0.0.1:{fake.port}", {"llm": ServedModel("llm")}) as front:
            for _ in range(5):
                fake.closed.clear()
                host, port = front.url.removeprefix("http://").split(":")
                conn = http.client.HTTPConnection(host, int(port), timeout=30)
                conn.request("POST", "/v1/completions", headers={"Content-Type": "application/json"},
                             body=json.dumps({"model": "llm", "prompt": "a", "max_tokens": EVENTS, "stream": True}))
                resp = conn.getresponse()
                assert resp.status == 200
                lines = [resp.readline() for _ in range(6)]
                assert any(line.startswith(b"data:") for line in lines), lines
                conn.sock.close()  # the client goes away mid-stream
                conn.close()
                assert fake.closed.wait(10), "the frontend kept reading its upstream after the client left"
            time.sleep(0.5)  # what the frontend logs after the last one
    finally:
        fake.stop()
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors
