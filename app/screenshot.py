"""Render docs/chat.svg: a real pair answering two coding questions in the chat app.

    python -m dflash_mac.app.screenshot [docs/chat.svg] [--model M --draft D]

Uses the bundled pair when it is built, else a tiny random pair (its text is noise, but the
panel, stats line and prefix reuse are real). Chats go to a temporary DFLASH_MAC_HOME."""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
from pathlib import Path

QUESTIONS = [
    "Write a Python function is_prime(n) with type hints.",
    "Now make it faster with a 6k±1 loop.",
]


async def shoot(out: Path, model: str | None, draft: str | None, max_tokens: int) -> None:
    from .backend import ChatOptions
    from .chat_app import ChatApp
    from .widgets import AssistantMessage, ChatInput

    app = ChatApp(ChatOptions(model, draft, max_tokens=max_tokens))
    async with app.run_test(size=(120, 40)) as pilot:
        while app.backend is None:
            await pilot.pause(0.1)
        for question in QUESTIONS:
            before = len(app.query(AssistantMessage))
            app.query_one(ChatInput).text = question
            await pilot.press("enter")
            while len(app.query(AssistantMessage)) == before or app.turn is not None:
                await pilot.pause(0.1)
        app.query_one(ChatInput).cursor_blink = False
        await pilot.pause(0.3)
        app.save_screenshot(filename=out.name, path=str(out.parent))


def main() -> None:
    from dflash_mac.loading.loader import BUNDLED_DRAFT

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", default="docs/chat.svg")
    ap.add_argument("--model")
    ap.add_argument("--draft")
    ap.add_argument("--max-tokens", type=int, default=160)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="dflash-chat-shot-") as home:
        os.environ["DFLASH_MAC_HOME"] = home
        model, draft = args.model, args.draft
        if model is None and not (BUNDLED_DRAFT / "config.json").exists():
            from dflash_mac.loading.random_pair import build_random_pair

            model, draft = map(str, build_random_pair(Path(home) / "tiny"))
        asyncio.run(shoot(Path(args.out), model, draft, args.max_tokens))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
