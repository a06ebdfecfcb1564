"""Tree drafting (DDTree): the tree is the best-first one under its budget, the verify sees
ancestors only (a causal mask must fail the same check), the cache after acceptance equals a
fresh prefill of the accepted path, greedy output is the target's own, sampled output keeps the
target's distribution (chi-square, with a lossy walk the test must reject), and `auto` weighs
trees against chains on their measured rates."""

from __future__ import annotations

import itertools
import math
import random
import threading

import mlx.core as mx
import pytest
from dflash_mac.models.distribution import SamplingParams
from helpers.oracle import OracleDrafter, with_drafter
from mlx_lm.models.cache import make_prompt_cache
from test_sampling import chi_square_p, exact_joint, small_pair  # noqa: F401  (fixture)

from dflash_mac.api import generate
from dflash_mac.drafting.tree import (
    DraftTree,
    chain_reach,
    graft,
    grow,
    keep_path,
    verify_logits,
    walk,
)
from dflash_mac.session import Session
from dflash_mac.sizing.controller import TREES, BlockController, tree_arms
from dflash_mac.sizing.cost import CostCurve, CostModel
from dflash_mac.sizing.tuning import AutoTuning
from dflash_mac.target.capture import FeatureCapture

# log q of 3 candidates (tokens 10+i at position t) at each of 3 positions, whatever the parent
LOGQ = [[-0.1, -2.5, -3.0], [-0.7, -0.8, -4.0], [-0.05, -3.5, -4.5]]


def fixed_expand(t: int, parents: mx.array):
    k = len(LOGQ[t])
    shape = (parents.shape[0], k)
    cand = mx.broadcast_to(mx.arange(k) + 10 * (t + 1), shape)
    return cand, mx.broadcast_to(mx.array(LOGQ[t]), shape)


def test_the_tree_is_the_best_first_one_under_its_budget():
    for budget in (1, 3, 5, 9):
        tree = grow(mx.array(7), fixed_expand, 3, budget)
        tokens, parents, depth = (a.tolist() for a in (tree.tokens, tree.parents, tree.depth))
        assert tree.width == budget + 1 and tokens[0] == 7 and depth[0] == 0
        assert all(
            parents[i] < i and depth[i] == depth[parents[i]] + 1 for i in range(1, len(tokens))
        )
        # every path of ranks, scored by its summed log q: the tree holds the `budget` best
        paths = [p for d in (1, 2, 3) for p in itertools.product(range(3), repeat=d)]
        score = {p: sum(LOGQ[t][r] for t, r in enumerate(p)) for p in paths}
        best = sorted(paths, key=lambda p: -score[p])[:budget]

        def ranks(i, tokens=tokens, parents=parents, depth=depth):
            out = []
            while i:
                out.append(tokens[i] - 10 * depth[i])
                i = parents[i]
            return tuple(reversed(out))

        assert sorted(ranks(i) for i in range(1, len(tokens))) == sorted(best)
        anc = tree.ancestors.tolist()
        for i in range(len(tokens)):  # ancestors: i, its parent's ancestors, nothing else
            want = {i} | ({j for j in range(len(tokens)) if anc[parents[i]][j]} if i else set())
            assert {j for j in range(len(tokens)) if anc[i][j]} == want


def test_the_walk_follows_the_targets_tokens():
    tree = grow(mx.array(7), fixed_expand, 3, 6)
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    deepest = max(range(len(tokens)), key=lambda i: tree.depth.tolist()[i])
    path = []
    i = deepest
    while i:
        path.append(i)
        i = parents[i]
    path.reverse()
    x = [0] * len(tokens)  # the target's token at each node: follow `path`, then 99
    for a, b in zip([0, *path], path):
        x[a] = tokens[b]
    x[path[-1]] = 99
    acc, bonus, got = walk(tree, mx.array(x))
    assert acc.item() == len(path) and bonus.item() == 99
    assert got.tolist()[: len(path)] == path
    x[path[0]] = 98  # the first step's child holds the wrong token: accept one, bonus 98
    acc, bonus, _ = walk(tree, mx.array(x))
    assert (acc.item(), bonus.item()) == (1, 98)


