"""GGUF targets (dflash_mac/loading/gguf.py): weights against the gguf package's own dequantization,
the tokenizer from the metadata, greedy decoding against mlx-lm on a converted folder, and
broken files as one sentence."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from gguf_files import (
    HEADS,
    KV_HEADS,
    SPECIALS,
    hf_config,
    permute,
    reference,
    vocabulary,
    write_gguf,
)
from mlx import nn
from mlx_lm.generate import generate_step

from dflash_mac.errors import LoadError
from dflash_mac.loading import gguf
from dflash_mac.loading.loader import PairSpec, resolve

QTYPES = ["Q4_0", "Q4_1", "Q8_0", "F16"]


def linear_weight(module: nn.Module) -> np.ndarray:
    """A (possibly quantized) layer's weight as floats."""
    if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        scales, biases = (a.astype(mx.float32) for a in (module.scales, module.biases))
        w = mx.dequantize(module.weight, scales, biases, module.group_size, module.bits)
    else:
        w = module.weight
    return np.array(w.astype(mx.float32))


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [None, mx.float32], ids=["kept", "fp32"])
def test_weights_match_the_gguf_packages_dequantization(tmp_path, arch, qtype, dtype):
    path = tmp_path / "m.gguf"
    weights = write_gguf(path, arch, qtype)
    model, _, cfg, warnings = gguf.load(path, dtype)
    assert warnings == []
    assert cfg["max_position_embeddings"] == 2048
    kept = dtype is None and qtype.startswith("Q")
    assert bool(cfg.get("quantization")) == kept
    layer = model.model.layers[1]
    checks = {
        "model.embed_tokens.weight": model.model.embed_tokens,
        "model.layers.1.self_attn.q_proj.weight": layer.self_attn.q_proj,
        "model.layers.1.self_attn.k_proj.weight": layer.self_attn.k_proj,
        "model.layers.1.mlp.down_proj.weight": layer.mlp.down_proj,
    }
    for name, module in checks.items():
        assert isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)) == kept, name
        ours, ref = linear_weight(module), reference(weights[name], qtype)
        if ".q_proj." in name and arch == "llama":  # the file's rows are in llama.cpp's order
            ours, ref = permute(ours, HEADS), permute(ref, HEADS)
        elif ".k_proj." in name and arch == "llama":
            ours, ref = permute(ours, KV_HEADS), permute(ref, KV_HEADS)
        np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-6, err_msg=name)
    if arch == "qwen2":
        bias = np.array(layer.self_attn.q_proj.bias)
        np.testing.assert_array_equal(bias, weights["model.layers.1.self_attn.q_proj.bias"])


@pytest.mark.parametrize("arch,qtype", [("llama", "F32"), ("llama", "Q4_1"), ("qwen2", "Q8_0")])
def test_greedy_decoding_equals_mlx_lm_on_a_converted_folder(tmp_path, arch, qtype):
    from mlx_lm.utils import load_model

    path = tmp_path / "m.gguf"
    weights = write_gguf(path, arch, qtype, seed=3)
    folder = tmp_path / "folder"  # the same weights, dequantized by the gguf package, HF layout
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(hf_config(arch, len(vocabulary()[0]))))
    converted = {k: mx.array(reference(v, qtype) if v.ndim == 2 else v) for k, v in weights.items()}
    mx.save_safetensors(str(folder / "model.safetensors"), converted)
    expected_model, _ = load_model(folder)
    ours, _, _, _ = gguf.load(path, mx.float32)
    prompt = mx.array([5, 80, 33, 260, 71, 9])

    def greedy(model) -> list[int]:
        return [int(t) for (t, _), _ in zip(generate_step(prompt, model, max_tokens=16), range(16))]

    expected = greedy(expected_model)
    assert len(set(expected)) > 2  # a varied sequence, not one token repeated
    assert greedy(ours) == expected


def test_tokenizer_round_trips_with_special_tokens(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path)
    _, tok, _, _ = gguf.load(path, mx.float32)
    tokens, _ = vocabulary()
    corpus = [
        "the theater in the rain",
        "<|im_start|>user\nHello, wörld! 3.14 ✓<|im_end|>\n",
        "  leading spaces\tand\ttabs\n\nnew lines",
        "def f(x):\n    return x * 2  # émoji 🙂",
        "<|endoftext|>after the end",
    ]
    for text in corpus:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
    for special in SPECIALS:
        assert tok.encode(special, add_special_tokens=False) == [tokens.index(special)]
    assert tok.encode(" the", add_special_tokens=False) == [tokens.index("Ġthe")]
    assert tok.eos_token_ids == {tokens.index("<|im_end|>")}
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert "<|im_start|>user\nhi<|im_end|>" in chat and chat.endswith("<|im_start|>assistant\n")
    detok = tok.detokenizer  # mlx-lm's streaming detokenizer agrees with decode
    detok.reset()
    for t in tok.encode(corpus[1], add_special_tokens=False):
        detok.add_token(t)
    detok.finalize()
    assert detok.text == corpus[1]


