"""kserve_infer.LoopbackClient against a plain asyncio server (no Triton): connections kept alive and reused, one
closed by the server while idle replaced, one whose answer was not read whole never reused, answers it cannot read
refused."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from model_factory.serving.kserve_infer import LoopbackClient, UpstreamClosed, infer
from model_factory.serving.openai_protocol import OpenAIError


class Server:
    """Answers each request with ``answer(n)`` (n: requests seen so far), closing after it when ``close_after``."""

    def __init__(self, answer, close_after: bool = False, hold: bool = False) -> None:
        self.answer, self.close_after, self.hold = answer, close_after, hold
        self.connections = 0
        self.requests: list[bytes] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length")))
                self.requests.append(head + await reader.readexactly(length))
                if self.hold:
                    await asyncio.sleep(10)
                writer.write(self.answer(len(self.requests)))
                await writer.drain()
                if self.close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc) -> None:
        self.server.close()


def _ok(body: bytes = b"{}", extra: str = "") -> bytes:
    return f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body


def _binary_answer(n: int) -> bytes:
    vec = np.full((1, 3), n, dtype="<f4")
    head = (b'{"outputs":[{"name":"embedding","datatype":"FP32","shape":[1,3],'
            b'"parameters":{"binary_data_size":12}}]}')
    return _ok(head + vec.tobytes(), f"Inference-Header-Content-Length: {len(head)}\r\n")


def test_calls_reuse_one_kept_alive_connection_and_read_binary_outputs() -> None:
    async def main() -> None:
        server = Server(_binary_answer)
        async with server as url:
            client = LoopbackClient(url)
            got = [await infer(client, "m", {"text": ["a"]}, ["embedding"], None, f"id-{i}") for i in range(3)]
            client.close()
        assert [g["embedding"].tolist() for g in got] == [[[1.0] * 3], [[2.0] * 3], [[3.0] * 3]]
        assert server.connections == 1 and len(server.requests) == 3
        assert b"POST /v2/models/m/infer HTTP/1.1" in server.requests[0] and b"X-Request-ID: id-2" in server.requests[2]

    asyncio.run(main())


def test_a_connection_the_server_closed_while_idle_is_replaced() -> None:
    async def main() -> None:
        server = Server(lambda n: _ok(b"{}"), close_after=True)
        async with server as url:
            client = LoopbackClient(url)
            first = await client.post("/x", b"1", {})
            await asyncio.sleep(0.05)  # the server's close reaches the client
            second = await client.post("/x", b"2", {})
            client.close()
        assert first[0] == second[0] == 200 and server.connections == 2

    asyncio.run(main())


def test_connection_close_and_a_cancelled_call_leave_no_connection_to_reuse() -> None:
    async def main() -> None:
        server = Server(lambda n: _ok(b"{}", "Connection: close\r\n"))
        async with server as url:
            client = LoopbackClient(url)
            await client.post("/x", b"1", {})
            assert client._idle == []
        held = Server(lambda n: _ok(b"{}"), hold=True)
        async with held as url:
            client = LoopbackClient(url)
            call = asyncio.ensure_future(client.post("/x", b"1", {}))
            await asyncio.sleep(0.05)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            assert client._idle == []

    asyncio.run(main())


def test_answers_that_cannot_be_read_and_a_server_gone() -> None:
    async def main() -> None:
        async with Server(lambda n: b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n") as url:
            with pytest.raises(OpenAIError) as info:
                await infer(LoopbackClient(url), "m", {"text": ["a"]}, ["embedding"], None, "r")
            assert info.value.status == 502 and "Content-Length" in info.value.message
        async with Server(lambda n: b"", close_after=True) as url:  # closes without answering
            with pytest.raises(UpstreamClosed):
                await LoopbackClient(url).post("/x", b"1", {})
            with pytest.raises(OpenAIError) as info:
                await infer(LoopbackClient(url), "m", {"text": ["a"]}, ["embedding"], None, "r")
            assert info.value.status == 503 and info.value.retry_after_s

    asyncio.run(main())
