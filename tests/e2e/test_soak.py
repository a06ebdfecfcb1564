"""The soak run (scripts/soak.py): its short version as CI runs it (`make test`), and its
verdict, which must catch what a soak is for."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import user_env

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "soak.py"


def load_soak():
    """scripts/soak.py as a module (registered first: its dataclasses look it up)."""
    if "soak_script" not in sys.modules:
        spec = importlib.util.spec_from_file_location("soak_script", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules["soak_script"] = module
        spec.loader.exec_module(module)
    return sys.modules["soak_script"]


@pytest.mark.slow
def test_short_soak_passes(tmp_path):
    """Half a minute of mixed traffic against two lives of `dflash-mac serve` (the second
    started after SIGTERM on the first one's data directory, as a restart): every kind of
    request was sent, the queue overflowed, and every check of both lives passed."""
    out = tmp_path / "soak"
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--minutes", "0.5", "--lives", "2", "--out", str(out)],
        env=user_env(tmp_path / "home"),
        capture_output=True,
        text=True,
        timeout=420,
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    summary = json.loads(Path(f"{out}.json").read_text())
    assert summary["pass"] and Path(f"{out}.md").read_text().startswith("# Soak run: PASS")
    soak = load_soak()
    kinds = set(summary["latency_by_kind"])
    assert set(soak.WELL_FORMED) <= kinds
    assert {"disconnect", "malformed", "oversize", "burst.429"} <= kinds
    assert summary["skipped"] == [] and "anthropic.messages" in kinds  # /v1/messages too
    assert "anthropic.messages.stream" in kinds  # its event stream, read to message_stop
    assert [life["exit"] for life in summary["lives"]] == [0, 0]
    assert {c["check"].split(":")[0] for c in summary["checks"]} == {"life 1", "life 2"}


def test_an_anthropic_stream_is_right_only_when_it_ends_in_message_stop():
    """The soak's check of a streamed Messages answer: named events, message_stop last; a
    stream cut short or carrying an error event is wrong (the controls)."""
    soak = load_soak()
    kind = "anthropic.messages.stream"
    events = ["message_start", "content_block_start", "content_block_delta", "message_stop"]
    good = [line for e in events for line in (f"event: {e}", "data: {}", "")]
    assert soak.check_answer(kind, None, good) == ""
    assert soak.check_answer(kind, None, good[:-3]) == "no message_stop event"
    bad = good[:3] + ["event: error", 'data: {"type": "error"}', ""] + good[3:]
    assert soak.check_answer(kind, None, bad) == "the event stream carried an error"


def state(**totals) -> dict:
    base = dict(requests=3, completed=3, cancelled=0, failed=0, invalid=0, rejected=1)
    base.update(totals)
    health = {"status": "ok", "failed": base["failed"], "requests": base["requests"]}
    prom = f"dflash_requests_total {base['requests']}\ndflash_rejected_total {base['rejected']}\n"
    return {
        "stats": {"totals": base},
        "metrics": {"totals": dict(base)},
        "prometheus": prom,
        "health": health,
    }


def test_the_verdict_catches_failures():
    soak = load_soak()
    out = soak.Outcome
    good = [out("openai.chat", 200, 0.1, True), out("ollama.generate", 200, 0.2, True)]
    good += [out("disconnect", 200, 0.1, True), out("burst.429", 429, 0.0, True)]
    mb = 2**20
    rss = {"warm": 100 * mb, "after": 105 * mb, "change": 0.05}

    def failed(outcomes, server, rss=rss, log="INFO fine") -> list[str]:
        return [c["check"] for c in soak.verdict(outcomes, server, rss, log) if not c["ok"]]

    assert failed(good, state()) == []
    assert failed(good, state(), log="Traceback (most recent call last):") == [
        "no traceback in the server's log or stderr"
    ]
    rss_check = "RSS after the run within 10% (at least 32 MB) of RSS after warm-up"
    grown = {"warm": 100 * mb, "after": 140 * mb, "change": 0.4}
    assert failed(good, state(), rss=grown) == [rss_check]
    big = {"warm": 900 * mb, "after": 1000 * mb, "change": 100 / 900}  # 10 % of a large one
    assert failed(good, state(), rss=big) == [rss_check]
    small = {"warm": 200 * mb, "after": 222 * mb, "change": 0.11}  # filling caches, no leak
    assert failed(good, state(), rss=small) == []
    assert "no 5xx" in failed(good + [out("openai.chat", 500, 0.1, False)], state())
    lost = failed(good, state(requests=4))  # a request the server counted but nobody sent
    assert "queued requests = 200s + oversize 400s (queued, then refused)" in lost
    assert "invalid = oversize prompts; rejected = 429s; failed = 0" in failed(
        good, state(failed=1)
    )
