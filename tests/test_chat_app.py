"""The chat app driven by a scripted fake engine (Pilot), one real pair end to end, snapshots."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
from chat_fakes import ANSWER, FakeSession, fake_backend
from dflash_mac.app.backend import ChatOptions
from dflash_mac.app.chat_app import ChatApp, window_note
from dflash_mac.app.screens import ChatListScreen, HelpScreen, InputScreen
from dflash_mac.app.store import Store
from dflash_mac.app.text import close_fences, fence_code, printable
from dflash_mac.app.widgets import (
    AssistantMessage,
    ChatInput,
    ChatMarkdown,
    CodeFence,
    HistogramPanel,
    UserMessage,
    turn_line,
)
from textual.app import App, ComposeResult
from textual.widgets import Collapsible, Input, Static

from dflash_mac.api import PromptError
from dflash_mac.engine.stats import DecodeStats
from dflash_mac.engine.think import ThinkSplitter, split_think
from dflash_mac.loading.loader import BUNDLED_DRAFT, BUNDLED_TARGET, LoadError

SIZE = (120, 40)


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_MAC_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def make_app(session: FakeSession | None = None, reasoning: bool = False, **kw) -> ChatApp:
    backend = fake_backend(session, reasoning=reasoning)
    return ChatApp(ChatOptions(), loader=lambda: backend, **kw)


async def until(pilot, cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await pilot.pause(0.01)


async def loaded(pilot) -> None:
    await until(pilot, lambda: pilot.app.backend is not None)


async def ask(pilot, text: str, wait: bool = True) -> AssistantMessage:
    before = len(pilot.app.query(AssistantMessage))
    pilot.app.query_one(ChatInput).text = text
    await pilot.press("enter")
    await until(pilot, lambda: len(pilot.app.query(AssistantMessage)) > before)
    widget = pilot.app.query(AssistantMessage).last()
    if wait:
        await until(pilot, lambda: widget.finished and pilot.app.turn is None)
        await pilot.pause()
    return widget


def answer_source(widget: AssistantMessage) -> str:
    return widget.query_one("#answer", ChatMarkdown).source


def stats_text(widget: AssistantMessage) -> str:
    return str(widget.query_one(".stats-line").render())


# ---- text helpers ----


def test_think_splitter_handles_tags_cut_between_chunks():
    """The chat app uses the server's splitter (dflash_mac/engine/think.py)."""
    s = ThinkSplitter()
    parts = [
        s.feed(c) for c in ["<thi", "nk>plan it", "</th", "ink>\n\nThe answer", " <think> stays"]
    ]
    parts.append(s.flush())
    assert "".join(r for r, _ in parts) == "plan it"
    assert "".join(c for _, c in parts) == "The answer <think> stays"
    assert split_think("opened in the prompt</think>\nanswer") == ("opened in the prompt", "answer")


def test_control_characters_never_reach_the_terminal():
    assert printable("a\x1b[2Jb\x00\x7f\n\tc") == "a␛[2Jb␀␡\n\tc"


def test_close_fences():
    assert close_fences("```python\nx = 1\n") == "```\n"
    assert close_fences("```python\nx = 1") == "\n```\n"
    assert close_fences("```\nx\n```\ntext") == ""
    assert close_fences("~~~~\n```\n") == "~~~~\n"


class CharTokenizer:
    """One id per character; a template that opens <think> in the prompt when thinking."""

    chat_template = "... enable_thinking ..."

    def apply_chat_template(
        self, messages, add_generation_prompt=True, tokenize=True, enable_thinking=True
    ):
        text = "".join(f"<{m['role']}>{m['content']}</>" for m in messages)
        text += "<assistant>" + ("<think>\n" if enable_thinking else "")
        return text if not tokenize else self.encode(text)

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


class TokenizingSession:
    def tokenize(self, messages, system=None, reasoning=None):
        full = ([{"role": "system", "content": system}] if system else []) + messages
        kw = {} if reasoning is None else {"enable_thinking": reasoning == "on"}
        return CharTokenizer().apply_chat_template(full, **kw)


