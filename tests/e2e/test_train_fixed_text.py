"""`dflash-mac train --fixed-text FILE` as a user runs it: the installed command trains on the
target's answers and on fixed text taught teacher-forced; a missing file or a bad record is one
sentence, before any answer is generated."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow  # starts the installed command in subprocesses


def test_train_on_fixed_text_and_refuse_bad_files(cli, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": a}) + "\n" for a in ["def add(a, b):", "x ="]))
    fixed = tmp_path / "fixed.jsonl"
    record = {"messages": [{"role": "user", "content": "write add"}], "answer": "def add(a, b):"}
    fixed.write_text(json.dumps(record) + "\n")
    base = ("train", "-m", "tiny-code", "--data", str(data), "--steps", "2", "--block-size", "4")
    base += ("--gen-max-tokens", "16")
    cached = ("--cache-dir", str(tmp_path / "cache"))
    res = cli(*base, *cached, "--fixed-text", str(fixed), "--out", str(tmp_path / "d"), timeout=300)
    assert res.returncode == 0, res.stderr + res.stdout
    assert "fixed text: 1 sequences" in res.stdout + res.stderr
    assert (tmp_path / "d" / "config.json").is_file()

    missing = cli(*base, "--fixed-text", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "e"))
    assert missing.returncode != 0 and "Traceback" not in missing.stderr
    assert "--fixed-text" in missing.stderr and "does not exist" in missing.stderr

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": []}\n')
    fresh = ("--cache-dir", str(tmp_path / "fresh"))  # no answers cached: none may be made
    refused = cli(
        *base, *fresh, "--fixed-text", str(bad), "--out", str(tmp_path / "f"), timeout=300
    )
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    assert "bad.jsonl, line 1: not a fixed-text record" in refused.stderr
    assert "regenerating" not in refused.stdout + refused.stderr  # refused before any answer
