"""Tool calling for `dflash-mac serve`: does the chat template take `tools`, and which tool calls
did the model write.

Formats: mlx-lm's own parsers wherever its tokenizer wrapper found one for the template (Qwen3
`<tool_call>` JSON, Qwen3-Coder / Qwen3.5 `<tool_call><function=…>`, Mistral, GLM, Kimi, …),
and Llama 3.x here (the whole answer is one JSON object `{"name": …, "parameters": …}`, as its
template asks). `ToolStream` takes content deltas and holds tool-call text back, so clients see
content and tool calls apart, streamed or not (docs/editors.md)."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from dflash_mac.engine.textstream import held_suffix

log = logging.getLogger("dflash_mac.serve")
PYTHON_TAG = "<|python_tag|>"

Parser = Callable[[str, Any], Any]


@dataclass(frozen=True)
class ToolFormat:
    """How one model family writes tool calls: the text between `start` and `end` goes to
    `parse`; an empty `start` means the whole answer is a call when it starts with `{`."""

    name: str
    start: str
    end: str
    parse: Parser


def template_text(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # named templates: the default one, else all of them
        template = template.get("default") or "\n".join(map(str, template.values()))
    return template if isinstance(template, str) else ""


@lru_cache(maxsize=8)
def template_variables(template: str) -> frozenset[str]:
    """The variables a Jinja chat template reads (empty when it does not parse)."""
    from jinja2 import Environment, meta

    try:
        return frozenset(meta.find_undeclared_variables(Environment().parse(template)))
    except Exception:  # a template jinja2 cannot read: the tokenizer will say so later
        return frozenset()


def parse_llama3(text: str, tools: Any = None) -> list[dict]:
    """One or more JSON objects `{"name": …, "parameters"|"arguments": {…}}`, separated by
    whitespace or `;`."""
    text = text.strip().removeprefix(PYTHON_TAG).strip()
    decoder, calls, i = json.JSONDecoder(), [], 0
    while i < len(text):
        obj, i = decoder.raw_decode(text, i)
        args = obj.get("parameters", obj.get("arguments")) if isinstance(obj, dict) else None
        if not isinstance(obj.get("name") if isinstance(obj, dict) else None, str) or not (
            isinstance(args, dict)
        ):
            raise ValueError("not a tool call object")
        calls.append({"name": obj["name"], "arguments": args})
        while i < len(text) and text[i] in " \t\r\n;":
            i += 1
    if not calls:
        raise ValueError("no tool call")
    return calls


LLAMA3 = ToolFormat("llama3_json", "", "", parse_llama3)


def tool_format(tokenizer: Any) -> ToolFormat | None:
    """The tool-call format of the model behind `tokenizer`, or None when none is known."""
    if getattr(tokenizer, "has_tool_calling", False) and getattr(tokenizer, "tool_parser", None):
        parser = tokenizer.tool_parser
        name = getattr(parser, "__module__", "mlx_lm").rsplit(".", 1)[-1]
        return ToolFormat(name, tokenizer.tool_call_start, tokenizer.tool_call_end, parser)
    template = template_text(tokenizer)
    if "<|start_header_id|>" in template and ('"parameters"' in template or PYTHON_TAG in template):
        return LLAMA3
    return None


@dataclass(frozen=True)
class ToolSupport:
    """What the loaded model's chat template can do with tools."""

    takes_tools: bool  # the template renders `tools`
    takes_tool_choice: bool
    format: ToolFormat | None

    @classmethod
    def of(cls, tokenizer: Any) -> ToolSupport:
        names = template_variables(template_text(tokenizer))
        return cls("tools" in names, "tool_choice" in names, tool_format(tokenizer))

    def problem(self) -> str | None:
        """Why tool requests cannot be served, or None."""
        if not self.takes_tools:
            return (
                "this model's chat template does not take tools, so it cannot call them; "
                "describe the tools in the prompt instead."
            )
        if self.format is None:
            return "no tool-call parser is known for this model's output format."
        return None


def openai_call(call: dict, index: int | None = None) -> dict:
    """A parsed call as an OpenAI `tool_calls` entry (with `index` when streamed)."""
    args = call.get("arguments", {})
    out = {
        "id": call.get("id") or f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {
            "name": call["name"],
            "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False),
        },
    }
    return out if index is None else {"index": index, **out}


class ToolStream:
    """Feed content deltas; get (content, new tool calls) back. Tool-call text is held back
    and parsed when its end marker (or the answer's end) arrives; text that does not parse is
    given back as content."""

    def __init__(self, fmt: ToolFormat, tools: list | None = None, parallel: bool = True):
        self.fmt, self.tools, self.parallel = fmt, tools, parallel
        self.buf, self.inside, self.pending_ws = "", False, ""
        self.decided = bool(fmt.start)  # start-less formats decide on the first character
        self.calls: list[dict] = []

    def _parse(self, text: str) -> list[dict] | None:
        try:
            parsed = self.fmt.parse(text.strip(), self.tools)
        except Exception as e:  # ValueError, JSONDecodeError, …: not a call after all
            log.warning("could not parse a tool call (%s): %r", e, text[:200])
            return None
        calls = parsed if isinstance(parsed, list) else [parsed]
        if not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
            return None
        return calls

    def _take(self, calls: list[dict]) -> list[dict]:
        if not self.parallel:
            calls = calls[: max(0, 1 - len(self.calls))]
        self.calls += calls
        return calls

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        self.buf += text
        out, new = "", []
        if not self.decided:
            head = self.buf.lstrip()
            if head[:1] == "{" or head.startswith(PYTHON_TAG):
                self.decided, self.inside = True, True
            elif head and not PYTHON_TAG.startswith(head):
                self.decided = True
            elif not final:
                return "", []
        start, end = self.fmt.start, self.fmt.end
        while start or not self.inside:
            if not start:  # a start-less format that is plain content
                out, self.buf = out + self.buf, ""
                break
            if not self.inside:
                i = self.buf.find(start)
                if i >= 0:
                    out += self.buf[:i]
                    self.buf, self.inside = self.buf[i + len(start) :], True
                    continue
                keep = 0 if final else held_suffix(self.buf, [start])
                out += self.buf[: len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep :]
                break
            j = self.buf.find(end) if end else -1
            if j < 0:
                break
            body, self.buf = self.buf[:j], self.buf[j + len(end) :]
            calls = self._parse(body)
            self.inside = False
            if calls is None:
                out += f"{start}{body}{end}"
            else:
                new += self._take(calls)
        if final and self.inside:  # the answer ended inside a call (no end marker)
            calls = self._parse(self.buf)
            if calls is None:
                out += f"{start}{self.buf}"
            else:
                new += self._take(calls)
            self.buf, self.inside = "", False
        return self._content(out, final), new

    def _content(self, out: str, final: bool) -> str:
        """Whitespace before a call, between calls or after the last one is not content; it is
        held until text (or the end of an answer without calls) follows."""
        out = self.pending_ws + out
        body = out.rstrip()
        self.pending_ws = out[len(body) :]
        if final:
            body += "" if self.calls else self.pending_ws
            self.pending_ws = ""
        return body