def deepest_path(tree: DraftTree) -> list[int]:
    """The nodes from the root's child down to the deepest node."""
    parents, depth = tree.parents.tolist(), tree.depth.tolist()
    i, path = max(range(tree.width), key=lambda j: depth[j]), []
    while i:
        path.append(i)
        i = parents[i]
    return path[::-1]


def test_a_grafted_copy_goes_on_below_the_nodes_that_spell_it():
    tree = grow(mx.array(7), fixed_expand, 3, 6)
    spelled = deepest_path(tree)[:2]  # the copy repeats two tree nodes, then leaves the tree
    toks = tree.tokens.tolist()
    copy = [toks[spelled[0]], toks[spelled[1]], 55, 56]
    g = graft(tree, mx.array(copy))
    w = tree.width
    assert g.width == w + 4 and g.max_depth == 4 and g.budget == tree.budget
    parents, live = g.parents.tolist(), g.live.tolist()
    assert parents[w + 2 :] == [spelled[1], w + 2] and live[w + 2 :] == [True, True]
    assert live[w : w + 2] == [False, False] and all(live[:w])  # the repeats never match
    for i in range(g.width):  # live siblings hold distinct tokens: the walk stays lossless
        for j in range(i):
            if live[i] and live[j] and parents[i] == parents[j] and i:
                assert g.tokens.tolist()[i] != g.tokens.tolist()[j]
    x = [0] * g.width  # the target says copy[0], copy[1], 55, 56, then 99
    for a, b in zip([0, *spelled, w + 2, w + 3], copy):
        x[a] = b
    x[w + 3] = 99
    acc, bonus, path = walk(g, mx.array(x))
    assert (acc.item(), bonus.item()) == (4, 99)
    assert path.tolist() == [*spelled, w + 2, w + 3]
    x[spelled[1]] = toks[deepest_path(tree)[2]]  # the target goes on down the tree instead
    acc, _, path = walk(g, mx.array(x))
    assert acc.item() == 3 and path.tolist()[:3] == deepest_path(tree)
    none = graft(tree, mx.array([50, 51]))  # nothing spelled: a branch from the root
    assert none.parents.tolist()[w:] == [0, w] and all(none.live.tolist())


def test_greedy_with_copies_grafted_onto_trees_is_the_targets(tiny_pair):
    """A doubtful copy (after a partial one) is a branch of the tree; an oracle drafter wrong
    30 % of the time leaves the copy's branch room to win."""
    src = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
    ids = tiny_pair.tokenizer.encode(src * 3 + "# again\n" + src[:20])
    kw = dict(max_tokens=48, use_eos=False)
    ref = generate(tiny_pair, ids, block_size=1, copy=False, **kw).tokens
    oracle = with_drafter(tiny_pair, OracleDrafter(tiny_pair.drafter, ids + ref, 320, 0.3, 1))
    out = generate(oracle, ids, block_size=5, tree=6, copy=True, **kw)
    assert out.tokens == ref
    s = out.stats
    assert any(t and c for t, c in zip(s.trees, s.copied))  # a copy's branch won a tree


def test_auto_grafts_a_doubtful_copy_only_where_verifies_are_nearly_flat():
    """A CPU's verify costs its width: a doubtful copy of 5 tokens alone (2.7 tokens for a
    verify of 6) beats riding on a tree of 8; where verifies are nearly flat it rides."""
    steep = CostCurve({1: 1.0, **{b: 1.3 + 0.1 * (b - 1) for b in range(2, 40)}}, measured=True)
    flat = CostCurve({1: 1.0, **{b: 1.05 + 0.005 * (b - 1) for b in range(2, 40)}}, measured=True)
    for curve, pays in ((steep, False), (flat, True)):
        ctl = BlockController(8, CostModel(curve), trees=(8,))
        assert ctl.graft_pays(8, 5, hit=2.7, zero=0.3) is pays
    ctl = BlockController(8, CostModel(flat), trees=(8,))
    assert not ctl.graft_pays(8, 5, hit=2.7, zero=0.0)  # a copy that never misses: alone


