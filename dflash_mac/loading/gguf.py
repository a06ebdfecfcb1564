"""GGUF targets: a llama.cpp file loaded as an mlx-lm model and tokenizer (docs/models.md).

MLX reads the tensors (`mx.load`: Q4_0 / Q4_1 / Q8_0 stay MLX-quantized, group size 32), mlx-lm
builds the model, transformers' GGUF converter builds the tokenizer; this module maps names and
configs between them and checks the file's structure first."""

from __future__ import annotations

import mmap
import re
import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import LoadError

GROUP_SIZE = 32  # every GGUF block type MLX keeps quantized has 32 weights per block
# GGUF architecture -> mlx-lm model_type; llama.cpp stores llama-family q/k rows permuted.
ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
PERMUTED = {"llama", "mistral"}
# ggml tensor types MLX loads as is (floats) or keeps quantized; any other type it dequantizes.
KEPT_TYPES = {0: "F32", 1: "F16", 30: "BF16", 2: "Q4_0", 3: "Q4_1", 8: "Q8_0"}
TYPE_NAMES = {6: "Q5_0", 7: "Q5_1", 10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}
_NAMES = [
    (r"token_embd\.", "model.embed_tokens."),
    (r"output_norm\.", "model.norm."),
    (r"output\.", "lm_head."),
    (r"blk\.(\d+)\.attn_q_norm\.", r"model.layers.\1.self_attn.q_norm."),
    (r"blk\.(\d+)\.attn_k_norm\.", r"model.layers.\1.self_attn.k_norm."),
    (r"blk\.(\d+)\.attn_q\.", r"model.layers.\1.self_attn.q_proj."),
    (r"blk\.(\d+)\.attn_k\.", r"model.layers.\1.self_attn.k_proj."),
    (r"blk\.(\d+)\.attn_v\.", r"model.layers.\1.self_attn.v_proj."),
    (r"blk\.(\d+)\.attn_output\.", r"model.layers.\1.self_attn.o_proj."),
    (r"blk\.(\d+)\.attn_norm\.", r"model.layers.\1.input_layernorm."),
    (r"blk\.(\d+)\.ffn_norm\.", r"model.layers.\1.post_attention_layernorm."),
    (r"blk\.(\d+)\.ffn_gate\.", r"model.layers.\1.mlp.gate_proj."),
    (r"blk\.(\d+)\.ffn_up\.", r"model.layers.\1.mlp.up_proj."),
    (r"blk\.(\d+)\.ffn_down\.", r"model.layers.\1.mlp.down_proj."),
]


def is_gguf(path: str | Path) -> bool:
    return str(path).lower().endswith(".gguf")


def find_gguf(folder: Path) -> Path | None:
    """The one .gguf file of a folder without config.json; None when it is an mlx-lm folder."""
    if (folder / "config.json").exists():
        return None
    found = sorted(folder.glob("*.gguf"))
    if len(found) > 1:
        names = ", ".join(f.name for f in found[:3])
        raise LoadError(f"{folder} holds several GGUF files ({names}); pass one of them.")
    return found[0] if found else None


@dataclass
class Header:
    """What the structure check read: scalar and string metadata, and tensor types by name."""

    metadata: dict[str, Any] = field(default_factory=dict)
    array_lengths: dict[str, int] = field(default_factory=dict)
    tensor_types: dict[str, int] = field(default_factory=dict)


_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q"}
_SCALARS[12] = "d"
_U64 = struct.Struct("<Q")


