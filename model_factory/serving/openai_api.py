"""An OpenAI-compatible HTTP frontend for the models a Triton server serves.

The encoders' routes (``/v1/embeddings``, TEI's ``/embed``, ``/rerank`` and ``/predict``, Cohere / Jina's
``/v1/rerank``) are ``encoder_api``'s, registered on the same application: each becomes KServe ``infer`` calls on
Triton.
For text-generation models:

``/v1/completions`` and ``/v1/chat/completions`` (streamed as server-sent events, or one JSON answer),
``/v1/models`` and ``/health`` (200 while Triton is ready, 503 otherwise: a probe of this port covers both),
served by aiohttp beside Triton (``serve --openai-port``). Each request is checked and translated
(``openai_protocol``) into one call of Triton's generate extension on loopback: ``generate_stream`` when the
client streams (each Triton event becomes one OpenAI chunk, ``data: [DONE]`` last), ``generate`` otherwise
(the backend then sends exactly one response). A request naming a prompt template is first filled in from the
definition the prompt's served version answers (``openai_prompts``: one ``infer`` call) and sent to its base model,
answered under the prompt's name. A client that disconnects cancels its handler (aiohttp's
handler cancellation), which closes the upstream stream, and the backend frees the sequence at its next step.
Errors are OpenAI-shaped JSON with the status they deserve: 400 naming the bad value, 404 for an unknown
model, 503 with ``Retry-After`` when the model's waiting queue is full. An error the backend reports before
the first token is answered as that status, never as a broken stream.
Every answer (errors and streams included) carries ``X-Request-ID``: the client's own when it sent one (a
printable id of at most 128 characters), else one generated here; it goes on to Triton in the same header, so
the request is known by one id end to end (Triton's own responses cannot carry it back: docs/serving.md).

aiohttp is imported where the frontend starts: extra ``serve``.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

from model_factory.errors import FactoryError
from model_factory.serving.openai_protocol import (OpenAIError, best_choices, chat_chunk, chat_logprobs, chat_request,
                                                   chat_response, completion_chunk, completion_logprobs,
                                                   completion_request, completion_response, new_id, openai_finish,
                                                   triton_error, usage)
from model_factory.serving.openai_tools import ToolStream, tool_message
from model_factory.serving.pool_metrics import ProtocolMetrics


REQUEST_ID_HEADER = "X-Request-ID"
MAX_REQUEST_ID = 128


def request_id_for(sent: str | None) -> str:
    """The id a request is known by: the client's ``X-Request-ID`` when it is a printable id of at most
    128 characters, else a new one (16 hex digits, as the backend generates them)."""
    if sent and len(sent) <= MAX_REQUEST_ID and sent.isprintable() and sent.strip() == sent:
        return sent
    return secrets.token_hex(8)


async def _add_request_id(request: Any, response: Any) -> None:
    """aiohttp's on_response_prepare: an answer the handlers did not give an id (models, health, an error of
    aiohttp's own) gets the client's or a new one, so every answer, streamed or not, carries one."""
    if REQUEST_ID_HEADER not in response.headers:
        response.headers[REQUEST_ID_HEADER] = request_id_for(request.headers.get(REQUEST_ID_HEADER))


@dataclass(frozen=True)
class ServedModel:
    """A text-generation model as the frontend lists and prompts it."""

    name: str
    chat_template: str | None = None
    max_context: int | None = None
    base: str | None = None  # a LoRA adapter's: the model that serves it (its requests carry lora_name)
    adapter: str | None = None


def generative_models(repository: Path, names: list[str]) -> dict[str, ServedModel]:
    """The text-generation models among ``names`` in ``repository`` (``task`` parameter), with their chat
    templates from the highest version's ``generation.json``, and the LoRA adapters beside each (their entries name
    it as their base: ``lora_contract.adapter_entries``), served under their own names by that model."""
    from model_factory.backend.contract import TEXT_GENERATION, Files, GenerationSpec
    from model_factory.backend.lora_contract import adapter_entries
    from model_factory.build.repository import config_parameters, read_config

    out = {}
    for name in names:
        model_dir = Path(repository) / name
        if config_parameters(read_config(model_dir)).get("task") != TEXT_GENERATION:
            continue
        versions = sorted((p for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
        spec = None
        if versions and (versions[-1] / Files.GENERATION).is_file():
            spec = GenerationSpec.from_json((versions[-1] / Files.GENERATION).read_text())
        out[name] = ServedModel(name, spec.chat_template if spec else None, spec.max_context if spec else None)
        for adapter, _ in adapter_entries(Path(repository), name):
            if adapter not in names:
                out[adapter] = replace(out[name], name=adapter, base=name, adapter=adapter)
    return out


def _aiohttp():
    try:
        import aiohttp
        from aiohttp import web
    except ImportError as exc:
        raise FactoryError("the OpenAI frontend needs aiohttp. Fix: pip install 'model-factory[serve]'") from exc
    return aiohttp, web


def _new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's event loop where it is installed (the frontend's own CPU per request is what it saves), else
    asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def _first(value: Any) -> Any:
    return value[0] if isinstance(value, list) and len(value) == 1 else value


def _count(value: Any) -> int:
    value = _first(value)
    return int(value) if isinstance(value, (int, float)) else 0


def _each(value: Any, n: int, default: Any = None) -> list:
    """An output's entries, one a choice (Triton's generate answers a one-element tensor as a scalar)."""
    if value is None:
        return [default] * n
    return list(value) if isinstance(value, list) else [value]


def _upstream_error(call: Any, status: int, message: str) -> OpenAIError:
    """Triton's error as OpenAI's; a grammar the backend could not compile names the field that asked for it."""
    err = triton_error(status, message)
    if err.status == 400 and call.guided_param and message.lstrip().startswith("guided"):
        err.param = call.guided_param
    return err


def _entries(raw: Any) -> list[dict]:
    """The backend's ``logprobs`` entry of one choice: its JSON list of tokens."""
    try:
        entries = json.loads(raw) if isinstance(raw, str) else []
    except ValueError:
        return []
    return entries if isinstance(entries, list) else []


