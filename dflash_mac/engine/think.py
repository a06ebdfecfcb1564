"""Split model text into reasoning (`<think>…</think>`) and answer content: the one splitter
of serve, chat and exports, streamed (`ThinkSplitter`) or whole (`split_think`)."""

from __future__ import annotations

from .textstream import held_suffix

OPEN, CLOSE = "<think>", "</think>"
REASONING_CHOICES = ("on", "off", "low", "medium", "high", "xhigh")


def prompt_opens_think(prompt_tail: str) -> bool:
    """True when the generation prompt ends inside an open <think> block (the template started
    the reasoning for the model, as Qwen3 / DeepSeek-R1 templates do)."""
    return prompt_tail.rfind(OPEN) > prompt_tail.rfind(CLOSE)


class ThinkSplitter:
    """Feed text deltas; get (reasoning, content) deltas back.

    Only a leading think block counts: either the prompt opened it, or the output starts with
    `<think>` (after whitespace). Text after `</think>` is content (leading blank lines dropped)."""

    def __init__(self, open_at_start: bool = False):
        self.mode = "think" if open_at_start else "start"
        self.buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        self.buf += text
        reasoning = content = ""
        while True:
            if self.mode == "start":
                head = self.buf.lstrip()
                if head.startswith(OPEN):
                    self.buf, self.mode = head[len(OPEN) :], "think"
                    continue
                if not head or OPEN.startswith(head):
                    return reasoning, content  # undecided yet
                self.mode = "content"
                continue
            if self.mode == "think":
                i = self.buf.find(CLOSE)
                if i >= 0:
                    reasoning += self.buf[:i]
                    self.buf, self.mode = self.buf[i + len(CLOSE) :], "after"
                    continue
                keep = held_suffix(self.buf, [CLOSE])
                reasoning += self.buf[: len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep :]
                return reasoning, content
            if self.mode == "after":
                self.buf = self.buf.lstrip("\n")
                if not self.buf:
                    return reasoning, content
                self.mode = "content"
            content += self.buf
            self.buf = ""
            return reasoning, content

    def flush(self) -> tuple[str, str]:
        """What is still held back, at the end of the stream."""
        buf, self.buf = self.buf, ""
        if self.mode == "think":
            return buf, ""
        return "", buf if self.mode != "after" else buf.lstrip("\n")


def split_think(text: str) -> tuple[str, str]:
    """(reasoning, answer) of a whole message. A leading section closed by </think> without an
    opening tag (templates that open it in the prompt) counts as reasoning."""
    opened = CLOSE in text and OPEN not in text.split(CLOSE, 1)[0]
    splitter = ThinkSplitter(open_at_start=opened)
    r1, c1 = splitter.feed(text)
    r2, c2 = splitter.flush()
    return (r1 + r2).strip("\n"), c1 + c2
