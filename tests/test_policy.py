"""The block-size policy (dflash_mac/sizing/choice.py): one rule for every front end."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from dflash_mac.loading.registry import load_registry
from dflash_mac.sizing.choice import BlockChoice, block_size_for


def fake_pair(trained: int, quantized: bool, model_id: str = "org/Unknown", draft_id: str = "x"):
    drafter = SimpleNamespace(config=SimpleNamespace(block_size=trained))
    return SimpleNamespace(
        drafter=drafter,
        quantized=quantized,
        model_id=model_id,
        draft_id=draft_id,
        block_size=trained,
    )


@pytest.mark.parametrize(
    "trained, quantized, expected",
    [
        (16, False, 16),
        (8, False, 8),
        (16, True, 5),
        (8, True, 5),
        (4, True, 4),
    ],
)
def test_defaults_for_pairs_the_registry_does_not_know(trained, quantized, expected):
    assert block_size_for(fake_pair(trained, quantized), None) == BlockChoice(expected, auto=True)


def test_the_registry_figure_is_used_for_quantized_pairs():
    entry = dataclasses.replace(load_registry().pairs[0], quantized_block_size=3)
    assert block_size_for(fake_pair(16, True), None, entry).size == 3
    assert block_size_for(fake_pair(16, False), None, entry).size == 16  # not quantized
    # a real registry pair, looked up by its drafter id
    real = next(p for p in load_registry().pairs if p.block_size >= 8 and not p.local)
    pair = fake_pair(real.block_size, True, real.preferred_target, real.draft)
    assert block_size_for(pair, None).size == real.quantized_block_size


def test_above_the_trained_block_is_clamped_with_a_warning():
    choice = block_size_for(fake_pair(8, False), 999)
    assert choice == BlockChoice(8, "block size 999 > the drafter's trained block 8; using 8.")


def test_wide_blocks_on_quantized_pairs_run_with_a_warning():
    choice = block_size_for(fake_pair(16, True), 8)
    assert choice == BlockChoice(
        8, "block size 8 > 5 is slower with a quantized model (default 5)."
    )
    assert block_size_for(fake_pair(16, True), 4) == BlockChoice(4)
    assert block_size_for(fake_pair(16, False), 16) == BlockChoice(16)