class _Reader:
    """Bounds-checked little-endian reads over the mapped file."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        if self.pos + size > len(self.buf):
            raise ValueError("the header runs past the end of the file")
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self, keep: bool = True) -> str | None:
        n = self.take("Q")
        if self.pos + n > len(self.buf):
            raise ValueError("a string runs past the end of the file")
        raw = self.buf[self.pos : self.pos + n] if keep else None
        self.pos += n
        return raw.decode("utf-8", "replace") if raw is not None else None

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind == 8:
            return self.string()
        raise ValueError(f"unknown metadata type {kind}")

    def skip_array(self) -> int:
        """Step over an array (MLX reads its values; only the layout is checked); its length."""
        inner, count = self.take("I"), self.take("Q")
        if count > len(self.buf):
            raise ValueError("an array is longer than the file")
        if inner in _SCALARS:
            self.pos += count * struct.calcsize("<" + _SCALARS[inner])
            if self.pos > len(self.buf):
                raise ValueError("an array runs past the end of the file")
        elif inner == 8:  # one tight loop: a vocabulary's strings are ~100k of them
            buf, pos, end, length = self.buf, self.pos, len(self.buf), _U64.unpack_from
            for _ in range(count):
                if pos + 8 > end:
                    raise ValueError("the header runs past the end of the file")
                pos += 8 + length(buf, pos)[0]
            if pos > end:
                raise ValueError("a string runs past the end of the file")
            self.pos = pos
        else:
            raise ValueError(f"unknown array type {inner}")
        return count


def read_header(path: Path) -> Header:
    """Check the file's header, metadata and tensor table (MLX's reader crashes on a corrupt
    one; the `gguf` package's takes seconds on a real vocabulary), and read its scalars."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            r = _Reader(buf)
            if r.take("4s") != b"GGUF":
                raise ValueError("it does not start with the GGUF magic")
            if r.take("I") not in (2, 3):
                raise ValueError("its GGUF version is not 2 or 3")
            n_tensors, n_kv = r.take("Q"), r.take("Q")
            if n_tensors > len(buf) or n_kv > len(buf):
                raise ValueError("its counts are larger than the file")
            header = Header()
            for _ in range(n_kv):
                key, kind = r.string(), r.take("I")
                if kind == 9:
                    header.array_lengths[key] = r.skip_array()
                else:
                    header.metadata[key] = r.value(kind)
            for _ in range(n_tensors):
                name = r.string()
                n_dims = r.take("I")
                if not 1 <= n_dims <= 4:
                    raise ValueError(f"tensor {name} has {n_dims} dimensions")
                for _ in range(n_dims):
                    r.take("Q")
                header.tensor_types[name] = r.take("I")
                r.take("Q")
            return header
    except (ValueError, OSError) as e:  # mmap of an empty file is a ValueError too
        raise LoadError(f"{path} is not a readable GGUF file ({e}).")


def _meta(header: Header, arch: str, key: str, default: Any = None) -> Any:
    return header.metadata.get(f"{arch}.{key}", default)


def config_from_header(header: Header, path: Path) -> dict:
    """The mlx-lm config.json the file's metadata describes."""
    arch = header.metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        known = ", ".join(sorted(ARCHITECTURES))
        raise LoadError(f"{path} is a '{arch}' GGUF; dflash-mac reads {known} GGUF files.")
    if "rope_freqs.weight" in header.tensor_types:
        raise LoadError(f"{path} uses Llama 3.1 rope scaling (rope_freqs), not supported yet.")
    heads = _meta(header, arch, "attention.head_count")
    hidden = _meta(header, arch, "embedding_length")
    required = {
        "hidden_size": hidden,
        "num_hidden_layers": _meta(header, arch, "block_count"),
        "intermediate_size": _meta(header, arch, "feed_forward_length"),
        "num_attention_heads": heads,
    }
    if missing := [k for k, v in required.items() if v is None]:
        raise LoadError(f"{path} lacks the metadata {arch} needs ({', '.join(missing)}).")
    vocab = _meta(header, arch, "vocab_size", header.array_lengths.get("tokenizer.ggml.tokens"))
    cfg = {
        "model_type": ARCHITECTURES[arch],
        **required,
        "num_key_value_heads": _meta(header, arch, "attention.head_count_kv", heads),
        "head_dim": _meta(header, arch, "attention.key_length", hidden // heads),
        "rms_norm_eps": _meta(header, arch, "attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": _meta(header, arch, "rope.freq_base", 10000.0),
        "max_position_embeddings": _meta(header, arch, "context_length", 4096),
        "tie_word_embeddings": "output.weight" not in header.tensor_types,
        "vocab_size": vocab,
        "gguf_architecture": arch,
    }
    return cfg


def read_config(path: Path) -> dict:
    """The target config of a GGUF file, from its metadata alone (no tensors read)."""
    return config_from_header(read_header(path), path)


def rename(name: str) -> str:
    for pattern, repl in _NAMES:
        new, n = re.subn("^" + pattern, repl, name)
        if n:
            return new
    return name


def unpermute(w, n_head: int):
    """Undo llama.cpp's q/k row permutation (convert_hf_to_gguf `permute`) on a weight, its
    scales or biases: rows go back to the Hugging Face order mlx-lm's RoPE expects."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def map_weights(raw: dict, cfg: dict) -> dict:
    """GGUF tensor names -> mlx-lm's, llama q/k rows un-permuted."""
    permuted = cfg["gguf_architecture"] in PERMUTED
    out = {}
    for name, w in raw.items():
        new = rename(name)
        if permuted and ".self_attn.q_proj." in new:
            w = unpermute(w, cfg["num_attention_heads"])
        elif permuted and ".self_attn.k_proj." in new:
            w = unpermute(w, cfg["num_key_value_heads"])
        out[new] = w
    return out


def _bits(weights: dict, prefix: str) -> int:
    """Bits per weight of a quantized layer: packed uint32 columns vs groups of 32."""
    packed, groups = weights[f"{prefix}.weight"].shape[-1], weights[f"{prefix}.scales"].shape[-1]
    return packed * 32 // (groups * GROUP_SIZE)


def other_types(header: Header) -> str:
    """The file's tensor types MLX does not keep as they are, by name ('' when none)."""
    other = sorted({t for t in header.tensor_types.values() if t not in KEPT_TYPES})
    return ", ".join(TYPE_NAMES.get(t, f"type {t}") for t in other)


def dequantized_note(header: Header, path: Path) -> str | None:
    """One sentence when MLX dequantizes tensors of types it does not keep quantized."""
    if not (names := other_types(header)):
        return None
    return (
        f"{path.name} holds {names} tensors, which MLX dequantizes to float16 at load "
        "(Q4_0, Q4_1 and Q8_0 stay quantized)."
    )


def load_tokenizer(metadata: dict, arch: str, eos_ids: list[int]):
    """mlx-lm's TokenizerWrapper over the tokenizer transformers builds from the metadata."""
    from mlx_lm.tokenizer_utils import load as load_wrapper
    from transformers import PreTrainedTokenizerFast

    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )
    except ImportError:  # transformers 4.x
        from transformers.integrations.ggml import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    def plain(v: Any) -> Any:
        return v.tolist() if hasattr(v, "tolist") else v

    renames = GGUF_TOKENIZER_MAPPING["tokenizer"]
    tok = {
        n: plain(metadata[f"tokenizer.{k}"])
        for k, n in renames.items()
        if f"tokenizer.{k}" in metadata
    }
    if "tokens" not in tok:
        raise LoadError("the GGUF file has no tokenizer (tokenizer.ggml.tokens).")
    try:
        backend, _ = convert_gguf_tokenizer(arch, tok)
    except (ValueError, KeyError) as e:
        raise LoadError(f"could not build the GGUF file's tokenizer ({e}).")
    special = {
        name: tok["tokens"][tok[key]] if tok.get(key) is not None else None
        for name, key in (
            ("bos_token", "bos_token_id"),
            ("eos_token", "eos_token_id"),
            ("unk_token", "unk_token_id"),
            ("pad_token", "pad_token_id"),
        )
    }
    template = plain(metadata.get("tokenizer.chat_template"))
    hf = PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=template, **special)
    with tempfile.TemporaryDirectory() as tmp:  # mlx-lm picks its streaming detokenizer from files
        hf.save_pretrained(tmp)
        return load_wrapper(Path(tmp), eos_token_ids=eos_ids)


