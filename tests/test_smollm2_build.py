"""The smollm2-135m drafters' training prompts (dflash_mac/bundle/smollm2.py) keep the bench
suites out: no held-out stdlib module's code, no `chat` suite question."""

from __future__ import annotations

import gzip
import json
import re

import pytest

from dflash_mac.bench.inputs import suite_prompts
from dflash_mac.bundle import campaign, corpus, smollm2


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


def test_committed_data_is_restored_once_and_kept_gzipped(tmp_path):
    """A fresh machine takes the committed prompts / answers instead of regenerating them; a
    cache file is copied into the repository once, gzipped, and read back byte for byte."""
    cache = tmp_path / "cache" / "regen-abc.jsonl"
    cache.parent.mkdir()
    cache.write_text('{"prompt": [1, 2], "response": [3, 2]}\n')
    kept = tmp_path / "repo" / "regen-abc.jsonl.gz"
    smollm2.keep(cache, kept)
    assert kept.exists() and kept.read_bytes()[:2] == b"\x1f\x8b"
    fresh = tmp_path / "fresh" / "regen-abc.jsonl"
    assert smollm2.restore(kept, fresh) and fresh.read_text() == cache.read_text()
    assert not smollm2.restore(tmp_path / "missing.gz", tmp_path / "nothing.jsonl")
    cache.write_text("changed\n")
    smollm2.keep(cache, kept)  # never overwritten: the committed copy is the record
    assert smollm2.restore(kept, tmp_path / "again.jsonl")
    assert (tmp_path / "again.jsonl").read_text() != "changed\n"


def test_a_stage_row_carries_the_curve_on(tmp_path):
    """Cumulative steps and blocks continue the curve's last row; a stage's own summary gives
    its steps, blocks and seconds per step."""

    curve = tmp_path / "curve.csv"
    campaign.append_row(curve, {"stage": "5", "steps": 901, "blocks": 166400})
    draft = tmp_path / "d"
    draft.mkdir()
    (draft / "config.json").write_text(
        json.dumps({"vocab_size": 100, "dflash_config": {"draft_vocab_size": 40}})
    )
    summary = {"steps": 10, "blocks": 1500, "train_seconds": 25.0, "response_tokens": 7}
    (draft / "dflash_training.json").write_text(json.dumps(summary))
    tau = {"tau_code_greedy": 1.7, "identical": "14/14"}
    row = campaign.stage_row(draft, curve, "6", tau)
    assert (row["steps"], row["blocks"], row["s_per_step"]) == (911, 167900, 2.5)
    assert row["draft_vocab"] == 40 and row["blocks_estimated"] is False
    campaign.append_row(curve, row)
    rows = campaign.read_rows(curve)
    assert [r["stage"] for r in rows] == ["5", "6"] and rows[1]["tau_code_greedy"] == "1.7"
    # a stage not adopted left the drafter as it was: the next goes on from the one before it
    campaign.append_row(curve, {**row, "stage": "7", "steps": 999, "note": "NOT ADOPTED: worse"})
    assert campaign.stage_row(draft, curve, "8", tau)["steps"] == 921


def test_the_second_prompt_set_is_new_and_keeps_the_suites_out():
    """prompts2: code asks on functions the first set did not use, from training modules only,
    and everyday requests on topics that are not `chat` suite questions."""
    first = {json.dumps(r["messages"]) for r in smollm2.code_prompts()}
    second = smollm2.prompts2()
    assert not first & {json.dumps(r["messages"]) for r in second}
    _, heldout = corpus.split_modules()
    named = {m for r in second for m in re.findall(r"module `([\w.]+)`", json.dumps(r))}
    assert named and not named & {m.name for m in heldout}
    chat = " ".join(p.prompt[0]["content"].lower() for p in suite_prompts("chat", lambda _: None))
    assert not [t for t in smollm2.TOPICS2 if t.lower() in chat]
    asks = {r["messages"][0]["content"] for r in second}
    assert len(asks) == len(second)  # no prompt twice
    assert not asks & {p.prompt[0]["content"] for p in suite_prompts("chat", lambda _: None)}


