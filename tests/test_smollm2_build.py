"""The smollm2-135m drafters' training prompts (dflash_mac/bundle/smollm2.py) keep the bench
suites out: no held-out stdlib module's code, no `chat` suite question."""

from __future__ import annotations

import json
import re

from dflash_mac.bench.inputs import suite_prompts
from dflash_mac.bundle import corpus, smollm2


def test_code_prompts_come_only_from_training_modules_and_have_every_shape():
    rows = smollm2.code_prompts()
    assert len(rows) == sum(smollm2.COUNTS[k] for k in ("write", "ask", "multi", "long"))
    _, heldout = corpus.split_modules()
    held = {m.name for m in heldout}
    named = {m for r in rows for m in re.findall(r"module `([\w.]+)`", json.dumps(r))}
    assert named and not named & held
    assert {r.get("module") for r in rows if "module" in r} <= named | {None}
    assert sum(len(r["messages"]) == 3 for r in rows) == smollm2.COUNTS["multi"]
    # the `code` bench suite is drawn from exactly those held-out modules
    code_suite = suite_prompts("code", lambda _: None)
    assert code_suite and all(p.id.split(":")[0] in held for p in code_suite)
    asked = {json.dumps(r["messages"][0]["content"]) for r in rows}
    assert not asked & {json.dumps(p.prompt[0]["content"]) for p in code_suite}


def test_no_seed_topic_is_a_chat_suite_question():
    chat = " ".join(p.prompt[0]["content"].lower() for p in suite_prompts("chat", lambda _: None))
    assert not [t for t in smollm2.TOPICS if t.lower() in chat]