def load(path: Path, dtype=None) -> tuple[Any, Any, dict, list[str]]:
    """(model, TokenizerWrapper, config, warnings) of a GGUF file. `dtype`: dequantize every
    quantized weight to it (the CPU's fp32); None keeps Q4_0 / Q4_1 / Q8_0 quantized."""
    import mlx.core as mx
    from mlx import nn
    from mlx_lm.utils import _get_classes

    header = read_header(path)
    cfg = config_from_header(header, path)
    try:
        raw, metadata = mx.load(str(path), return_metadata=True)
    except (RuntimeError, ValueError) as e:
        if other := other_types(header):
            raise LoadError(
                f"{path} holds {other} tensors, which MLX cannot read; use a Q4_0, Q4_1, Q8_0 "
                "or F16 GGUF of the model."
            )
        raise LoadError(f"{path} is not a readable GGUF file ({e}).")
    cfg["vocab_size"] = cfg["vocab_size"] or raw["token_embd.weight"].shape[0]
    weights = map_weights(raw, cfg)
    bits = {k[: -len(".scales")]: 0 for k in weights if k.endswith(".scales")}
    for p in bits:
        bits[p] = _bits(weights, p)
    if dtype is not None:  # dequantized: plain layers of `dtype`
        for p, b in bits.items():
            w, s, z = (weights.pop(f"{p}.{n}") for n in ("weight", "scales", "biases"))
            s, z = s.astype(dtype), z.astype(dtype)  # fp16 scales would round the result
            weights[f"{p}.weight"] = mx.dequantize(w, s, z, group_size=GROUP_SIZE, bits=b)
        weights = {k: v.astype(dtype) for k, v in weights.items()}
        bits = {}
    model_class, args_class = _get_classes(cfg)
    model = model_class(args_class.from_dict(cfg))
    weights = model.sanitize(weights) if hasattr(model, "sanitize") else weights
    if bits:
        nn.quantize(
            model,
            class_predicate=lambda p, m: (
                {"group_size": GROUP_SIZE, "bits": bits[p]} if p in bits else False
            ),
        )
        cfg["quantization"] = {"group_size": GROUP_SIZE, "bits": max(bits.values())}
        cfg["quantization"].update(
            {p: {"group_size": GROUP_SIZE, "bits": b} for p, b in bits.items()}
        )
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise LoadError(f"the tensors of {path} do not match its {cfg['model_type']} config ({e}).")
    model.eval()
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    eos_ids = [int(eos.item())] if eos is not None else []
    tokenizer = load_tokenizer(metadata, cfg["gguf_architecture"], eos_ids)
    note = dequantized_note(header, path)
    return model, tokenizer, cfg, [note] if note else []