def test_backend_prompt_detects_open_think_and_splices_generated_ids():
    backend = fake_backend()
    backend.session, backend.tokenizer = TokenizingSession(), CharTokenizer()
    history = [{"role": "user", "content": "hi"}]
    ids, thinking = backend.prompt(history, "sys", None)
    assert thinking and ids == CharTokenizer().apply_chat_template(
        [{"role": "system", "content": "sys"}] + history
    )
    assert backend.prompt(history, None, "off")[1] is False
    ids, _ = backend.prompt(history, None, "off")
    generated = [7, 8, 9]  # ids the model produced; re-tokenizing "ok!" would differ
    backend.record("ok!", generated)
    history += [{"role": "assistant", "content": "ok!"}, {"role": "user", "content": "more"}]
    ids2, _ = backend.prompt(history, None, "off")
    assert ids2[: len(ids) + 3] == ids + generated  # the cached ids, as generated
    assert ids2[len(ids) + 3 :] == CharTokenizer().encode("</><user>more</><assistant>")
    ids3, _ = backend.prompt(history, "a new system prompt", "off")  # no longer a prefix
    assert ids3 == TokenizingSession().tokenize(history, "a new system prompt", "off")


# ---- the app with the fake engine ----


@pytest.mark.anyio
async def test_streams_answer_with_stats_and_histogram():
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        widget = await ask(pilot, "Reverse a string in Python")
        expected = "".join(t for t, _ in ANSWER)
        assert answer_source(widget) == expected
        assert widget.query_one(CodeFence).code.startswith("def reverse")
        panel = app.query_one(HistogramPanel)
        assert panel.stats.histogram == [0, 1, 1, 0, 1, 1, 0, 0]
        assert panel.stats.tau == pytest.approx(4.0)
        # 17 tokens, 80 tok/s, τ 4.0; the first turn has nothing cached.
        assert stats_text(widget) == (
            f"17 tok · 80.0 tok/s · τ 4.0 · prefill {panel.stats.prompt_tokens} new + 0 cached"
        )
        saved = app.store.messages(app.chat_id)
        assert [m.role for m in saved] == ["user", "assistant"]
        assert saved[1].content == expected and saved[1].stats["tau"] == 4.0


@pytest.mark.anyio
async def test_histogram_moves_every_cycle():
    session = FakeSession(hold_at=3)
    app = make_app(session)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await ask(pilot, "go", wait=False)
        await until(pilot, lambda: session.held.is_set())
        panel = app.query_one(HistogramPanel)
        await until(pilot, lambda: panel.stats and panel.stats.generation_tokens == 9)
        assert panel.stats.histogram == [0, 0, 1, 0, 1, 0, 0, 0]
        assert "4.00" in str(panel.render())
        session.release.set()
        await until(pilot, lambda: app.turn is None)
        assert panel.stats.histogram == [0, 1, 1, 0, 1, 1, 0, 0]


@pytest.mark.anyio
async def test_escape_stops_mid_stream_and_repairs_the_fence():
    session = FakeSession(hold_at=2)
    app = make_app(session)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        widget = await ask(pilot, "go", wait=False)
        await until(pilot, lambda: session.held.is_set())
        await pilot.press("escape")
        await until(pilot, lambda: app.turn is None)
        await pilot.pause()
        source = answer_source(widget)
        assert source == ANSWER[0][0] + ANSWER[1][0] + "```\n"  # the open fence was closed
        assert "stopped" in stats_text(widget)
        assert app.store.messages(app.chat_id)[1].stats["finish"] == "cancelled"
        # The conversation goes on after a stop.
        session.hold_at = None
        second = await ask(pilot, "again")
        assert "stopped" not in stats_text(second)
        assert len(session.prompts[-1]) == 3


@pytest.mark.anyio
async def test_thinking_section_is_collapsed_and_separate():
    script = [("<think>", 0), ("Let me plan.", 3), ("</think>\n\n", 2), ("Done.", 4)]
    app = make_app(FakeSession(script))
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        widget = await ask(pilot, "think")
        box = widget.query_one(Collapsible)
        assert box.collapsed
        assert box.query_one(ChatMarkdown).source == "Let me plan."
        assert answer_source(widget) == "Done."


@pytest.mark.anyio
async def test_keybindings():
    app = make_app(reasoning=True)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        box = app.query_one(ChatInput)
        await pilot.press("a", "ctrl+j", "b", "shift+enter", "c")
        assert box.text == "a\nb\nc" and app.chat_id is None  # nothing was sent
        box.text = ""
        await pilot.press("f1")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)
        await pilot.press("ctrl+t")
        assert app.reasoning == "off" and "off" in str(app.query_one(HistogramPanel).render())
        await pilot.press("ctrl+t")
        assert app.reasoning == "on"
        await ask(pilot, "code please")
        app.query_one("#log").focus()
        await pilot.press("y")
        assert app.clipboard.startswith("def reverse(s: str)")
        app.copy_to_clipboard("")
        await pilot.click(CodeFence)
        assert app.clipboard.endswith("return s[::-1]")
        await pilot.press("ctrl+n")
        await pilot.pause()
        assert not app.query(UserMessage) and app.chat_id is None


