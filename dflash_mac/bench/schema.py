"""The bench report's JSON schema (`dflash-mac-bench/1`) and a validator for the subset of JSON
Schema it uses; no dependency on a schema library."""

from __future__ import annotations

from typing import Any

SCHEMA_ID = "dflash-mac-bench/2"  # /2: `auto` is the block size "auto" (it was 0)

_NUM = {"type": "number"}
_INT = {"type": "integer"}
_PAIR = {"type": "array", "items": _NUM, "minItems": 2, "maxItems": 2}
_INTS = {"type": "array", "items": _INT}
_BS = {"type": ["integer", "string"]}  # a fixed size or "auto"
_NUMS = {"type": "array", "items": _NUM}
_RUN = {
    "type": "object",
    "required": [
        "generation_tokens",
        "decode_tokens",
        "decode_time_s",
        "decode_tps",
        "ttft_s",
        "prefill_tps",
        "peak_memory_bytes",
        "finish_reason",
        "tokens",
    ],
    "properties": {
        "generation_tokens": _INT,
        "decode_tps": _NUM,
        "ttft_s": _NUM,
        "tokens": _INTS,
        "finish_reason": {"type": "string"},
    },
}
_DFLASH_RUN = {
    "type": "object",
    "required": [
        *_RUN["required"],
        "block_size",
        "tau",
        "cycles",
        "acceptance_lengths",
        "histogram",
        "lossless",
    ],
    "properties": {
        **_RUN["properties"],
        "block_size": _BS,
        "tau": _NUM,
        "cycles": _INT,
        "acceptance_lengths": _INTS,
        "histogram": _INTS,
        "lossless": {"type": ["boolean", "null"]},
        "first_diff": {"type": ["integer", "null"]},
    },
}
_ROW = {
    "type": "object",
    "required": [
        "block_size",
        "suite",
        "prompts",
        "trials",
        "runs",
        "baseline_tps",
        "dflash_tps",
        "speedup",
        "tau",
        "cycles",
        "histogram",
        "survival",
        "position_acceptance",
        "baseline_prefill_tps",
        "dflash_prefill_tps",
        "baseline_ttft_ms",
        "dflash_ttft_ms",
        "baseline_peak_bytes",
        "dflash_peak_bytes",
        "lossless_equal",
        "lossless_checked",
    ],
    "properties": {
        "block_size": _BS,
        "suite": {"type": "string"},
        "prompts": _INT,
        "baseline_tps": _PAIR,
        "dflash_tps": _PAIR,
        "speedup": _PAIR,
        "speedup_ci": _PAIR,
        "tau": _PAIR,
        "eta": _NUM,
        "histogram": _INTS,
        "survival": _NUMS,
        "position_acceptance": _NUMS,
        "lossless_equal": {"type": ["integer", "null"]},
        "lossless_checked": {"type": ["integer", "null"]},
    },
}
SCHEMA: dict = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "dflash-mac bench report",
    "type": "object",
    "required": ["schema", "header", "config", "rows", "best_block_size", "lossless", "prompts"],
    "properties": {
        "schema": {"enum": [SCHEMA_ID, "dflash-mac-bench/1"]},  # /1 files still read
        "header": {
            "type": "object",
            "required": [
                "machine",
                "os",
                "mlx",
                "mlx_lm",
                "device",
                "blas",
                "target",
                "draft",
                "drafter_kind",
                "target_quantization",
                "draft_quantization",
                "dtype",
                "drafter_weight_bytes",
                "date",
                "dflash_mac",
                "definitions",
            ],
            "properties": {
                "blas": {"type": "string"},
                "device": {"type": "string"},
                "drafter_weight_bytes": _INT,
                "definitions": {"type": "object"},
            },
        },
        "config": {
            "type": "object",
            "required": [
                "suite",
                "prompts_file",
                "trials",
                "max_tokens",
                "block_sizes",
                "temp",
                "seed",
                "use_eos",
                "cooldown_s",
            ],
            "properties": {
                "block_sizes": {"type": "array", "items": _BS},
                "trials": _INT,
                "max_tokens": _INT,
            },
        },
        "rows": {"type": "array", "items": _ROW, "minItems": 1},
        "best_block_size": {"type": ["integer", "string", "null"]},
        "auto_vs_fixed": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["block_size", "ratio", "ci"],
                "properties": {"block_size": _BS, "ratio": {"type": "number"}, "ci": _PAIR},
            },
        },
        "lossless": {
            "type": "object",
            "required": ["checked", "equal", "mismatches"],
            "properties": {
                "checked": {"type": ["integer", "null"]},
                "equal": {"type": ["integer", "null"]},
                "mismatches": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["id", "trial", "block_size", "first_diff"],
                    },
                },
            },
        },
        "prompts": {
            "type": "array",
            "items": {
                "type": "object",
                "required": [
                    "id",
                    "suite",
                    "trial",
                    "position",
                    "prompt_tokens",
                    "baseline",
                    "dflash",
                ],
                "properties": {"baseline": _RUN, "dflash": {"type": "array", "items": _DFLASH_RUN}},
            },
        },
    },
}

_TYPES = {
    "object": dict,
    "array": list,
    "string": str,
    "boolean": bool,
    "null": type(None),
    "integer": int,
    "number": (int, float),
}


def validate(doc: Any, schema: dict = SCHEMA, path: str = "$") -> list[str]:
    """Errors of `doc` against the JSON-schema subset used by SCHEMA (type, enum, required,
    properties, items, minItems, maxItems)."""
    errors = []
    types = schema.get("type")
    if types is not None:
        names = types if isinstance(types, list) else [types]
        ok = any(
            isinstance(doc, _TYPES[t])
            and not (t in ("integer", "number") and isinstance(doc, bool))
            for t in names
        )
        if not ok:
            return [f"{path}: expected {'/'.join(names)}, got {type(doc).__name__}"]
    if "enum" in schema and doc not in schema["enum"]:
        errors.append(f"{path}: {doc!r} not in {schema['enum']}")
    if isinstance(doc, dict):
        errors += [f"{path}: missing {k!r}" for k in schema.get("required", []) if k not in doc]
        for k, sub in schema.get("properties", {}).items():
            if k in doc:
                errors += validate(doc[k], sub, f"{path}.{k}")
    if isinstance(doc, list):
        if len(doc) < schema.get("minItems", 0):
            errors.append(f"{path}: fewer than {schema['minItems']} items")
        if len(doc) > schema.get("maxItems", len(doc)):
            errors.append(f"{path}: more than {schema['maxItems']} items")
        if "items" in schema:
            for i, item in enumerate(doc):
                errors += validate(item, schema["items"], f"{path}[{i}]")
    return errors
