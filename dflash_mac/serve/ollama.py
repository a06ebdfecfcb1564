"""Ollama-compatible routes (`/api/*`) for clients that speak Ollama's API (Open WebUI, oterm,
the `ollama` Python client, editors' Ollama providers).

Requests are translated into the OpenAI-shaped body that `schema.py` validates, so both APIs
share one set of rules and one generation path (the worker); answers are Ollama's JSON objects,
streamed as NDJSON. See docs/editors.md."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime, timedelta, timezone
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from .responses import Responder, next_item
from .routes import Routes, body_of
from .schema import APIError, GenRequest, bad, parse_chat, parse_completion
from .worker import Job

OLLAMA_VERSION = "0.12.0"  # the Ollama API level these routes follow
NDJSON = "application/x-ndjson"
THINK_LEVELS = {"low", "medium", "high"}
FLOATS = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}  # MLX dtype → Ollama
Handler = Callable[[Request], Awaitable[Response]]


def now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def ollama_errors(handler: Handler) -> Handler:
    """Errors as Ollama writes them: `{"error": "message"}`."""

    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except APIError as e:
            headers = getattr(e, "headers", None)
            return JSONResponse({"error": e.message}, status_code=e.status, headers=headers)

    return wrapped


def options_body(options: Any) -> dict:
    """Ollama `options` as OpenAI-style request fields (validated later, in schema.py)."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise bad("options", "'options' must be an object.")
    out: dict[str, Any] = {}
    for ours, theirs in (
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("top_k", "top_k"),
        ("min_p", "min_p"),
        ("seed", "seed"),
        ("stop", "stop"),
        ("presence_penalty", "presence_penalty"),
        ("frequency_penalty", "frequency_penalty"),
        ("repetition_penalty", "repeat_penalty"),
        ("block_size", "block_size"),  # ours: the request's DFlash block size
    ):
        if options.get(theirs) is not None:
            out[ours] = options[theirs]
    n = options.get("num_predict")
    if n is not None:
        if isinstance(n, bool) or not isinstance(n, int):
            raise bad("options.num_predict", "'num_predict' must be an integer.")
        if n > 0:
            out["max_tokens"] = n  # -1 (no limit) and -2 (fill the context): the server's cap
    for name, neutral in (("mirostat", 0), ("typical_p", 1), ("tfs_z", 1)):
        if options.get(name) not in (None, neutral):
            raise bad(f"options.{name}", f"'{name}' is not supported by dflash-mac serve.")
    return out


def num_ctx(options: Any) -> int | None:
    value = (options or {}).get("num_ctx") if isinstance(options, dict) else None
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise bad("options.num_ctx", "'num_ctx' must be a positive integer.")
    return value


def apply_think(req: GenRequest, think: Any) -> None:
    """Ollama's `think` as the CLI's --reasoning: true is `on` (a template without a thinking
    switch gets the CLI's sentence as a 400), a level is that level; false turns a switch off
    and, as in Ollama, is no error where there is none."""
    if think is None:
        return
    if think is False:
        args = req.template.get("chat_template_args", {})
        req.template["chat_template_args"] = {**args, "enable_thinking": False}
    elif think is True or (isinstance(think, str) and think in THINK_LEVELS):
        req.template["reasoning"] = "on" if think is True else think
    else:
        raise bad("think", "'think' must be true, false, low, medium or high.")


def format_body(fmt: Any) -> dict:
    """Ollama's `format`: "json" (any JSON object) or a JSON schema, as OpenAI's
    `response_format` (enforced by a grammar, schema.py)."""
    if fmt in (None, ""):
        return {}
    if fmt == "json":
        return {"response_format": {"type": "json_object"}}
    if isinstance(fmt, dict):
        return {"response_format": {"type": "json_schema", "json_schema": {"schema": fmt}}}
    raise bad("format", "'format' must be \"json\" or a JSON schema object.")


def chat_messages(messages: Any) -> list[dict]:
    """Ollama messages as OpenAI messages (tool-call arguments are objects in both)."""
    if not isinstance(messages, list):
        raise bad("messages", "'messages' must be a list.")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}]", "each message must be an object.")
        if m.get("images"):
            raise bad(f"messages[{i}].images", "images are not supported (text only).")
        msg = {k: m[k] for k in ("role", "content", "tool_calls") if k in m}
        if m.get("role") == "tool" and isinstance(m.get("tool_name"), str):
            msg["name"] = m["tool_name"]
        out.append(msg)
    return out


def common_body(body: dict) -> dict:
    return {
        "model": body.get("model"),
        "stream": body.get("stream", True),  # Ollama streams unless told not to
        **options_body(body.get("options")),
        **format_body(body.get("format")),
    }


