"""Fast tests of the bundled model's data pipeline, tokenizer and target."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dflash_mac.models.config import DraftConfig

from dflash_mac.bundle import corpus
from dflash_mac.bundle.stages2 import V2, set_candidates

ROOT = Path(__file__).resolve().parents[1]
BUNDLED = ROOT / "models" / "bundled"
TARGET = BUNDLED / "target"
has_target = pytest.mark.skipif(
    not (TARGET / "model.safetensors").exists(), reason="bundled target not built"
)
has_tokenizer = pytest.mark.skipif(
    not (TARGET / "tokenizer.json").exists(), reason="bundled tokenizer not built"
)


@pytest.fixture(scope="module")
def split() -> tuple[list[corpus.Module], list[corpus.Module]]:
    return corpus.split_modules()


def test_split_is_deterministic_and_disjoint(split) -> None:
    train, heldout = split
    train2, heldout2 = corpus.split_modules()
    assert [m.name for m in train] == [m.name for m in train2]
    assert [m.name for m in heldout] == [m.name for m in heldout2]
    names_tr, names_ho = {m.name for m in train}, {m.name for m in heldout}
    assert names_ho and not names_tr & names_ho
    assert all(corpus.is_heldout(n) for n in names_ho)
    assert 0.02 < len(heldout) / (len(train) + len(heldout)) < 0.10
    assert not any(".test" in n or n.startswith("test") for n in names_tr | names_ho)


@pytest.mark.slow
def test_heldout_modules_never_in_training_data(split) -> None:
    train, heldout = split
    ho = {m.name for m in heldout}
    docs = list(corpus.training_documents(train))
    headers = {d.split("\n", 1)[0] for d in docs if d.startswith("# module: ")}
    assert not {h.removeprefix("# module: ") for h in headers} & ho
    for doc in docs:
        if doc.startswith(corpus.IM_START):
            mod = doc.split("`", 2)[1]
            assert mod not in ho
    # a held-out module's distinctive source text never appears in any training document
    big = max(heldout, key=lambda m: len(m.source))
    probe = max(big.source.splitlines(), key=len)
    assert len(probe) > 40 and not any(probe in d for d in docs)


def test_eval_prompts_are_heldout(split) -> None:
    _, heldout = split
    ho = {m.name for m in heldout}
    rows = [json.loads(x) for x in (BUNDLED / "eval_prompts.jsonl").read_text().splitlines()]
    assert 24 <= len(rows) <= 40
    for r in rows:
        assert r["module"] in ho and r["id"]
        assert r["messages"][0]["role"] == "user" and len(r["messages"]) == 1


def test_chat_examples_shape(split) -> None:
    train, _ = split
    mod = next(m for m in train if m.name == "queue")
    ex = corpus.chat_examples(mod)
    get = next(e for e in ex if e.id.startswith("queue:Queue.get:"))
    assert get.user.startswith("In the Python module `queue`, write the method `Queue.get(self")
    assert get.assistant.startswith("def get(self, block=True, timeout=None):")


SAMPLE = (
    "def f(x):\n\n    \t  return  x  # héllo ünïcode 日本語 é e\u0301 \u00a0→\n\n\n"
    "<|im_start|>user\nhi<|mask|><|im_end|>\n<|endoftext|>  \r\n    if  a:\n\t\tpass\n"
)


@has_tokenizer
def test_tokenizer_roundtrip_matches_mlx_lm() -> None:
    from mlx_lm.utils import load_tokenizer
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(TARGET / "tokenizer.json"))
    wrapped = load_tokenizer(TARGET)
    hf = wrapped._tokenizer
    ids = raw.encode(SAMPLE).ids
    assert hf.encode(SAMPLE, add_special_tokens=False) == ids
    assert raw.decode(ids, skip_special_tokens=False) == hf.decode(ids) == wrapped.decode(ids)
    mask = hf.convert_tokens_to_ids("<|mask|>")
    assert mask == raw.token_to_id("<|mask|>") == 3 and mask in ids
    assert raw.token_to_id("<|im_end|>") in wrapped.eos_token_ids
    assert raw.get_vocab_size() == json.loads((TARGET / "config.json").read_text())["vocab_size"]
    text = hf.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text == corpus.render_chat([{"role": "user", "content": "hi"}], True)


@has_target
def test_target_loads_and_greedy_decodes() -> None:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    model, tok = load(str(TARGET))
    cfg = json.loads((TARGET / "config.json").read_text())
    assert cfg["model_type"] == "qwen3" and cfg["tie_word_embeddings"]
    assert cfg["num_hidden_layers"] >= 6
    assert (TARGET / "model.safetensors").stat().st_size < 18e6
    row = json.loads((BUNDLED / "eval_prompts.jsonl").read_text().splitlines()[0])
    prompt = tok.apply_chat_template(row["messages"], add_generation_prompt=True)
    out = []
    for (t, _), _ in zip(generate_step(mx.array(prompt), model, max_tokens=24), range(24)):
        out.append(int(t))
        if t in tok.eos_token_ids:
            break
    assert out and all(0 <= t < cfg["vocab_size"] for t in out)
    assert isinstance(tok.decode(out), str)


def test_set_candidates_widens_the_walk_and_the_bundled_config_has_it(tmp_path: Path) -> None:
    """The build's last DFlash 2 step sets the walk's candidates and nothing else; the committed
    drafter carries the build's figure, and the runtime walks over that many."""
    bundled = Path(__file__).resolve().parents[1] / "models" / "bundled" / "dflash2"
    cfg = json.loads((bundled / "config.json").read_text())
    trained = dict(cfg, dflash_config=dict(cfg["dflash_config"], selector_top_k=16))
    (tmp_path / "config.json").write_text(json.dumps(trained))
    set_candidates(tmp_path, V2["dflash2_candidates"])
    assert json.loads((tmp_path / "config.json").read_text()) == cfg
    assert DraftConfig.from_dict(cfg).selector_top_k == V2["dflash2_candidates"] > 16
