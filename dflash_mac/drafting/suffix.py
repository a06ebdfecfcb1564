"""Suffix drafting (SuffixDecoding, arXiv 2411.04975): drafts from what the target answered
before. Agents send the same shapes again and again (tool-call JSON, a file with two lines
changed, a plan re-stated), so the longest earlier answer text that ends like the current
context usually goes on the way it went on then.

`SuffixMemory` is the global index over earlier answers (per pair, bounded by tokens, least
recently used answers dropped first). This request's own prompt and answer are `CopyIndex`'s
(drafting/copies.py), which also follows an aligned source through edits; the memory is asked only
where that index has nothing. A proposal is verified like a copy: greedy output is unchanged,
and sampled, q puts all its mass on each proposed token, so the rejection sampler keeps the
target's distribution.

The index is a suffix array (libdivsufsort through `pydivsufsort`) over the answers reversed
and joined by separators: the context read backwards is a prefix of the suffixes that match
it, so each further context token narrows one sorted range (`match`), and the positions left
in the range are where the earlier text went on. The chain follows the most frequent next
token among them, as long as its share of the matches keeps the path's estimated probability
above `MIN_PROB`, for at most `ALPHA` × the match length tokens (SuffixDecoding's adaptive
length: a long match predicts a long run)."""

from __future__ import annotations

import json
from bisect import bisect_left, bisect_right
from collections import OrderedDict
from pathlib import Path

import numpy as np
from pydivsufsort import divsufsort

# context tokens a proposal needs to match: one more than a copy's three, as earlier answers
# hold many more short phrases than one request does (each would stop a plain step's look-ahead)
MIN_MATCH = 4
MAX_MATCH = 24  # the longest context suffix looked up (longer ones add little, cost a search)
ALPHA = 4.0  # at most ALPHA × the match length tokens proposed
MIN_PROB = 0.3  # stop where the path's share of the matches falls below this
SEP = -1  # between answers: no context token equals it, so no match crosses two answers
FORMAT = "dflash-mac-suffix/1"