def test_a_folder_holding_one_gguf_resolves_to_it(tmp_path):
    write_gguf(tmp_path / "only.gguf")
    assert gguf.find_gguf(tmp_path) == tmp_path / "only.gguf"
    assert resolve(tmp_path / "only.gguf") == tmp_path / "only.gguf"
    write_gguf(tmp_path / "second.gguf")
    with pytest.raises(LoadError, match="several GGUF files"):
        gguf.find_gguf(tmp_path)


def test_a_missing_gguf_is_named_as_a_file(tmp_path):
    with pytest.raises(LoadError, match=r"^the file .*/nope\.gguf does not exist\.$"):
        resolve(tmp_path / "nope.gguf")


def test_pair_spec_reads_the_gguf_config_before_any_weight(tmp_path):
    from dflash_mac.loading.random_pair import draft_config

    path = tmp_path / "m.gguf"
    write_gguf(path)
    tcfg = gguf.read_config(path)
    tcfg.update(head_dim=16, rms_norm_eps=1e-6)
    ddir = tmp_path / "draft"
    ddir.mkdir()
    dcfg = draft_config(tcfg, vocabulary()[0].index("<|mask|>"), layer_ids=[1])
    (ddir / "config.json").write_text(json.dumps(dcfg))
    spec = PairSpec.resolve(str(tmp_path), str(ddir))
    assert spec.target_path == path
    assert spec.target_config["num_hidden_layers"] == 2
    bad = dict(dcfg, hidden_size=128)
    (ddir / "config.json").write_text(json.dumps(bad))
    with pytest.raises(LoadError, match="does not fit target"):
        PairSpec.resolve(str(path), str(ddir))


def test_a_k_quant_file_loads_dequantized_and_says_so(tmp_path):
    path = tmp_path / "m.gguf"
    weights = write_gguf(path, "llama", "Q4_1", down="Q6_K")
    model, _, cfg, warnings = gguf.load(path, None)
    assert warnings == [
        "m.gguf holds Q6_K tensors, which MLX dequantizes to float16 at load "
        "(Q4_0, Q4_1 and Q8_0 stay quantized)."
    ]
    down = model.model.layers[0].mlp.down_proj
    assert isinstance(down, nn.Linear) and "model.layers.0.mlp.down_proj" not in cfg["quantization"]
    expected = weights["model.layers.0.mlp.down_proj.weight"]
    np.testing.assert_allclose(linear_weight(down), expected, rtol=2e-3, atol=1e-4)
    assert isinstance(model.model.layers[0].mlp.up_proj, nn.QuantizedLinear)


def test_other_block_types_are_said_to_be_dequantized():
    header = gguf.Header(tensor_types={"a": 2, "b": 14, "c": 12, "d": 0})
    note = gguf.dequantized_note(header, Path("m.gguf"))
    assert note is not None and "Q4_K, Q6_K" in note and "\n" not in note
    assert gguf.dequantized_note(gguf.Header(tensor_types={"a": 3, "b": 8}), Path("m")) is None


def test_a_block_type_mlx_cannot_read_is_named(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, down="Q5_0")
    with pytest.raises(LoadError, match=r"holds Q5_0 tensors, which MLX cannot read; use"):
        gguf.load(path, mx.float32)


def corrupt(tmp_path: Path, how: str) -> Path:
    good = tmp_path / "good.gguf"
    write_gguf(good)
    data = good.read_bytes()
    bad = tmp_path / f"{how}.gguf"
    rng = np.random.default_rng(0)
    bad.write_bytes(
        {
            # a valid header, then noise: MLX's own reader crashes the process on this one
            "noise": data[:24] + rng.bytes(4000),
            "truncated": data[: len(data) // 2],
            "header-only": data[:30],
            "not-gguf": b"hello, this is text\n" * 50,
            "empty": b"",
        }[how]
    )
    return bad


@pytest.mark.parametrize("how", ["noise", "truncated", "header-only", "not-gguf", "empty"])
def test_a_broken_file_is_one_sentence(tmp_path, how):
    bad = corrupt(tmp_path, how)
    with pytest.raises(LoadError) as e:
        gguf.load(bad, mx.float32)
    text = str(e.value)
    assert str(bad) in text and "\n" not in text and text.endswith(".")


@pytest.mark.parametrize("cut", [0, 3, 9, 13])
def test_a_string_array_cut_short_is_refused(cut):
    """The vocabulary's strings are stepped over in one tight loop: an array whose strings run
    past the end of the file is refused wherever it is cut, and a whole one is stepped over."""
    import mmap
    import struct

    strings = [b"ab", b"", b"xyz"]
    body = struct.pack("<IQ", 8, len(strings)) + b"".join(
        struct.pack("<Q", len(s)) + s for s in strings
    )
    buf = mmap.mmap(-1, len(body))
    buf.write(body)
    reader = gguf._Reader(buf)
    assert reader.skip_array() == 3 and reader.pos == len(body)
    short = mmap.mmap(-1, len(body) - 1 - cut)
    short.write(body[: len(body) - 1 - cut])
    with pytest.raises(ValueError, match="past the end of the file"):
        gguf._Reader(short).skip_array()