@pytest.mark.anyio
async def test_palette_commands_rename_system_export_delete(tmp_path):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await ask(pilot, "first question")
        chat_id = app.chat_id
        await pilot.press("ctrl+p")
        await pilot.press(*"rename")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await until(pilot, lambda: isinstance(app.screen, InputScreen) and app.screen.query(Input))
        app.screen.query_one(Input).value = "Renamed"
        await pilot.press("enter")
        assert app.store.chat(chat_id).title == "Renamed" and app.sub_title == "Renamed"
        app.action_system_prompt()
        await until(pilot, lambda: isinstance(app.screen, InputScreen) and app.screen.query(Input))
        app.screen.query_one(Input).value = "Be terse."
        await pilot.press("enter")
        assert app.store.chat(chat_id).system == "Be terse."
        out = tmp_path / "chat.md"
        app.action_export()
        await until(pilot, lambda: isinstance(app.screen, InputScreen) and app.screen.query(Input))
        app.screen.query_one(Input).value = str(out)
        await pilot.press("enter")
        text = out.read_text()
        assert text.startswith("# Renamed") and "**System:** Be terse." in text
        assert "## Assistant" in text and "return s[::-1]" in text
        app.action_delete()
        await pilot.pause()
        await pilot.press("y")
        await until(pilot, lambda: app.chat_id is None)
        assert app.store.chat(chat_id) is None


@pytest.mark.anyio
async def test_history_survives_a_restart(home):
    session = FakeSession()
    async with make_app(session).run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await ask(pilot, "question one")
        await ask(pilot, "question two")
    assert (home / "chats.sqlite3").exists()
    again = FakeSession()
    app = make_app(again)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await pilot.press("ctrl+o")
        await until(pilot, lambda: isinstance(app.screen, ChatListScreen))
        await pilot.press("enter")
        await until(pilot, lambda: len(app.query(AssistantMessage)) == 2)
        shown = [str(w.render()) for w in app.query(UserMessage)]
        assert shown == ["question one", "question two"]
        assert "τ 4.0" in stats_text(app.query(AssistantMessage).last())
        await ask(pilot, "question three")
        assert [m["content"] for m in again.prompts[0]][::2] == [
            "question one",
            "question two",
            "question three",
        ]
    assert len(Store().messages(1)) == 6


@pytest.mark.anyio
async def test_load_error_is_shown_in_the_app():
    def fail():
        raise LoadError("the bundled pair is not built yet; pass --model and --draft.")

    app = ChatApp(ChatOptions(), loader=fail)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.query_one(ChatInput).disabled)
        status = str(app.query_one("#status-text").render())
        assert status == "error: the bundled pair is not built yet; pass --model and --draft."


@pytest.mark.anyio
async def test_loading_steps_show_in_the_status_bar():
    """The cost curve's timing at first use reports its progress from the engine thread."""
    import threading

    go = threading.Event()
    app: ChatApp

    def slow_loader():
        app.post_loading("Timing block sizes 1..8 on this machine (once for this pair)…", 0.25)
        go.wait(10)
        return fake_backend(None)

    app = ChatApp(ChatOptions(), loader=slow_loader)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: "Timing" in str(app.query_one("#status-text").render()))
        bar = app.query_one("#status ProgressBar")
        assert bar.display and bar.percentage == pytest.approx(0.25)
        go.set()
        await loaded(pilot)
        assert str(app.query_one("#status-text").render()).startswith("Ready")
        assert not bar.display


@pytest.mark.anyio
async def test_prompt_error_is_shown_and_the_question_forgotten():
    class TooLong(FakeSession):
        def stream(self, prompt, should_stop=None, **kwargs):
            raise PromptError("the prompt has 9000 tokens but the model's context is 4096 tokens.")

    app = make_app(TooLong())
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        widget = await ask(pilot, "a very long question")
        error = "error: the prompt has 9000 tokens but the model's context is 4096 tokens."
        assert str(widget.query_one(".error").render()) == error
        assert app.history == [] and app.store.messages(app.chat_id) == []


