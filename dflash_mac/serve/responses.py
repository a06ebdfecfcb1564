"""OpenAI response objects of one request, and the SSE stream of a job."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request

from dflash_mac import __version__
from dflash_mac.engine.think import ThinkSplitter

from .logprobs import completion_logprobs
from .schema import APIError, GenRequest
from .tools import ToolFormat, ToolStream, openai_call
from .worker import Job, Ready, Worker

FINGERPRINT = f"dflash-mac-{__version__}"


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


class Responder:
    """Builds the OpenAI response objects of one request (chat or completion)."""

    def __init__(
        self, req: GenRequest, model: str, ready: Ready, tool_format: ToolFormat | None = None
    ):
        self.req, self.chat = req, req.kind == "chat"
        prefix = "chatcmpl" if self.chat else "cmpl"
        self.base = {
            "id": f"{prefix}-{uuid.uuid4().hex[:24]}",
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": int(time.time()),
            "model": model,
            "system_fingerprint": FINGERPRINT,
        }
        self.split = ThinkSplitter(ready.think_open) if self.chat else None
        self.tools = (
            ToolStream(tool_format, req.tools, req.parallel_tool_calls)
            if self.chat and req.tools and tool_format
            else None
        )
        self.calls: list[dict] = []  # OpenAI tool_calls entries so far
        self.new_calls: list[dict] = []  # those of the last delta
        self.asks_logprobs = req.sampling.get("logprobs") is not None
        self.logprobs: list[dict] = []  # every token's entry (logprobs.entries), in order
        self.sent = 0  # entries already streamed
        self.text_sent = 0  # characters of completion text streamed (text_offset)

    def add_logprobs(self, content: list[dict]) -> None:
        """The entries of the tokens whose text comes next (a worker "logprobs" item)."""
        self.logprobs += content

    def logprobs_of(self, content: list[dict], offset: int = 0) -> dict | None:
        """A choice's `logprobs` in the API's shape (None when the request did not ask)."""
        if not self.asks_logprobs:
            return None
        if self.chat:
            return {"content": content, "refusal": None}
        return completion_logprobs(content, offset)

    def parts(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) of a text delta; tool calls go to `new_calls` / `calls`."""
        if not self.split:
            return "", text
        r, c = self.split.feed(text)
        if final:
            r2, c2 = self.split.flush()
            r, c = r + r2, c + c2
        self.new_calls = []
        if self.tools:
            c, calls = self.tools.feed(c, final)
            self.new_calls = [
                openai_call(call, len(self.calls) + i) for i, call in enumerate(calls)
            ]
            self.calls += self.new_calls
        return r, c

    def finish_reason(self, reason: str) -> str:
        """`tool_calls` when the model stopped after calling tools."""
        return "tool_calls" if self.calls and reason == "stop" else reason

    def chunk(
        self, delta: dict | None = None, text: str = "", finish: str | None = None, **extra: Any
    ) -> dict:
        """One SSE chunk; it carries the log-probabilities not streamed yet."""
        pending, self.sent = self.logprobs[self.sent :], len(self.logprobs)
        lps = self.logprobs_of(pending, self.text_sent) if pending else None
        if self.chat:
            choice = {"index": 0, "delta": delta or {}, "logprobs": lps, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": lps, "finish_reason": finish}
            self.text_sent += len(text)
        out = {**self.base, "choices": [choice], **extra}
        if self.req.include_usage:
            out.setdefault("usage", None)
        return out

    def deltas(self, text: str, final: bool = False) -> list[dict]:
        reasoning, content = self.parts(text, final)
        if not self.chat:
            return [self.chunk(text=content)] if content else []
        out = [self.chunk({"reasoning_content": reasoning})] if reasoning else []
        out += [self.chunk({"content": content})] if content else []
        for call in self.new_calls:  # name first, then the arguments, as OpenAI streams them
            fn = call["function"]
            head = {**call, "function": {"name": fn["name"], "arguments": ""}}
            out.append(self.chunk({"tool_calls": [head]}))
            tail = {"index": call["index"], "function": {"arguments": fn["arguments"]}}
            out.append(self.chunk({"tool_calls": [tail]}))
        return out

    def whole(self, reasoning: str, content: str, result: dict) -> dict:
        finish = self.finish_reason(result["finish_reason"])
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if reasoning:
                message["reasoning_content"] = reasoning
            if self.calls:
                message["content"] = content or None
                message["tool_calls"] = [
                    {k: v for k, v in c.items() if k != "index"} for c in self.calls
                ]
            lps = self.logprobs_of(self.logprobs)
            choice = {"index": 0, "message": message, "logprobs": lps, "finish_reason": finish}
            obj = "chat.completion"
        else:
            lps = self.logprobs_of(self.logprobs)
            choice = {"index": 0, "text": content, "logprobs": lps, "finish_reason": finish}
            obj = "text_completion"
        return {
            **self.base,
            "object": obj,
            "choices": [choice],
            "usage": result["usage"],
            "dflash": result["dflash"],
        }


async def start_job(worker: Worker, req: GenRequest, request: Request) -> tuple[Job, Ready]:
    """Queue `req` on the worker and wait until it runs: the job and its `Ready` facts. A
    request that fails before it starts raises its `APIError`; a stopped worker, a 503."""
    job = Job(req, asyncio.get_running_loop())
    worker.submit(job)
    try:
        kind, payload = await next_item(job, request)
    except BaseException:
        job.cancel()
        raise
    if kind != "ready":
        raise payload if kind == "error" else APIError(503, "the server is shutting down.")
    return job, payload


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


async def collect(job: Job, request: Request, out: Responder) -> tuple[str, str, dict]:
    """A whole (non-streamed) answer: (reasoning, content, result); the job's error raised,
    a 499 when it was cancelled."""
    texts, result = [], None
    while (item := await next_item(job, request))[0] != "end":
        kind, payload = item
        if kind == "text":
            texts.append(payload[0])
        elif kind == "logprobs":
            out.add_logprobs(payload)
        elif kind == "done":
            result = payload
        elif kind == "error":
            raise payload
    if result is None:
        raise APIError(499, "the request was cancelled.")
    reasoning, content = out.parts("".join(texts), final=True)
    return reasoning, content, result


async def stream_events(job: Job, out: Responder) -> AsyncIterator[str]:
    """SSE: role chunk, deltas, final chunk, optional usage chunk, [DONE]. Leaving early (client
    disconnect) cancels the generation at its next cycle."""
    try:
        if out.chat:
            yield sse(out.chunk({"role": "assistant", "content": ""}))
        while True:
            kind, payload = await job.items.get()
            if kind == "logprobs":
                out.add_logprobs(payload)
            elif kind == "text":
                text, finish = payload
                for c in out.deltas(text, final=finish is not None):
                    yield sse(c)
            elif kind == "done":
                finish = out.finish_reason(payload["finish_reason"])
                yield sse(out.chunk(finish=finish, dflash=payload["dflash"]))
                if out.req.include_usage:
                    yield sse(
                        {
                            **out.base,
                            "choices": [],
                            "usage": payload["usage"],
                            "dflash": payload["dflash"],
                        }
                    )
            elif kind == "error":
                yield sse(payload.body())
            elif kind == "end":
                break
        yield sse("[DONE]")
    finally:
        job.cancel()