class SuffixMemory:
    """Earlier answers of one pair as token ids, with a suffix array over them (rebuilt on
    the first query after a change: ~10 ms for 100k tokens). `max_tokens` bounds what it
    keeps; `add` drops the least recently used answers beyond it (an answer is used when a
    proposal follows it)."""

    def __init__(self, max_tokens: int = 100_000):
        self.max_tokens = max_tokens
        self.answers: OrderedDict[int, np.ndarray] = OrderedDict()  # id -> tokens, LRU first
        self.tokens = 0
        self.next_id = 0
        self.grams: dict[tuple[int, ...], int] = {}  # MIN_MATCH-grams held: a cheap no-match
        self.text = np.zeros(0, np.int32)  # the answers reversed, joined by SEP
        self.owner = np.zeros(0, np.int32)  # answer id at each position of `text`
        self.sa = np.zeros(0, np.int32)
        self.dirty = False

    # -- what it holds ---------------------------------------------------------------------
    def add(self, answer: list[int]) -> None:
        """Keep an answer (one of at least MIN_MATCH + 1 tokens), then drop the least
        recently used ones while over `max_tokens`."""
        if len(answer) <= MIN_MATCH or len(answer) > self.max_tokens:
            return
        ids = np.asarray(answer, np.int32)
        self.answers[self.next_id] = ids
        self.next_id += 1
        self.tokens += len(ids)
        self._count(ids, +1)
        while self.tokens > self.max_tokens:
            _, old = self.answers.popitem(last=False)
            self.tokens -= len(old)
            self._count(old, -1)
        self.dirty = True

    def _count(self, ids: np.ndarray, sign: int) -> None:
        seq = ids.tolist()
        for i in range(len(seq) - MIN_MATCH + 1):
            g = tuple(seq[i : i + MIN_MATCH])
            n = self.grams.get(g, 0) + sign
            if n > 0:
                self.grams[g] = n
            else:
                self.grams.pop(g, None)

    @property
    def nbytes(self) -> int:
        """Memory the index holds (answers, joined text, owners, suffix array; the n-gram
        table estimated at ~200 bytes an entry). Read from counters only: /metrics asks from
        another thread while a request's end may be adding an answer."""
        arrays = 4 * self.tokens + self.text.nbytes + self.owner.nbytes + self.sa.nbytes
        return arrays + 200 * len(self.grams)

    def stats(self) -> dict[str, int]:
        """What it holds, for /metrics."""
        return {  # counters only (see `nbytes`)
            "answers": len(self.answers),
            "tokens": self.tokens,
            "max_tokens": self.max_tokens,
            "bytes": self.nbytes,
        }

    def may_match(self, context: list[int]) -> bool:
        """Whether the context's last MIN_MATCH tokens occur in an earlier answer (a dict
        lookup: text that repeats nothing pays only this)."""
        return len(context) >= MIN_MATCH and tuple(context[-MIN_MATCH:]) in self.grams

    # -- proposals -------------------------------------------------------------------------
    def build(self) -> None:
        """The joined reversed text and its suffix array, after a change."""
        parts, owners = [], []
        for key, ids in self.answers.items():
            parts += [ids[::-1], np.array([SEP], np.int32)]
            owners.append(np.full(len(ids) + 1, key, np.int32))
        self.text = np.concatenate(parts) if parts else np.zeros(0, np.int32)
        self.owner = np.concatenate(owners) if owners else np.zeros(0, np.int32)
        self.sa = divsufsort(self.text).astype(np.int32) if len(self.text) else self.text
        self.dirty = False

    def match(self, context: list[int]) -> tuple[int, np.ndarray]:
        """(m, starts): the longest suffix of `context` (up to MAX_MATCH tokens) found in the
        answers, and where each occurrence starts in `text` (its continuation runs backwards
        from start - 1). (0, []) when fewer than MIN_MATCH tokens match."""
        if self.dirty:
            self.build()
        text, sa, n = self.text, self.sa, len(self.text)
        lo, hi, best = 0, n, (0, 0, 0)
        for m in range(1, min(MAX_MATCH, len(context)) + 1):
            token = context[-m]

            def char(i: int, m: int = m) -> int:  # the m-th token of suffix sa[i]; -2 past the end
                j = int(sa[i]) + m - 1
                return int(text[j]) if j < n else -2

            new_lo = bisect_left(range(n), token, lo, hi, key=char)
            new_hi = bisect_right(range(n), token, new_lo, hi, key=char)
            if new_lo >= new_hi:
                break
            lo, hi, best = new_lo, new_hi, (m, new_lo, new_hi)
        m, lo, hi = best
        if m < MIN_MATCH:
            return 0, np.zeros(0, np.int32)
        return m, sa[lo:hi]

    def propose(self, context: list[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the longest earlier match of the context's end,
        each the most frequent continuation among the matches still on the path; [] when
        nothing matches."""
        if k <= 0 or not self.may_match(context):
            return []
        m, starts = self.match(context)
        if m == 0:
            return []
        out, prob = [], 1.0
        for i in range(min(k, int(ALPHA * m))):
            pos = starts - 1 - i
            nxt = np.where(pos >= 0, self.text[np.maximum(pos, 0)], SEP)
            live = nxt[nxt != SEP]
            if live.size == 0:
                break
            values, counts = np.unique(live, return_counts=True)
            best = int(np.argmax(counts))
            prob *= counts[best] / len(starts)
            if prob < MIN_PROB:
                break
            token = int(values[best])
            out.append(token)
            starts = starts[nxt == token]
        if out:  # the answer followed is in use: evicted last
            self.answers.move_to_end(int(self.owner[starts[0]]))
        return out

    # -- between processes -----------------------------------------------------------------
    def save(self, path: Path, key: str) -> None:
        """Write the answers (oldest first) for pair `key`, atomically."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        with tmp.open("w") as f:
            json.dump({"format": FORMAT, "pair": key, "max_tokens": self.max_tokens}, f)
            f.write("\n")
            for ids in self.answers.values():
                f.write(json.dumps(ids.tolist()) + "\n")
        tmp.replace(path)

    def read(self, path: Path, key: str) -> int:
        """Add the answers `save` wrote for pair `key` (in their order; the oldest go first
        where they do not fit); how many. A `ValueError` that says why not (another pair or
        format, a damaged file): then nothing is added."""
        try:
            with path.open() as f:
                head = json.loads(f.readline() or "{}")
                if head.get("format") != FORMAT or head.get("pair") != key:
                    raise ValueError(f"{path} was written for another pair or format")
                answers = [[int(t) for t in json.loads(line)] for line in f]
        except (json.JSONDecodeError, TypeError) as e:
            raise ValueError(f"{path} is damaged ({e})") from e
        for ids in answers:
            self.add(ids)
        return len(answers)