def test_the_third_prompt_set_is_new_and_keeps_the_suites_out(tmp_path):
    """prompts3: everyday requests on new topics, two-turn chats that follow up on the second
    set's own chat answers, code asks on functions neither earlier set used; answered at T 0.7
    (its shards train as sampled parts)."""
    chats = smollm2.answered_chats(tmp_path, lambda ids: f"answer of {len(ids)} tokens")
    assert len(chats) >= 200 and all(len(m) == 1 for m, _ in chats)
    third = smollm2.prompts3(chats)
    earlier = {json.dumps(r["messages"]) for r in smollm2.code_prompts() + smollm2.prompts2()}
    assert not earlier & {json.dumps(r["messages"]) for r in third}
    follow = [r for r in third if r["messages"][-1]["content"] in smollm2.CHAT_FOLLOW_UPS]
    assert len(follow) == smollm2.COUNTS3["follow"]
    assert all(r["messages"][1]["role"] == "assistant" for r in follow)
    _, heldout = corpus.split_modules()
    named = {m for r in third for m in re.findall(r"module `([\w.]+)`", json.dumps(r))}
    assert not named & {m.name for m in heldout}
    chat = " ".join(p.prompt[0]["content"].lower() for p in suite_prompts("chat", lambda _: None))
    assert not [t for t in smollm2.TOPICS3 if t.lower() in chat]
    assert not set(smollm2.TOPICS3) & set(smollm2.TOPICS2 + smollm2.TOPICS)
    asks = [json.dumps(r["messages"]) for r in third]
    assert len(set(asks)) == len(asks)
    assert "prompts3" in smollm2.SAMPLED_SETS
    assert smollm2.shard_order("prompts3-10.jsonl") == ("prompts3", 10)


def test_the_fourth_set_is_the_second_answered_at_t07(tmp_path):
    """Stage data4 answers the second set's prompts again, sampled this time: the same rows in
    the same order (answered greedily before, so the answers are new text), its own stage."""
    rows = smollm2.prompts4(tmp_path)
    second = [
        json.loads(line)
        for f in sorted(
            smollm2.COMMITTED.glob("prompts2-*.jsonl"), key=lambda p: smollm2.shard_order(p.name)
        )
        for line in f.read_text().splitlines()
        if line.strip()
    ]
    assert len(rows) > 1000 and rows == second
    assert "prompts4" in smollm2.SAMPLED_SETS and "prompts2" not in smollm2.SAMPLED_SETS
    assert smollm2.ANSWERS["data4"] == "prompts4" and smollm2.ANSWERS["data2"] == "prompts2"


def test_the_fifth_set_is_the_first_answered_at_t07(tmp_path):
    """Stage data5 answers the first set's prompts again, sampled (they were answered
    greedily): the committed first set's rows in its order, its own stage."""
    rows = smollm2.prompts5(tmp_path)
    first = (smollm2.COMMITTED / "prompts.jsonl").read_text().splitlines()
    assert len(rows) == smollm2.KEEP and rows == [json.loads(x) for x in first if x.strip()]
    assert "prompts5" in smollm2.SAMPLED_SETS and smollm2.ANSWERS["data5"] == "prompts5"


def test_the_sixth_set_asks_everyday_things_anew(tmp_path):
    """Stage data6: new topics asked new ways, standalone tasks and follow-ups on the fourth
    set's sampled chat answers (two-turn chats whose first answer is the sampled one); no
    prompt of an earlier set nor a topic of the chat suite (held out); answered at T 0.7."""
    chats = smollm2.answered_chats(tmp_path, lambda ids: f"answer of {len(ids)} tokens", "prompts4")
    assert len(chats) >= 150 and all(len(m) == 1 for m, _ in chats)
    sixth = smollm2.prompts6(chats)
    follow = [r for r in sixth if r["messages"][-1]["content"] in smollm2.CHAT_FOLLOW_UPS6]
    assert len(follow) == smollm2.COUNTS6["follow"]
    assert all(r["messages"][1]["role"] == "assistant" for r in follow)
    assert len(sixth) == 3 * len(smollm2.TOPICS6) + len(smollm2.TASKS6) + len(follow)
    earlier = smollm2.code_prompts() + smollm2.prompts2() + smollm2.prompts3(chats)
    firsts = {json.dumps(r["messages"]) for r in earlier}
    assert not firsts & {json.dumps(r["messages"]) for r in sixth}
    chat = [p.prompt[0]["content"].lower() for p in suite_prompts("chat", lambda _: None)]
    assert not [t for t in smollm2.TOPICS6 if t.lower() in " ".join(chat)]
    assert not {t.lower() for t in smollm2.TASKS6} & set(chat)
    assert not set(smollm2.TOPICS6) & set(smollm2.TOPICS3 + smollm2.TOPICS2 + smollm2.TOPICS)
    asks = [json.dumps(r["messages"]) for r in sixth]
    assert len(set(asks)) == len(asks)
    assert "prompts6" in smollm2.SAMPLED_SETS and smollm2.ANSWERS["data6"] == "prompts6"


