"""Text helpers for the chat app: control characters, fence repair, unfenced code detection
(<think> splitting is dflash_mac/engine/think.py, shared with the server)."""

from __future__ import annotations

import re

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def printable(text: str) -> str:
    """Model text safe for the screen: C0 control characters (escape sequences from a noisy
    model would reach the terminal) become Unicode control pictures (␛); \n and \t stay."""
    return CONTROL.sub(
        lambda m: chr(0x2421 if m.group() == "\x7f" else 0x2400 + ord(m.group())), text
    )


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
