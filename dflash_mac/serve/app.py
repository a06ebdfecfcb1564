"""OpenAI-compatible HTTP server (Starlette) over one DFlash `Session`.

`create_app(pair_or_session, api_key=None, ...)` returns the ASGI app; `dflash-mac serve`
(serve_cmd.py) runs it with uvicorn. Generation happens on one worker thread (serve_worker.py);
handlers only validate, queue and stream."""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from dflash_mac import __version__
from dflash_mac.pair import Pair
from dflash_mac.session import Session
from dflash_mac.think import ThinkSplitter

from .metrics import prometheus
from .schema import APIError, GenRequest, parse_chat, parse_completion
from .worker import Job, Ready, Worker

FINGERPRINT = f"dflash-mac-{__version__}"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def model_name(pair: Pair) -> str:
    """The id clients see: a Hub id as is, a local folder by its name."""
    from dflash_mac.loading import BUNDLED_TARGET

    path = Path(str(pair.model_id))
    if path.resolve() == BUNDLED_TARGET.resolve():
        return "dflash-mac-bundled"
    return path.name if path.exists() else str(pair.model_id)


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


class Responder:
    """Builds the OpenAI response objects of one request (chat or completion)."""

    def __init__(self, req: GenRequest, model: str, ready: Ready):
        self.req, self.chat = req, req.kind == "chat"
        prefix = "chatcmpl" if self.chat else "cmpl"
        self.base = {"id": f"{prefix}-{uuid.uuid4().hex[:24]}",
                     "object": "chat.completion.chunk" if self.chat else "text_completion",
                     "created": int(time.time()), "model": model,
                     "system_fingerprint": FINGERPRINT}
        self.split = ThinkSplitter(ready.think_open) if self.chat else None

    def parts(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) of a text delta."""
        if not self.split:
            return "", text
        r, c = self.split.feed(text)
        if final:
            r2, c2 = self.split.flush()
            r, c = r + r2, c + c2
        return r, c

    def chunk(self, delta: dict | None = None, text: str = "", finish: str | None = None,
              **extra: Any) -> dict:
        if self.chat:
            choice = {"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        out = {**self.base, "choices": [choice], **extra}
        if self.req.include_usage:
            out.setdefault("usage", None)
        return out

    def deltas(self, text: str, final: bool = False) -> list[dict]:
        reasoning, content = self.parts(text, final)
        if not self.chat:
            return [self.chunk(text=content)] if content else []
        out = [self.chunk({"reasoning_content": reasoning})] if reasoning else []
        return out + ([self.chunk({"content": content})] if content else [])

    def whole(self, reasoning: str, content: str, result: dict) -> dict:
        finish = result["finish_reason"]
        if self.chat:
            message = {"role": "assistant", "content": content}
            if reasoning:
                message["reasoning_content"] = reasoning
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": content, "logprobs": None, "finish_reason": finish}
            obj = "text_completion"
        return {**self.base, "object": obj, "choices": [choice], "usage": result["usage"],
                "dflash": result["dflash"]}


async def next_item(job: Job, request: Request | None) -> tuple[str, Any]:
    """The job's next item. For non-streaming requests, a client that went away (checked every
    half second) cancels the job at its next cycle."""
    while True:
        if request is not None and time.monotonic() - job.checked > 0.5:
            job.checked = time.monotonic()
            if await request.is_disconnected():
                job.cancel()
        try:
            return await asyncio.wait_for(job.items.get(), 0.5)
        except asyncio.TimeoutError:
            pass


async def stream_events(job: Job, out: Responder) -> AsyncIterator[str]:
    """SSE: role chunk, deltas, final chunk, optional usage chunk, [DONE]. Leaving early (client
    disconnect) cancels the generation at its next cycle."""
    try:
        if out.chat:
            yield sse(out.chunk({"role": "assistant", "content": ""}))
        while True:
            kind, payload = await job.items.get()
            if kind == "text":
                text, finish = payload
                for c in out.deltas(text, final=finish is not None):
                    yield sse(c)
            elif kind == "done":
                yield sse(out.chunk(finish=payload["finish_reason"], dflash=payload["dflash"]))
                if out.req.include_usage:
                    yield sse({**out.base, "choices": [], "usage": payload["usage"],
                               "dflash": payload["dflash"]})
            elif kind == "error":
                yield sse(payload.body())
            elif kind == "end":
                break
        yield sse("[DONE]")
    finally:
        job.cancel()


def create_app(pair_or_session: Any, api_key: str | None = None, max_tokens: int = 4096,
               block_size: int | None = None, default_temp: float = 0.0) -> Starlette:
    """The ASGI app. `max_tokens` is the default and the cap of a request's max_tokens;
    requests that omit `temperature` get `default_temp` (0: greedy)."""
    session = (pair_or_session if isinstance(pair_or_session, Session)
               else Session(pair_or_session))
    pair = session.pair
    worker = Worker(session, block_size)
    name = model_name(pair)

    def guarded(handler: Callable[[Request], Awaitable[Response]]):
        async def wrapped(request: Request) -> Response:
            if api_key is not None:
                scheme, _, token = request.headers.get("authorization", "").partition(" ")
                if scheme.lower() != "bearer" or not hmac.compare_digest(
                        token.strip().encode(), api_key.encode()):
                    raise APIError(401, "missing or wrong API key; send 'Authorization: Bearer "
                                   "<key>'.", code="invalid_api_key")
            return await handler(request)
        return wrapped

    async def body_of(request: Request) -> Any:
        raw = await request.body()
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON ({e}).")

    async def generate(request: Request, req: GenRequest) -> Response:
        job = Job(req, asyncio.get_running_loop())
        worker.submit(job)
        try:
            kind, payload = await next_item(job, request)
        except BaseException:
            job.cancel()
            raise
        if kind != "ready":
            raise payload if kind == "error" else APIError(503, "the server is shutting down.")
        out = Responder(req, name, payload)
        if req.stream:
            return StreamingResponse(stream_events(job, out), media_type="text/event-stream",
                                     headers=SSE_HEADERS)
        texts, result = [], None
        while (item := await next_item(job, request))[0] != "end":
            kind, payload = item
            if kind == "text":
                texts.append(payload[0])
            elif kind == "done":
                result = payload
            elif kind == "error":
                raise payload
        if result is None:
            raise APIError(499, "the request was cancelled.")
        reasoning, content = out.parts("".join(texts), final=True)
        return JSONResponse(out.whole(reasoning, content, result))

    async def chat(request: Request) -> Response:
        return await generate(request, parse_chat(await body_of(request), max_tokens,
                                                  max_tokens, default_temp))

    async def completions(request: Request) -> Response:
        return await generate(request, parse_completion(await body_of(request), max_tokens,
                                                        max_tokens, default_temp))

    def model_card() -> dict:
        return {"id": name, "object": "model", "created": int(worker.metrics.started),
                "owned_by": "dflash-mac", "root": str(pair.model_id),
                "context_length": pair.context_length, "max_model_len": pair.context_length,
                "draft": str(pair.draft_id), "drafter": pair.kind,
                "block_size": block_size or pair.block_size}

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def model(request: Request) -> Response:
        if request.path_params["model_id"] not in (name, str(pair.model_id)):
            raise APIError(404, f"model {request.path_params['model_id']!r} is not loaded; "
                           f"this server serves {name!r}.", code="model_not_found")
        return JSONResponse(model_card())

    def stats() -> dict:
        return {"model": name, "model_id": str(pair.model_id), "draft_id": str(pair.draft_id),
                "drafter": pair.kind, "block_size": block_size or pair.block_size,
                "context_length": pair.context_length, "busy": worker.busy,
                "queued": worker.queued, "cached_tokens": len(session.state.ids),
                **worker.metrics.snapshot()}

    async def metrics(request: Request) -> Response:
        if request.query_params.get("format") == "prometheus":
            return PlainTextResponse(prometheus(stats()), media_type="text/plain; version=0.0.4")
        return JSONResponse(stats())

    async def dflash_stats(request: Request) -> Response:
        return JSONResponse(stats())

    async def health(request: Request) -> Response:
        return JSONResponse({**worker.metrics.health(), "model": name, "busy": worker.busy,
                             "queued": worker.queued})

    async def api_error(request: Request, exc: Exception) -> Response:
        if isinstance(exc, HTTPException):
            exc = APIError(exc.status_code, str(exc.detail), kind="invalid_request_error")
        assert isinstance(exc, APIError)
        return JSONResponse(exc.body(), status_code=exc.status)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        worker.close()

    routes = [
        Route("/health", health),
        Route("/metrics", metrics),
        Route("/v1/dflash/stats", guarded(dflash_stats)),
        Route("/v1/models", guarded(models)),
        Route("/v1/models/{model_id:path}", guarded(model)),
        Route("/v1/chat/completions", guarded(chat), methods=["POST"]),
        Route("/v1/completions", guarded(completions), methods=["POST"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={APIError: api_error, HTTPException: api_error})
    app.state.worker, app.state.session, app.state.model_name = worker, session, name
    return app
