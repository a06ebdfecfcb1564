"""A drafter over a draft vocabulary (a frequency-ranked subset of the target's ids): its head
is the full head's rows, output stays exactly the target's (greedy and sampled), a token
outside the subset still comes out (as a correction or the bonus), and the ranking itself."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np
import pytest
from dflash_mac.models.config import DraftConfig
from helpers.lossy import accepting_every_draft
from helpers.oracle import with_drafter
from helpers.subset import copy_drafter, subset_copy
from test_dflash2 import (
    d2_config,
    randomize,
    small_d2_pair,  # noqa: F401 (fixture)
)
from test_greedy_exact import PROMPTS, baseline, run
from test_sampling import V, chi_square_p, dflash_samples, exact_joint, small_pair  # noqa: F401

from dflash_mac.draft_vocab import coverage, rank
from dflash_mac.engine.verify import SamplingParams
from dflash_mac.loading.loader import load_drafter
from dflash_mac.sizing.choice import BlockChoice
from dflash_mac.target.capture import FeatureCapture
from dflash_mac.target.structure import target_head
from dflash_mac.train.data import Sequence
from dflash_mac.train.vocab import token_counts


def subset_drafter(drafter, target, ids: list[int]):
    """The same drafter (same weights) drafting over the target ids `ids` only."""
    return subset_copy(drafter, target_head(target), ids)


def make_d2_pair(tiny_pair):
    """The tiny target with a random DFlash 2 drafter (as test_dflash2's `d2_pair`)."""
    from dflash_mac.models.dflash2 import DFlash2DraftModel

    mask = tiny_pair.drafter.config.mask_token_id
    cfg = DraftConfig.from_dict(d2_config(tiny_pair.target_config, mask, layers=2, top_k=8))
    d = randomize(DFlash2DraftModel(cfg), 4, scale=1.0)
    d.bind(target_head(tiny_pair.target))
    mx.eval(d.parameters())
    return with_drafter(tiny_pair, d)


def on_worker(fn, *args, **kw):
    with ThreadPoolExecutor(1) as ex:
        return ex.submit(fn, *args, **kw).result()


def context_cache(pair, drafter, prompt):
    cache = drafter.make_cache()
    with FeatureCapture(pair.target, drafter.config.target_layer_ids) as cap:
        pair.target(mx.array([prompt]))
        drafter.extend_context(cap.features(), cache)
    return cache


def test_subset_head_is_the_full_heads_rows(tiny_pair):
    V_ = tiny_pair.drafter.config.vocab_size
    ids = list(np.random.default_rng(0).permutation(V_)[:40])
    sub = subset_drafter(tiny_pair.drafter, tiny_pair.target, ids)
    h = mx.random.normal((1, 3, tiny_pair.drafter.config.hidden_size), key=mx.random.key(0))
    full = np.array(tiny_pair.drafter.logits(h))
    np.testing.assert_allclose(np.array(sub.draft_logits(h)), full[..., ids], rtol=1e-5, atol=1e-5)
    spread = np.array(sub.logits(h))
    np.testing.assert_allclose(spread[..., ids], full[..., ids], rtol=1e-5, atol=1e-5)
    outside = np.setdiff1d(np.arange(V_), ids)
    assert np.isneginf(spread[..., outside]).all()


@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
def test_a_whole_vocabulary_subset_drafts_what_the_drafter_drafts(tiny_pair, arch):
    """A draft vocabulary holding every id (in another order) gives the same drafts, greedy
    and sampled, bit for bit: the subset path changes nothing but the rows it computes."""
    from dflash_mac.engine.drafts import propose

    pair = tiny_pair if arch == "dflash" else make_d2_pair(tiny_pair)
    perm = list(np.random.default_rng(1).permutation(pair.drafter.config.vocab_size))
    sub = with_drafter(pair, subset_drafter(pair.drafter, pair.target, perm))
    prompt = pair.tokenizer.encode("def add(a, b):")
    block = mx.array([prompt[-1]] + [pair.drafter.config.mask_token_id] * 5)
    for sp in (SamplingParams(), SamplingParams(temperature=0.8)):
        got = []
        for p in (pair, sub):
            drafts, _ = propose(p, block, context_cache(p, p.drafter, prompt), sp, mx.random.key(3))
            got.append(drafts.tolist())
        assert got[0] == got[1], sp


def subset_pair(pair, k: int, seed: int = 0):
    """`pair` with its drafter over `k` random ids, and those ids."""
    V_ = pair.drafter.config.vocab_size
    ids = sorted(int(i) for i in np.random.default_rng(seed).permutation(V_)[:k])
    return with_drafter(pair, subset_drafter(pair.drafter, pair.target, ids)), set(ids)


@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
def test_greedy_output_is_the_targets_with_a_subset(tiny_pair, arch):
    """Forced block sizes and `auto`, on a worker thread; the answers hold tokens outside the
    subset, which only verification can have put there."""
    base = tiny_pair if arch == "dflash" else make_d2_pair(tiny_pair)
    pair, ids = subset_pair(base, 160)
    outside = 0
    for p in PROMPTS[:5]:
        prompt = pair.tokenizer.encode(p)
        ref = baseline(pair, prompt, 40)
        outside += sum(t not in ids for t in ref)
        for block in (5, "auto"):
            kw = {"block_size": block} if block != "auto" else {"block": BlockChoice(8, auto=True)}
            tokens, _, _ = on_worker(run, pair, prompt, max_tokens=40, use_eos=False, **kw)
            assert tokens == ref, (p, block)
    assert outside > 0


def test_drafts_stay_inside_the_subset(tiny_pair):
    pair, ids = subset_pair(make_d2_pair(tiny_pair), 50, seed=2)
    d = pair.drafter
    prompt = pair.tokenizer.encode("class Stack:")
    block = mx.array([prompt[-1]] + [d.config.mask_token_id] * 7)
    for sp in (SamplingParams(), SamplingParams(temperature=1.0)):
        for s in range(5):
            drafts, q = d.propose(block, context_cache(pair, d, prompt), sp, mx.random.key(s))
            assert set(drafts.tolist()) <= ids
            if q is not None:
                outside = sorted(set(range(d.config.vocab_size)) - ids)
                assert float(q[:, outside].sum()) == 0.0


def small_subset(pair):
    """The 5-token pair's drafter over 3 of the 5 ids: q is 0 on ids 1 and 4."""
    return with_drafter(pair, subset_drafter(pair.drafter, pair.target, [0, 2, 3]))


@pytest.mark.slow
@pytest.mark.parametrize("which", ["dflash", "dflash2"])
def test_sampling_through_a_subset_is_lossless(small_pair, small_d2_pair, which):  # noqa: F811
    pair = small_subset(small_pair if which == "dflash" else small_d2_pair)
    sp = SamplingParams(temperature=1.0)
    joint = exact_joint(pair, sp)
    samples = on_worker(dflash_samples, pair, sp, 4, 1200)
    assert chi_square_p(samples, joint) > 0.001
    assert any(t in (1, 4) for s in samples for t in s)  # ids the drafter cannot draft


@pytest.mark.slow
def test_a_lossy_rule_through_a_subset_is_detected(small_pair):  # noqa: F811
    """Negative control: accepting every draft of the subset drafter fails the same test."""
    import dflash_mac.engine.drafts as engine

    pair = small_subset(small_pair)
    sp = SamplingParams(temperature=1.0)
    joint = exact_joint(pair, sp)
    real = engine.accept_sampled
    engine.accept_sampled = accepting_every_draft(real)
    try:
        samples = on_worker(dflash_samples, pair, sp, 4, 800)
    finally:
        engine.accept_sampled = real
    assert chi_square_p(samples, joint) < 1e-6


def test_a_subset_drafter_folder_loads(tiny_pair, tmp_path):
    """`dflash_config.draft_vocab_size` + a `draft_vocab` tensor: saved, loaded, drafted."""
    from dflash_mac.train.checkpoint import save_drafter

    pair, ids = subset_pair(tiny_pair, 64)
    save_drafter(pair.drafter, pair.drafter.config.raw, tmp_path / "d", mx.float32)
    assert (
        json.loads((tmp_path / "d" / "config.json").read_text())["dflash_config"][
            "draft_vocab_size"
        ]
        == 64
    )
    cfg = DraftConfig.from_file(tmp_path / "d" / "config.json")
    loaded = load_drafter(tmp_path / "d", cfg)
    assert sorted(loaded.draft_vocab.tolist()) == sorted(ids)
    loaded.bind(target_head(pair.target))
    h = mx.random.normal((1, 2, cfg.hidden_size), key=mx.random.key(1))
    assert mx.allclose(loaded.draft_logits(h), pair.drafter.draft_logits(h), atol=1e-5).item()


def test_draft_vocab_size_is_checked():
    from dflash_mac.models.config import ConfigError
    from helpers.tiny import draft_config, target_config

    raw = draft_config(target_config(vocab=50), mask_id=49)
    raw["dflash_config"]["draft_vocab_size"] = 60
    with pytest.raises(ConfigError, match="draft_vocab_size"):
        DraftConfig.from_dict(raw)


# -- the ranking -------------------------------------------------------------------------------


def test_rank_keeps_the_most_frequent_and_the_forced_ids():
    counts = np.array([5.0, 0.0, 9.0, 1.0, 9.0, 0.0, 2.0])
    got = rank(counts, always=[5], k=4).tolist()
    assert got == [2, 4, 0, 5]  # by count (ties by id), the forced id 5 in though never seen
    assert rank(counts, always=[], k=7).tolist() == [2, 4, 0, 6, 3, 1, 5]
    with pytest.raises(ValueError):
        rank(counts, always=[1, 3, 5], k=2)


def test_counts_and_coverage_against_brute_force():
    rng = np.random.default_rng(0)
    seqs = [Sequence([1, 2], rng.integers(0, 30, size=20).tolist()) for _ in range(6)]
    counts = token_counts(seqs, 30)
    brute = np.bincount([t for s in seqs for t in s.response], minlength=30)
    np.testing.assert_array_equal(counts, brute)
    vocab = rank(counts, [], 10)
    toks = [t for s in seqs for t in s.response]
    assert coverage(vocab, toks) == pytest.approx(np.mean([t in set(vocab) for t in toks]))


# -- a published drafter cut to a subset at load (FR-Spec) -------------------------------------


def test_a_drafter_without_one_is_cut_to_its_targets_most_used_ids(
    tiny_pair, tmp_path, monkeypatch
):
    """The target answers the starter prompts once; the ranking is saved per target and read
    back (no second generation); the drafter then drafts over K ids with EOS among them, and
    greedy output is still the target's."""
    from dflash_mac import draft_vocab

    monkeypatch.setenv("DFLASH_MAC_HOME", str(tmp_path))
    pair = with_drafter(tiny_pair, copy_drafter(tiny_pair.drafter, target_head(tiny_pair.target)))
    said = on_worker(draft_vocab.apply_draft_vocab, pair, 64)
    assert "counted the target's token frequencies" in said and "saved to" in said
    vocab = pair.drafter.draft_vocab.tolist()
    assert len(vocab) == 64 and set(pair.eos_ids) <= set(vocab)
    assert draft_vocab.ranking_path(pair).exists()

    def boom(*a, **k):
        raise AssertionError("answered again")

    monkeypatch.setattr(draft_vocab, "regenerate", boom)
    again = with_drafter(tiny_pair, copy_drafter(tiny_pair.drafter, target_head(tiny_pair.target)))
    assert "counted" not in draft_vocab.apply_draft_vocab(again, 64)
    assert again.drafter.draft_vocab.tolist() == vocab
    prompt = pair.tokenizer.encode("def add(a, b):")
    tokens, _, _ = on_worker(run, pair, prompt, max_tokens=32, block_size=5, use_eos=False)
    assert tokens == baseline(pair, prompt, 32)


def test_a_drafter_with_one_keeps_its_first_ids(tiny_pair):
    from dflash_mac.draft_vocab import DraftVocabError, apply_draft_vocab

    pair, _ = subset_pair(tiny_pair, 64)
    own = pair.drafter.draft_vocab.tolist()
    with pytest.raises(DraftVocabError, match="more than the 64 ids"):
        apply_draft_vocab(pair, 100)
    assert "first 32 of the drafter's own 64" in apply_draft_vocab(pair, 32)
    assert pair.drafter.draft_vocab.tolist() == own[:32]


@pytest.mark.parametrize("temp", [0.0, 1.0])
def test_a_grammar_that_allows_nothing_in_the_subset_stops_the_drafts(tiny_pair, temp):
    """Under a grammar, a position where every allowed token lies outside the draft vocabulary
    ends the drafts there (the target's own constrained token comes as the bonus): greedy
    output is still plain constrained decoding's, sampled output still follows the schema."""
    from test_structured import SCHEMA, check_answer, plain_constrained

    from dflash_mac.api import generate

    tok = tiny_pair.tokenizer
    punctuation = set(tok.encode('{}":,[] '))  # JSON's structure is never drafted
    letters = [i for i in range(tiny_pair.drafter.config.vocab_size) if i not in punctuation]
    pair = with_drafter(tiny_pair, subset_drafter(tiny_pair.drafter, tiny_pair.target, letters))
    ids = tok.encode(PROMPTS[0])
    kw = dict(max_tokens=80, block_size=5, json_schema=SCHEMA, temp=temp, seed=1)
    out = on_worker(generate, pair, ids, **kw)
    check_answer(out.text)
    if temp == 0:
        assert out.tokens == plain_constrained(tiny_pair, ids, 80, SCHEMA, {})
