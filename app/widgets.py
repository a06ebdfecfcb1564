"""Chat widgets: the input box, messages (streamed Markdown), the stats line, the side panel."""

from __future__ import annotations

import textwrap

from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.message import Message
from textual.widget import Widget
from textual.widgets import Collapsible, Markdown, Static, TextArea
from textual.widgets.markdown import MarkdownFence

from dflash_mac.engine.stats import DecodeStats
from dflash_mac.engine.think import ThinkSplitter, split_think

from .backend import EngineInfo, block_label
from .text import printable, repair_markdown

EIGHTHS = " ▏▎▍▌▋▊▉█"


class ChatInput(TextArea):
    """Multi-line prompt box: Enter sends, shift+Enter or ctrl+j inserts a newline."""

    class Submitted(Message):
        def __init__(self, text: str) -> None:
            super().__init__()
            self.text = text

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            if self.text.strip():
                self.post_message(self.Submitted(self.text))
            return
        if event.key in ("shift+enter", "ctrl+j"):
            event.stop()
            event.prevent_default()
            self.insert("\n")
            return
        await super()._on_key(event)


class CopyCode(Message):
    """Asks the app to copy a code block to the clipboard."""

    def __init__(self, code: str) -> None:
        super().__init__()
        self.code = code


class CodeFence(MarkdownFence):
    """A syntax-highlighted code block; a click copies it."""

    def on_click(self, event: events.Click) -> None:
        event.stop()
        self.post_message(CopyCode(self.code))


class ChatMarkdown(Markdown):
    """Markdown whose code blocks can be copied."""

    BLOCKS = {**Markdown.BLOCKS, "fence": CodeFence, "code_block": CodeFence}

    def code_blocks(self) -> list[str]:
        return [f.code for f in self.query(CodeFence)]


def turn_line(stats: dict) -> str:
    """`412 tok · 96.4 tok/s · τ 4.6 · prefill 35 new + 120 cached` (a `speedup` stored by
    older versions is not shown: backend.turn_stats says why)."""
    if "tokens" not in stats:  # failed before the first token
        return ""
    new = stats.get("prompt", 0) - stats.get("cached", 0)
    line = (
        f"{stats['tokens']} tok · {stats['tps']:.1f} tok/s · τ {stats['tau']:.1f}"
        f" · prefill {new} new + {stats.get('cached', 0)} cached"
    )
    finish = stats.get("finish")
    if finish == "cancelled":
        line += " · stopped"
    elif finish == "length":
        line += " · max tokens"
    return line


class UserMessage(Static):
    """What the user typed (shown as typed, not rendered)."""

    def __init__(self, text: str) -> None:
        super().__init__(Text(printable(text)), classes="user")


class LiveText(Vertical):
    """Streamed plain text (newlines and indentation as written). Finished lines are frozen
    in blocks of `BLOCK_LINES` that are never redrawn; only the last block changes, so a
    refresh costs the same for a long answer as for a short one."""

    BLOCK_LINES = 8

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.text = ""
        self._frozen = 0  # length of the text held in frozen blocks

    def compose(self) -> ComposeResult:
        yield Static("", classes="tail")

    async def show(self, text: str) -> None:
        self.text = text
        tail = self.query_one(".tail", Static)
        rest = text[self._frozen :]
        if rest.count("\n") >= self.BLOCK_LINES:
            cut = rest.rindex("\n")
            await self.mount(Static(Text(rest[:cut])), before=tail)
            self._frozen += cut + 1
            rest = rest[cut + 1 :]
        tail.update(Text(rest))


class AssistantMessage(Vertical):
    """An answer: a collapsed thinking section (if any), the body and a stats line.

    While the answer streams it is shown as plain text (newlines and indentation kept, nothing
    re-parsed per token), redrawn by the app a few times a second (`flush`); when the turn
    ends it is rendered once as Markdown, with unfenced code put in code blocks
    (`text.repair_markdown`)."""

    def __init__(self, thinking: bool = False) -> None:
        super().__init__(classes="assistant")
        self.raw = ""
        self.answer = ""
        self.thinking = ""
        self.splitter = ThinkSplitter(open_at_start=thinking)
        self.finished = False
        self._dirty = False

    def compose(self) -> ComposeResult:
        yield ChatMarkdown(id="answer")
        yield LiveText(id="live", classes="live")
        yield Static("", classes="stats-line")

    def start(self, thinking: bool) -> None:
        """Before the first chunk: whether the prompt opened a thinking section."""
        self.splitter = ThinkSplitter(open_at_start=thinking)

    def feed(self, text: str) -> None:
        """Take a streamed chunk (shown at the next `flush`)."""
        self.raw += text
        self._take(self.splitter.feed(printable(text)))

    def _take(self, parts: tuple[str, str]) -> None:
        reasoning, answer = parts
        self.thinking += reasoning
        self.answer += answer
        self._dirty = self._dirty or bool(reasoning or answer)

    async def _thinking_box(self) -> Collapsible:
        if not self.query(Collapsible):
            box = Collapsible(
                ChatMarkdown(classes="thinking"),
                Static("", classes="thinking live-thinking"),
                title="Thinking",
                collapsed=True,
            )
            await self.mount(box, before=self.query_one("#answer"))
        return self.query_one(Collapsible)

    async def flush(self) -> bool:
        """Show what arrived since the last flush; True if anything changed."""
        if not self._dirty:
            return False
        self._dirty = False
        if self.thinking:
            box = await self._thinking_box()
            box.query_one(".live-thinking", Static).update(Text(self.thinking.strip("\n")))
        await self.query_one("#live", LiveText).show(self.answer)
        return True

    async def finish(self, stats: dict) -> None:
        """End of the turn: render the Markdown once and show the stats line."""
        self._take(self.splitter.flush())
        await self._render_final(stats)

    async def show(self, raw: str, stats: dict) -> None:
        """Render a stored answer at once."""
        self.raw = raw
        self.thinking, self.answer = split_think(printable(raw))
        await self._render_final(stats)

    async def _render_final(self, stats: dict) -> None:
        if self.thinking.strip():
            box = await self._thinking_box()
            await box.query_one(ChatMarkdown).update(self.thinking.strip("\n"))
            box.query_one(".live-thinking").display = False
        self.answer = repair_markdown(self.answer)
        body = self.answer
        if not body.strip():
            body = "*(stopped)*" if stats.get("finish") == "cancelled" else "*(no answer)*"
        await self.query_one("#answer", ChatMarkdown).update(body)
        if not self.is_attached or not self.query(".stats-line"):
            return  # removed while rendering (a new chat, the app quitting)
        self.query_one("#live").display = False
        self.query_one(".stats-line", Static).update(turn_line(stats))
        self.finished = True


