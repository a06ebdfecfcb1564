"""The suffix memory (drafting/suffix.py) against brute force: longest match, continuation counts,
eviction, and what it keeps between processes."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest

from dflash_mac.drafting.suffix import ALPHA, MAX_MATCH, MIN_MATCH, MIN_PROB, SuffixMemory


def brute_match(answers: list[list[int]], context: list[int]) -> tuple[int, list[tuple]]:
    """The longest context suffix (<= MAX_MATCH) inside one answer, and every (answer, end)
    where it ends."""
    best, where = 0, []
    for m in range(1, min(MAX_MATCH, len(context)) + 1):
        pat = context[-m:]
        hits = [
            (a, i + m)
            for a, ids in enumerate(answers)
            for i in range(len(ids) - m + 1)
            if ids[i : i + m] == pat
        ]
        if not hits:
            break
        best, where = m, hits
    return (best, where) if best >= MIN_MATCH else (0, [])


def brute_propose(answers: list[list[int]], context: list[int], k: int) -> list[int]:
    m, where = brute_match(answers, context)
    if m == 0:
        return []
    out, prob, total = [], 1.0, len(where)
    for _ in range(min(k, int(ALPHA * m))):
        nxt = [answers[a][e] for a, e in where if e < len(answers[a])]
        if not nxt:
            break
        counts: dict[int, int] = {}
        for t in nxt:
            counts[t] = counts.get(t, 0) + 1
        token = min(counts, key=lambda t: (-counts[t], t))  # most frequent, then lowest id
        prob *= counts[token] / total
        if prob < MIN_PROB:
            break
        out.append(token)
        where = [(a, e + 1) for a, e in where if e < len(answers[a]) and answers[a][e] == token]
        total = len(where)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_match_and_proposals_equal_brute_force(seed):
    rng = random.Random(seed)
    vocab = rng.choice([3, 5, 9])  # small vocabularies: many repeats, long matches, ties
    answers = [[rng.randrange(vocab) for _ in range(rng.randint(5, 60))] for _ in range(8)]
    memory = SuffixMemory()
    for a in answers:
        memory.add(a)
    owners = {}
    for key, ids in memory.answers.items():
        owners[key] = ids.tolist()
    for _ in range(60):
        src = answers[rng.randrange(len(answers))]
        cut = rng.randint(1, len(src))
        context = [rng.randrange(vocab) for _ in range(rng.randint(0, 4))] + src[:cut]
        m, starts = memory.match(context)
        bm, where = brute_match(answers, context)
        assert m == bm, context
        # each occurrence's start in the reversed text, as (answer, end) of the forward match
        got = sorted(
            (int(memory.owner[s]), len(owners[int(memory.owner[s])]) - int(s - first(memory, s)))
            for s in starts
        )
        assert got == sorted(where)
        k = rng.randint(1, 40)
        assert memory.propose(context, k) == brute_propose(answers, context, k), context


def first(memory: SuffixMemory, s: int) -> int:
    """Where the reversed answer holding position `s` starts in the joined text."""
    owner = memory.owner[s]
    return int(np.flatnonzero(memory.owner == owner)[0])


def test_a_context_that_matches_nothing_proposes_nothing():
    memory = SuffixMemory()
    memory.add([1, 2, 3, 4, 5, 6, 7])
    assert MIN_MATCH == 4
    assert memory.propose([8, 9, 10, 11], 8) == []
    assert memory.propose([2, 3, 4], 8) == []  # fewer than MIN_MATCH tokens
    assert memory.propose([1, 2, 3, 4], 8) == [5, 6, 7]
    assert memory.propose([1, 2, 3, 4], 0) == []
    assert not SuffixMemory().may_match([1, 2, 3, 4])


def test_the_most_frequent_continuation_wins_and_a_split_stops_the_chain():
    memory = SuffixMemory()
    for tail in ([7, 7, 7], [7, 7, 7], [8, 9, 9]):
        memory.add([1, 2, 3, 4, 5, *tail])
    assert memory.propose([0, 2, 3, 4, 5], 8) == [7, 7, 7]  # 2 of 3: above MIN_PROB
    assert memory.propose([9, 3, 4, 5, 8], 8) == [9, 9]  # a longer match: the 8 answer's
    for tail in ([5, 5], [6, 6], [5, 6], [6, 5]):
        memory.add([1, 2, 3, 4, 5, *tail])
    assert 2 / 7 < MIN_PROB
    assert memory.propose([0, 2, 3, 4, 5], 8) == []  # the likeliest, 2 of 7, is too unlikely
    assert memory.propose([2, 3, 4, 5, 7], 8) == [7, 7]  # a longer match among the 7s


def test_eviction_keeps_the_recently_used_answers():
    memory = SuffixMemory(max_tokens=30)
    memory.add([10, 11, 12, 13, 14, 15, 16, 17, 18, 19])
    memory.add([20, 21, 22, 23, 24, 25, 26, 27, 28, 29])
    assert memory.propose([10, 11, 12, 13], 3) == [14, 15, 16]  # the first answer is used now
    memory.add([30, 31, 32, 33, 34, 35, 36, 37, 38, 39])
    memory.add([40, 41, 42, 43, 44, 45, 46, 47, 48, 49])  # 40 tokens: the LRU one goes
    assert memory.tokens == 30
    assert memory.propose([20, 21, 22, 23], 3) == []  # dropped: least recently used
    assert memory.propose([10, 11, 12, 13], 3) == [14, 15, 16]
    assert (20, 21, 22, 23) not in memory.grams and (10, 11, 12, 13) in memory.grams


def test_save_and_load(tmp_path):
    memory = SuffixMemory()
    memory.add([1, 2, 3, 4, 5])
    memory.add([6, 7, 8, 9, 10, 11])
    memory.save(tmp_path / "answers.jsonl", "pair-a")
    again = SuffixMemory()
    assert again.read(tmp_path / "answers.jsonl", "pair-a") == 2
    assert again.propose([6, 7, 8, 9], 4) == [10, 11]
    assert again.tokens == memory.tokens
    with pytest.raises(ValueError, match="another pair"):
        SuffixMemory().read(tmp_path / "answers.jsonl", "pair-b")
    (tmp_path / "answers.jsonl").write_text(open(tmp_path / "answers.jsonl").read()[:-3])
    with pytest.raises(ValueError, match="damaged"):
        SuffixMemory().read(tmp_path / "answers.jsonl", "pair-a")


def test_a_query_on_100k_tokens_takes_under_a_millisecond():
    rng = np.random.default_rng(0)
    memory = SuffixMemory(max_tokens=110_000)
    for _ in range(200):
        memory.add(rng.integers(0, 2_000, 500).tolist())
    answer = list(memory.answers.values())[50].tolist()
    memory.propose(answer[:10], 16)  # builds the index
    t0 = time.perf_counter()
    for i in range(200):
        assert memory.propose(answer[: 10 + i], 16)
    per = (time.perf_counter() - t0) / 200
    assert memory.tokens == 100_000 and memory.nbytes < 64 << 20
    assert per < 0.005  # 1 ms is the goal (docs/bench.md measures it); 5x slack for a busy CI
