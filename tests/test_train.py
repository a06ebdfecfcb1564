"""`dflash-mac train`: blocks, masks, weights, training == inference forward, loop, resume."""

from __future__ import annotations

import json
import math

import mlx.core as mx
import numpy as np
import pytest
from dflash_mac.models.config import DraftConfig
from dflash_mac.models.dflash import DFlashDraftModel
from helpers.tiny import draft_config

from dflash_mac.loading.loader import load
from dflash_mac.target.structure import target_head
from dflash_mac.train import TrainError, TrainingArgs, TrainingCallback, train_drafter
from dflash_mac.train.batches import target_features
from dflash_mac.train.blocks import (
    block_inputs,
    block_mask,
    decay_gamma,
    dense_block_mask,
    position_weights,
    sample_anchors,
)
from dflash_mac.train.config import default_layer_ids, resolve_mask_id
from dflash_mac.train.data import read_prompts
from dflash_mac.train.forward import layer_masks, train_hidden


def test_position_weights():
    assert decay_gamma(16) == 7 and decay_gamma(10) == 5 and decay_gamma(8) == 4
    assert decay_gamma(12) == pytest.approx(5 + 2 / 3)
    assert 1 <= decay_gamma(5) < 4
    w = position_weights(8)
    assert w.shape == (7,)
    assert np.allclose(w, [math.exp(-(k - 1) / 4) for k in range(1, 8)])
    assert w[0] == 1.0


def _visible_by_definition(q, k, anchor_q, block_q, anchor_k, block_k, is_ctx, causal, window):
    """Direct definition: context strictly before the anchor; own block only."""
    if is_ctx:
        ok = k < anchor_q
    else:
        ok = block_k == block_q
    if causal:
        ok = ok and k <= q
    if window is not None:
        ok = ok and q - k < window
    return ok


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, 3), (True, 4)])
def test_block_sparse_mask_elementwise(causal, window):
    anchors, n_ctx, bs = np.array([2, 5, 6]), 9, 3
    dense = dense_block_mask(anchors, n_ctx, bs, causal, window)
    assert dense.shape == (len(anchors) * bs, n_ctx + len(anchors) * bs)
    for r in range(dense.shape[0]):
        i, kq = divmod(r, bs)
        q = anchors[i] + kq
        for c in range(dense.shape[1]):
            if c < n_ctx:
                want = _visible_by_definition(q, c, anchors[i], i, None, None, True, causal, window)
            else:
                j, kk = divmod(c - n_ctx, bs)
                want = _visible_by_definition(
                    q, anchors[j] + kk, anchors[i], i, anchors[j], j, False, causal, window
                )
            assert dense[r, c] == want, (r, c)
    # the compact per-block layout the trainer uses is exactly the dense mask's diagonal
    compact = block_mask(anchors, n_ctx, bs, causal, window)
    for i in range(len(anchors)):
        rows = slice(i * bs, (i + 1) * bs)
        assert (compact[i, :, :n_ctx] == dense[rows, :n_ctx]).all()
        assert (compact[i, :, n_ctx:] == dense[rows, n_ctx + i * bs : n_ctx + (i + 1) * bs]).all()
    if not causal and window is None:  # bidirectional inside a block, nothing at/after anchor
        assert compact[:, :, n_ctx:].all()
        assert not compact[0, :, 2:n_ctx].any() and compact[0, :, :2].all()


def test_anchors_and_block_inputs():
    rng = np.random.default_rng(0)
    a = sample_anchors(rng, prompt_len=5, length=40, block_size=8, max_anchors=10)
    assert len(a) == 10 and len(set(a)) == 10 and a.min() >= 5 and a.max() <= 32
    assert list(sample_anchors(rng, 5, 14, 8, 512)) == [5, 6]
    toks = np.arange(100, 120)
    ids, labels = block_inputs(toks, np.array([3, 10]), 4, mask_id=7)
    assert ids.tolist() == [[103, 7, 7, 7], [110, 7, 7, 7]]
    assert labels.tolist() == [[104, 105, 106], [111, 112, 113]]


