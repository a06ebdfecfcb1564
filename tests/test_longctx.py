"""Continued pretraining of the bundled target over its whole context (`bundle/longctx.py`)."""

from __future__ import annotations

import numpy as np
import pytest

from dflash_mac.bundle import build, stages2
from dflash_mac.bundle.longctx import CurriculumConfig, aligned_windows, lr_at, stage_of


def test_windows_start_at_documents_and_keep_them_whole():
    # documents (0 = end of document) of lengths 5, 3, 9, 2, 4, 12
    docs = [5, 3, 9, 2, 4, 12]
    toks = np.concatenate([np.r_[np.full(n - 1, 7), 0] for n in docs])
    wins = aligned_windows(toks, 8)
    # [5 | 3] fit whole (+1 token); the 9-token document (8..16) is longer than a window: cut
    # at 16; the next window starts at the 4-token document (23); the last would overrun
    assert list(wins) == [0, 8, 16, 23]
    assert all(w + 9 <= len(toks) for w in wins)
    assert np.all(np.diff(wins) > 0)


def test_curriculum_stages_and_schedule():
    cc = CurriculumConfig(stages=[(512, 0.2), (1024, 0.3), (2048, 0.5)], tokens=1000)
    assert [stage_of(t, cc) for t in (0, 199, 200, 499, 500, 999, 5000)] == [0, 0, 1, 1, 2, 2, 2]
    assert cc.max_len == 2048
    lrs = [lr_at(t, cc) for t in range(0, 1000, 10)]
    assert max(lrs) <= cc.lr and lrs[-1] < 0.2 * cc.lr and lrs[0] < lrs[3]


def test_long_eval_prompts_come_from_heldout_modules():
    import json
    from pathlib import Path

    from dflash_mac.bundle.corpus import is_heldout

    path = Path(__file__).parents[1] / "models" / "bundled" / "eval_long_prompts.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(rows) == 12
    for r in rows:
        assert is_heldout(r["module"]) and r["id"].startswith("long:")
        text = r["messages"][0]["content"]
        assert text.startswith(f"Here is part of the Python module `{r['module']}`")
        assert len(text) > 4000 and "write the" in text.rsplit("\n\n", 1)[1]


def test_v2_stages_start_from_the_cached_v1_models(tmp_path):
    # the v2 stages never take <out>'s (committed v2) models as their v1 starting point
    with pytest.raises(SystemExit, match=r"target_v1 is missing: .*--stage v1` first\."):
        stages2.stage_longctx(tmp_path / "out", tmp_path)
    (tmp_path / "target_v1").mkdir()
    (tmp_path / "target_v1" / "config.json").write_text("{}")
    assert stages2.need_v1(tmp_path, "target") == tmp_path / "target_v1"
    # `all` = the v1 stages (which keep their models in the cache), then the v2 stages
    assert build.GROUPS["all"][: len(build.GROUPS["v1"])] == build.GROUPS["v1"]
    assert build.GROUPS["v1"][-2:] == ("drafter", "drafter2")
