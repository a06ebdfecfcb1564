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


def copy_model(lag: int, vocab: int):
    """A fake model that predicts the token `lag` positions back (uniform before that)."""
    import mlx.core as mx

    def model(x):  # x: [1, n] -> logits [1, n, vocab]
        back = mx.concatenate([mx.full((1, lag - 1), -1, x.dtype), x[:, : -(lag - 1)]], axis=1)
        return 100.0 * (mx.arange(vocab)[None, None] == back[..., None]).astype(mx.float32)

    return model


def test_context_control_tells_whether_long_prefixes_help():
    import math

    from dflash_mac.bundle.longctx import context_control

    V, period = 50, 300
    rng = np.random.default_rng(0)
    toks = np.tile(rng.integers(1, V, period), 8)[:2200]  # no document ends: one long text
    # copying from 300 back needs more than 256 tokens of context: with 256 only, the first 43
    # targets of every 256-target chunk are guesses (uniform: log V)
    res = context_control(copy_model(period, V), toks, 2048, n_windows=None)
    assert res["windows"] == 1
    assert res["full"]["1024-2048"] == pytest.approx(0.0, abs=1e-4)
    assert res["short"]["1024-2048"] == pytest.approx((period - 257) / 256 * math.log(V), 1e-3)
    assert res["short"]["0-256"] == res["full"]["0-256"] == pytest.approx(math.log(V), 1e-3)
    # negative control: a model that looks 100 back loses nothing to a 256-token context
    near = context_control(copy_model(100, V), toks, 2048, n_windows=None)
    assert near["short"] == near["full"]


def test_positions_stage_scores_the_built_target(tmp_path, tiny_dirs):
    import json
    import shutil

    target, _ = tiny_dirs
    out, cache = tmp_path / "out", tmp_path / "cache"
    shutil.copytree(target, out / "target")
    cache.mkdir()
    config = out / "target" / "config.json"
    short_context = {**json.loads(config.read_text()), "max_position_embeddings": 2048}
    config.write_text(json.dumps(short_context))
    np.save(cache / "eval2_tokens.npy", np.random.default_rng(1).integers(1, 256, 2100))
    res = stages2.stage_positions(out, cache, windows=1)
    assert res == json.loads((cache / "target2_positions.json").read_text())
    assert res["windows"] == 1 and list(res["full"]) == ["0-256", "256-1024", "1024-2048"]
    assert res["short"]["0-256"] == res["full"]["0-256"]
    assert res["short"]["1024-2048"] != res["full"]["1024-2048"]  # a random model: not equal
