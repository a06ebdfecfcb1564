"""Shared fixtures: tiny random pairs built once per session (fp32, reference BLAS)."""

from __future__ import annotations

import pytest
from helpers.tiny import build_tiny_pair

from dflash_mac.loading.loader import load


@pytest.fixture(scope="session", autouse=True)
def data_home(tmp_path_factory):
    """Tests never read or write your data directory (cost curves, chats, logs): the whole
    session, and the commands it starts, use a temporary one (tests may set their own). Without
    --model they run the tiny pair; the real default pair has tests of its own."""
    patch = pytest.MonkeyPatch()
    patch.setenv("DFLASH_MAC_HOME", str(tmp_path_factory.mktemp("data-home")))
    patch.setenv("DFLASH_MAC_PAIR", "tiny-code")
    yield
    patch.undo()


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    return build_tiny_pair(tmp_path_factory.mktemp("tiny"), seed=0, target_layers=4)


@pytest.fixture(scope="session")
def tiny_pair(tiny_dirs):
    return load(*tiny_dirs)
