"""4-bit targets and drafters: exact greedy output, the block <= 5 policy, convert, the CLI."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from helpers.oracle import OracleDrafter, with_drafter
from helpers.tiny_hybrid import build_tiny_hybrid_pair
from mlx import nn
from mlx_lm.generate import generate_step
from typer.testing import CliRunner

from dflash_mac.cli import app
from dflash_mac.cli.terminal import load_pair
from dflash_mac.engine.decode import GenerationConfig, speculative_stream
from dflash_mac.loading.loader import LoadError, load, quantize_drafter
from dflash_mac.sizing.choice import BlockChoice, block_size_for

runner = CliRunner()
PROMPTS = ["def add(a, b):", "hello world"]


def cli(*args: str):
    result = runner.invoke(app, [str(a) for a in args])
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


@pytest.fixture(scope="module")
def q4(tiny_dirs, tmp_path_factory):
    """4-bit target and 4-bit drafter written by `dflash-mac convert`."""
    out = tmp_path_factory.mktemp("q4")
    t, d = out / "target-4bit", out / "draft-4bit"
    assert "4-bit target" in cli("convert", tiny_dirs[0], t, "--bits", "4").stdout
    assert (
        "4-bit drafter"
        in cli("convert", tiny_dirs[1], d, "--bits", "4", "--group-size", "64").stdout
    )
    return t, d


@pytest.fixture(scope="module")
def hybrid_dirs(tmp_path_factory):
    out = tmp_path_factory.mktemp("hyb")
    t, d = build_tiny_hybrid_pair(out)
    cli("convert", t, out / "target-4bit", "--bits", "4")
    return t, d, out / "target-4bit"


def baseline(pair, ids: list[int], n: int) -> list[int]:
    return [t for t, _ in generate_step(mx.array(ids), pair.target, max_tokens=n)]


def run(pair, ids, **kw) -> list[int]:
    if "block_size" in kw:  # a fixed size
        kw["block"] = BlockChoice(kw.pop("block_size"))
    events = list(speculative_stream(pair, ids, GenerationConfig(use_eos=False, **kw)))
    return [t for e in events for t in e.tokens]


@pytest.mark.slow
def test_4bit_pair_matches_4bit_target(q4):
    pair = load(*q4)
    assert pair.quantized and block_size_for(pair, None).size == 5
    assert pair.target_config["quantization"]["bits"] == 4
    assert any(isinstance(m, nn.QuantizedLinear) for _, m in pair.target.named_modules())
    for i, ids in enumerate(map(pair.tokenizer.encode, PROMPTS)):
        ref = baseline(pair, ids, 100)
        assert len(set(ref)) > 10
        assert run(pair, ids, max_tokens=100) == ref  # default block: 5
        oracle = with_drafter(pair, OracleDrafter(pair.drafter, ids + ref, 320, 0.3, i))
        for bs in (2, 5, 8):
            assert run(oracle, ids, max_tokens=100, block_size=bs) == ref


@pytest.mark.slow
def test_4bit_hybrid_target_matches(hybrid_dirs):
    t, d, t4 = hybrid_dirs
    pair = load(t4, d)
    assert pair.quantized and block_size_for(pair, None).size == 5
    ids = pair.tokenizer.encode(PROMPTS[0])
    ref = baseline(pair, ids, 100)
    assert run(pair, ids, max_tokens=100) == ref
    oracle = with_drafter(pair, OracleDrafter(pair.drafter, ids + ref, 320, 0.3, 1))
    assert run(oracle, ids, max_tokens=100) == ref


def test_quantize_drafter_keeps_norms_in_float(tiny_dirs):
    for bits in (4, 8):
        pair = load(*tiny_dirs)
        quantize_drafter(pair.drafter, bits)
        mods = dict(pair.drafter.named_modules())
        linear = [m for m in mods.values() if isinstance(m, nn.QuantizedLinear)]
        assert linear and all(m.bits == bits and m.group_size == 64 for m in linear)
        assert not any(type(m) is nn.Linear for m in mods.values())
        norms = [m for m in mods.values() if isinstance(m, nn.RMSNorm)]
        assert norms and all(m.weight.dtype == mx.float32 for m in norms)
        assert pair.drafter.config.quantization == {"group_size": 64, "bits": bits}
    with pytest.raises(LoadError, match="4 or 8"):
        quantize_drafter(pair.drafter, 3)


def test_block_size_policy(tiny_dirs, q4):
    fp = load(*tiny_dirs)
    assert not fp.quantized and block_size_for(fp, None) == BlockChoice(16, auto=True)
    # a quantized drafter alone is enough
    assert block_size_for(load(tiny_dirs[0], q4[1]), None).size == 5
    assert block_size_for(load(q4[0], tiny_dirs[1]), None).size == 5
    q = load(*q4)
    assert q.block_size == 16  # loading applies no policy: requests resolve their block
    assert block_size_for(q, None) == BlockChoice(5, auto=True)
    assert block_size_for(q, 5) == BlockChoice(5) and block_size_for(q, 3) == BlockChoice(3)
    wide = block_size_for(q, 8)  # explicit wins, with a warning
    assert wide.size == 8 and "\n" not in wide.warning and "block size 8 > 5" in wide.warning
    assert len(wide.warning) < 80
    assert block_size_for(fp, 16) == BlockChoice(16)
    q.drafter.config.block_size = 4
    assert block_size_for(q, None).size == 4  # min(5, drafter block)
    prepared = load_pair(*tiny_dirs, draft_bits=4)
    assert prepared.pair.quantized and prepared.block == BlockChoice(5, auto=True)


def test_convert_refuses_an_existing_folder(q4):
    with pytest.raises(LoadError, match="already exists"):
        cli("convert", q4[1], q4[0])


def generate_json(*args) -> tuple[dict, str]:
    res = cli("generate", "hello world", "-n", "40", "--ignore-chat-template", "--json", *args)
    assert res.exit_code == 0, res.stderr
    return json.loads(res.stdout), res.stderr


@pytest.mark.slow
def test_cli_generate_on_quantized_pair(q4):
    pair = load(*q4)
    ref = baseline(pair, pair.tokenizer.encode("hello world"), 40)
    out, err = generate_json("-m", q4[0], "-d", q4[1])
    assert out["tokens"] == ref and out["block_size"] == 5 and "warning" not in err
    out, err = generate_json("-m", q4[0], "-d", q4[1], "-b", "8")
    assert out["tokens"] == ref and out["block_size"] == 8
    warned = [line for line in err.splitlines() if "block size" in line]
    assert warned == ["warning: block size 8 > 5 is slower with a quantized model (default 5)."]


@pytest.mark.slow
def test_cli_generate_on_hybrid_pairs(hybrid_dirs):
    t, d, t4 = hybrid_dirs
    for model, extra, bs in ((t, [], 16), (t, ["--draft-bits", "4"], 5), (t4, [], 5)):
        pair = load(model, d)
        ref = baseline(pair, pair.tokenizer.encode("hello world"), 40)
        out, _ = generate_json("-m", model, "-d", d, *extra)
        assert out["tokens"] == ref and out["block_size"] == bs