def test_default_layer_ids_and_mask_token():
    assert default_layer_ids(36) == [1, 9, 17, 25, 33]
    assert default_layer_ids(8) == [1, 3, 5]
    assert default_layer_ids(4) == [1]

    class Tok:
        def __init__(self, vocab):
            self.vocab = vocab

        def get_vocab(self):
            return self.vocab

    assert resolve_mask_id(Tok({"<|mask|>": 9}), None) == 9
    assert resolve_mask_id(Tok({}), 5) == 5
    with pytest.raises(TrainError, match="mask-token-id"):
        resolve_mask_id(Tok({}), None)


def test_read_prompts(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {
                    "messages": [
                        {"role": "user", "content": "hi"},
                        {"role": "assistant", "content": "drop me"},
                    ]
                },
                {"text": "plain"},
                {"prompt": "also plain"},
                {},
            ]
        )
    )
    with pytest.raises(ValueError, match="line 4"):
        read_prompts(p)
    p.write_text("\n".join(p.read_text().splitlines()[:3]))
    assert read_prompts(p) == [
        {"messages": [{"role": "user", "content": "hi"}]},
        "plain",
        "also plain",
    ]


@pytest.mark.parametrize("layout", ["bidirectional", "sliding-causal"])
def test_training_forward_equals_inference(tiny_pair, layout):
    """Blocks of the training pass == `drafter(block, cache)` with the context up to the anchor."""
    tcfg = tiny_pair.target_config
    extra = {}
    if layout == "sliding-causal":
        extra = {"layer_types": ["sliding_attention"] * 2, "sliding_window": 6}
    cfg = draft_config(tcfg, 259, layers=2, block_size=6, layer_ids=[0, 2])
    cfg.update(extra)
    mx.random.seed(3)
    drafter = DFlashDraftModel(DraftConfig.from_dict(cfg))
    drafter.bind(target_head(tiny_pair.target))
    tokens = mx.array([list(range(40, 70)), list(range(90, 120))])
    feats = target_features(tiny_pair.target, [0, 2], tokens)
    anchors = np.array([[4, 11, 17, 24], [9, 3, 20, 20]])
    ids = np.stack([block_inputs(np.array(t), a, 6, 259)[0] for t, a in zip(tokens, anchors)])
    masks = layer_masks(drafter, anchors, tokens.shape[1], 6)
    hidden = train_hidden(drafter, feats, mx.array(ids), mx.array(anchors.astype(np.int32)), masks)
    train = drafter.logits(hidden[:, :, 1:])  # [B, N, bs-1, V]
    for (b, n), a in np.ndenumerate(anchors):
        cache = drafter.make_cache()
        drafter.extend_context(feats[b : b + 1, :a], cache)
        ref = drafter(mx.array(ids[b, n])[None], cache)[0]
        assert np.allclose(np.array(train[b, n]), np.array(ref), atol=1e-4, rtol=1e-4), (b, a)


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    p.write_text(
        "\n".join(
            json.dumps({"text": t})
            for t in [
                "def add(a, b):",
                "import os",
                "class Stack:",
                "for i in x:",
                "while True:",
                "print('hi')",
                "try:",
                "x = [1, 2]",
            ]
        )
    )
    return p


class Record(TrainingCallback):
    """Collects each step's loss; `on_step(step, loss)` may raise to stop the run."""

    def __init__(self, on_step=None):
        self.losses: list[float] = []
        self.hook = on_step

    def on_step(self, r):
        self.losses.append(r.losses[-1])
        if self.hook:
            self.hook(r.step, r.losses[-1])


def _train(tiny_dirs, prompts, out, cache, on_step=None, **kw):
    opts = dict(
        block_size=6,
        num_layers=1,
        arch="dflash",
        loss="ce",
        steps=12,
        batch_size=2,
        anchors=16,
        max_new_tokens=24,
        lr=3e-3,
        cache_dir=cache,
        save_every=4,
    )
    opts.update(kw)
    rec = Record(on_step)
    summary = train_drafter(TrainingArgs(tiny_dirs[0], prompts, out, **opts), rec)
    return rec.losses, summary