@pytest.fixture
def prefilled(tiny_pair):
    """A tree drafted by the tiny pair's drafter after a prompt, and the target cache."""
    pair = tiny_pair
    ids = pair.tokenizer.encode("def add(a, b):\n    return")
    cache, dcache = make_prompt_cache(pair.target), pair.drafter.make_cache()
    with FeatureCapture(pair.target, pair.layer_ids) as cap:
        pair.target(mx.array(ids[:-1])[None], cache=cache)
        pair.drafter.extend_context(cap.features(), dcache)
    block = mx.array([ids[-1]] + [pair.drafter.config.mask_token_id] * 5)
    tree = grow(mx.array(ids[-1]), pair.drafter.expansion(block, dcache, 3), 5, 10)
    mx.eval(tree.tokens, tree.ancestors, [c.state for c in cache])
    return pair, ids, cache, tree


def path_to(tree: DraftTree, i: int) -> list[int]:
    anc, depth = tree.ancestors.tolist(), tree.depth.tolist()
    return sorted((j for j in range(tree.width) if anc[i][j]), key=lambda j: depth[j])


def chain_logits(pair, ids: list[int], tree: DraftTree, i: int) -> mx.array:
    cache = make_prompt_cache(pair.target)
    pair.target(mx.array(ids[:-1])[None], cache=cache)
    toks = tree.tokens.tolist()
    return pair.target(mx.array([toks[j] for j in path_to(tree, i)])[None], cache=cache)[0, -1]


def test_each_node_sees_its_ancestors_only(prefilled):
    pair, ids, cache, tree = prefilled
    logits = verify_logits(pair.target, tree, cache)
    assert tree.depth.max().item() >= 2 and tree.width > tree.depth.max().item() + 1
    for i in range(tree.width):
        assert mx.array_equal(logits[i], chain_logits(pair, ids, tree, i)), i


def test_a_causal_mask_fails_the_same_check(prefilled):
    pair, ids, cache, tree = prefilled
    causal = DraftTree(
        tree.tokens, tree.parents, tree.depth, mx.tril(mx.ones((tree.width,) * 2, mx.bool_)),
        tree.top, tree.budget, tree.max_depth,
    )  # fmt: skip
    logits = verify_logits(pair.target, causal, cache)
    differ = [
        i
        for i in range(tree.width)
        if not mx.allclose(logits[i], chain_logits(pair, ids, tree, i), atol=1e-4)
    ]
    assert differ  # a node that sees its cousins is not the target given its path


def test_the_cache_after_acceptance_equals_a_fresh_prefill(prefilled):
    pair, ids, cache, tree = prefilled
    start = cache[0].offset
    verify_logits(pair.target, tree, cache)
    deepest = max(range(tree.width), key=lambda i: tree.depth.tolist()[i])
    path = path_to(tree, deepest)[1:]  # accept the deepest branch
    keep_path(cache, start, mx.array(path, mx.int32), len(path) + 1)
    for c in cache:
        c.trim(tree.width - len(path) - 1)
    fresh = make_prompt_cache(pair.target)  # prefilled as the verify was: prompt, then path
    pair.target(mx.array(ids[:-1])[None], cache=fresh)
    toks = tree.tokens.tolist()
    pair.target(mx.array([toks[j] for j in [0, *path]])[None], cache=fresh)
    for a, b in zip(cache, fresh):
        assert a.offset == b.offset == len(ids) + len(path)
        n = a.offset  # rows past the offset are free slots, whatever they hold
        for x, y in ((a.keys, b.keys), (a.values, b.values)):
            assert mx.array_equal(x[..., :n, :], y[..., :n, :]), "not the accepted path's cache"


