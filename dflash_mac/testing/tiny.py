"""Tiny random model pairs built on the fly (tests, demos, the pre-bundle main job)."""

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

# A Qwen3-style template that takes tools: definitions in the system turn, calls written as
# <tool_call>{"name": …, "arguments": …}</tool_call>, tool results as <tool_response> turns.
CHATML_TOOLS = (
    "{%- set nl = '\\n' %}{%- if tools %}{{ '<|im_start|>system' + nl }}"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content + nl + nl }}{% endif %}"
    "{{ '# Tools' + nl + nl + 'To call a function, answer with <tool_call>' + nl }}"
    '{{ \'{"name": <function-name>, "arguments": <args-json-object>}\' + nl }}'
    "{{ '</tool_call>' + nl + '<tools>' }}{% for t in tools %}{{ nl + t | tojson }}{% endfor %}"
    "{{ nl + '</tools><|im_end|>' + nl }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{ '<|im_start|>system' + nl + messages[0].content + '<|im_end|>' + nl }}{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}"
    "{{ '<|im_start|>' + m.role + nl + m.content + '<|im_end|>' + nl }}"
    "{%- elif m.role == 'assistant' %}{{ '<|im_start|>assistant' + nl + m.content }}"
    "{%- for call in m.tool_calls or [] %}{% set tool_call = call.function %}"
    "{%- if m.content or not loop.first %}{{ nl }}{% endif %}"
    "{{ '<tool_call>' + nl + '{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
    "{{ tool_call.arguments | tojson }}{{ '}' + nl + '</tool_call>' }}"
    "{%- endfor %}{{ '<|im_end|>' + nl }}"
    "{%- elif m.role == 'tool' %}{{ '<|im_start|>user' + nl + '<tool_response>' + nl }}"
    "{{ m.content + nl + '</tool_response><|im_end|>' + nl }}{% endif %}"
    "{%- endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant' + nl }}{% endif %}"
)


def set_chat_template(folder: Path, template: str) -> None:
    """Give the tokenizer in `folder` another chat template."""
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = template
    path.write_text(json.dumps(config, indent=1))


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
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))


def build_tiny_pair(
    out: str | Path,
    seed: int = 0,
    target_layers: int = 4,
    draft_layers: int = 1,
    block_size: int = 16,
    weight_scale: float = 4.0,
    **target_kw,
) -> tuple[Path, Path]:
    """Write a random qwen3 target (with tokenizer) and a matching random DFlash drafter."""
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
