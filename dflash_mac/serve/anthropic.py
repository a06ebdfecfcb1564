"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) for Claude Code
and the agent frameworks that speak it to local servers.

As with the Ollama routes, a request is translated into the OpenAI-shaped body `schema.py`
validates, so all three APIs share one set of rules, one tool-call parser and one generation
path (the worker); answers are Anthropic's message objects, streamed as its typed SSE events.
See docs/editors.md."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from dflash_mac.api import reasoning_args
from dflash_mac.errors import PromptError

from .responses import Responder, collect
from .routes import SSE_HEADERS, Routes, body_of
from .schema import APIError, GenRequest, bad, parse_chat
from .worker import Job

Handler = Callable[[Request], Awaitable[Response]]
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


def anthropic_errors(handler: Handler) -> Handler:
    """Errors as Anthropic writes them: `{"type": "error", "error": {"type", "message"}}`."""

    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except APIError as e:
            return JSONResponse(
                error_body(e), status_code=e.status, headers=getattr(e, "headers", None)
            )

    return wrapped


def error_body(e: APIError) -> dict:
    """Anthropic's error object; a 4xx it has no name for is the request's fault."""
    kind = ERROR_TYPES.get(e.status, "invalid_request_error" if e.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


def text_of(content: Any, where: str) -> str:
    """A string, or the text of a list of text blocks."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(where, f"'{where}' must be a string or a list of content blocks.")
    texts = []
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise bad(f"{where}[{j}]", f"only text blocks are supported here (got {kind!r}).")
        texts.append(str(block.get("text", "")))
    return "".join(texts)


def openai_messages(messages: Any) -> list[dict]:
    """Anthropic `messages` as OpenAI chat messages: tool_use blocks become an assistant's
    `tool_calls`, tool_result blocks `tool` messages (before the user's text)."""
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "'messages' must be a non-empty list.")
    out: list[dict] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise bad(f"{where}.role", "each message needs a role of 'user' or 'assistant'.")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": m["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise bad(f"{where}.content", "'content' must be a string or a list of blocks.")
        texts, calls, results = [], [], []
        for j, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            at = f"{where}.content[{j}]"
            if kind == "text":
                texts.append(str(block.get("text", "")))
            elif kind == "tool_use" and m["role"] == "assistant":
                args = json.dumps(block.get("input") or {})
                fn = {"name": str(block.get("name", "")), "arguments": args}
                calls.append({"id": str(block.get("id", "")), "type": "function", "function": fn})
            elif kind == "tool_result" and m["role"] == "user":
                text = text_of(block.get("content", ""), f"{at}.content")
                if block.get("is_error"):
                    text = f"Error: {text}"
                results.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")),
                                "content": text})  # fmt: skip
            elif kind in ("thinking", "redacted_thinking"):
                continue  # earlier reasoning is not sent back to the template
            elif kind in ("image", "document"):
                raise bad(at, f"{kind} blocks are not supported: this server runs text models.")
            else:
                raise bad(at, f"unsupported content block type {kind!r} for role {m['role']!r}.")
        out += results
        if m["role"] == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
        elif texts or not results:
            out.append({"role": "user", "content": "".join(texts)})
    return out