def test_a_restarted_drafter_starts_a_lineage_of_its_own():
    rows = [
        {"stage": s, "steps": n} for s, n in (("6", 3337), ("7", 4456), ("8a", 400), ("8", 1191))
    ]
    assert [[r["stage"] for r in lineage] for lineage in campaign.restarts(rows)] == [
        ["6", "7"],
        ["8a", "8"],
    ]


def test_the_fixed_text_is_new_and_keeps_the_suites_out():
    """The teacher-forced text, part by part: stdlib functions no prompt set asks for (as a
    fenced answer to the function's ask) and pydoc's language reference (the openings, then
    the rest a piece per "tell me more", a piece of overlapping topics once; later parts
    functions only); no function
    or piece in two parts, no held-out module of
    the code suite, no chat-suite prompt; the committed copies are what this stdlib gives."""
    parts = [smollm2.fixed_text(i) for i in range(len(smollm2.FIXED))]
    rows = [r for part in parts for r in part]
    code = [r for r in rows if r["answer"].startswith("```python")]
    for part, count in zip(parts, smollm2.FIXED_CODE):
        assert sum(r["answer"].startswith("```python") for r in part) == count
    assert all(len(part) > count + 50 for part, count in zip(parts[:2], smollm2.FIXED_CODE))
    assert [len(part) for part in parts[2:]] == list(smollm2.FIXED_CODE[2:])
    later = [r["answer"] for part in parts[1:] for r in part]
    assert len(set(later)) == len(later) and not set(later) & {r["answer"] for r in parts[0]}
    skip, sets = 0, []
    for counts in (smollm2.COUNTS, smollm2.COUNTS2, smollm2.COUNTS3):
        asks = smollm2.used_examples(counts)  # write, ask, multi (then long: pasted modules)
        sets += smollm2.code_prompts(seed=0, counts=counts, skip=skip)[:asks]
        skip += asks
    texts = [m["content"] for r in sets for m in r["messages"]]
    shown = {b for t in texts for b in re.findall(r"```python\n(.*?)\n```", t, re.S)}
    written = {t.replace("For the Python module", "In the Python module") for t in texts}
    assert len(shown) > 500 and len(written) > 1000  # the control: what the sets ask is found
    assert not {r["answer"].removeprefix("```python\n").removesuffix("\n```") for r in code} & shown
    assert not {r["messages"][0]["content"] for r in code} & written
    _, heldout = corpus.split_modules()
    named = {m for r in code for m in re.findall(r"module `([\w.]+)`", json.dumps(r))}
    assert len(named) > 50 and not named & {m.name for m in heldout}
    chat = {p.prompt[0]["content"] for p in suite_prompts("chat", lambda _: None)}
    assert not chat & {r["messages"][0]["content"] for r in rows}
    for name, part in zip(smollm2.FIXED, parts):
        committed = smollm2.COMMITTED / f"{name}.gz"
        assert [json.loads(line) for line in gzip.open(committed, "rt", encoding="utf-8")] == part


def test_a_topic_is_cut_into_whole_paragraphs():
    """Each piece ends at a paragraph, holds about FIXED_PART characters, and the pieces
    together are the topic; a paragraph longer than twice the size is cut."""
    paras = [f"p{i} " + "x" * 400 for i in range(10)]
    pieces = smollm2.topic_parts("\n\n".join(paras), size=1_000)
    assert "\n\n".join(pieces) == "\n\n".join(paras)
    assert all(len(p) <= 1_000 + 410 for p in pieces) and len(pieces) == 5
    assert smollm2.topic_parts("y" * 5_000, size=1_000) == ["y" * 2_000]


def test_a_learning_rate_that_is_not_positive_is_refused_in_one_sentence(capsys, tmp_path):
    with pytest.raises(SystemExit) as ended:
        smollm2.main(["--stage", "eval", "--lr", "0", "--cache", str(tmp_path)])
    assert ended.value.code == 2
    assert "--lr must be a positive learning rate" in capsys.readouterr().err