@pytest.mark.parametrize("tree", [3, 12, None])
@pytest.mark.parametrize("block", [4, "auto"])
def test_greedy_output_is_the_targets(tiny_pair, tree, block):
    ids = tiny_pair.tokenizer.encode("class Stack:\n    def push(self, x):")
    kw = dict(max_tokens=40, use_eos=False, copy=False)
    ref = generate(tiny_pair, ids, block_size=1, **kw).tokens
    out = generate(tiny_pair, ids, block_size=block, tree=tree, **kw)
    assert out.tokens == ref
    if tree and block == 4:
        # forced: every cycle is a tree but the last (one token of room: a plain step)
        assert out.stats.tree_cycles == out.stats.cycles - 1


def test_tree_cycles_show_in_the_stats_and_the_servers_summary(tiny_pair):
    from types import SimpleNamespace

    from dflash_mac.serve.metrics import summary

    ids = tiny_pair.tokenizer.encode("hello world")
    out = generate(tiny_pair, ids, max_tokens=12, use_eos=False, block_size=4, tree=5)
    s = out.stats
    assert s.tree_cycles == s.cycles - 1 and s.tree_mix == f"5×{s.tree_cycles}"
    d = s.as_dict()
    assert d["tree_cycles"] == s.tree_cycles and d["tree_tau"] == pytest.approx(s.tree_tau)
    ev = SimpleNamespace(stats=s, finish_reason="length", stop=None)
    assert summary(ev, "chat")["dflash"]["tree_budgets"] == s.tree_mix


def test_an_oracle_wrong_30_percent_commits_more_with_trees(tiny_pair):
    """Where the drafter's second choice is right, a tree recovers what a chain loses, and
    the output is still the target's."""
    ids = tiny_pair.tokenizer.encode("import os\nimport")
    kw = dict(max_tokens=60, use_eos=False, copy=False, block_size=6)
    ref = generate(tiny_pair, ids, max_tokens=60, use_eos=False, block_size=1).tokens
    taus = {}
    for tree in (0, 8):
        oracle = with_drafter(tiny_pair, OracleDrafter(tiny_pair.drafter, ids + ref, 320, 0.3, 1))
        out = generate(oracle, ids, tree=tree, **kw)
        assert out.tokens == ref
        taus[tree] = out.stats.tau
    assert taus[8] > 1.15 * taus[0]


def test_trees_run_on_a_worker_thread(tiny_pair):
    ids = tiny_pair.tokenizer.encode("hello world")
    ref = generate(tiny_pair, ids, max_tokens=24, use_eos=False, block_size=1).tokens
    got = {}

    def work():
        got["out"] = generate(tiny_pair, ids, max_tokens=24, use_eos=False, block_size=5, tree=6)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert got["out"].tokens == ref and got["out"].stats.tree_cycles > 0


def tree_samples(pair, sp, n, budget) -> list[tuple]:
    session, out = Session(pair), []
    prompt = [0, 3, 1, 2]
    for seed in range(n):
        events = session.stream(
            prompt, max_tokens=3, block_size=4, temp=sp.temperature, seed=seed,
            use_eos=False, copy=False, tree=budget,
        )  # fmt: skip
        out.append(tuple(t for e in events for t in e.tokens))
    return out


@pytest.mark.slow
def test_sampled_trees_keep_the_target_distribution(small_pair):  # noqa: F811
    sp = SamplingParams(temperature=1.0)
    samples = tree_samples(small_pair, sp, 1200, 6)
    assert chi_square_p(samples, exact_joint(small_pair, sp, prompt=[0, 3, 1, 2])) > 0.001


@pytest.mark.slow
def test_a_lossy_tree_walk_is_detected(small_pair, monkeypatch):  # noqa: F811
    """Descending into the drafter's first child whatever the target drew must fail the same
    test (the power check)."""
    import dflash_mac.engine.drafts as engine

    real = engine.walk

    def first_child(tree, x):
        x = mx.where(mx.arange(tree.width) == 0, tree.tokens[1], x)  # the root "drew" node 1
        return real(tree, x)

    monkeypatch.setattr(engine, "walk", first_child)
    sp = SamplingParams(temperature=1.0)
    samples = tree_samples(small_pair, sp, 600, 6)
    assert chi_square_p(samples, exact_joint(small_pair, sp, prompt=[0, 3, 1, 2])) < 1e-6


