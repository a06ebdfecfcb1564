"""Modal screens: text input, confirmation, the saved-chat list, help."""

from __future__ import annotations

from rich.table import Table
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import Input, Label, Markdown, OptionList, Static
from textual.widgets.option_list import Option

from .store import ChatInfo

KEYS = [
    ("Enter", "send the message"),
    ("shift+Enter, ctrl+j", "new line in the message"),
    ("Esc", "stop the answer (at the next decode cycle)"),
    ("ctrl+n", "new chat"),
    ("ctrl+o", "open a saved chat (resume it)"),
    ("ctrl+p", "commands: new, open, rename, delete, export, system prompt, reasoning"),
    ("ctrl+t", "toggle reasoning (when the chat template has a switch)"),
    ("y / click", "copy the last code block / the clicked one"),
    ("tab, shift+tab", "move focus between the input and the conversation"),
    ("F2", "hide / show the side panel (narrower below 100 columns, hidden below 70)"),
    ("F1", "this help"),
    ("ctrl+q", "quit"),
]
ABOUT = """\
The side panel shows, every decode cycle, the acceptance histogram (tokens committed per
drafting cycle, 1..block size), τ (their mean) and the decode speed. With `auto` blocks its
block row gives the size chosen now and why: "plain steps" are one-token target steps, chosen
where the costs measured on this machine say drafting would be slower than plain decoding.
For the speed-up over plain decoding, `dflash-mac bench` times both back to back. The line
under each answer counts its prefill:
*new* tokens ran through the model, *cached* ones were reused from earlier turns.
Chats are saved in SQLite under the data directory (`DFLASH_MAC_HOME` overrides it)."""


def keys_table() -> Table:
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold", no_wrap=True)
    table.add_column()
    for key, what in KEYS:
        table.add_row(key, what)
    return table


class InputScreen(ModalScreen[str | None]):
    """Asks for one line of text; Enter accepts, Esc cancels (None)."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, title: str, value: str = "", placeholder: str = "") -> None:
        super().__init__(classes="dialog")
        self.title_text, self.value, self.placeholder = title, value, placeholder

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog-box"):
            yield Label(self.title_text, classes="dialog-title")
            yield Input(self.value, placeholder=self.placeholder)
            yield Label("Enter to accept · Esc to cancel", classes="dialog-hint")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value)

    def action_cancel(self) -> None:
        self.dismiss(None)


class ConfirmScreen(ModalScreen[bool]):
    """A yes/no question: y or Enter confirms, n or Esc declines."""

    BINDINGS = [
        Binding("y,enter", "answer(True)", "Yes"),
        Binding("n,escape", "answer(False)", "No"),
    ]

    def __init__(self, question: str) -> None:
        super().__init__(classes="dialog")
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog-box"):
            yield Label(self.question, classes="dialog-title")
            yield Label("y / Enter: yes · n / Esc: no", classes="dialog-hint")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)


class ChatListScreen(ModalScreen[int | None]):
    """Saved conversations, most recent first; Enter resumes one."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, chats: list[ChatInfo]) -> None:
        super().__init__(classes="dialog")
        self.chats = chats

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog-box chat-list"):
            yield Label("Saved chats", classes="dialog-title")
            if self.chats:
                yield OptionList(
                    *[
                        Option(
                            Content.assemble(c.title, (f"  {c.messages} messages", "dim")),
                            id=str(c.id),
                        )
                        for c in self.chats
                    ]
                )
            else:
                yield Label("No saved chats yet.")
            yield Label("Enter to open · Esc to close", classes="dialog-hint")

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(int(event.option.id))

    def action_cancel(self) -> None:
        self.dismiss(None)


class HelpScreen(ModalScreen[None]):
    """All key bindings (F1)."""

    BINDINGS = [Binding("escape,f1,q", "close", "Close")]

    def __init__(self) -> None:
        super().__init__(classes="dialog")

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog-box help"):
            yield Label("dflash-mac chat · keys", classes="dialog-title")
            yield Static(keys_table())
            yield Markdown(ABOUT)
            yield Label("Esc to close", classes="dialog-hint")

    def action_close(self) -> None:
        self.dismiss(None)
