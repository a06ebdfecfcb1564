"""Tiny random model pairs for the tests: the product's random pairs (`loading/random_pair.py`)
under their test names, plus a tool-calling chat template."""

from __future__ import annotations

import json
from pathlib import Path

from dflash_mac.loading.random_pair import (
    CHATML,
    SPECIALS,
    build_random_pair,
    draft_config,
    save_model,
    target_config,
    write_byte_tokenizer,
)

__all__ = [
    "CHATML",
    "CHATML_TOOLS",
    "SPECIALS",
    "build_tiny_pair",
    "draft_config",
    "save_model",
    "set_chat_template",
    "target_config",
    "write_byte_tokenizer",
]

build_tiny_pair = build_random_pair  # the tests' name

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