def openai_tools(tools: Any, choice: Any) -> dict:
    """`tools` / `tool_choice` in OpenAI's shapes."""
    if tools is None:
        return {}
    if not isinstance(tools, list):
        raise bad("tools", "'tools' must be a list.")
    out: dict[str, Any] = {"tools": []}
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise bad(f"tools[{i}]", "each tool needs a 'name'.")
        fn = {"name": t["name"], "description": t.get("description", "")}
        fn["parameters"] = t.get("input_schema") or {"type": "object", "properties": {}}
        out["tools"].append({"type": "function", "function": fn})
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind == "tool":
            out["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
        elif kind in ("auto", "any", "none"):
            out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
        else:
            raise bad("tool_choice", "'tool_choice' must be {'type': auto | any | tool | none}.")
    return out


def openai_body(body: Any) -> dict:
    """The OpenAI chat body of an Anthropic Messages request."""
    if not isinstance(body, dict):
        raise bad("body", "the request body must be a JSON object.")
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise bad("max_tokens", "'max_tokens' is required: a positive integer.")
    messages = openai_messages(body.get("messages"))
    if body.get("system") not in (None, "", []):
        messages.insert(0, {"role": "system", "content": text_of(body["system"], "system")})
    out: dict[str, Any] = {"messages": messages, "max_tokens": max_tokens}
    for key in ("model", "temperature", "top_p", "top_k", "stream", "block_size"):
        if body.get(key) is not None:
            out[key] = body[key]
    if body.get("stop_sequences"):
        out["stop"] = body["stop_sequences"]
    return out | openai_tools(body.get("tools"), body.get("tool_choice"))


def apply_thinking(req: GenRequest, thinking: Any, tokenizer: Any) -> None:
    """Anthropic's `thinking` as the CLI's --reasoning. `enabled` (or `adaptive`) is `on` where
    the chat template has a thinking mode (a switch or effort levels); elsewhere the model
    answers without one, as documented: Claude Code may send it to any model it is pointed at,
    and a 400 would end the session. `disabled` turns a switch off, like Ollama's
    `think: false` (harmless for templates without one)."""
    if thinking is None:
        return
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind in ("enabled", "adaptive"):
        try:
            reasoning_args(tokenizer, "on")
        except PromptError:
            return  # no thinking mode in this template
        req.template["reasoning"] = "on"
    elif kind == "disabled":
        args = req.template.get("chat_template_args", {})
        req.template["chat_template_args"] = {**args, "enable_thinking": False}
    else:
        raise bad("thinking", "'thinking' must be {'type': enabled | adaptive | disabled}.")


def usage(result: dict) -> dict:
    u = result["usage"]
    cached = u["prompt_tokens_details"]["cached_tokens"]
    return {
        "input_tokens": u["prompt_tokens"] - cached,
        "output_tokens": u["completion_tokens"],
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def stop_of(out: Responder, result: dict) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence)."""
    finish = out.finish_reason(result["finish_reason"])
    if finish == "stop" and result.get("stop_sequence"):
        return "stop_sequence", result["stop_sequence"]
    return STOP_REASONS.get(finish, "end_turn"), None


def tool_block(call: dict) -> dict:
    fn = call["function"]
    try:
        args = json.loads(fn["arguments"] or "{}")
    except json.JSONDecodeError:
        args = {"_raw": fn["arguments"]}
    return {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"),
            "name": fn["name"], "input": args}  # fmt: skip


def sse(event: str, data: dict) -> str:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n"


class AnthropicRoutes:
    """`/v1/messages` over the same session, worker and settings as the OpenAI routes."""

    def __init__(self, routes: Routes):
        self.routes = routes

    def table(self) -> list[Route]:
        def g(h: Handler) -> Handler:
            return anthropic_errors(self.routes.guarded(h))

        return [
            Route("/v1/messages", g(self.messages), methods=["POST"]),
            Route("/v1/messages/count_tokens", g(self.count_tokens), methods=["POST"]),
        ]

    def request(self, body: Any) -> GenRequest:
        s = self.routes.settings
        req = parse_chat(openai_body(body), s.max_tokens, s.max_tokens, s.default_temp)
        apply_thinking(req, body.get("thinking"), self.routes.pair.tokenizer)
        if req.tools:
            self.routes.give_tools(req)
        return req

    async def count_tokens(self, request: Request) -> Response:
        body = await body_of(request)
        if isinstance(body, dict) and "max_tokens" not in body:
            body = {**body, "max_tokens": 1}  # count_tokens takes no max_tokens
        req = self.request(body)
        try:  # tokenizing only (no MLX): fine on the event loop
            ids = self.routes.session.tokenize(req.prompt, **req.template)
        except PromptError as e:
            raise APIError(400, str(e))
        except Exception as e:  # the messages don't fit the template: the worker's 400 too
            raise APIError(400, f"could not build the prompt: {e}")
        return JSONResponse({"input_tokens": len(ids)})

    async def messages(self, request: Request) -> Response:
        req = self.request(await body_of(request))
        job, ready = await self.routes.start(request, req)
        out = Responder(req, self.routes.name, ready, self.routes.tool_support.format)
        base = {"id": "msg_" + uuid.uuid4().hex[:24], "type": "message", "role": "assistant",
                "model": self.routes.name}  # fmt: skip
        if req.stream:
            events = self.stream(job, out, base, ready.prompt_tokens)
            return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
        reasoning, content, result = await collect(job, request, out)
        blocks = [{"type": "thinking", "thinking": reasoning, "signature": ""}] if reasoning else []
        blocks += [{"type": "text", "text": content}] if content or not out.calls else []
        blocks += [tool_block(c) for c in out.calls]
        reason, seq = stop_of(out, result)
        return JSONResponse(
            {
                **base,
                "content": blocks,
                "stop_reason": reason,
                "stop_sequence": seq,
                "usage": usage(result),
            }  # fmt: skip
        )

    async def stream(self, job: Job, out: Responder, base: dict, prompt: int) -> AsyncIterator[str]:
        """message_start, a content block per kind of output (text deltas as they come, a
        tool_use block per parsed call), message_delta with the stop reason, message_stop.
        Leaving early (client disconnect) cancels the generation at its next cycle."""
        open_kind, index = None, -1
        kinds: set[str] = set()  # block kinds opened so far

        def switch(kind: str, start: dict) -> list[str]:
            nonlocal open_kind, index
            kinds.add(kind)
            events = [sse("content_block_stop", {"type": "content_block_stop", "index": index})]
            events = events if open_kind else []
            index += 1
            open_kind = kind
            block = {"type": "content_block_start", "index": index, "content_block": start}
            return events + [sse("content_block_start", block)]

        def delta(d: dict) -> str:
            return sse("content_block_delta", {"type": "content_block_delta", "index": index,
                                               "delta": d})  # fmt: skip

        try:
            start = {**base, "content": [], "stop_reason": None, "stop_sequence": None,
                     "usage": {"input_tokens": prompt, "output_tokens": 0}}  # fmt: skip
            yield sse("message_start", {"type": "message_start", "message": start})
            while (item := await job.items.get())[0] != "end":
                kind, payload = item
                if kind == "text":
                    reasoning, content = out.parts(payload[0], final=payload[1] is not None)
                    if reasoning:
                        if open_kind != "thinking":
                            for e in switch("thinking", {"type": "thinking", "thinking": ""}):
                                yield e
                        yield delta({"type": "thinking_delta", "thinking": reasoning})
                    if content:
                        if open_kind != "text":
                            for e in switch("text", {"type": "text", "text": ""}):
                                yield e
                        yield delta({"type": "text_delta", "text": content})
                    for call in out.new_calls:
                        block = tool_block(call)
                        args = json.dumps(block.pop("input"))
                        for e in switch("tool_use", {**block, "input": {}}):
                            yield e
                        yield delta({"type": "input_json_delta", "partial_json": args})
                elif kind == "done":
                    if "text" not in kinds and not out.calls:  # the blocks a whole answer has
                        for e in switch("text", {"type": "text", "text": ""}):
                            yield e
                    yield sse("content_block_stop", {"type": "content_block_stop",
                                                     "index": index})  # fmt: skip
                    reason, seq = stop_of(out, payload)
                    yield sse("message_delta", {"type": "message_delta", "usage": usage(payload),
                              "delta": {"stop_reason": reason, "stop_sequence": seq}})  # fmt: skip
                    yield sse("message_stop", {"type": "message_stop"})
                elif kind == "error":
                    yield sse("error", error_body(payload))
        finally:
            job.cancel()
