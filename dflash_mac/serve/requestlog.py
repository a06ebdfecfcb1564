"""One log line per HTTP request (method, route, status, and for a generation its tokens,
tok/s and τ; for an error the sentence the client got), written when the response has ended,
streamed ones included.

Levels say who cares: DEBUG for the routes launchers poll, WARNING for a client's error
(4xx), ERROR for the server's (5xx), INFO for the rest; `serve --log-level` picks what the
terminal shows (command.py)."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("dflash_mac.serve.requests")
POLLED = ("/health", "/metrics")  # launchers (the menu bar) poll these every few seconds
JOB = "dflash_job"  # the request state's key for its generation job (`routes.Routes.start`)


def level_of(path: str, status: int) -> int:
    if status >= 500:
        return logging.ERROR
    if status >= 400:
        return logging.WARNING
    return logging.DEBUG if path in POLLED else logging.INFO


def error_message(body: bytes) -> str | None:
    """The sentence of an error body: OpenAI's and Anthropic's `error.message`, Ollama's
    `error` string, else None."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return None
    if isinstance(error, dict):
        error = error.get("message")
    return error if isinstance(error, str) and error else None


def request_line(
    method: str,
    path: str,
    status: int,
    result: dict | None,
    seconds: float,
    error: str | None = None,
) -> str:
    """`POST /v1/chat/completions 200 · 64 tok · 95.3 tok/s · τ 3.41 · 0.71 s`, or for an
    error `POST /v1/chat/completions 400 · 0.00 s · <the sentence the client got>`."""
    parts = [f"{method} {path} {status}"]
    if result:
        d = result["dflash"]
        parts += [
            f"{result['usage']['completion_tokens']} tok",
            f"{d['decode_tps']:.1f} tok/s",
            f"τ {d['tau']:.2f}",
        ]
        if result["finish_reason"] not in ("stop", "length"):
            parts.append(str(result["finish_reason"]))
    parts.append(f"{seconds:.2f} s")
    if error:
        parts.append(error)
    return " · ".join(parts)


class RequestLog:
    """ASGI middleware: logs each request's line once its response is over."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        began, status = time.perf_counter(), 500  # 500: the app raised before answering
        state: dict[str, Any] = scope.setdefault("state", {})
        body = bytearray()  # an error's body, for its sentence (errors are small JSON)

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and status >= 400 and len(body) < 8192:
                body.extend(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            path = scope["path"]
            job = state.get(JOB)
            result = getattr(job, "result", None)
            seconds, error = (
                time.perf_counter() - began,
                error_message(bytes(body)) if body else None,
            )
            line = request_line(scope["method"], path, status, result, seconds, error)
            log.log(level_of(path, status), line)