class WindowSession(FakeSession):
    """The fake engine behind a Backend with a (one id per character) tokenizer."""

    def tokenize(self, messages, system=None, reasoning=None):
        return TokenizingSession().tokenize(messages, system, reasoning)


@pytest.mark.anyio
async def test_long_conversation_leaves_out_the_oldest_turns_with_a_note():
    session = WindowSession()
    context = 200  # a turn is ~50 tokens: a ~30-character question, 17 generated answer ids
    backend = fake_backend(session)
    backend.tokenizer, backend.context = CharTokenizer(), context
    app = ChatApp(
        ChatOptions(system="Be brief.", reasoning="off", max_tokens=100), loader=lambda: backend
    )
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        for i in range(6):
            widget = await ask(pilot, f"question {i}")
            assert not widget.query(".error") and "17 tok" in stats_text(widget)
            prompt = "".join(map(chr, session.prompts[-1]))
            assert len(prompt) < context and prompt.startswith("<system>Be brief.</>")
            assert f"question {i}" in prompt
            assert session.max_tokens == min(100, context - len(prompt))
        assert "question 0" not in prompt and app.skip >= 2
        notes = [str(n.render()) for n in app.query(".note")]
        assert notes and notes[-1] == window_note(app.skip, context)
        assert "200-token context: the oldest" in notes[0]
        assert len(app.store.messages(app.chat_id)) == 12  # the stored chat keeps everything


@pytest.mark.anyio
async def test_unfenced_code_keeps_lines_indentation_and_underscores():
    script = [
        ("class Point:\n    def __init__(self, x):\n", 3),
        ("        self.x = x\n\nThe __init__ method sets x.", 4),
    ]
    session = FakeSession(script, hold_at=1)
    app = make_app(session)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        widget = await ask(pilot, "a class", wait=False)
        await until(pilot, lambda: session.held.is_set())
        live = widget.query_one("#live")
        await until(pilot, lambda: live.text.startswith("class"))
        assert live.text == script[0][0]  # streamed as plain text, as written
        shown = "\n".join(str(s.render()) for s in live.query(Static))
        assert shown == script[0][0]
        session.release.set()
        await until(pilot, lambda: widget.finished)
        assert widget.query_one(CodeFence).code == (
            "class Point:\n    def __init__(self, x):\n        self.x = x"
        )
        assert answer_source(widget).endswith("\n```\n\nThe \\_\\_init\\_\\_ method sets x.")
        assert not live.display


def test_fence_code_leaves_prose_and_fenced_code_alone():
    text = "Use it like this:\n\n```\nx = 1\n```\nDone: all good."
    assert fence_code(text) == text
    assert fence_code("x = 1\nprint(x)\nThat prints 1.") == (
        "```python\nx = 1\nprint(x)\n```\nThat prints 1."
    )
    assert fence_code("Note: `a_b` and a_b") == "Note: `a_b` and a\\_b"


@pytest.mark.anyio
async def test_long_answer_follows_the_stream_until_the_user_scrolls_up():
    script = [(f"line {i}\n\n", 1) for i in range(60)]
    session = FakeSession(script, hold_at=40)
    app = make_app(session)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await ask(pilot, "count", wait=False)
        await until(pilot, lambda: session.held.is_set())
        log = app.query_one("#log")
        live = app.turn.widget.query_one("#live")
        await until(pilot, lambda: "line 39" in live.text)
        shown = "\n".join(str(s.render()) for s in live.query(Static))
        assert shown == "".join(t for t, _ in script[:40])  # in frozen blocks + the tail
        await pilot.pause(0.2)
        assert log.max_scroll_y > 0 and log.scroll_y == log.max_scroll_y
        session.release.set()
        await until(pilot, lambda: app.turn is None)
        await pilot.pause(0.2)
        assert log.scroll_y == log.max_scroll_y


@pytest.mark.anyio
async def test_side_panel_hides_with_f2_and_narrows_on_small_terminals():
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        panel = app.query_one(HistogramPanel)
        assert panel.display and panel.outer_size.width == 36
        await pilot.press("f2")
        assert not panel.display
        await pilot.press("f2")
        assert panel.display
        await pilot.resize_terminal(90, 30)
        await pilot.pause()
        assert panel.display and panel.outer_size.width == 26
        assert "█" in str(panel.render()) or panel.stats is None
        await pilot.resize_terminal(60, 30)
        await pilot.pause()
        assert not panel.display