# (0, 3, x) occurred for every x and the prompt ends with (0, 3): each first token is a copy's
PERIODIC = [0, 3, 0, 1, 0, 3, 1, 2, 0, 3, 2, 3, 0, 3, 3, 4, 0, 3, 4, 0, 0, 3]


def grafted_samples(pair, sp, n) -> tuple[list[tuple], int]:
    """Samples of 3 tokens after PERIODIC with trees of 1 node and copies on (a new request's
    first copy is doubtful: a branch of its tree); how many cycles the copy's branch won (the
    target draws the copied token: rarely, for this random target)."""
    session, out, won = Session(pair), [], 0
    for seed in range(n):
        events = session.stream(
            PERIODIC, max_tokens=3, block_size=4, temp=sp.temperature, seed=seed,
            use_eos=False, copy=True, tree=1,
        )  # fmt: skip
        events = list(events)
        out.append(tuple(t for e in events for t in e.tokens))
        s = events[-1].stats
        won += sum(bool(t and c) for t, c in zip(s.trees, s.copied))
    return out, won


@pytest.mark.slow
def test_sampled_trees_with_grafted_copies_keep_the_target_distribution(small_pair, monkeypatch):  # noqa: F811, E501
    sp = SamplingParams(temperature=1.0)
    import dflash_mac.engine.drafts as engine

    real, grafted = engine.graft, []

    def counted(tree, copy):
        grafted.append(copy.shape[0])
        return real(tree, copy)

    monkeypatch.setattr(engine, "graft", counted)
    samples, won = grafted_samples(small_pair, sp, 1200)
    assert len(grafted) >= 1000 and won >= 20  # the test is about the copy's branch
    joint = exact_joint(small_pair, sp, prompt=PERIODIC)
    assert chi_square_p(samples, joint) > 0.001


@pytest.mark.slow
def test_a_grafted_copy_taken_whatever_the_target_drew_is_detected(small_pair, monkeypatch):  # noqa: F811
    """Descending into the copy's branch whatever the target drew must fail the same test."""
    import dflash_mac.engine.drafts as engine

    real = engine.walk

    def copy_wins(tree, x):
        if tree.copied:  # the draw at the copy's parent becomes the copy's token
            first = tree.width - tree.copied
            live = mx.where(tree.live[first:], mx.arange(tree.copied), tree.copied)
            k = mx.min(live)  # the first live copy node
            node = first + mx.minimum(k, tree.copied - 1)
            at = tree.parents[node]
            x = mx.where((mx.arange(tree.width) == at) & (k < tree.copied), tree.tokens[node], x)
        return real(tree, x)

    monkeypatch.setattr(engine, "walk", copy_wins)
    sp = SamplingParams(temperature=1.0)
    samples, _ = grafted_samples(small_pair, sp, 600)
    assert chi_square_p(samples, exact_joint(small_pair, sp, prompt=PERIODIC)) < 1e-6


def curve(trees: dict[int, float] | None = None) -> CostCurve:
    """Chains cost 1 + 0.1 bs plain steps (block 8: 1.8), trees `trees` (a tree of 8: 1.9)."""
    ratios = {1: 1.0, **{b: 1.0 + 0.1 * b for b in range(2, 9)}}
    return CostCurve(ratios, measured=True, trees=trees or {8: 1.9})


def controller(trees=(8,), chains=True, costs: dict[int, float] | None = None) -> BlockController:
    return BlockController(8, CostModel(curve(costs)), timed=False, trees=trees, chains=chains)


def test_auto_takes_trees_when_they_commit_more_and_drops_them_when_not():
    c = controller()
    assert c.choose().tree == 8  # the optimistic guess: trees get tried
    for _ in range(30):  # trees commit no more than a chain: back to chains
        d = c.choose()
        c.update(d.size, 1 if d.tree else 1, None, tree=d.tree, chain=1)
    assert c.choose().tree == 0
    c = controller()
    for _ in range(30):  # trees commit 5, chains 2: trees stay
        d = c.choose()
        c.update(d.size, 4 if d.tree else 1, None, tree=d.tree, chain=1)
    assert c.last.tree == 8
    # no flapping: the choice settles on one kind
    kinds = []
    for _ in range(20):
        d = c.choose()
        kinds.append(d.tree)
        c.update(d.size, 4 if d.tree else 1, None, tree=d.tree, chain=1)
    assert len(set(kinds)) == 1