@pytest.mark.slow
def test_training_decreases_loss_and_roundtrips(tiny_dirs, prompts_file, tmp_path):
    losses, summary = _train(
        tiny_dirs,
        prompts_file,
        tmp_path / "out",
        tmp_path / "c",
        steps=40,
        eval_prompts=prompts_file,
        eval_limit=2,
        eval_max_tokens=12,
    )
    assert np.mean(losses[-5:]) < losses[0] - 0.5
    # the z-lab folder loads like any Hub drafter
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"] == {"block_size": 6, "mask_token_id": 259, "target_layer_ids": [1]}
    assert cfg["num_target_layers"] == 4 and "rope_parameters" in cfg
    saved = mx.load(str(tmp_path / "out" / "model.safetensors"))
    assert all(v.dtype == mx.float16 for v in saved.values())
    assert not any("embed" in k or "lm_head" in k for k in saved)
    pair = load(tiny_dirs[0], tmp_path / "out")
    assert pair.block_size == 6 and pair.layer_ids == [1]
    ev = summary["eval"]
    assert [e["block_size"] for e in ev] == [6, 5]
    assert all(e["identical"] == e["prompts"] for e in ev)
    # fine-tuning starts from the saved drafter (fp16-rounded), not from scratch
    more, _ = _train(
        tiny_dirs,
        prompts_file,
        tmp_path / "ft",
        tmp_path / "c",
        steps=2,
        init_from=tmp_path / "out",
    )
    assert more[0] < losses[0] - 0.3


def test_resume_continues_the_same_trajectory(tiny_dirs, prompts_file, tmp_path):
    full, _ = _train(tiny_dirs, prompts_file, tmp_path / "a", tmp_path / "ca")

    class Stop(Exception):
        pass

    def stop_at_4(step, loss):
        first.append(loss)
        if step == 4:
            raise Stop

    first: list[float] = []
    with pytest.raises(Stop):
        _train(tiny_dirs, prompts_file, tmp_path / "b", tmp_path / "cb", on_step=stop_at_4)
    meta = json.loads((tmp_path / "cb" / "checkpoint" / "meta.json").read_text())
    assert meta["step"] == 4
    rest, summary = _train(tiny_dirs, prompts_file, tmp_path / "b", tmp_path / "cb", resume=True)
    assert len(rest) == 8 and summary["steps"] == 12
    assert np.allclose(first + rest, full, rtol=1e-4, atol=1e-5)


def test_regeneration_is_cached_and_limit_spreads(
    tiny_pair, tiny_dirs, prompts_file, tmp_path, monkeypatch
):
    from dflash_mac.train import data

    args = dict(max_tokens=8, limit=3, log=lambda m: None)
    seqs, path = data.load_or_regenerate(
        tiny_pair.target, tiny_pair.tokenizer, tiny_dirs[0], prompts_file, tmp_path, **args
    )
    want = [
        data.encode_prompts(tiny_pair.tokenizer, [p], 4096)[0]
        for p in np.array(read_prompts(prompts_file), dtype=object)[[0, 4, 7]]
    ]
    assert [s.prompt for s in seqs] == want  # evenly spread: first, middle, last
    assert all(1 <= len(s.response) <= 8 for s in seqs)

    def boom(*a, **k):
        raise AssertionError("regenerated again")

    monkeypatch.setattr(data, "regenerate", boom)
    again, path2 = data.load_or_regenerate(
        tiny_pair.target, tiny_pair.tokenizer, tiny_dirs[0], prompts_file, tmp_path, **args
    )
    assert path2 == path and [s.ids for s in again] == [s.ids for s in seqs]
    # greedy answers are the same whatever the seed (another training order reuses them) ...
    reseeded, path3 = data.load_or_regenerate(
        tiny_pair.target, tiny_pair.tokenizer, tiny_dirs[0], prompts_file, tmp_path, seed=7, **args
    )
    assert path3 == path and [s.ids for s in reseeded] == [s.ids for s in seqs]
    with pytest.raises(AssertionError, match="regenerated again"):  # ... sampled ones are not
        data.load_or_regenerate(
            tiny_pair.target, tiny_pair.tokenizer, tiny_dirs[0], prompts_file, tmp_path,
            temp=0.7, seed=7, **args,
        )  # fmt: skip


