"""Source generation: MLX's custom-kernel source, and the C++ the emulator compiles.

`mlx_kernel_source` ports MLX 0.32's `write_signature` / `write_template` (mlx/fast.cpp)
exactly; tests/metal_emu/test_shim.py checks it against MLX's own output.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

MAX_CONSTANT_ARRAY_SIZE = 8  # MLX: smaller inputs go in the constant address space
MLX_ATTRIBUTES = [  # (name, type) in the order MLX's metal_kernel emits them
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
]
TYPES = {  # mx dtype -> (Metal type string as MLX's get_type_string, numpy storage dtype)
    mx.float32: ("float", np.float32),
    mx.float16: ("float16_t", np.float16),
    mx.bfloat16: ("bfloat16_t", np.uint16),
    mx.bool_: ("bool", np.bool_),
    mx.int8: ("int8_t", np.int8),
    mx.int16: ("int16_t", np.int16),
    mx.int32: ("int32_t", np.int32),
    mx.int64: ("int64_t", np.int64),
    mx.uint8: ("uint8_t", np.uint8),
    mx.uint16: ("uint16_t", np.uint16),
    mx.uint32: ("uint32_t", np.uint32),
    mx.uint64: ("uint64_t", np.uint64),
}


def type_string(dtype: Any) -> str:
    if dtype not in TYPES:
        raise ValueError(f"dtype {dtype} is not supported by the emulator")
    return TYPES[dtype][0]


def _template_value(value: Any) -> tuple[str, str]:
    if isinstance(value, bool):
        return "bool", str(int(value))
    if isinstance(value, int):
        return "int", str(value)
    return "typename", type_string(value)


def mlx_kernel_source(
    name: str,
    input_names: Sequence[str],
    output_names: Sequence[str],
    source: str,
    header: str,
    inputs: Sequence[mx.array],
    output_dtypes: Sequence[Any],
    template: Sequence[tuple[str, Any]],
    atomic_outputs: bool = False,
) -> tuple[str, str]:
    """(kernel name, full source) exactly as MLX's metal_kernel generates them."""
    tvals = [(n, *_template_value(v)) for n, v in template]
    kernel_name = f"custom_kernel_{name}"
    template_def = ""
    if tvals:
        template_def = "<" + ", ".join(v for _, _, v in tvals) + ">"
        kernel_name += "_" + re.sub(r"<|>|(, )", "_", template_def)[:-1]
    for a in inputs:
        kernel_name += "_" + type_string(a.dtype)
        kernel_name += "s" if a.ndim == 0 else ("c" if a.size < MAX_CONSTANT_ARRAY_SIZE else "")
    for d in output_dtypes:
        kernel_name += "_" + type_string(d)
    attrs = [f"  {t} {a} [[{a}]]" for a, t in MLX_ATTRIBUTES if a in source]
    text = header
    if tvals:
        text += "template <" + ", ".join(f"{k} {n}" for n, k, _ in tvals) + ">\n"
    text += f"[[kernel]] void {kernel_name}(\n"
    index = 0
    for n, a in zip(input_names, inputs):
        loc = "constant" if a.size < MAX_CONSTANT_ARRAY_SIZE else "device"
        ref = "&" if a.ndim == 0 else "*"
        text += f"  const {loc} {type_string(a.dtype)}{ref} {n} [[buffer({index})]],\n"
        index += 1
        if a.ndim > 0:
            for suffix, decl in (("_shape", "int*"), ("_strides", "int64_t*"), ("_ndim", "int&")):
                if n + suffix in source:
                    text += f"  const constant {decl} {n}{suffix} [[buffer({index})]],\n"
                    index += 1
    for n, d in zip(output_names, output_dtypes):
        t = f"atomic<{type_string(d)}>" if atomic_outputs else type_string(d)
        text += f"  device {t}* {n} [[buffer({index})]]"
        last = not (index < len(inputs) + len(output_names) - 1 or attrs)
        text += ") {\n" if last else ",\n"
        index += 1
    for i, attr in enumerate(attrs):
        text += attr + (",\n" if i < len(attrs) - 1 else ") {\n")
    text += source + "\n}\n"
    if tvals:
        full = kernel_name + template_def
        text += f'\ntemplate [[host_name("{kernel_name}")]] [[kernel]] decltype({full}) {full};\n'
    return kernel_name, text