LOSING = {4: 1.9, 8: 2.07, 16: 2.4}  # trees' costs against a chain of 8's 1.8, as measured
GAINS = {4: 1.0, 8: 1.05, 16: 1.1}  # what they commit per token of their chain


def losing_trees(c: BlockController, cycles: int) -> int:
    """Run `cycles` where each tree commits GAINS times its chain's tokens (the chain accepting
    as a drafter does on code, 2.4 tokens a cycle at block 8); the count of tree cycles."""
    rng, trees = random.Random(0), 0
    for _ in range(cycles):
        d = c.choose()
        a = 0
        while a < d.size - 1 and rng.random() < 0.6:
            a += 1
        t = a
        if d.tree:
            t = min(round((a + 1) * GAINS[d.tree] - 1 + rng.random() - 0.5), d.size - 1)
            trees += 1
        c.update(d.size, max(t, a), None, tree=d.tree, chain=a)
    return trees


def test_a_tree_that_loses_is_not_tried_again_every_few_cycles():
    """Trees commit up to 10 % more than their chain and cost 6-33 % more (as on the default
    pair, code): after a few measured cycles auto drafts chains and tries trees again only
    now and then (an estimate that drifted back to the optimistic guess within tens of cycles
    retried them 5 % of the time here, and a third of the time on the real curve: auto ran
    0.91x the best fixed block). Remembered between processes, a new controller tries none."""
    assert losing_trees(controller(TREES, costs=LOSING), 1_000) < 20
    assert losing_trees(controller(trees=()), 1_000) == 0  # the control: no phantom trees
    tuning = AutoTuning(greedy_curve=curve(LOSING))
    losing_trees(tuning.controller(8, trees=TREES), 200)
    again = AutoTuning(greedy_curve=curve(LOSING), remembered=tuning.acceptance())
    assert losing_trees(again.controller(8, trees=TREES), 100) == 0
    fresh = AutoTuning(greedy_curve=curve(LOSING))
    assert losing_trees(fresh.controller(8, trees=TREES), 100) > 0  # unremembered: tried


def test_a_small_tree_is_weighed_against_the_largest_chain_not_its_own():
    """A tree of 4 nodes reaches 4 deep at most: it commits 8 % more than its own chain of
    likeliest children, and less than the chain of 8 (acceptance 0.8 a position), for 6 %
    less cost. Weighed against its own chain, its gain was applied to the 8-chain's tokens and
    `auto` drafted such trees in most cycles (the stage-12 drafter on code: 0.906x of block 8).
    Against the largest chain's expected tokens it loses and `auto` drafts chains; the control:
    a 4-node tree that commits 15 % more than the 8-chain is taken."""

    def trees(better: float) -> int:
        c, rng, n = controller((4,), costs={4: 1.7}), random.Random(1), 0
        for _ in range(600):
            d = c.choose()
            a = 0
            while a < 7 and rng.random() < 0.8:
                a += 1
            if d.tree:
                n += 1
                t = min(a, 4) if better < 1 else a
                t = max(min(round((t + 1) * abs(better) - 1 + rng.random() - 0.5), 7), 0)
                c.update(d.size, t, None, tree=d.tree, chain=min(a, 4))
            else:
                c.update(d.size, a, None)
        return n

    assert trees(-1.08) < 60  # 8 % over its own 4-deep chain (was 121 of 600)
    assert trees(1.15) > 300


