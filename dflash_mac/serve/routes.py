"""The HTTP routes of the server: OpenAI chat / completions / models, stats, metrics, health.

Handlers only validate, queue and stream; generation runs on the worker thread."""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from dflash_mac.session import Session
from dflash_mac.sizing.choice import BlockChoice

from .metrics import prometheus
from .requestlog import JOB
from .responses import Responder, collect, start_job, stream_events
from .schema import APIError, GenRequest, parse_chat, parse_completion
from .tools import ToolSupport
from .worker import Job, Ready, Worker

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
Handler = Callable[[Request], Awaitable[Response]]


@dataclass
class Settings:
    """Server-wide settings: `max_tokens` is the default and the cap of a request's max_tokens;
    requests that omit `temperature` get `default_temp` (0: greedy)."""

    api_key: str | None = None
    max_tokens: int = 4096
    block: BlockChoice = BlockChoice(8, auto=True)  # resolved for the pair at start-up
    default_temp: float = 0.0


class Routes:
    """Route handlers over one session, its worker and the model's public name."""

    def __init__(self, session: Session, worker: Worker, name: str, settings: Settings):
        self.session, self.worker, self.name, self.settings = session, worker, name, settings
        self.pair = session.pair
        self.tool_support = ToolSupport.of(self.pair.tokenizer)

    def table(self) -> list[Route]:
        g = self.guarded
        return [
            Route("/health", self.health),
            Route("/metrics", self.metrics),
            Route("/v1/dflash/stats", g(self.dflash_stats)),
            Route("/v1/models", g(self.models)),
            Route("/v1/models/{model_id:path}", g(self.model)),
            Route("/v1/chat/completions", g(self.chat), methods=["POST"]),
            Route("/v1/completions", g(self.completions), methods=["POST"]),
        ]

    def guarded(self, handler: Handler) -> Handler:
        """`handler` behind the API key (when the server has one)."""
        key = self.settings.api_key

        async def wrapped(request: Request) -> Response:
            if key is not None:  # `Authorization: Bearer` (OpenAI, Ollama) or `x-api-key`
                scheme, _, token = request.headers.get("authorization", "").partition(" ")
                token = token.strip() if scheme.lower() == "bearer" else ""
                token = token or request.headers.get("x-api-key", "").strip()
                if not token or not hmac.compare_digest(token.encode(), key.encode()):
                    raise APIError(
                        401,
                        "missing or wrong API key; send 'Authorization: Bearer <key>' "
                        "(or 'x-api-key: <key>').",
                        code="invalid_api_key",
                    )
            return await handler(request)

        return wrapped

    # -- generation -------------------------------------------------------------------------

    async def chat(self, request: Request) -> Response:
        s = self.settings
        req = parse_chat(await body_of(request), s.max_tokens, s.max_tokens, s.default_temp)
        if req.tools:
            self.give_tools(req)
        return await self.generate(request, req)

    def give_tools(self, req: GenRequest) -> None:
        """Pass the request's tools (and tool_choice) to the chat template, or a 400 when this
        model cannot call tools."""
        support = self.tool_support
        if problem := support.problem():
            raise APIError(400, problem, param="tools")
        args = {**req.template.get("chat_template_args", {}), "tools": req.tools}
        if support.takes_tool_choice and req.tool_choice is not None:
            args["tool_choice"] = req.tool_choice
        elif req.tool_choice == "required":
            raise APIError(
                400,
                "'tool_choice': 'required' cannot be enforced with this model's chat template; "
                "use 'auto' or name the function.",
                param="tool_choice",
            )
        req.template["chat_template_args"] = args

    async def completions(self, request: Request) -> Response:
        s = self.settings
        req = parse_completion(await body_of(request), s.max_tokens, s.max_tokens, s.default_temp)
        return await self.generate(request, req)

    async def start(self, request: Request, req: GenRequest) -> tuple[Job, Ready]:
        """Queue `req` (`responses.start_job`); the job is kept for the request's log line."""
        job, ready = await start_job(self.worker, req, request)
        setattr(request.state, JOB, job)
        return job, ready

    async def generate(self, request: Request, req: GenRequest) -> Response:
        job, payload = await self.start(request, req)
        out = Responder(req, self.name, payload, self.tool_support.format)
        if req.stream:
            return StreamingResponse(
                stream_events(job, out), media_type="text/event-stream", headers=SSE_HEADERS
            )
        return JSONResponse(out.whole(*await collect(job, request, out)))

    # -- models, stats, health ----------------------------------------------------------------

    def model_card(self) -> dict:
        pair = self.pair
        return {
            "id": self.name,
            "object": "model",
            "created": int(self.worker.metrics.started),
            "owned_by": "dflash-mac",
            "root": str(pair.model_id),
            "context_length": pair.context_length,
            "max_model_len": pair.context_length,
            "draft": str(pair.draft_id),
            "drafter": pair.kind,
            "block_size": self.settings.block.size,
            # agents and editors read this before they send tools (a 400 otherwise)
            "tool_calls": self.tool_support.problem() is None,
            **({"tool_calls_problem": p} if (p := self.tool_support.problem()) else {}),
        }

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self.model_card()]})

    async def model(self, request: Request) -> Response:
        wanted = request.path_params["model_id"]
        if wanted not in (self.name, str(self.pair.model_id)):
            raise APIError(
                404,
                f"model {wanted!r} is not loaded; this server serves {self.name!r}.",
                code="model_not_found",
            )
        return JSONResponse(self.model_card())

    def stats(self) -> dict:
        pair, worker = self.pair, self.worker
        return {
            "model": self.name,
            "model_id": str(pair.model_id),
            "draft_id": str(pair.draft_id),
            "drafter": pair.kind,
            "block_size": self.settings.block.size,
            "context_length": pair.context_length,
            "busy": worker.busy,
            "queued": worker.queued,
            "max_queue": worker.max_queue,
            "cached_tokens": len(self.session.state.ids),
            "prompt_cache": self.session.cache.stats(),
            "suffix_memory": self.session.tuning.answers.stats(),
            "batch": worker.batch_stats(),
            **worker.metrics.snapshot(),
        }

    async def metrics(self, request: Request) -> Response:
        if request.query_params.get("format") == "prometheus":
            return PlainTextResponse(
                prometheus(self.stats()), media_type="text/plain; version=0.0.4"
            )
        return JSONResponse(self.stats())

    async def dflash_stats(self, request: Request) -> Response:
        return JSONResponse(self.stats())

    async def health(self, request: Request) -> Response:
        return JSONResponse(
            {
                **self.worker.metrics.health(),
                "model": self.name,
                "busy": self.worker.busy,
                "queued": self.worker.queued,
            }
        )


async def body_of(request: Request) -> object:
    """The request's JSON body; a 400 when it is not JSON."""
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON ({e}).")
