"""Random-weight pairs: a qwen3 target and a matching DFlash drafter with the right shapes and
no training. What `doctor`'s self-test decodes without the bundled pair, what
`bench --shape` times, and what the tests and demos run on."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_byte_tokenizer(folder: Path) -> dict[str, int]:
    """A byte-level BPE tokenizer with no merges (256 byte tokens + ChatML specials)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "chat_template": CHATML,
            },
            indent=1,
        )
    )
    return ids


def target_config(vocab: int = 320, hidden: int = 64, layers: int = 4, **kw) -> dict:
    """A qwen3 target's config.json of the given size; `kw` overrides any key."""
    cfg = {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": hidden * 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": hidden // 4,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    }
    cfg.update(kw)
    return cfg


def draft_config(
    tcfg: dict,
    mask_id: int,
    layers: int = 1,
    block_size: int = 16,
    layer_ids: list[int] | None = None,
    arch: str = "DFlashDraftModel",
) -> dict:
    """A drafter's config.json matching target config `tcfg` (z-lab's schema)."""
    n = tcfg["num_hidden_layers"]
    ids = layer_ids or sorted({1, max(1, n // 2), max(1, n - 2)})
    keys = (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "vocab_size",
        "max_position_embeddings",
    )
    cfg = {k: tcfg[k] for k in keys}
    cfg.update(
        architectures=[arch],
        model_type="qwen3",
        num_hidden_layers=layers,
        num_target_layers=n,
        rope_parameters={"rope_theta": tcfg["rope_theta"], "rope_type": "default"},
        dflash_config={"block_size": block_size, "mask_token_id": mask_id, "target_layer_ids": ids},
    )
    return cfg


def save_model(model, folder: Path, config: dict) -> None:
    """Write `model`'s weights and `config` as a model folder the loader reads."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))


def build_random_pair(
    out: str | Path,
    seed: int = 0,
    target_layers: int = 4,
    draft_layers: int = 1,
    block_size: int = 16,
    weight_scale: float = 4.0,
    **target_kw,
) -> tuple[Path, Path]:
    """Write a random qwen3 target (with tokenizer) and a matching random DFlash drafter under
    `out`; returns the target and drafter folders."""
    from mlx_lm.models import qwen3

    from dflash_mac.models.config import DraftConfig
    from dflash_mac.models.dflash import DFlashDraftModel

    out = Path(out)
    tdir, ddir = out / "target", out / "draft"
    ids = write_byte_tokenizer(tdir)
    tcfg = target_config(layers=target_layers, **target_kw)
    tcfg["eos_token_id"] = ids["<|im_end|>"]
    mx.random.seed(seed)
    target = qwen3.Model(qwen3.ModelArgs.from_dict(tcfg))
    # Random init at scale 1 decodes one token forever; a larger scale gives varied text.
    target.update(tree_map(lambda p: p * weight_scale if p.ndim == 2 else p, target.parameters()))
    save_model(target, tdir, tcfg)
    dcfg = draft_config(tcfg, ids["<|mask|>"], layers=draft_layers, block_size=block_size)
    drafter = DFlashDraftModel(DraftConfig.from_dict(dcfg))
    save_model(drafter, ddir, dcfg)
    return tdir, ddir
