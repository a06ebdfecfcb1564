"""Chat history in SQLite (WAL) under the platform data directory.

`DFLASH_MAC_HOME` overrides the directory (tests use a temporary one); otherwise
~/Library/Application Support/dflash-mac on macOS and the XDG data dir on Linux."""

from __future__ import annotations

import json
import re
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path

from dflash_mac.host import data_dir

DB_NAME = "chats.sqlite3"
SCHEMA = """
CREATE TABLE IF NOT EXISTS chats (
    id INTEGER PRIMARY KEY,
    title TEXT NOT NULL,
    system TEXT NOT NULL DEFAULT '',
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY,
    chat_id INTEGER NOT NULL REFERENCES chats(id) ON DELETE CASCADE,
    role TEXT NOT NULL,
    content TEXT NOT NULL,
    stats TEXT,
    created REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS messages_by_chat ON messages(chat_id, id);
"""


@dataclass(frozen=True)
class ChatInfo:
    """One conversation's header."""

    id: int
    title: str
    system: str
    messages: int = 0


@dataclass(frozen=True)
class StoredMessage:
    """One user or assistant message; `stats` holds the per-turn numbers of an answer."""

    role: str
    content: str
    stats: dict = field(default_factory=dict)


def slug(title: str) -> str:
    """A file-name friendly version of a chat title."""
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")[:48] or "chat"


class Store:
    """Conversations and their messages. Used from the UI thread only."""

    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path else data_dir() / DB_NAME
        self.db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA foreign_keys=ON")
        self.db.executescript(SCHEMA)

    def close(self) -> None:
        self.db.close()

    def create_chat(self, title: str, system: str = "") -> int:
        now = time.time()
        cur = self.db.execute(
            "INSERT INTO chats(title, system, created, updated) VALUES (?, ?, ?, ?)",
            (title, system or "", now, now),
        )
        return int(cur.lastrowid)

    def chats(self) -> list[ChatInfo]:
        """All conversations, most recently updated first."""
        rows = self.db.execute(
            "SELECT c.id, c.title, c.system, COUNT(m.id) AS n FROM chats c "
            "LEFT JOIN messages m ON m.chat_id = c.id GROUP BY c.id "
            "ORDER BY c.updated DESC, c.id DESC"
        ).fetchall()
        return [ChatInfo(r["id"], r["title"], r["system"], r["n"]) for r in rows]

    def chat(self, chat_id: int) -> ChatInfo | None:
        return next((c for c in self.chats() if c.id == chat_id), None)

    def latest(self) -> ChatInfo | None:
        chats = self.chats()
        return chats[0] if chats else None

    def messages(self, chat_id: int) -> list[StoredMessage]:
        rows = self.db.execute(
            "SELECT role, content, stats FROM messages WHERE chat_id = ? ORDER BY id", (chat_id,)
        ).fetchall()
        return [
            StoredMessage(r["role"], r["content"], json.loads(r["stats"] or "{}")) for r in rows
        ]

    def add_message(self, chat_id: int, role: str, content: str, stats: dict | None = None) -> int:
        now = time.time()
        with self.db:
            cur = self.db.execute(
                "INSERT INTO messages(chat_id, role, content, stats, created) VALUES (?,?,?,?,?)",
                (chat_id, role, content, json.dumps(stats) if stats else None, now),
            )
            self.db.execute("UPDATE chats SET updated = ? WHERE id = ?", (now, chat_id))
        return int(cur.lastrowid)

    def delete_message(self, message_id: int) -> None:
        self.db.execute("DELETE FROM messages WHERE id = ?", (message_id,))

    def rename(self, chat_id: int, title: str) -> None:
        self.db.execute("UPDATE chats SET title = ? WHERE id = ?", (title, chat_id))

    def set_system(self, chat_id: int, system: str) -> None:
        self.db.execute("UPDATE chats SET system = ? WHERE id = ?", (system or "", chat_id))

    def delete(self, chat_id: int) -> None:
        self.db.execute("DELETE FROM chats WHERE id = ?", (chat_id,))

    def export_markdown(self, chat_id: int) -> str:
        """The conversation as a Markdown document."""
        from dflash_mac.engine.think import split_think

        from .text import close_fences

        info = self.chat(chat_id)
        if info is None:
            raise KeyError(chat_id)
        out = [f"# {info.title}", ""]
        if info.system:
            out += ["> **System:** " + info.system.replace("\n", "\n> "), ""]
        for m in self.messages(chat_id):
            if m.role == "user":
                out += ["## You", "", m.content, ""]
                continue
            thinking, answer = split_think(m.content)
            out += ["## Assistant", ""]
            if thinking:
                out += ["<details><summary>Thinking</summary>", "", thinking, "", "</details>", ""]
            out += [answer + close_fences(answer), ""]
        return "\n".join(out).rstrip() + "\n"
