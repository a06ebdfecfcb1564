"""Chat history store: SQLite (WAL) under DFLASH_MAC_HOME, CRUD, export to Markdown."""

from __future__ import annotations

import sqlite3

from dflash_mac.app.store import Store, data_dir, slug


def test_home_override_and_wal(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_MAC_HOME", str(tmp_path / "home"))
    assert data_dir() == tmp_path / "home"
    store = Store()
    assert store.path == tmp_path / "home" / "chats.sqlite3"
    assert store.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    store.close()


def test_default_dir_is_the_platform_data_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("DFLASH_MAC_HOME", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path))
    path = data_dir()
    assert path.name == "dflash-mac" and path.is_dir()


def test_chats_messages_rename_delete(tmp_path):
    store = Store(tmp_path / "c.db")
    a = store.create_chat("First", system="Be brief.")
    b = store.create_chat("Second")
    store.add_message(a, "user", "hi")
    store.add_message(a, "assistant", "hello", {"tokens": 3, "tau": 2.5})
    assert [c.id for c in store.chats()] == [a, b]  # most recently updated first
    assert store.chat(a).messages == 2 and store.chat(a).system == "Be brief."
    msgs = store.messages(a)
    assert [(m.role, m.content) for m in msgs] == [("user", "hi"), ("assistant", "hello")]
    assert msgs[1].stats == {"tokens": 3, "tau": 2.5} and msgs[0].stats == {}
    store.rename(a, "Renamed")
    store.set_system(a, "")
    assert store.chat(a).title == "Renamed" and store.chat(a).system == ""
    qid = store.add_message(b, "user", "unanswered")
    store.delete_message(qid)
    assert store.messages(b) == []
    store.delete(a)
    assert store.chat(a) is None
    count = store.db.execute("SELECT COUNT(*) FROM messages WHERE chat_id = ?", (a,)).fetchone()
    assert count[0] == 0  # messages go with their chat
    assert store.latest().id == b


def test_survives_reopen_and_a_second_connection(tmp_path):
    path = tmp_path / "c.db"
    store = Store(path)
    cid = store.create_chat("Persist")
    store.add_message(cid, "user", "remember me")
    other = sqlite3.connect(path)  # WAL: another reader sees committed rows
    assert other.execute("SELECT content FROM messages").fetchone()[0] == "remember me"
    other.close()
    store.close()
    again = Store(path)
    assert again.messages(cid)[0].content == "remember me"


def test_export_markdown(tmp_path):
    store = Store(tmp_path / "c.db")
    cid = store.create_chat("Reverse a string", system="Answer in Python.")
    store.add_message(cid, "user", "How?")
    store.add_message(cid, "assistant", "<think>slicing</think>\n\nUse:\n```python\ns[::-1]")
    text = store.export_markdown(cid)
    assert text.startswith("# Reverse a string\n")
    assert "> **System:** Answer in Python." in text
    assert "## You\n\nHow?" in text
    assert "<details><summary>Thinking</summary>\n\nslicing\n\n</details>" in text
    assert text.endswith("```python\ns[::-1]\n```\n")  # the open fence is closed
    assert slug("Reverse a string!") == "reverse-a-string" and slug("???") == "chat"
