"""One prompt-file reader: bench and train see the same prompts in the same file."""

from __future__ import annotations

import json

import pytest

from dflash_mac.bench.inputs import read_prompts as bench_prompts
from dflash_mac.errors import PromptError, UserError
from dflash_mac.prompts import read_prompt_file
from dflash_mac.train.data import read_prompts as train_prompts

CHAT = [{"role": "user", "content": "hi"}]


def test_bench_and_train_read_the_same_prompts(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"id": "a", "messages": [*CHAT, {"role": "assistant", "content": "dropped"}]},
                {"prompt": "plain"},
                {"text": "also plain"},
                "bare string",
            ]
        )
        + "\n\n"
    )
    records = read_prompt_file(path)
    assert [r.prompt for r in records] == [CHAT, "plain", "also plain", "bare string"]
    assert [(r.id, r.line) for r in records] == [("a", 1), (None, 2), (None, 3), (None, 4)]
    assert [p.prompt for p in bench_prompts(path)] == [r.prompt for r in records]
    assert train_prompts(path) == [{"messages": CHAT}, "plain", "also plain", "bare string"]


@pytest.mark.parametrize(
    "line, message",
    [
        ("{nope", "line 1 is not valid JSON"),
        ('{"messages": []}', 'line 1 needs a non-empty "messages" list'),
        ('{"prompt": 3}', "line 1 needs"),
        ("", "holds no prompts"),
    ],
)
def test_bad_files_are_user_errors(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(PromptError, match=message) as e:
        read_prompt_file(path)
    assert isinstance(e.value, UserError)
    with pytest.raises(UserError, match=message):
        train_prompts(path)