class OpenAIFrontend:
    """The frontend's aiohttp server, run on its own event-loop thread (:meth:`start` / :meth:`stop`)."""

    def __init__(self, triton_http: str, models: Mapping[str, ServedModel], host: str = "127.0.0.1",
                 port: int = 0, metrics_url: str | None = None,
                 encoders: Mapping[str, Any] | None = None, prompts: Mapping[str, Any] | None = None) -> None:
        self.triton = f"http://{triton_http}" if "://" not in triton_http else triton_http
        self.metrics_url = metrics_url  # Triton's metrics port: /metrics answers from it (pool_metrics)
        self.models = dict(models)
        self.encoders = dict(encoders or {})  # embedding, reranker, classification: encoder_api's routes
        self.prompts = dict(prompts or {})  # prompt templates on a base model (openai_prompts.ServedPrompt)
        self.host, self.port = host, int(port)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: Any = None
        self._session: Any = None
        self._encoder_routes: Any = None
        self._started = threading.Event()
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # ------------------------------------------------------------------ lifecycle

    def start(self, timeout_s: float = 30.0) -> "OpenAIFrontend":
        _aiohttp()
        self._thread = threading.Thread(target=self._run, name="mf-openai", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout_s):
            raise FactoryError(f"the OpenAI frontend did not start within {timeout_s:.0f} s")
        if self._error is not None:
            raise FactoryError(f"the OpenAI frontend could not listen on {self.host}:{self.port} ({self._error}). "
                               "Fix: pick a free --openai-port") from None
        return self

    def _run(self) -> None:
        loop = self._loop = _new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._serve())
        except BaseException as exc:  # noqa: BLE001 - reported by start()
            self._error = exc
            self._started.set()
            return
        self._started.set()
        loop.run_forever()
        loop.run_until_complete(self._shutdown())
        loop.close()

    async def _serve(self) -> None:
        aiohttp, web = _aiohttp()
        app = web.Application(client_max_size=8 << 20)
        app.on_response_prepare.append(_add_request_id)
        app.router.add_get("/v1/models", self._list_models)
        app.router.add_get("/health", self._health)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        from model_factory.serving.encoder_api import EncoderRoutes

        self._encoder_routes = EncoderRoutes(self.triton, self.encoders,
                                             lambda request: request_id_for(request.headers.get(REQUEST_ID_HEADER)))
        self._encoder_routes.add_to(app)
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
                                              connector=aiohttp.TCPConnector(limit=0))
        # The model-server protocol's metrics, for an InferencePool's endpoint picker.
        app.router.add_get("/metrics", ProtocolMetrics(self._session, self.metrics_url,
                                                         sorted(n for n, m in self.models.items() if not m.base)).response)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # the port picked when 0 was asked

    async def _shutdown(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()
        if self._encoder_routes is not None:
            self._encoder_routes.close()

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=15)

    def __enter__(self) -> "OpenAIFrontend":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ handlers

    async def _health(self, request: Any) -> Any:
        """200 while Triton behind it is ready (a probe of this port covers both), 503 otherwise."""
        aiohttp, web = _aiohttp()
        try:
            async with self._session.get(f"{self.triton}/v2/health/ready",
                                         timeout=aiohttp.ClientTimeout(total=5)) as resp:
                ready = resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            ready = False
        return web.json_response({"status": "ok" if ready else "inference server not ready"},
                                 status=200 if ready else 503)

    async def _list_models(self, request: Any) -> Any:
        _, web = _aiohttp()
        listed = [{"id": name, "object": "model", "created": 0, "owned_by": "model-factory", "task": "text-generation",
                   **({"max_model_len": m.max_context} if m.max_context else {}),
                   **({"parent": m.base} if m.base else {})} for name, m in self.models.items()]  # vLLM's LoRA field
        listed += [{"id": name, "object": "model", "created": 0, "owned_by": "model-factory", "task": m.task,
                    **({"dimensions": m.dimensions} if m.dimensions else {})} for name, m in self.encoders.items()]
        listed += [{"id": name, "object": "model", "created": 0, "owned_by": "model-factory", "task": "prompt",
                    "root": p.base} for name, p in self.prompts.items()]
        return web.json_response({"object": "list", "data": sorted(listed, key=lambda m: m["id"])})

    async def _completions(self, request: Any) -> Any:
        return await self._handle(request, chat=False)

    async def _chat(self, request: Any) -> Any:
        return await self._handle(request, chat=True)

    async def _handle(self, request: Any, chat: bool) -> Any:
        _, web = _aiohttp()
        rid = request_id_for(request.headers.get(REQUEST_ID_HEADER))  # one id, forwarded to Triton and answered
        try:
            try:
                req = await request.json()
            except (ValueError, UnicodeDecodeError):
                raise OpenAIError(400, "the body is not JSON") from None
            prompt = req.get("model") if isinstance(req, dict) and req.get("model") in self.prompts else None
            if prompt is not None:  # a prompt template: the request its base model gets (openai_prompts)
                req = await self._prompted(req, prompt, chat, rid)
            call = (chat_request if chat else completion_request)(req, self.models)
            if prompt is not None:
                call = replace(call, shown=prompt)
            if call.stream:
                return await self._stream(request, call, chat, rid)
            return await self._once(call, chat, rid)
        except OpenAIError as err:
            headers = {REQUEST_ID_HEADER: rid}
            if err.retry_after_s:
                headers["Retry-After"] = str(int(max(1, err.retry_after_s)))
            return web.json_response(err.body(), status=err.status, headers=headers)

    async def _prompted(self, req: dict, prompt: str, chat: bool, rid: str) -> dict:
        """The prompt's definition as the version Triton serves now answers it, filled with ``req``'s fields."""
        from model_factory.serving.openai_prompts import base_request, definition_request, read_definition

        url = f"{self.triton}/v2/models/{prompt}/infer"
        async with self._session.post(url, json=definition_request(rid), headers={REQUEST_ID_HEADER: rid}) as resp:
            definition = read_definition(resp.status, await resp.text(), prompt)
        out = base_request(req, definition, chat)
        if out["model"] not in self.models:
            raise OpenAIError(503, f"prompt {prompt!r} runs on {out['model']!r}, which is not served here",
                              retry_after_s=1.0)
        return out

    async def _once(self, call: Any, chat: bool, rid: str) -> Any:
        _, web = _aiohttp()
        url = f"{self.triton}/v2/models/{call.triton_model}/generate"
        async with self._session.post(url, json=call.body, headers={REQUEST_ID_HEADER: rid}) as resp:
            text = await resp.text()
        try:
            data = json.loads(text)
        except ValueError:
            raise OpenAIError(502, f"the inference server answered {resp.status}: {text[:200]}") from None
        if resp.status != 200 or "error" in data:
            raise _upstream_error(call, resp.status, str(data.get("error", text)))
        texts = _each(data.get("text_output"), 1, "")
        k = len(texts)
        finishes, counts = _each(data.get("finish_reason"), k, ""), _each(data.get("num_output_tokens"), k, 0)
        indexes, lps = _each(data.get("index"), k, 0), _each(data.get("logprobs"), k)
        choices = []
        for pos in range(k):
            entries = _entries(lps[pos]) if lps[pos] is not None else None
            choice = {"index": int(indexes[pos]) if k > 1 else 0, "text": call.echo + str(texts[pos] or ""),
                      "finish_reason": openai_finish(finishes[pos]) or "stop",
                      "cumulative_logprob": sum(e["logprob"] for e in entries or ())}
            if entries is not None and call.logprobs is not None:
                choice["logprobs"] = (chat_logprobs(entries) if chat
                                      else completion_logprobs(entries, len(call.echo))[0])
            if chat and call.tools is not None:
                choice["message"], choice["finish_reason"] = tool_message(call.tools, choice["text"],
                                                                          choice["finish_reason"])
            choices.append(choice)
        choices.sort(key=lambda c: c["index"])
        if call.best_of > call.n:
            choices = best_choices(choices, call.n)
        make = chat_response if chat else completion_response
        return web.json_response(make(call.shown or call.model, choices, _count(data.get("num_input_tokens")),
                                      sum(_count(c) for c in counts)),
                                 headers={REQUEST_ID_HEADER: rid})

    async def _stream(self, request: Any, call: Any, chat: bool, request_id: str) -> Any:
        """Relay the generation's events as server-sent events. A client that goes away mid-stream ends it quietly:
        the next write raises ConnectionResetError (aiohttp's ClientConnectionResetError), leaving the upstream
        request closes its connection, and Triton cancels the generation (its sequence and cache freed)."""
        try:
            return await self._relay(request, call, chat, request_id)
        except ConnectionResetError:
            if request.transport is not None and not request.transport.is_closing():
                raise  # not the client's connection: the upstream's, an error to answer
            _, web = _aiohttp()
            return web.Response(status=499, text="the client closed the stream")  # nginx's "client closed request"

    async def _relay(self, request: Any, call: Any, chat: bool, request_id: str) -> Any:
        _, web = _aiohttp()
        url = f"{self.triton}/v2/models/{call.triton_model}/generate_stream"
        rid, created = new_id("chatcmpl" if chat else "cmpl"), int(time.time())
        shown = call.shown or call.model  # the name answered: a prompt's, else the model's
        out = None
        n_in = 0
        n_out: dict[int, int] = {}
        offsets: dict[int, int] = {}  # completions' text_offset, per choice
        echo = {i: call.echo for i in range(call.n)} if call.echo else {}  # prepended to each choice's first chunk
        tools = ToolStream(call.tools) if chat and call.tools is not None else None
        async with self._session.post(url, json=call.body, headers={REQUEST_ID_HEADER: request_id}) as resp:
            async for raw in resp.content:
                line = raw.decode("utf-8", errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                try:
                    event = json.loads(line[5:])
                except ValueError:
                    continue
                if "error" in event:
                    err = _upstream_error(call, resp.status, str(event["error"]))
                    if out is None:
                        raise err
                    await out.write(f"data: {json.dumps(err.body())}\n\n".encode())
                    break
                if out is None:
                    out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                                      REQUEST_ID_HEADER: request_id})
                    await out.prepare(request)
                    if chat:
                        for i in range(call.n):
                            first = chat_chunk(rid, shown, created, {"role": "assistant", "content": ""}, None, i)
                            await out.write(f"data: {json.dumps(first)}\n\n".encode())
                index = int(_first(event.get("index")) or 0)
                finish = openai_finish(_first(event.get("finish_reason")))
                text = echo.pop(index, "") + str(_first(event.get("text_output")) or "")
                n_in, n_out[index] = _count(event.get("num_input_tokens")), _count(event.get("num_output_tokens"))
                entries = _entries(_first(event.get("logprobs"))) if call.logprobs is not None else []
                logprobs = None
                if entries:
                    if chat:
                        logprobs = chat_logprobs(entries)
                    else:
                        logprobs, offsets[index] = completion_logprobs(entries, offsets.get(index, len(call.echo)))
                if tools is not None:
                    for delta, done in tools.feed(index, text, finish):
                        chunk = chat_chunk(rid, shown, created, delta, done, index, logprobs)
                        logprobs = None
                        await out.write(f"data: {json.dumps(chunk)}\n\n".encode())
                elif text or finish or logprobs:
                    chunk = (chat_chunk(rid, shown, created, {"content": text} if text else {}, finish, index,
                                        logprobs) if chat
                             else completion_chunk(rid, shown, created, text, finish, index, logprobs))
                    await out.write(f"data: {json.dumps(chunk)}\n\n".encode())
            if out is None:
                raise _upstream_error(call, resp.status, "the inference server closed the stream without an answer")
        if call.include_usage:
            tail = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                    "model": shown, "choices": [], "usage": usage(n_in, sum(n_out.values()))}
            await out.write(f"data: {json.dumps(tail)}\n\n".encode())
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out