def test_chat_command_is_registered():
    from typer.testing import CliRunner

    from dflash_mac.cli import app as cli

    result = CliRunner().invoke(cli, ["chat", "--help"])
    assert result.exit_code == 0 and "--resume" in result.output


# ---- a real pair through the app ----


@pytest.fixture(scope="module")
def real_dirs(tmp_path_factory):
    if (BUNDLED_DRAFT / "config.json").exists():
        return BUNDLED_TARGET, BUNDLED_DRAFT
    from helpers.tiny import build_tiny_pair

    return build_tiny_pair(tmp_path_factory.mktemp("chat-tiny"), seed=0)


@pytest.mark.slow
@pytest.mark.anyio
async def test_real_pair_end_to_end_second_turn_prefills_only_new_tokens(real_dirs, home):
    model, draft = real_dirs
    app = ChatApp(ChatOptions(str(model), str(draft), max_tokens=12))
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.backend is not None, timeout=60)
        # auto's cost curve was measured on the engine thread, once: the turns below run there
        assert len(list(home.glob("cost-curves/*/*.json"))) == 1
        await ask(pilot, "def add(a, b):")
        await ask(pilot, "and subtract?")
        first, second = [m.stats for m in app.store.messages(app.chat_id)[1::2]]
        assert first["cached"] == 0 and first["tokens"] >= 1
        tail = 0 if first["finish"] == "stop" else 1  # the last answer token is not cached
        assert second["cached"] == first["prompt"] + first["tokens"] - tail
        shown = stats_text(app.query(AssistantMessage).last())
        new = second["prompt"] - second["cached"]
        assert f"prefill {new} new + {second['cached']} cached" in shown
        chat_id = app.chat_id
    # Restart and resume: the history is prefilled while the user types, so the next turn
    # prefills little more than the new message.
    app = ChatApp(ChatOptions(str(model), str(draft), max_tokens=4))
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.backend is not None, timeout=60)
        await app.open_chat(chat_id)
        await until(pilot, lambda: "cached" in str(app.query_one("#status-text").render()))
        await ask(pilot, "and multiply?")
        third = app.store.messages(chat_id)[-1].stats
        tok, history = app.backend.tokenizer, app.history[:-2]
        before = tok.apply_chat_template(history, add_generation_prompt=False)
        assert third["prompt"] == len(
            tok.apply_chat_template(app.history[:-1], add_generation_prompt=True)
        )
        assert third["cached"] >= len(before)  # only the new message is prefilled


@pytest.mark.slow
@pytest.mark.anyio
async def test_real_pair_conversation_longer_than_its_context_keeps_working(real_dirs):
    from dflash_mac.app.backend import load_backend

    model, draft = real_dirs
    opts = ChatOptions(str(model), str(draft), max_tokens=8)

    def loader():  # the real pair, with its context cut to 100 tokens
        backend = load_backend(opts)
        backend.context = 100
        return backend

    app = ChatApp(opts, loader=loader)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.backend is not None, timeout=60)
        skips = []
        for question in (
            "def add(a, b):",
            "and subtract?",
            "and multiply?",
            "and divide?",
            "and power?",
            "and modulo?",
        ):
            widget = await ask(pilot, question)
            assert not widget.query(".error")
            skips.append(app.skip)
        stats = [m.stats for m in app.store.messages(app.chat_id)[1::2]]
        assert all(s["tokens"] >= 1 and s["prompt"] + 8 <= 100 for s in stats)
        assert app.skip >= 2 and app.query(".note")
        # After a cut the window start holds still: the next turn reuses the cached prefix.
        cut = next(i for i, n in enumerate(skips) if n)
        assert cut + 1 < len(skips) and skips[cut + 1] == skips[cut]
        assert stats[cut + 1]["cached"] > stats[cut + 1]["prompt"] // 2


# ---- snapshots ----


def test_snapshot_main_screen(snap_compare):
    async def run_before(pilot):
        await loaded(pilot)
        pilot.app.query_one(ChatInput).cursor_blink = False
        await ask(pilot, "Write a Python function that reverses a string")

    assert snap_compare(make_app(), terminal_size=SIZE, run_before=run_before)


