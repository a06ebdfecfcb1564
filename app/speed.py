"""Chat vs generate decode speed, measured the way a user runs them (see docs/chat.md).

    python -m dflash_mac.app.speed [--prompt TEXT] [-n 256] [--repeats 5]

Each repeat runs, back to back, `dflash-mac generate PROMPT -n N --json` and `dflash-mac chat
-n N` in a real terminal (a 120x40 tmux session) with the same prompt, greedy, default block
size; both are fresh processes on the bundled pair. generate's decode tok/s comes from its JSON,
the chat's from the turn's saved statistics (the numbers of its stats line). Needs tmux."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CLI = Path(sys.executable).with_name("dflash-mac")  # --cli: another install (before/after)
PROMPT = "Write a Python class for a binary search tree with insert, find and delete."


def user_env(home: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("COLUMNS", "LINES") and not k.startswith("DFLASH_MAC")
    }
    return {**env, "DFLASH_MAC_HOME": home, "HF_HUB_OFFLINE": "1"}


def generate_tps(prompt: str, n: int) -> tuple[float, int]:
    """(decode tok/s, tokens) of one `dflash-mac generate`."""
    with tempfile.TemporaryDirectory() as home:
        out = subprocess.run(
            [str(CLI), "generate", prompt, "-n", str(n), "--json"],
            capture_output=True,
            text=True,
            env=user_env(home),
            timeout=300,
        )
    if out.returncode:
        raise SystemExit(f"generate failed: {out.stderr.strip()}")
    result = json.loads(out.stdout)
    return float(result["decode_tps"]), int(result["generation_tokens"])


def chat_tps(prompt: str, n: int) -> tuple[float, int]:
    """One answer in `dflash-mac chat` in tmux; its decode tok/s from the saved chat."""
    with tempfile.TemporaryDirectory() as home:
        sock = f"dflash-speed-{os.getpid()}"
        tmux = ["tmux", "-L", sock, "-f", "/dev/null"]
        env = " ".join(
            f"{k}={shlex.quote(v)}" for k, v in (("DFLASH_MAC_HOME", home), ("HF_HUB_OFFLINE", "1"))
        )
        shell = f"env -u COLUMNS -u LINES {env} {shlex.quote(str(CLI))} chat -n {n}"
        subprocess.run(
            [*tmux, "new-session", "-d", "-x", "120", "-y", "40", "-s", "chat", shell],
            check=True,
            env=user_env(home),
        )
        try:
            db = Path(home) / "chats.sqlite3"

            def screen() -> str:
                return subprocess.run(
                    [*tmux, "capture-pane", "-p", "-t", "chat"], capture_output=True, text=True
                ).stdout

            wait(lambda: "Ready ·" in screen(), "the chat to load")
            subprocess.run([*tmux, "send-keys", "-t", "chat", "-l", prompt], check=True)
            subprocess.run([*tmux, "send-keys", "-t", "chat", "Enter"], check=True)
            wait(lambda: answer_stats(db) is not None, "the answer")
            subprocess.run([*tmux, "send-keys", "-t", "chat", "C-q"])
            time.sleep(0.5)
            stats = answer_stats(db)
            return float(stats["tps"]), int(stats["tokens"])
        finally:
            subprocess.run([*tmux, "kill-server"], capture_output=True)


def answer_stats(db: Path) -> dict | None:
    if not db.exists():
        return None
    try:
        with sqlite3.connect(db) as con:
            row = con.execute("SELECT stats FROM messages WHERE role = 'assistant'").fetchone()
    except sqlite3.Error:
        return None
    return json.loads(row[0]) if row and row[0] else None


def wait(cond, what: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}.")
        time.sleep(0.2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("-n", "--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cli", type=Path, default=CLI, help="the dflash-mac command to measure")
    args = ap.parse_args()
    globals()["CLI"] = args.cli
    if not shutil.which("tmux"):
        raise SystemExit("this measurement needs tmux.")
    gen, chat = [], []
    for i in range(args.repeats):
        (g, gn), (c, cn) = (
            generate_tps(args.prompt, args.max_tokens),
            chat_tps(args.prompt, args.max_tokens),
        )
        gen.append(g)
        chat.append(c)
        print(
            f"repeat {i + 1}: generate {g:.1f} tok/s ({gn} tok) · chat {c:.1f} tok/s ({cn} tok)",
            flush=True,
        )
    g, c = statistics.median(gen), statistics.median(chat)
    ratio = statistics.median(b / a for a, b in zip(gen, chat))  # pairs ran back to back
    print(
        f"median: generate {g:.1f} tok/s · chat {c:.1f} tok/s · chat/generate {c / g:.2f}"
        f" (median of the per-repeat ratios {ratio:.2f})"
    )


if __name__ == "__main__":
    main()