class OllamaRoutes:
    """`/api/*` over the same session, worker and settings as the OpenAI routes."""

    def __init__(self, routes: Routes):
        self.routes = routes

    def table(self) -> list[Route]:
        def g(h: Handler) -> Handler:
            return ollama_errors(self.routes.guarded(h))

        return [
            Route("/", self.root),
            Route("/api/version", ollama_errors(self.version)),
            Route("/api/tags", g(self.tags)),
            Route("/api/ps", g(self.ps)),
            Route("/api/show", g(self.show), methods=["POST"]),
            Route("/api/chat", g(self.chat), methods=["POST"]),
            Route("/api/generate", g(self.generate), methods=["POST"]),
        ]

    # -- the model ------------------------------------------------------------------------------

    @property
    def tag(self) -> str:
        return f"{self.routes.name}:latest"

    def details(self) -> dict:
        cfg = self.routes.pair.target_config
        text = cfg.get("text_config", cfg)
        family = str(text.get("model_type") or cfg.get("model_type") or "unknown")
        return {
            "parent_model": "",
            "format": "mlx",
            "family": family,
            "families": [family],
            "parameter_size": f"{self.parameters() / 1e9:.2f}B",
            "quantization_level": self.quantization_level(),
        }

    def quantization_level(self) -> str:
        """Ollama's name for how the weights are stored: `Q4` / `Q8` from the quantization
        bits, else the floating dtype that holds most of them (`F32`, `F16`, `BF16`)."""
        import mlx.core as mx
        from mlx.utils import tree_flatten

        pair = self.routes.pair
        if bits := (pair.target_config.get("quantization") or {}).get("bits"):
            return f"Q{bits}"
        sizes: dict[str, int] = {}
        for _, v in tree_flatten(pair.target.parameters()):
            if mx.issubdtype(v.dtype, mx.floating):
                name = str(v.dtype).rpartition(".")[2]
                sizes[name] = sizes.get(name, 0) + v.size
        most = max(sizes, key=sizes.get) if sizes else ""
        return FLOATS.get(most, most.upper() or "unknown")

    def parameters(self) -> int:
        from mlx.utils import tree_flatten

        return sum(v.size for _, v in tree_flatten(self.routes.pair.target.parameters()))

    def size(self) -> int:
        from mlx.utils import tree_flatten

        return sum(v.nbytes for _, v in tree_flatten(self.routes.pair.target.parameters()))

    def card(self) -> dict:
        digest = hashlib.sha256(str(self.routes.pair.model_id).encode()).hexdigest()
        started = datetime.fromtimestamp(self.routes.worker.metrics.started, timezone.utc)
        return {
            "name": self.tag,
            "model": self.tag,
            "modified_at": started.isoformat().replace("+00:00", "Z"),
            "size": self.size(),
            "digest": digest,
            "details": self.details(),
        }

    async def root(self, request: Request) -> Response:
        """Ollama clients probe `/` to see whether a server runs."""
        return PlainTextResponse("dflash-mac is running (OpenAI API at /v1, Ollama API at /api)")

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": OLLAMA_VERSION})

    async def tags(self, request: Request) -> Response:
        return JSONResponse({"models": [self.card()]})

    async def ps(self, request: Request) -> Response:
        expires = datetime.now(timezone.utc) + timedelta(days=365)
        card = self.card()
        card.update(
            expires_at=expires.isoformat().replace("+00:00", "Z"),
            size_vram=card["size"],
            context_length=self.routes.pair.context_length,
        )
        return JSONResponse({"models": [card]})

    async def show(self, request: Request) -> Response:
        body = await body_of(request)
        if not isinstance(body, dict):
            raise bad("body", "the request body must be a JSON object.")
        # Any name, as the generation routes take any (clients use `dflash-mac`, docs/editors.md).
        pair, details = self.routes.pair, self.details()
        arch = details["family"]
        capabilities = ["completion"]
        if self.routes.tool_support.problem() is None:
            capabilities.append("tools")
        return JSONResponse(
            {
                "modelfile": f"FROM {pair.model_id}\n",
                "parameters": "",
                "template": getattr(pair.tokenizer, "chat_template", None) or "",
                "details": details,
                "model_info": {
                    "general.architecture": arch,
                    "general.parameter_count": self.parameters(),
                    f"{arch}.context_length": pair.context_length,
                    "dflash.draft": str(pair.draft_id),
                    "dflash.block_size": self.routes.settings.block.size,
                },
                "capabilities": capabilities,
                "modified_at": self.card()["modified_at"],
            }
        )

    # -- generation -------------------------------------------------------------------------------

    async def chat(self, request: Request) -> Response:
        body = await body_of(request)
        if not isinstance(body, dict):
            raise bad("body", "the request body must be a JSON object.")
        if not body.get("messages"):
            return self.loaded(body, "message")
        oa = {**common_body(body), "messages": chat_messages(body["messages"])}
        if body.get("tools"):
            oa["tools"] = body["tools"]
        s = self.routes.settings
        req = parse_chat(oa, s.max_tokens, s.max_tokens, s.default_temp)
        apply_think(req, body.get("think"))
        if req.tools:
            self.routes.give_tools(req)
        req.context_cap = num_ctx(body.get("options"))
        return await self.run(request, req, "message")

    async def generate(self, request: Request) -> Response:
        body = await body_of(request)
        if not isinstance(body, dict):
            raise bad("body", "the request body must be a JSON object.")
        for name in ("template", "suffix", "images", "context"):
            if body.get(name):
                raise bad(name, f"'{name}' is not supported by dflash-mac serve's /api/generate.")
        prompt = body.get("prompt")
        if prompt in (None, ""):
            return self.loaded(body, "response")
        if not isinstance(prompt, str):
            raise bad("prompt", "'prompt' must be a string.")
        s = self.routes.settings
        if body.get("raw"):
            req = parse_completion(
                {**common_body(body), "prompt": prompt}, s.max_tokens, s.max_tokens, s.default_temp
            )
        else:
            system = body.get("system")
            messages = [{"role": "system", "content": system}] if system else []
            oa = {
                **common_body(body),
                "messages": [*messages, {"role": "user", "content": prompt}],
            }
            req = parse_chat(oa, s.max_tokens, s.max_tokens, s.default_temp)
            apply_think(req, body.get("think"))
        req.context_cap = num_ctx(body.get("options"))
        return await self.run(request, req, "response")

    def loaded(self, body: dict, field: str) -> Response:
        """An empty prompt loads the model in Ollama: here it is always loaded."""
        out = {"model": body.get("model") or self.tag, "created_at": now(), "done": True}
        out["done_reason"] = "load"
        out[field] = {"role": "assistant", "content": ""} if field == "message" else ""
        return JSONResponse(out)

    async def run(self, request: Request, req: GenRequest, field: str) -> Response:
        began = time.perf_counter()
        job, payload = await self.routes.start(request, req)
        out = Responder(req, self.routes.name, payload, self.routes.tool_support.format)
        model = req.model or self.tag
        answer = Answer(out, model, field, began)
        if req.stream:
            return StreamingResponse(answer.lines(job), media_type=NDJSON)
        while (item := await next_item(job, request))[0] != "end":
            kind, payload = item
            if kind == "text":
                answer.add(*payload)
            elif kind == "done":
                answer.result = payload
            elif kind == "error":
                raise payload
        if answer.result is None:
            raise APIError(499, "the request was cancelled.")
        return JSONResponse(answer.final(whole=True))