def test_regeneration_resumes_after_a_kill(
    tiny_pair, tiny_dirs, prompts_file, tmp_path, monkeypatch
):
    """A regeneration stopped after its first chunk (and a torn last line) answers only the
    rest when run again, and ends with what an uninterrupted run gives."""
    from dflash_mac.train import data

    args = dict(max_tokens=6, chunk=3, log=lambda m: None)
    whole, _ = data.load_or_regenerate(
        tiny_pair.target, tiny_pair.tokenizer, tiny_dirs[0], prompts_file, tmp_path / "a", **args
    )

    class Killed(Exception):
        pass

    def kill(done, n, tokens, seconds):
        raise Killed  # the process dies once the first chunk is on disk

    with pytest.raises(Killed):
        data.load_or_regenerate(
            tiny_pair.target, tiny_pair.tokenizer, tiny_dirs[0], prompts_file, tmp_path / "b",
            progress=kill, **args,
        )  # fmt: skip
    [partial] = (tmp_path / "b").glob("*.partial")
    with partial.open("a") as f:
        f.write('{"prompt": [1, 2')  # torn by the kill
    asked = []
    real = data.regenerate

    def counting(target, tokenizer, prompts, *a, **k):
        asked.extend(prompts)
        return real(target, tokenizer, prompts, *a, **k)

    monkeypatch.setattr(data, "regenerate", counting)
    again, path = data.load_or_regenerate(
        tiny_pair.target, tiny_pair.tokenizer, tiny_dirs[0], prompts_file, tmp_path / "b", **args
    )
    assert len(asked) == len(whole) - 3  # only what the first chunk had not answered
    assert [s.ids for s in again] == [s.ids for s in whole] and path.suffix == ".jsonl"


def test_sampled_prompt_files_are_answered_once_at_their_temperature_with_seed_0():
    """A later prompt set answered at T 0.7 keeps one cache whatever the training seed."""
    args = TrainingArgs(
        "t", "a.jsonl", "out", temps=[0.0], seed=7, extra_prompts=["b.jsonl"],
        sampled_prompts=["c.jsonl"], sampled_temp=0.7,
    )  # fmt: skip
    assert [(p.name, t, s) for p, t, s in args.parts] == [
        ("a.jsonl", 0.0, 7),
        ("b.jsonl", 0.0, 7),
        ("c.jsonl", 0.7, 0),
    ]
    assert args.data_temps == [0.0, 0.7]


def test_fixed_text_is_taught_teacher_forced(tiny_pair, tiny_dirs, prompts_file, tmp_path):
    """A fixed-text record becomes the templated prompt followed by the answer's tokens and
    the target's EOS (no generation), is tokenized once, and a training run takes it as a data
    part of its own beside the answered prompts; a bad record is one sentence."""
    from dflash_mac.api import prompt_ids
    from dflash_mac.train import data

    tok = tiny_pair.tokenizer
    fixed = tmp_path / "fixed.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": "write add"}], "answer": "def add(a, b):"},
        {"messages": [{"role": "user", "content": "a loop"}], "answer": "for i in range(9):"},
    ]
    fixed.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    seqs, path = data.load_fixed(tok, fixed, tmp_path / "cache")
    eos = list(tok.eos_token_ids)[0]
    for seq, row in zip(seqs, rows, strict=True):
        assert seq.prompt == prompt_ids(tok, row["messages"])
        assert seq.response == list(tok.encode(row["answer"], add_special_tokens=False)) + [eos]
    fixed.write_text("")  # the cache is keyed by the file's bytes: an emptied file is new
    assert data.load_fixed(tok, fixed, tmp_path / "cache")[0] == []
    fixed.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert data.load_fixed(tok, fixed, tmp_path / "cache") == (seqs, path)  # read back
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": []}\n')
    with pytest.raises(data.DataError, match="bad.jsonl, line 1: not a fixed-text record"):
        data.load_fixed(tok, bad, tmp_path / "cache")

    _, alone = _train(tiny_dirs, prompts_file, tmp_path / "a", tmp_path / "c1", steps=2)
    _, both = _train(
        tiny_dirs, prompts_file, tmp_path / "b", tmp_path / "c2", steps=2, fixed=[fixed]
    )
    taught = sum(len(s.response) for s in seqs if len(s.response) >= 6)
    assert taught > 0  # a block of the fixed text at least
    assert both["sequences"] == alone["sequences"] + sum(len(s.response) >= 6 for s in seqs)
    assert both["response_tokens"] == alone["response_tokens"] + taught
    assert both["fixed_text"] == [str(fixed)] and alone["fixed_text"] == []