def bar(value: int, top: int, width: int) -> str:
    """A horizontal bar with eighth-block resolution."""
    eighths = round(8 * width * value / top) if top else 0
    eighths = max(eighths, 1) if value else 0
    full, part = divmod(eighths, 8)
    return ("█" * full + (EIGHTHS[part] if part else "")).ljust(width)


def memory(gb: float) -> str:
    return f"{gb:.2f} GB peak" if gb >= 1 else f"{gb * 1000:.0f} MB peak"


class HistogramPanel(Widget):
    """Acceptance histogram 1..block size and the live decode numbers. `show` only stores the
    snapshot; the panel is drawn when the screen refreshes (at most once a frame), so a fast
    decode loop does not pay for a redraw per cycle."""

    BAR_WIDTH = 18

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.info: EngineInfo | None = None
        self.stats: DecodeStats | None = None
        self.reasoning = "default"

    def set_info(self, info: EngineInfo | None, reasoning: str = "default") -> None:
        self.info, self.reasoning = info, reasoning
        self.refresh()

    def show(self, stats: DecodeStats) -> None:
        self.stats = stats
        self.refresh()

    def render(self) -> Text:
        return self.render_panel()

    def render_panel(self) -> Text:
        info, s = self.info, self.stats
        bs = (s.block_size if s else None) or (info.block_size if info else 0)
        hist = list(s.histogram) if s else [0] * bs
        top = max(hist) if hist and max(hist) else 0
        room = self.content_size.width - 10  # label and count around the bar
        width = max(4, min(self.BAR_WIDTH, room)) if room > -10 else self.BAR_WIDTH
        out = Text()
        out.append("Acceptance", style="bold")
        out.append("  drafting cycles\n", style="dim")
        for i, count in enumerate(hist):
            out.append(f"{i + 1:>2} ", style="dim")
            out.append(bar(count, top, width), style="cyan")
            out.append(f" {count}\n")
        out.append("\n")
        rows = [  # this answer's own numbers only (no speedup: backend.turn_stats)
            ("τ", f"{s.tau:.2f}" if s and s.tau else "–"),
            ("decode", f"{s.decode_tps:.1f} tok/s" if s and s.decode_tps else "–"),
            ("tokens", str(s.generation_tokens) if s else "–"),
            (
                "prefill",
                f"{s.prompt_tokens - s.cached_tokens} new + {s.cached_tokens} cached" if s else "–",
            ),
            ("block", block_label(s) if s else info.block if info else "–"),
            *([("why", s.block_reason)] if s and s.auto and s.block_reason else []),
            *(
                [("drafting", f"{s.draft_cycles} of {s.cycles} cycles")]
                if s and s.plain_steps
                else []
            ),
            *(
                [("copies", f"{s.copy_cycles} cycles · {s.copy_tokens} tok")]
                if s and s.copy_cycles
                else []
            ),
            *(
                [("suffix", f"{s.suffix_cycles} cycles · {s.suffix_tokens} tok")]
                if s and s.suffix_cycles
                else []
            ),
            *([("trees", f"{s.tree_mix} · τ {s.tree_tau:.2f}")] if s and s.tree_cycles else []),
            ("drafter", info.kind if info else "–"),
            ("kernels", info.kernels if info else "–"),
            ("memory", memory(s.peak_memory_gb) if s else "–"),
            ("reasoning", self.reasoning),
        ]
        if s and s.ranks > 1:  # a target sharded over several Macs (docs/distributed.md)
            rows += [
                ("ranks", f"{s.ranks} · {s.parallel}"),
                (
                    "collect.",
                    f"{s.collectives_per_cycle}/cycle · {s.collective_ms_per_cycle:.1f} ms",
                ),
            ]
        room = self.content_size.width - 10  # a long value wraps under itself, not the names
        for name, value in rows:
            out.append(f"{name:<10}", style="dim")
            lines = textwrap.wrap(value, room) if room >= 12 and len(value) > room else [value]
            out.append(("\n" + " " * 10).join(lines) + "\n")
        out.rstrip()
        return out