class Answer:
    """Builds the Ollama objects of one answer (`message` for chat, `response` for generate)."""

    def __init__(self, out: Responder, model: str, field: str, began: float):
        self.out, self.model, self.field, self.began = out, model, field, began
        self.thinking, self.content, self.calls = "", "", []
        self.result: dict | None = None

    def add(self, text: str, finish: str | None) -> tuple[str, str, list[dict]]:
        reasoning, content = self.out.parts(text, final=finish is not None)
        calls = [
            {"function": {"name": c["function"]["name"], "arguments": self.args(c)}}
            for c in self.out.new_calls
        ]
        self.thinking, self.content = self.thinking + reasoning, self.content + content
        self.calls += calls
        return reasoning, content, calls

    @staticmethod
    def args(call: dict) -> Any:
        try:
            return json.loads(call["function"]["arguments"])
        except json.JSONDecodeError:
            return call["function"]["arguments"]

    def piece(self, thinking: str, content: str, calls: list[dict], done: bool) -> dict:
        obj: dict[str, Any] = {"model": self.model, "created_at": now()}
        if self.field == "message":
            msg: dict[str, Any] = {"role": "assistant", "content": content}
            if thinking:
                msg["thinking"] = thinking
            if calls:
                msg["tool_calls"] = calls
            obj["message"] = msg
        else:
            obj["response"] = content
            if thinking:
                obj["thinking"] = thinking
        obj["done"] = done
        return obj

    def final(self, whole: bool) -> dict:
        r = self.result or {}
        if whole:
            obj = self.piece(self.thinking, self.content, self.calls, True)
        else:
            obj = self.piece("", "", [], True)
        usage, ext = r.get("usage", {}), r.get("dflash", {})
        n = usage.get("completion_tokens", 0)
        eval_s = n / ext["decode_tps"] if ext.get("decode_tps") else 0.0
        finish = self.out.finish_reason(r.get("finish_reason") or "stop")
        obj.update(
            done_reason="stop" if finish == "tool_calls" else finish,
            total_duration=int((time.perf_counter() - self.began) * 1e9),
            load_duration=0,
            prompt_eval_count=usage.get("prompt_tokens", 0),
            prompt_eval_duration=int(ext.get("ttft_s", 0.0) * 1e9),
            eval_count=n,
            eval_duration=int(eval_s * 1e9),
            dflash=ext,
        )
        return obj

    async def lines(self, job: Job) -> AsyncIterator[str]:
        """NDJSON: one object per delta, then the final one with the counts."""
        try:
            while True:
                kind, payload = await job.items.get()
                if kind == "text":
                    thinking, content, calls = self.add(*payload)
                    if thinking or content or calls:
                        yield json.dumps(self.piece(thinking, content, calls, False)) + "\n"
                elif kind == "done":
                    self.result = payload
                    yield json.dumps(self.final(whole=False)) + "\n"
                elif kind == "error":
                    yield json.dumps({"error": payload.message}) + "\n"
                elif kind == "end":
                    break
        finally:
            job.cancel()
