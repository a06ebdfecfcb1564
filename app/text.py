"""Text helpers for the chat app: <think> splitting (streamed and whole), fence repair,
unfenced code detection."""

from __future__ import annotations

import re

OPEN, CLOSE = "<think>", "</think>"
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def printable(text: str) -> str:
    """Model text safe for the screen: C0 control characters (escape sequences from a noisy
    model would reach the terminal) become Unicode control pictures (␛); \n and \t stay."""
    return CONTROL.sub(
        lambda m: chr(0x2421 if m.group() == "\x7f" else 0x2400 + ord(m.group())), text
    )


def _held(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ThinkSplitter:
    """Splits streamed text into (thinking, answer) fragments at <think> / </think> tags,
    holding back a tag cut in half by a chunk boundary."""

    def __init__(self, thinking: bool = False):
        self.thinking = thinking
        self.seen_answer = False
        self._buf = ""

    def feed(self, text: str) -> list[tuple[str, str]]:
        """Returns [(kind, fragment)] with kind "thinking" or "answer", in order."""
        self._buf += text
        out: list[tuple[str, str]] = []
        while self._buf:
            if self.thinking:
                tag = CLOSE
            elif not self.seen_answer:  # a thinking section can only open before the answer
                tag = OPEN
            else:
                self._emit(out, self._buf)
                self._buf = ""
                break
            i = self._buf.find(tag)
            if i >= 0:
                self._emit(out, self._buf[:i])
                self._buf = self._buf[i + len(tag) :]
                self.thinking = not self.thinking
                continue
            keep = _held(self._buf, tag)
            self._emit(out, self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep :]
            break
        return out

    def flush(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        self._emit(out, self._buf)
        self._buf = ""
        return out

    def _emit(self, out: list[tuple[str, str]], text: str) -> None:
        if not text:
            return
        kind = "thinking" if self.thinking else "answer"
        if kind == "answer":
            if not self.seen_answer:
                text = text.lstrip("\n")
                if not text:
                    return
            self.seen_answer = True
        out.append((kind, text))


def split_think(text: str) -> tuple[str, str]:
    """(thinking, answer) of a whole message; a leading section closed by </think> without an
    opening tag (templates that open it in the prompt) counts as thinking."""
    starts_open = CLOSE in text and OPEN not in text.split(CLOSE, 1)[0]
    splitter = ThinkSplitter(thinking=starts_open)
    parts = splitter.feed(text) + splitter.flush()
    thinking = "".join(t for k, t in parts if k == "thinking")
    answer = "".join(t for k, t in parts if k == "answer")
    return thinking.strip("\n"), answer


def close_fences(text: str) -> str:
    """What to append to `text` so that an unclosed ``` / ~~~ code fence is closed ("" if none)."""
    opener: str | None = None
    for line in text.splitlines():
        m = FENCE.match(line)
        if not m:
            continue
        mark = m.group(1)
        if opener is None:
            opener = mark
        elif mark[0] == opener[0] and len(mark) >= len(opener) and not m.group(2).strip():
            opener = None
    if opener is None:
        return ""
    return ("" if text.endswith("\n") else "\n") + opener + "\n"


# Lines that start code in an answer that forgot its fences (small models write Python bare).
CODE_START = re.compile(
    r"^(async\s+def|def|class)\s+\w+.*[:(]|^(import|from)\s+[\w.]+"
    r"|^(if|elif|for|while|with|try|except|finally|else)\b.*:\s*(#.*)?$"
    r"|^(return|raise|yield|assert|pass|break|continue)\b|^print\(|^@\w"
    r"|^#!|^#include\b|^(const|let|var|function)\s+\w|^[}\])]"
)
ASSIGN = re.compile(r"^[A-Za-z_][\w.\[\]'\"]*(\s*,\s*[A-Za-z_][\w.]*)*\s*[-+*/%|&^]?=(?!=)\s*\S")
CALL = re.compile(r"^[A-Za-z_][\w.]*\(.*\)[;:]?$")
PYTHON = re.compile(r"^\s*(def|class|import|from|elif|print\()|:\s*$", re.MULTILINE)
INLINE_CODE = re.compile(r"(`+).*?\1")


def _is_code(line: str, in_code: bool) -> bool:
    """Does this line (outside a fence) belong to a code block?"""
    if not line.strip():
        return in_code
    if line[0] in " \t":  # indented: code inside a block, a nested list item outside one
        return in_code or bool(CODE_START.match(line.lstrip()))
    if in_code and line.startswith("#"):  # a comment, not a heading, inside code
        return True
    return bool(CODE_START.match(line) or ASSIGN.match(line) or CALL.match(line))


def _escape_identifiers(line: str) -> str:
    """`__init__` or `snake_case` in prose stay as written (not bold/italic), outside `code`."""
    out, pos = [], 0
    for m in INLINE_CODE.finditer(line):
        out.append(
            re.sub(r"\w*_\w*", lambda w: w.group().replace("_", r"\_"), line[pos : m.start()])
        )
        out.append(m.group())
        pos = m.end()
    out.append(re.sub(r"\w*_\w*", lambda w: w.group().replace("_", r"\_"), line[pos:]))
    return "".join(out)


def _fence(block: list[str]) -> list[str]:
    while block and not block[-1].strip():
        block.pop()
    lang = "python" if PYTHON.search("\n".join(block)) else ""
    return [f"```{lang}", *block, "```"]


def fence_code(text: str) -> str:
    """Put runs of unfenced code lines in ``` blocks and keep identifiers in prose literal;
    text inside existing fences is left alone."""
    out: list[str] = []
    block: list[str] = []  # the unfenced code run being collected
    opener: str | None = None
    for line in text.split("\n"):
        m = FENCE.match(line)
        if opener is not None:  # inside a fence the model wrote
            out.append(line)
            if (
                m
                and m.group(1)[0] == opener[0]
                and len(m.group(1)) >= len(opener)
                and not m.group(2).strip()
            ):
                opener = None
            continue
        if m and not block:
            opener = m.group(1)
            out.append(line)
            continue
        if _is_code(line, bool(block)) and not m:
            block.append(line)
            continue
        if block:
            trailing = len(block) - len("\n".join(block).rstrip().split("\n"))
            out += _fence(block) + [""] * trailing
            block = []
            if m:
                opener = m.group(1)
                out.append(line)
                continue
        out.append(_escape_identifiers(line))
    if block:
        out += _fence(block)
    return "\n".join(out)


def repair_markdown(answer: str) -> str:
    """An answer as Markdown to render: unfenced code fenced, an unclosed fence closed."""
    return fence_code(answer + close_fences(answer))


def chat_title(first_message: str, limit: int = 48) -> str:
    """A chat's default title: the first line of its first message, shortened."""
    line = next((ln.strip() for ln in first_message.splitlines() if ln.strip()), "New chat")
    return line if len(line) <= limit else line[: limit - 1].rstrip() + "…"
