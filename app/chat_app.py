"""`dflash-mac chat`: the Textual chat app.

The engine runs on one long-lived thread (`EngineThread`) and never touches widgets: jobs post
messages (`Loaded`, `TurnStarted`, `TurnEnded`, `Warmed`) and leave each cycle's text and
statistics in the `Turn`, which the UI picks up a few times a second (`REFRESH_HZ`), so a fast
decode loop does not pay for a redraw per cycle. See docs/chat.md."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from textual import events, on
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.message import Message
from textual.widgets import Footer, Header, Label, ProgressBar, Static

from dflash_mac.engine.stats import DecodeStats
from dflash_mac.errors import is_user_error

from .backend import Backend, ChatOptions, load_backend, turn_stats
from .engine_thread import EngineThread
from .palette import ChatCommands
from .screens import ChatListScreen
from .store import Store
from .text import chat_title
from .widgets import AssistantMessage, ChatInput, HistogramPanel, UserMessage

PLACEHOLDER = "Message · Enter sends · shift+Enter newline · F1 help"


class Loaded(Message):
    def __init__(self, backend: Backend | None, error: str | None = None) -> None:
        super().__init__()
        self.backend, self.error = backend, error


class Loading(Message):
    """A loading step (the cost curve's timing) and how far it is (None: unknown)."""

    def __init__(self, text: str, fraction: float | None) -> None:
        super().__init__()
        self.text, self.fraction = text, fraction


class TurnStarted(Message):
    def __init__(self, thinking: bool, skip: int = 0, capped: int | None = None) -> None:
        super().__init__()
        self.thinking, self.skip, self.capped = thinking, skip, capped


class TurnEnded(Message):
    def __init__(
        self, stats: DecodeStats | None, finish: str | None = None, error: str | None = None
    ) -> None:
        super().__init__()
        self.stats, self.finish, self.error = stats, finish, error


def warm_highlighter() -> None:
    """Compile the Python syntax highlighter off the UI thread (the first code block would
    otherwise pay ~0.3 s on it)."""
    try:
        from pygments.lexers import get_lexer_by_name

        get_lexer_by_name("python")
    except Exception:  # only a speed-up
        pass


class Warmed(Message):
    def __init__(self, cached: int, skip: int = 0, chat_id: int | None = None) -> None:
        super().__init__()
        self.cached, self.skip, self.chat_id = cached, skip, chat_id


def error_sentence(e: BaseException) -> str:
    """The one sentence the CLI prints for user errors (`cli.is_user_error`); the exception
    type and message otherwise."""
    return f"error: {e}" if is_user_error(e) else f"error: {type(e).__name__}: {e}"


@dataclass
class Turn:
    """The answer being generated."""

    chat_id: int
    history: list[dict]
    widget: AssistantMessage
    question_id: int  # the stored user message
    skip: int = 0  # messages of `history` left out of the prompt (context window)
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    chunks: list[str] = field(default_factory=list)  # text not yet shown (engine side fills)
    stats: DecodeStats | None = None  # the latest statistics (an immutable snapshot)
    thinking: bool = False  # the answer starts inside a thinking section (set before `put`)

    def put(self, text: str, stats: DecodeStats) -> None:
        """Engine side: one cycle's text and statistics."""
        with self.lock:
            self.chunks.append(text)
            self.stats = stats

    def take(self) -> tuple[str, DecodeStats | None]:
        """UI side: the text since the last call and the latest statistics."""
        with self.lock:
            text, self.chunks = "".join(self.chunks), []
            return text, self.stats


def window_note(skip: int, context: int) -> str:
    """The note shown in the chat when old turns no longer fit the model's context."""
    turns = skip // 2
    return (
        f"The conversation no longer fits the model's {context}-token context: the oldest "
        f"{turns} turn{'s' if turns != 1 else ''} (question and answer) "
        f"{'are' if turns != 1 else 'is'} left out of the prompt from here on."
    )


class ChatApp(ChatCommands, App):
    """Chat with a DFlash pair: streamed Markdown answers and a live acceptance histogram."""

    CSS_PATH = "chat.tcss"
    REFRESH_HZ = 15  # answer text updates per second while it streams
    PANEL_EVERY = 3  # the side panel: every 3rd refresh (5 Hz)
    NARROW, HIDE = 100, 70  # terminal widths below which the side panel narrows / hides
    TITLE = "dflash-mac chat"
    BINDINGS = [
        Binding("escape", "stop", "Stop"),
        Binding("ctrl+n", "new_chat", "New chat"),
        Binding("ctrl+o", "open_chats", "Chats"),
        Binding("ctrl+t", "toggle_reasoning", "Reasoning"),
        Binding("f2", "toggle_panel", "Panel"),
        Binding("f1", "help", "Help"),
        Binding("y", "copy_code", "Copy code", show=False),
        Binding("ctrl+q", "quit", "Quit", priority=True),
    ]

    def __init__(
        self,
        opts: ChatOptions | None = None,
        loader: Callable[[], Backend] | None = None,
        store: Store | None = None,
        resume: bool = False,
    ) -> None:
        super().__init__()
        self.opts = opts or ChatOptions()
        self.loader = loader or partial(load_backend, self.opts, status=self.post_loading)
        self.store = store or Store()
        self.backend: Backend | None = None
        self.reasoning = self.opts.reasoning
        self.system = self.opts.system or ""
        self.chat_id: int | None = None
        self.history: list[dict] = []
        self.turn: Turn | None = None
        self.skip = 0  # messages of this chat left out of the prompt (context window)
        self.resume_latest = resume
        self.panel_wanted = True  # F2 toggles
        self.engine: EngineThread | None = None
        self._ticks = 0

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="main"):
            with Vertical(id="chat-pane"):
                yield VerticalScroll(id="log")
                with Horizontal(id="status"):
                    yield Label(
                        f"Loading {self.opts.model or 'the default pair'}…", id="status-text"
                    )
                    yield ProgressBar(total=None, show_eta=False, show_percentage=False)
                yield ChatInput(id="input", placeholder=PLACEHOLDER)
            yield HistogramPanel(id="panel")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(ChatInput).focus()
        self.log_view.anchor()  # follow the stream unless the user scrolls up
        self.panel.set_info(None, self.reasoning_label)
        self.engine = EngineThread()
        self.engine.submit(self._load)
        # Through the message queue, so that a refresh never interleaves with TurnEnded.
        self.set_interval(1 / self.REFRESH_HZ, partial(self.call_next, self.refresh_turn))
        self.fit_panel(self.size.width)
        if self.resume_latest and (latest := self.store.latest()):
            self.call_later(self.open_chat, latest.id)

    # ---- engine side (the engine thread) ----

    def _load(self) -> None:
        try:
            backend = self.loader()
        except Exception as e:
            self.post_message(Loaded(None, error_sentence(e)))
            return
        warm_highlighter()
        self.post_message(Loaded(backend))

    def post_loading(self, text: str, fraction: float | None) -> None:
        self.post_message(Loading(text, fraction))

    def _generate(self, turn: Turn, system: str, reasoning: str | None) -> None:
        backend, stats, finish = self.backend, None, None
        try:
            with backend.lock:
                fit = backend.fit(turn.history, system, reasoning, self.opts.max_tokens, turn.skip)
                capped = fit.max_tokens if fit.capped else None
                turn.thinking = fit.thinking
                self.post_message(TurnStarted(fit.thinking, fit.skip, capped))
                kwargs = {**self.opts.generation_kwargs(), "max_tokens": fit.max_tokens}
                text, ids = [], []
                for ev in backend.stream(fit.prompt, turn.stop.is_set, **kwargs):
                    stats, finish = ev.stats, ev.finish_reason
                    text.append(ev.text)
                    ids += ev.tokens
                    turn.put(ev.text, stats)
                backend.record("".join(text), ids)
        except Exception as e:
            self.post_message(TurnEnded(stats, finish, error_sentence(e)))
        else:
            self.post_message(TurnEnded(stats, finish))

    def _warm(
        self,
        history: list[dict],
        system: str,
        reasoning: str | None,
        skip: int,
        chat_id: int | None,
    ) -> None:
        try:
            with self.backend.lock:
                n, skip = self.backend.warm(history, system, reasoning, skip)
        except Exception:  # a failed warm-up only costs the next turn a full prefill
            n = 0
        self.post_message(Warmed(n, skip, chat_id))

    def warm_up(self) -> None:
        """Prefill the shown conversation in the background (resume with prefix reuse)."""
        if self.backend is not None and self.history and self.turn is None:
            self.engine.submit(
                partial(
                    self._warm,
                    list(self.history),
                    self.system,
                    self.reasoning,
                    self.skip,
                    self.chat_id,
                )
            )

    # ---- UI side ----

    @property
    def panel(self) -> HistogramPanel:
        return self.query_one(HistogramPanel)

    @property
    def log_view(self) -> VerticalScroll:
        return self.query_one("#log", VerticalScroll)

    @property
    def reasoning_label(self) -> str:
        if self.backend and not self.backend.info.reasoning:
            return self.reasoning or "n/a"
        return self.reasoning or "default"

    def set_status(self, text: str, busy: bool = False, error: bool = False) -> None:
        self.query_one("#status-text", Label).update(text)
        self.query_one("#status").set_class(error, "error")
        self.query_one(ProgressBar).display = busy

    def on_loading(self, message: Loading) -> None:
        self.set_status(message.text, busy=True)
        self.query_one(ProgressBar).update(total=1.0, progress=message.fraction or 0.0)

    def on_loaded(self, message: Loaded) -> None:
        if message.error:
            self.set_status(message.error, error=True)
            self.query_one(ChatInput).disabled = True
            return
        self.backend = message.backend
        info = self.backend.info
        self.panel.set_info(info, self.reasoning_label)
        self.set_status(f"Ready · {info.kind} · block {info.block}")
        for w in self.backend.warnings:
            self.notify(w, severity="warning", timeout=10)
        self.warm_up()

    async def on_warmed(self, message: Warmed) -> None:
        if message.chat_id != self.chat_id:  # another chat was opened meanwhile
            return
        await self.note_window(message.skip)
        if message.cached and self.turn is None:
            self.set_status(f"Ready · {message.cached} tokens of this chat cached.")

    @on(ChatInput.Submitted)
    async def send(self, message: ChatInput.Submitted) -> None:
        if self.backend is None:
            self.notify("The model is still loading.", severity="warning")
            return
        if self.turn is not None:
            self.notify("Still answering; Esc stops it.", severity="warning")
            return
        text = message.text.rstrip()
        self.query_one(ChatInput).clear()
        if self.chat_id is None:
            self.chat_id = self.store.create_chat(chat_title(text), self.system)
            self.sub_title = chat_title(text)
        question_id = self.store.add_message(self.chat_id, "user", text)
        self.history.append({"role": "user", "content": text})
        widget = AssistantMessage()
        await self.log_view.mount_all([UserMessage(text), widget])
        self.log_view.anchor()
        self.turn = Turn(self.chat_id, self.history, widget, question_id, self.skip)
        self.set_status("Generating… (Esc stops)")  # no spinner: it would redraw every frame
        self.engine.submit(partial(self._generate, self.turn, self.system, self.reasoning))

    async def note_window(self, skip: int) -> None:
        """Show (once per change) that old turns were left out to fit the context."""
        if skip <= self.skip:
            return
        self.skip = skip
        note = Static(window_note(skip, self.backend.context), classes="note")
        if self.turn and self.turn.widget.is_attached:
            await self.log_view.mount(note, before=self.turn.widget)
        else:
            await self.log_view.mount(note)

    async def on_turn_started(self, message: TurnStarted) -> None:
        if self.turn and self.turn.chat_id == self.chat_id:  # not a chat closed meanwhile
            await self.note_window(message.skip)
            if message.capped is not None:
                self.set_status(
                    f"Generating… (Esc stops) · at most {message.capped} tokens fit in the context"
                )

    async def refresh_turn(self) -> None:
        """Show what the engine produced since the last refresh (REFRESH_HZ times a second)."""
        turn = self.turn
        if turn is None:
            return
        text, stats = turn.take()
        self._ticks += 1
        if (
            stats is not None
            and self._ticks % self.PANEL_EVERY == 0
            and stats is not self.panel.stats
        ):
            self.panel.show(stats)
        if text and turn.widget.is_attached:
            if not turn.widget.raw:
                turn.widget.start(thinking=turn.thinking)
            turn.widget.feed(text)
            await turn.widget.flush()

    async def on_turn_ended(self, message: TurnEnded) -> None:
        if self.turn is not None:
            await self.refresh_turn()  # what arrived after the last refresh
        turn, self.turn = self.turn, None
        if turn is None:
            return
        snap = message.stats
        stats = turn_stats(snap, message.finish) if snap else {}
        if message.error:
            stats["error"] = message.error
            self.set_status(message.error, error=True)
        else:
            self.set_status("Stopped." if stats.get("finish") == "cancelled" else "Ready.")
        if snap is not None:
            self.panel.show(snap)
        if turn.widget.is_attached:
            await turn.widget.finish(stats)
            if message.error:
                await turn.widget.mount(Static(message.error, classes="error"))
        if snap is None:  # nothing was generated: forget the unanswered question
            self.store.delete_message(turn.question_id)
            turn.history.pop()
            return
        if self.store.chat(turn.chat_id) is None:  # deleted while it was answering
            return
        self.store.add_message(turn.chat_id, "assistant", turn.widget.raw, stats)
        turn.history.append({"role": "assistant", "content": turn.widget.raw})

    def action_stop(self) -> None:
        if self.turn is not None:
            self.turn.stop.set()
            self.set_status("Stopping…", busy=True)

    async def action_quit(self) -> None:
        if self.turn is not None:
            self.turn.stop.set()
        self.exit()

    def action_toggle_panel(self) -> None:
        self.panel_wanted = not self.panel_wanted
        self.fit_panel(self.size.width)

    def fit_panel(self, width: int) -> None:
        """The side panel: narrower on small terminals, hidden on tiny ones or by F2."""
        self.panel.set_class(width < self.NARROW, "narrow")
        self.panel.display = self.panel_wanted and width >= self.HIDE

    def on_resize(self, event: events.Resize) -> None:
        self.fit_panel(event.size.width)

    async def clear_chat(self) -> None:
        self.action_stop()  # a running turn still ends (and is saved) at its next cycle
        self.chat_id, self.history, self.sub_title, self.skip = None, [], "", 0
        self.system = self.opts.system or ""
        await self.log_view.remove_children()

    async def action_new_chat(self) -> None:
        await self.clear_chat()
        self.query_one(ChatInput).focus()
        if self.backend is not None:
            self.set_status("New chat.")

    def action_open_chats(self) -> None:
        def chosen(chat_id: int | None) -> None:
            if chat_id is not None:
                self.call_later(self.open_chat, chat_id)

        self.push_screen(ChatListScreen(self.store.chats()), chosen)

    async def open_chat(self, chat_id: int) -> None:
        """Show a saved chat; the next turn continues it (reusing the cached prefix)."""
        info = self.store.chat(chat_id)
        if info is None:
            return
        await self.clear_chat()
        self.chat_id, self.system, self.sub_title = info.id, info.system, info.title
        for m in self.store.messages(chat_id):
            self.history.append({"role": m.role, "content": m.content})
            if m.role == "user":
                await self.log_view.mount(UserMessage(m.content))
            else:
                widget = AssistantMessage()
                await self.log_view.mount(widget)
                await widget.show(m.content, m.stats)
        self.log_view.scroll_end(animate=False)
        self.query_one(ChatInput).focus()
        self.warm_up()

    def action_toggle_reasoning(self) -> None:
        if self.backend is None:
            return
        if not self.backend.info.reasoning:
            self.notify("This model's chat template has no thinking switch.", severity="warning")
            return
        self.reasoning = "off" if self.reasoning in (None, "on") else "on"
        self.panel.set_info(self.backend.info, self.reasoning_label)
        self.notify(f"Reasoning {self.reasoning}.")
        if pair := getattr(self.backend.session, "pair", None):  # drafter trained the other way?
            from dflash_mac.prepare import thinking_mismatch

            if said := thinking_mismatch(pair, self.reasoning):
                self.notify(said, severity="warning", timeout=10)

    def on_unmount(self) -> None:
        if self.turn is not None:
            self.turn.stop.set()
        if self.engine is not None:
            self.engine.close()  # the running turn ends at its next cycle
        self.store.close()