_TG_VAR = re.compile(
    r"\bthreadgroup\s+(?P<type>[A-Za-z_][\w:<>, ]*?)\s+(?P<name>[A-Za-z_]\w*)\s*"
    r"(?P<dims>(?:\[[^\]\[;]*\]\s*)*);"
)
_TG_PTR = re.compile(r"\bthreadgroup\b(?=\s+[A-Za-z_][\w:<>, ]*?\s*[*&])")


def strip_comments(text: str) -> str:
    """Drop // and /* */ comments, keeping line numbers."""
    return re.sub(r"//[^\n]*|/\*.*?\*/", lambda m: "\n" * m[0].count("\n"), text, flags=re.S)


def lower_address_spaces(text: str) -> str:
    """Lower `threadgroup`: variables -> EMU_THREADGROUP_VAR, pointer qualifiers -> dropped.
    Any other use is left as an undefined name so compilation fails."""
    counter = iter(range(1, 1 << 30))
    text = strip_comments(text)

    def var(m: re.Match) -> str:
        typ = m["type"] + "".join(re.findall(r"\[[^\]]*\]", m["dims"]))
        return f"EMU_THREADGROUP_VAR({m['name']}, {next(counter)}, {typ});"

    text = _TG_VAR.sub(var, text)
    text = _TG_PTR.sub("", text)
    return re.sub(r"\bthreadgroup\b", "EMU_UNSUPPORTED_threadgroup_use", text)


def translation_unit(
    kernel_name: str,
    mlx_source: str,
    input_names: Sequence[str],
    inputs: Sequence[mx.array],
    output_dtypes: Sequence[Any],
    source: str,
    template: Sequence[tuple[str, Any]],
) -> str:
    """C++ for g++: the shim, the lowered MLX source, and a per-thread launcher."""
    args = []
    for i, (n, a) in enumerate(zip(input_names, inputs)):
        t = type_string(a.dtype)
        if a.ndim == 0:
            args.append(f"*static_cast<const {t}*>(b[{i}].data)")
            continue
        args.append(f"static_cast<const {t}*>(b[{i}].data)")
        for suffix, expr in (("_shape", "shape"), ("_strides", "strides"), ("_ndim", "ndim")):
            if n + suffix in source:
                args.append(f"b[{i}].{expr}")
    for j, d in enumerate(output_dtypes):
        args.append(f"static_cast<{type_string(d)}*>(b[{len(inputs) + j}].data)")
    for a, t in MLX_ATTRIBUTES:
        if a in source:
            args.append(f"emu_uint3(id->{a})" if t == "uint3" else f"id->{a}")
    targs = ""
    if template:
        targs = "<" + ", ".join(_template_value(v)[1] for _, v in template) + ">"
    call = f"{kernel_name}{targs}(\n      " + ",\n      ".join(args) + ")"
    body_at = mlx_source.rindex(source)  # make diagnostics point into the body file
    mlx_source = f'{mlx_source[:body_at]}#line 1 "{kernel_name}.metal"\n{mlx_source[body_at:]}'
    return (
        '#include "metal_shim.h"\n'
        "namespace {\n"
        f"{lower_address_spaces(mlx_source)}\n"
        "}  // namespace\n\n"
        'extern "C" void emu_kernel_thread(const EmuBuffer* b, const EmuThreadIds* id) {\n'
        f"  (void)b;\n  (void)id;\n  {call};\n}}\n"
    )
