"""Byte-level BPE tokenizer for the bundled model, trained on the training split only.

The pre-tokenizer, normalizer and decoder are exactly Qwen2's (NFC; Split on the Qwen2 regex,
isolated; ByteLevel without prefix space and without its own regex). transformers >= 5 rebuilds
a ``Qwen2Tokenizer`` from ``tokenizer.json``'s vocab and merges with that very pipeline, so the
tokenizer ``mlx_lm.load`` returns encodes identically to the raw ``tokenizers`` one.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from dflash_mac.bundle.corpus import (
    EOT,
    IM_END,
    IM_START,
    MASK,
    SPECIAL_TOKENS,
    Module,
    training_documents,
)

VOCAB_SIZE = 4096
QWEN2_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def new_tokenizer() -> Tokenizer:
    """An untrained BPE tokenizer with the Qwen2 text pipeline."""
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tokenizer(texts: Iterable[str], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Train the BPE on ``texts``; special tokens get ids 0..3 in SPECIAL_TOKENS order."""
    tok = new_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def tokenizer_config() -> dict:
    """The ``tokenizer_config.json`` contents (ChatML template, eos = <|im_end|>)."""
    added = {}
    for i, t in enumerate(SPECIAL_TOKENS):
        added[str(i)] = {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
    return {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END, MASK],
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": EOT,
        "unk_token": None,
        "mask_token": MASK,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": 2048,
        "split_special_tokens": False,
        "chat_template": CHAT_TEMPLATE,
    }


def save_tokenizer(tok: Tokenizer, out_dir: Path) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json to ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    stm = {
        "additional_special_tokens": [IM_START, IM_END, MASK],
        "eos_token": IM_END,
        "pad_token": EOT,
        "mask_token": MASK,
    }
    (out_dir / "special_tokens_map.json").write_text(json.dumps(stm, indent=2) + "\n")


def special_ids(tok: Tokenizer) -> dict[str, int]:
    """Ids of the special tokens (EOT, im_start, im_end, mask)."""
    return {t: tok.token_to_id(t) for t in (EOT, IM_START, IM_END, MASK)}


def build_tokenizer(train_texts: Iterable[str], out_dir: Path) -> Tokenizer:
    """Train on ``train_texts`` and save to ``out_dir``."""
    tok = train_tokenizer(train_texts)
    save_tokenizer(tok, out_dir)
    return tok


def write_token_streams(tok: Tokenizer, splits: dict[str, list[Module]], cache: Path) -> dict:
    """Tokenise each split's training documents into ``<cache>/<name>_tokens.npy`` (uint16);
    the first split (the training one) in a seeded shuffled document order. Returns the token
    count per split."""
    counts = {}
    for i, (name, mods) in enumerate(splits.items()):
        docs = list(training_documents(mods))
        if i == 0:
            order = np.random.default_rng(0).permutation(len(docs))
            docs = [docs[j] for j in order]
        ids = np.concatenate([np.array(e.ids, dtype=np.uint16) for e in tok.encode_batch(docs)])
        np.save(cache / f"{name}_tokens.npy", ids)
        counts[name] = len(ids)
    return counts
