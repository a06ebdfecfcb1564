"""The chat app's commands: help, copying code, and the command-palette entries
(new, open, rename, delete, export, system prompt, toggle reasoning)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

from textual.app import SystemCommand
from textual.screen import Screen

from .screens import ConfirmScreen, HelpScreen, InputScreen
from .store import slug
from .widgets import ChatMarkdown, CopyCode


class ChatCommands:
    """Mixin for ChatApp (uses its store, chat_id, sub_title, system and actions)."""

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def on_copy_code(self, message: CopyCode) -> None:
        self.copy_text(message.code)

    def action_copy_code(self) -> None:
        blocks = [c for md in self.query(ChatMarkdown) for c in md.code_blocks()]
        if blocks:
            self.copy_text(blocks[-1])
        else:
            self.notify("No code block to copy.", severity="warning")

    def copy_text(self, text: str) -> None:
        """OSC 52 (most terminals) and pbcopy on macOS (Terminal.app ignores OSC 52)."""
        self.copy_to_clipboard(text)
        if sys.platform == "darwin" and shutil.which("pbcopy"):
            subprocess.run(["pbcopy"], input=text.encode(), check=False, timeout=5)
        self.notify(f"Copied {len(text.splitlines())} lines of code.")

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        yield SystemCommand("New chat", "Start a new conversation (ctrl+n)", self.action_new_chat)
        yield SystemCommand(
            "Open chat", "Resume a saved conversation (ctrl+o)", self.action_open_chats
        )
        yield SystemCommand("Rename chat", "Rename this conversation", self.action_rename)
        yield SystemCommand("Delete chat", "Delete this conversation", self.action_delete)
        yield SystemCommand("Export chat", "Save this conversation as Markdown", self.action_export)
        yield SystemCommand(
            "System prompt", "Set this chat's system prompt", self.action_system_prompt
        )
        yield SystemCommand(
            "Toggle reasoning", "Thinking on/off (ctrl+t)", self.action_toggle_reasoning
        )

    def _need_chat(self) -> bool:
        if self.chat_id is None:
            self.notify("Nothing saved yet: send a message first.", severity="warning")
            return False
        return True

    def action_rename(self) -> None:
        if not self._need_chat():
            return

        def done(title: str | None) -> None:
            if title and title.strip() and self.chat_id is not None:
                self.store.rename(self.chat_id, title.strip())
                self.sub_title = title.strip()

        self.push_screen(InputScreen("Rename chat", self.sub_title), done)

    def action_delete(self) -> None:
        if not self._need_chat():
            return

        async def done(yes: bool | None) -> None:
            if yes and self.chat_id is not None:
                self.store.delete(self.chat_id)
                await self.action_new_chat()
                self.notify("Chat deleted.")

        self.push_screen(ConfirmScreen(f"Delete “{self.sub_title}”?"), done)

    def action_export(self) -> None:
        if not self._need_chat():
            return

        def done(path: str | None) -> None:
            if path and self.chat_id is not None:
                target = Path(path).expanduser()
                target.write_text(self.store.export_markdown(self.chat_id), encoding="utf-8")
                self.notify(f"Exported to {target}.")

        default = str(Path.cwd() / f"{slug(self.sub_title)}.md")
        self.push_screen(InputScreen("Export to Markdown file", default), done)

    def action_system_prompt(self) -> None:
        def done(text: str | None) -> None:
            if text is None:
                return
            self.system = text.strip()
            if self.chat_id is not None:
                self.store.set_system(self.chat_id, self.system)
            self.notify("System prompt set." if self.system else "System prompt cleared.")

        self.push_screen(InputScreen("System prompt for this chat", self.system), done)
