"""The drafting strategies' one interface (dflash_mac/engine/drafts.py): which strategy a cycle
gets; each kind's exactness is tested where it is exercised (test_greedy_exact, test_tree,
test_copydraft, test_structured, test_sampling)."""

from __future__ import annotations

from types import SimpleNamespace

from dflash_mac.engine import drafts
from dflash_mac.engine.verify import SamplingParams


def lane(grammar: bool = False) -> drafts.Lane:
    con = SimpleNamespace(ended=False) if grammar else None
    return drafts.Lane(None, None, None, SamplingParams(), con=con)


def test_each_cycle_gets_its_strategy():
    free, bound = lane(), lane(grammar=True)
    assert drafts.pick(1, [], False, 0, free) is drafts.PLAIN
    assert drafts.pick(8, [], False, 0, free) is drafts.CHAIN
    assert drafts.pick(8, [], False, 0, bound) is drafts.CONSTRAINED
    assert drafts.pick(8, [3, 4], False, 0, free) is drafts.COPY  # no drafter pass
    assert drafts.pick(1, [3, 4], False, 0, free) is drafts.COPY  # copies beside plain steps
    assert drafts.pick(8, [3, 4], False, 16, free) is drafts.COPY  # a sure copy: alone
    tree = drafts.pick(8, [3, 4], True, 16, free)  # a doubtful one rides on the tree
    assert isinstance(tree, drafts.Tree) and tree.budget == 16
    assert isinstance(drafts.pick(8, [], False, 4, free), drafts.Tree)


def test_every_strategy_reads_the_same_verdict():
    """A chain's outcome [accepted, bonus, drafts...] and a tree's [accepted, bonus, path
    tokens, path nodes, chain's accepted, chain's reach] read into one `Verdict`."""
    chain = SimpleNamespace(bs=4, q=None)
    v = drafts.CHAIN.read(chain, [2, 9, 5, 6, 7])
    assert v == drafts.Verdict(2, 9, [5, 6, 7], [], 2, [])
    # sampled: the drafts' acceptance odds follow them, then whatever rows were asked
    sampled = SimpleNamespace(bs=3, q=object())
    v = drafts.CHAIN.read(sampled, [1, 9, 5, 6, 1.0, 0.5, 0.9, 0.4, -1.5])
    assert v == drafts.Verdict(1, 9, [5, 6], [], 1, [-1.5], (1.0, 0.5, 0.9, 0.4))
    tree = SimpleNamespace(tree=SimpleNamespace(max_depth=3))
    v = drafts.Tree(8).read(tree, [2, 9, 5, 6, 0, 1, 4, 0, 1, 3])
    assert v == drafts.Verdict(2, 9, [5, 6, 0], [1, 4, 0], 1, [], reach=3)
