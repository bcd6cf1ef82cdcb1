"""`create_app`: the FastAPI application of ``hf-pagedkv serve``, an OpenAI-compatible API on an `EngineService`.

Endpoints: POST /v1/completions, POST /v1/chat/completions (``stream: true``: server-sent events), GET /v1/models,
GET /v1/models/{id}, GET /health (503 while draining), GET /metrics (Prometheus text, `server_metrics.py`).

A request body is refused with a 413 past `max_body_bytes` before it is parsed; parsing, tokenizing and chat
templating run in a worker thread (`asyncio.to_thread`), so a long prompt delays neither `/health` nor other
clients' streams.

A client that disconnects cancels its choices in the engine (their blocks are freed): streamed, when Starlette
cancels the response's generator; not streamed, when the wait for the answer sees ``http.disconnect``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from contextlib import asynccontextmanager

try:
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException

    from hf_pagedkv.serving.server.server_metrics import CONTENT_TYPE, ServerMetrics
except ImportError as _e:
    from hf_pagedkv.errors import install_hint
    raise ImportError(f"The HTTP server needs fastapi, uvicorn and prometheus_client ({_e}): "
                      + install_hint("serve", "fastapi uvicorn prometheus_client") + ".") from _e

from hf_pagedkv.serving.server.errors import ApiError
from hf_pagedkv.serving.server.generation import Generation
from hf_pagedkv.serving.server.protocol import (MAX_BODY_BYTES, ChatCompletionRequest, CompletionRequest,
                                                body_too_large, check_content_type, parse_body)
from hf_pagedkv.serving.server.responses import DONE, ResponseWriter, error_event
from hf_pagedkv.serving.server.service import DEFAULT_COMPLETION_TOKENS, EngineService

logger = logging.getLogger(__name__)

CLIENT_GONE = 499  # the status counted for a request whose client disconnected (nginx's convention)


def create_app(service: EngineService, *, max_body_bytes: int = MAX_BODY_BYTES):
    """The application. Its lifespan starts the service (`EngineService.start`) and closes it at shutdown
    (unfinished requests cancelled, the prefix cache saved).

    Args:
        service (`EngineService`): the engine behind the endpoints.
        max_body_bytes (`int`): request bodies larger than this, in bytes, get a 413 ``body_too_large``.

    Raises:
        ValueError: `max_body_bytes` < 1.
    """
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}.")
    metrics = ServerMetrics(service)

    @asynccontextmanager
    async def lifespan(app):
        service.start()
        try:
            yield
        finally:
            service.close()

    app = FastAPI(title="hf_pagedkv", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service
    app.state.metrics = metrics

    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        return JSONResponse(ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}").body(),
                            status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def server_error(request, e: Exception):
        logger.exception("hf_pagedkv server: %s %s failed", request.method, request.url.path)
        return JSONResponse(ApiError(500, f"Internal error: {type(e).__name__}: {e}").body(), status_code=500)

    @app.get("/health")
    async def health():
        if service.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok"}

    def model_card() -> dict:
        return {"id": service.model_name, "object": "model", "created": service.created, "owned_by": "hf_pagedkv"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        service.check_model(model_id)
        return model_card()

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    def prepare(raw: bytes, chat: bool):
        """The body parsed, its prompts tokenized and its settings checked (in a worker thread: a long prompt
        takes seconds to tokenize)."""
        body = parse_body(raw, ChatCompletionRequest if chat else CompletionRequest, max_body_bytes)
        service.check_model(body.model)
        prompts = [service.chat_prompt(body)] if chat else service.completion_prompts(body)
        return body, prompts, service.settings(body, prompts, None if chat else DEFAULT_COMPLETION_TOKENS)

    async def generate(request: Request, chat: bool):
        endpoint = "chat" if chat else "completions"
        started = time.perf_counter()
        try:
            check_content_type(request.headers.get("content-type"))
            raw = await _read_body(request, max_body_bytes)
            body, prompts, settings = await asyncio.to_thread(prepare, raw, chat)
            gen = service.generate(prompts, body.n, settings)
        except ApiError as e:
            metrics.observe(endpoint, e.status)
            raise
        writer = ResponseWriter(chat, service.model_name, body.return_token_ids)
        usage = body.stream_options is not None and body.stream_options.include_usage

        def done(status: int) -> None:
            metrics.observe(endpoint, status, started, gen.first_token_time, time.perf_counter(),
                            gen.completion_tokens, gen.prompt_tokens)

        if body.stream:
            return StreamingResponse(_stream(gen, writer, usage, done), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        service.num_open_generations += 1
        try:
            result = await _collect(gen, request)
        finally:
            service.num_open_generations -= 1
        if result is None:
            done(CLIENT_GONE)
            return Response(status_code=CLIENT_GONE)
        texts, reasons, errors = result
        if errors:
            done(500)
            raise ApiError(500, f"The engine failed this request: {errors[0]}")
        done(200)
        return JSONResponse(writer.whole(gen, texts, reasons))

    async def _stream(gen: Generation, writer: ResponseWriter, usage: bool, done):
        service.num_open_generations += 1
        status = CLIENT_GONE
        try:
            async for update in gen.updates():
                if update.error is not None:
                    status = 500
                    yield error_event(f"The engine failed this request: {update.error}")
                    return
                yield writer.chunk(update, gen, usage)
            if usage:
                yield writer.usage_chunk(gen)
            yield DONE
            status = 200
        finally:
            gen.cancel()
            service.num_open_generations -= 1
            done(status)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    return app


async def _read_body(request, max_bytes: int) -> bytes:
    """The body, refused with a 413 past `max_bytes` (before reading any of it when Content-Length says so)."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise body_too_large(length, max_bytes)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise body_too_large(f"over {max_bytes}", max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


async def _collect(gen: Generation, request):
    """Every choice's text, finish reason and error, or None when the client disconnected first (then every
    choice is cancelled)."""
    texts: dict[int, str] = defaultdict(str)
    reasons: dict[int, str | None] = {}
    errors: list[str] = []

    async def consume():
        async for u in gen.updates():
            texts[u.index] += u.text
            if u.finish_reason is not None or u.error is not None:
                reasons[u.index] = u.finish_reason
            if u.error is not None:
                errors.append(u.error)

    async def client_gone():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work, watch = asyncio.ensure_future(consume()), asyncio.ensure_future(client_gone())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            gen.cancel()
            work.cancel()
    if not work.done() or work.cancelled():
        return None
    work.result()  # re-raises an error of the consumer
    return texts, reasons, errors


__all__ = ["CLIENT_GONE", "create_app"]