def test_a_trees_chain_teaches_only_the_positions_the_tree_drafted():
    """A 4-node tree's chain of likeliest children is 4 deep at most: where it accepted all 4,
    the chain's 5th draft was never judged, and the chains' estimate must not read it as
    rejected (it did, and the largest chain looked worse while trees ran, so trees kept
    running). The control: the same cycles counted over the whole block lower position 5."""

    def alpha5(reach: int) -> float:
        c = controller((4,))
        for _ in range(40):
            c.update(8, 4, None, tree=4, chain=4, reach=reach)
        return c.acc.alphas(7)[4]

    assert alpha5(4) > 0.9  # positions 1-4 always accepted, 5 inherits position 4's estimate
    assert alpha5(0) < 0.2


def test_the_chain_of_likeliest_children_reaches_as_deep_as_the_tree_holds_it():
    """`chain_reach` against a walk down the likeliest children by hand, grafted or not."""
    for budget in (1, 2, 3, 5, 9):
        tree = grow(mx.array(7), fixed_expand, 3, budget)
        for t in (tree, graft(tree, mx.array([10, 20, 30]))):
            parents, top = t.parents.tolist(), t.top.tolist()
            node, depth = 0, 0
            while kids := [i for i in range(1, t.width) if parents[i] == node and top[i]]:
                node, depth = kids[0], depth + 1
            assert chain_reach(t).item() == depth, (budget, depth)
    assert chain_reach(grow(mx.array(7), fixed_expand, 3, 9)).item() == 3  # the control: deep


def test_a_forced_budget_drafts_trees_only_and_falls_back_to_plain_steps():
    assert tree_arms(None)[1] and tree_arms(0) == ((), True) and tree_arms(5) == ((5,), False)
    c = controller(chains=False)
    seen = set()
    for _ in range(40):  # trees accept nothing: plain steps (and probes, which are trees)
        d = c.choose()
        seen.add((d.size, d.tree))
        c.update(d.size, 0, None, tree=d.tree)
    assert seen <= {(1, 0), (8, 8)} and c.last.size == 1
    assert math.isclose(c.tree_cost.cost(8), 1.9)


def test_probes_after_a_fallback_are_chains_not_trees():
    """Where drafting does not pay (chat at T 0.7: a first draft accepted 27 % of the time) the
    probes that look for it again are the cheapest drafting cycles, chains. A tree's guess
    (1.3x the chain's tokens, its cost taken from a 5-token chain) must neither turn the probes
    into trees nor resume drafting on its own."""
    ratios = {1: 1.0, 2: 1.41, 3: 1.49, 4: 1.62, 5: 1.68, 6: 1.73, 7: 1.83, 8: 1.91}
    cost = CostModel(CostCurve(ratios, measured=True))  # the pair's sampled curve, no trees
    c = BlockController(8, cost, timed=False, trees=TREES, guess_weight=1.0)
    rng, seen = random.Random(0), []
    for _ in range(500):
        d = c.choose()
        a = 0
        while a < d.size - 1 and rng.random() < (0.27 if a == 0 else 0.47):
            a += 1
        seen.append((d.size, d.tree))
        c.update(d.size, a, None, tree=d.tree, chain=a)
    after = seen[seen.index((1, 0)) :]
    probes = [s for s in after if s[0] > 1]
    assert probes and all(tree == 0 for _, tree in probes), probes
    assert len(probes) < 0.06 * len(after)  # plain steps, a probe now and then


def test_rope_modules_are_each_models_own_and_found_once():
    """The RoPE modules a tree verify hooks, cached per model: a second model (same shape)
    gets its own, and one that replaced a dead model at the same address is walked afresh."""
    import gc

    from mlx_lm.models import qwen3

    from dflash_mac.drafting.tree import ropes
    from dflash_mac.loading.random_pair import target_config

    def model():
        return qwen3.Model(qwen3.ModelArgs.from_dict(target_config(vocab=8, hidden=16, layers=2)))

    def own(m) -> set[int]:
        return {id(layer.self_attn.rope) for layer in m.model.layers}

    a, b = model(), model()
    assert {id(r) for r in ropes(a)} == own(a) and ropes(a) is ropes(a)  # no second walk
    assert {id(r) for r in ropes(b)} == own(b) != own(a)
    del a
    gc.collect()
    c = model()
    assert {id(r) for r in ropes(c)} == own(c)
