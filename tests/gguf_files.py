"""Tiny synthetic GGUF files for the tests, written with llama.cpp's own `gguf` package."""

from __future__ import annotations

from pathlib import Path

import numpy as np

gguf = __import__("pytest").importorskip("gguf", reason="the gguf package (test extra)")

from gguf.quants import dequantize, quantize  # noqa: E402
from transformers.convert_slow_tokenizer import bytes_to_unicode  # noqa: E402

from dflash_mac.loading.random_pair import CHATML  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r"]
HIDDEN, HEADS, KV_HEADS, FF, LAYERS, CONTEXT = 64, 4, 2, 256, 2, 2048
HEAD_DIM = HIDDEN // HEADS


def vocabulary() -> tuple[list[str], list[int]]:
    """Byte-level BPE tokens (the 256 byte symbols, merged tokens, control tokens) and types."""
    tokens = list(bytes_to_unicode().values())
    tokens += ["".join(m.split(" ")) for m in MERGES]
    types = [1] * len(tokens) + [3] * len(SPECIALS)  # 1 NORMAL, 3 CONTROL
    return tokens + SPECIALS, types


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order (convert_hf_to_gguf.py `LlamaModel.permute`)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def hf_weights(arch: str, vocab: int, seed: int) -> dict[str, np.ndarray]:
    """Random weights in Hugging Face / mlx-lm names and layout."""
    rng = np.random.default_rng(seed)

    def lin(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * 0.3).astype(np.float32)

    w = {
        "model.embed_tokens.weight": lin(vocab, HIDDEN) * 3,
        "model.norm.weight": np.ones(HIDDEN, np.float32),
    }
    if arch == "qwen2":
        w["lm_head.weight"] = lin(vocab, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)
        w[p + "post_attention_layernorm.weight"] = np.ones(HIDDEN, np.float32)
        w[p + "self_attn.q_proj.weight"] = lin(HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.k_proj.weight"] = lin(KV_HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.v_proj.weight"] = lin(KV_HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.o_proj.weight"] = lin(HIDDEN, HEADS * HEAD_DIM)
        w[p + "mlp.gate_proj.weight"] = lin(FF, HIDDEN)
        w[p + "mlp.up_proj.weight"] = lin(FF, HIDDEN)
        w[p + "mlp.down_proj.weight"] = lin(HIDDEN, FF)
        if arch == "qwen2":
            for n, rows in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
                w[p + f"self_attn.{n}_proj.bias"] = lin(rows * HEAD_DIM, 1)[:, 0]
    return w


GGUF_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(name: str) -> str:
    module, kind = name.rsplit(".", 1)
    if module.startswith("model.layers."):
        _, _, i, rest = module.split(".", 3)
        return f"blk.{i}.{GGUF_NAMES[rest]}.{kind}"
    return f"{GGUF_NAMES[module]}.{kind}"


def stored(w: np.ndarray, qtype: str) -> tuple[np.ndarray, object]:
    """A 2-D weight as the file stores it: quantized bytes (or F16/F32) and its ggml type."""
    kind = gguf.GGMLQuantizationType[qtype]
    if qtype == "F32":
        return w, kind
    if qtype == "F16":
        return w.astype(np.float16), kind
    return quantize(w, kind), kind


def q6_k_blocks(rows: int, cols: int, seed: int) -> np.ndarray:
    """Random Q6_K blocks (the gguf package cannot quantize to K types): any bits are valid
    quants; each block's fp16 scale is set small so the weights stay in range."""
    blocks = np.random.default_rng(seed).integers(0, 256, (rows, cols // 256, 210), np.uint8)
    blocks[..., 208:210] = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)
    return blocks.reshape(rows, -1)


def reference(w: np.ndarray, qtype: str) -> np.ndarray:
    """What the gguf package dequantizes `w` stored as `qtype` back to."""
    data, kind = stored(w, qtype)
    return dequantize(data, kind).astype(np.float32) if qtype not in ("F32",) else w


def write_gguf(
    path: Path, arch: str = "llama", qtype: str = "Q4_1", seed: int = 0, down: str | None = None
) -> dict:
    """Write a tiny `arch` GGUF with linear weights stored as `qtype` (`down`: the mlp's down
    projections' type instead); returns its HF weights."""
    tokens, types = vocabulary()
    weights = hf_weights(arch, len(tokens), seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(CONTEXT)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FF)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_pad_token_id(tokens.index("<|endoftext|>"))
    w.add_chat_template(CHATML)
    for name, value in list(weights.items()):
        if arch == "llama" and ".q_proj.weight" in name:
            value = permute(value, HEADS)
        elif arch == "llama" and ".k_proj.weight" in name:
            value = permute(value, KV_HEADS)
        if value.ndim == 2 and down == "Q6_K" and "down_proj" in name:
            data, kind = q6_k_blocks(*value.shape, seed), gguf.GGMLQuantizationType.Q6_K
            weights[name] = dequantize(data, kind)  # what the file holds, as floats
            w.add_tensor(gguf_name(name), data, raw_dtype=kind)
        elif value.ndim == 2:
            data, kind = stored(value, down if down and "down_proj" in name else qtype)
            w.add_tensor(gguf_name(name), data, raw_dtype=kind)
        else:
            w.add_tensor(gguf_name(name), value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return weights


def hf_config(arch: str, vocab: int) -> dict:
    """The mlx-lm config.json of the same model, written independently of
    dflash_mac.loading.gguf."""
    return {
        "model_type": arch,
        "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS,
        "intermediate_size": FF,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "vocab_size": vocab,
        "max_position_embeddings": CONTEXT,
        "tie_word_embeddings": arch == "llama",
    }


def build_wheel(folder: Path, files: dict[str, bytes], name: str = "tinymodel") -> Path:
    """A minimal pure-Python wheel `name` 0.1.0 holding `files` (path inside -> bytes)."""
    import zipfile

    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"{name}-0.1.0-py3-none-any.whl"
    info = f"{name}-0.1.0.dist-info"
    meta = {
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1.0\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    with zipfile.ZipFile(wheel, "w") as z:
        for path, data in {**files, **{k: v.encode() for k, v in meta.items()}}.items():
            z.writestr(path, data)
        z.writestr(f"{info}/RECORD", "")
    return wheel


def local_index_env(wheels: Path, home: Path) -> dict[str, str]:
    """pip sees only the wheels in `wheels` (no index, no user config); data dir `home`."""
    import os

    return {
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": str(wheels),
        "PIP_CONFIG_FILE": os.devnull,
        "DFLASH_MAC_HOME": str(home),
    }


def write_drafter_for(folder: Path, block_size: int = 4, seed: int = 0) -> Path:
    """A random one-layer DFlash drafter for `write_gguf`'s llama (reading its layer 1)."""
    import mlx.core as mx
    from dflash_mac.models.config import DraftConfig
    from dflash_mac.models.dflash import DFlashDraftModel

    from dflash_mac.loading.random_pair import draft_config, save_model

    tcfg = hf_config("llama", len(vocabulary()[0]))
    tcfg.update(head_dim=HIDDEN // HEADS)
    mask = vocabulary()[0].index("<|mask|>")
    dcfg = draft_config(tcfg, mask, layer_ids=[1], block_size=block_size)
    mx.random.seed(seed)
    save_model(DFlashDraftModel(DraftConfig.from_dict(dcfg)), folder, dcfg)
    return folder