class PanelApp(App):
    CSS = "HistogramPanel { width: 36; height: 1fr; }"

    def compose(self) -> ComposeResult:
        yield HistogramPanel()

    def on_mount(self) -> None:
        panel = self.query_one(HistogramPanel)
        panel.set_info(fake_backend().info, "off")
        counts = (3, 5, 9, 14, 11, 6, 2, 1)  # cycles that committed 1..8 tokens
        lengths = tuple(k + 1 for k, c in enumerate(counts) for _ in range(c))
        panel.show(DecodeStats(8, 180, 150, 412, lengths, 0.1, 412 / 96.4, int(1.37e9)))


def test_snapshot_histogram_panel(snap_compare):
    assert snap_compare(PanelApp(), terminal_size=(36, 28))


def test_histogram_panel_shows_drafting_cycles_and_how_many_were_plain():
    """`auto` runs plain steps where drafting does not pay: they are not acceptance, so the
    bars count drafting cycles and a row says how many of the cycles drafted."""
    panel = HistogramPanel()
    panel.show(
        DecodeStats(4, acceptance_lengths=(1, 1, 3, 1, 4), block_sizes=(1, 1, 4, 4, 4), auto=True)
    )
    text = str(panel.render_panel())
    rows = [line.split() for line in text.splitlines()[1:5]]
    assert [int(r[-1]) for r in rows] == [1, 0, 1, 1]  # A = 1 once: the rejected block only
    assert "drafting  3 of 5 cycles" in text
    panel.show(DecodeStats(4, acceptance_lengths=(3, 4), block_sizes=(4, 4)))
    assert "of 2 cycles" not in str(panel.render_panel())  # no plain steps: no such row


def test_no_speedup_over_a_plain_rate_timed_at_another_moment():
    """The panel and the stats line show what the answer measured (τ, tok/s), not a ratio to
    a plain rate timed once at start-up (0.27× to 3.19× for one setting across launches);
    a `speedup` saved by an older version is not shown either."""
    from dflash_mac.app import backend

    panel = HistogramPanel()
    panel.set_info(fake_backend().info)
    snap = DecodeStats(8, 20, 0, 40, (4, 5, 3), 0.1, 0.5)
    panel.show(snap)
    text = str(panel.render_panel())
    assert "decode    80.0 tok/s" in text and "τ         4.00" in text
    assert "speedup" not in text and "plain" not in text
    stats = backend.turn_stats(snap, "stop")
    assert "speedup" not in stats
    old = {**stats, "speedup": 0.27}
    assert "×" not in turn_line(old) and turn_line(old) == turn_line(stats)
    assert not hasattr(backend, "measure_plain_tps")  # loading times no plain decode


class NarrowPanelApp(App):
    """The side panel alone, 32 columns wide (as beside a 100-column chat)."""

    def compose(self) -> ComposeResult:
        panel = HistogramPanel()
        panel.styles.width = 32
        yield panel


@pytest.mark.anyio
async def test_the_panel_names_auto_blocks_and_explains_plain_steps():
    """Issue 55: before the first answer an `auto` engine's panel said "block 8"; after one,
    "auto ≤8: 1 (drafting does not pay (0.75×))" wrapped into the label column unexplained."""
    from dflash_mac.app.backend import EngineInfo

    async with NarrowPanelApp().run_test() as pilot:
        panel = pilot.app.query_one(HistogramPanel)
        panel.set_info(EngineInfo("m", "DFlash", 8, "reference", False, auto=True))
        await pilot.pause()
        assert "block     auto ≤8" in str(panel.render_panel())
        why = "drafting does not pay: block 8 expected at 0.75× plain speed"
        stats = DecodeStats(8, acceptance_lengths=(1, 1), block_sizes=(8, 1), auto=True)
        panel.show(replace(stats, block_reason=why))
        await pilot.pause()
        lines = str(panel.render_panel()).splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("why       "))
    said = [lines[start][10:]]
    for line in lines[start + 1 :]:
        if not line.startswith(" " * 10):
            break
        said.append(line[10:])
    assert len(said) > 1 and " ".join(said) == why  # wrapped under its value, whole
    assert all(len(line) <= 32 for line in lines)
    assert "block     auto ≤8 · now plain" in lines[start - 1] + lines[start - 2]


def test_the_line_under_an_answer_keeps_one_decimal():
    assert turn_line({"tokens": 19, "tps": 9.5, "tau": 1.0, "prompt": 4}).startswith(
        "19 tok · 9.5 tok/s"
    )
