"""Training corpus for the bundled model: the Python standard library's own source.

Whole modules are held out for evaluation by a deterministic hash of the module name, so the
split depends only on the module names (and therefore only on the Python version whose stdlib
is read). Every module yields plain code text; every function or method of reasonable size also
yields a chat-shaped example (user: "write function X: <docstring line>", assistant: its source).
"""

from __future__ import annotations

import ast
import hashlib
import json
import sysconfig
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

HELDOUT_PERCENT = 5
SKIP_DIRS = {
    "test",
    "tests",
    "idle_test",
    "site-packages",
    "dist-packages",
    "idlelib",
    "tkinter",
    "turtledemo",
    "__pycache__",
    "pydoc_data",
    "_bundled",
    "lib2to3",
    "ensurepip",
}
# v2 (long-context target): more of the stdlib; tests, vendored and data files stay out
SKIP_DIRS_V2 = SKIP_DIRS - {"idlelib", "tkinter", "turtledemo", "lib2to3"}
MAX_FILE_BYTES = 150_000
MAX_FUNC_CHARS = 2_400
MAX_FUNC_LINES = 60
MIN_FUNC_LINES = 3

IM_START, IM_END, EOT, MASK = "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|mask|>"
SPECIAL_TOKENS = [EOT, IM_START, IM_END, MASK]


@dataclass(frozen=True)
class Module:
    """One stdlib module: dotted name and source text."""

    name: str
    source: str


@dataclass(frozen=True)
class ChatExample:
    """A chat-shaped example derived from one function of one module."""

    id: str
    module: str
    user: str
    assistant: str

    def messages(self, with_answer: bool = True) -> list[dict[str, str]]:
        """Return the example as a chat message list."""
        msgs = [{"role": "user", "content": self.user}]
        if with_answer:
            msgs.append({"role": "assistant", "content": self.assistant})
        return msgs


def stdlib_dir() -> Path:
    """Directory of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def module_name(rel: Path) -> str:
    """Dotted module name of a path relative to the stdlib root."""
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def is_heldout(name: str) -> bool:
    """Deterministic, hash-based choice of ~HELDOUT_PERCENT% of modules held out for eval."""
    h = int(hashlib.sha256(name.encode()).hexdigest()[:8], 16)
    return h % 100 < HELDOUT_PERCENT


def iter_modules(root: Path | None = None, skip: set[str] = SKIP_DIRS) -> Iterator[Module]:
    """Yield stdlib modules in sorted path order (deterministic), skipping tests and big files."""
    root = root or stdlib_dir()
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(p in skip or p.startswith("test_") for p in rel.parts):
            continue
        if rel.parts[0] == "encodings" and rel.name not in {"__init__.py", "aliases.py"}:
            continue  # codec tables: mostly numbers
        try:
            data = path.read_bytes()
        except OSError:
            continue
        if len(data) > MAX_FILE_BYTES:
            continue
        text = data.decode("utf-8", errors="replace").replace("\r\n", "\n")
        yield Module(module_name(rel), text)


def split_modules(
    root: Path | None = None, extended: bool = False
) -> tuple[list[Module], list[Module]]:
    """Return (train, heldout) module lists (``extended``: the v2 corpus, more directories;
    the hash split keeps every v1 held-out module held out)."""
    train, heldout = [], []
    for mod in iter_modules(root, SKIP_DIRS_V2 if extended else SKIP_DIRS):
        (heldout if is_heldout(mod.name) else train).append(mod)
    return train, heldout


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    return f"{node.name}({ast.unparse(node.args)})"


FuncNode = ast.FunctionDef | ast.AsyncFunctionDef


def _iter_functions(tree: ast.Module) -> Iterator[tuple[str, FuncNode]]:
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield "", node
        elif isinstance(node, ast.ClassDef):
            for sub in node.body:
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield node.name, sub


def chat_examples(mod: Module) -> list[ChatExample]:
    """Chat examples for each function/method of a module with a usable size."""
    try:
        tree = ast.parse(mod.source)
    except (SyntaxError, ValueError):
        return []
    lines = mod.source.splitlines()
    out = []
    for cls, node in _iter_functions(tree):
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        seg = "\n".join(lines[first - 1 : node.end_lineno])
        body = textwrap.dedent(seg).strip("\n")
        n_lines = body.count("\n") + 1
        if not (MIN_FUNC_LINES <= n_lines <= MAX_FUNC_LINES) or len(body) > MAX_FUNC_CHARS:
            continue
        sig = _signature(node)
        what = f"method `{cls}.{sig}`" if cls else f"function `{sig}`"
        doc = (ast.get_docstring(node) or "").strip().split("\n")[0].strip()
        user = f"In the Python module `{mod.name}`, write the {what}."
        if doc:
            user = f"{user[:-1]}: {doc}"
        qual = f"{cls}.{node.name}" if cls else node.name
        out.append(ChatExample(f"{mod.name}:{qual}:{node.lineno}", mod.name, user, body))
    return out


def render_chat(messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """Render messages with the ChatML template used by the bundled tokenizer."""
    text = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
    if add_generation_prompt:
        text += f"{IM_START}assistant\n"
    return text


def training_documents(modules: list[Module]) -> Iterator[str]:
    """Pretraining documents: every module's code, then every chat example, EOT-terminated."""
    for mod in modules:
        yield f"# module: {mod.name}\n{mod.source.strip()}\n{EOT}"
    for mod in modules:
        for ex in chat_examples(mod):
            yield render_chat(ex.messages()) + EOT


def write_prompts_jsonl(
    modules: list[Module], path: Path, limit: int | None = None, stride: int = 1
) -> int:
    """Write chat prompts (user turn only) from ``modules`` to JSONL; return the count.

    Every ``stride``-th example is kept, up to ``limit``, in deterministic order. Each line is
    ``{"id": ..., "module": ..., "messages": [{"role": "user", "content": ...}]}``.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with path.open("w", encoding="utf-8") as f:
        i = 0
        for mod in modules:
            for ex in chat_examples(mod):
                i += 1
                if (i - 1) % stride:
                    continue
                rec = {"id": ex.id, "module": ex.module, "messages": ex.messages(False)}
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
                n += 1
                if limit is not None and n >= limit:
                    return n
    return n


def train_prompts_jsonl(path: Path, limit: int = 4000) -> int:
    """Drafter-training prompts: chat prompts from TRAIN modules, evenly spread, ``limit`` max."""
    train, _ = split_modules()
    total = sum(len(chat_examples(m)) for m in train)
    return write_prompts_jsonl(train, path, limit=limit, stride=max(1, total // limit))


def cached_train_prompts(cache: Path) -> Path:
    """``<cache>/train_prompts.jsonl`` (written by the corpus stage; written here if missing)."""
    path = cache / "train_prompts.jsonl"
    if not path.exists():
        train_prompts_jsonl(path)
    return path


def eval_prompts_jsonl(path: Path, limit: int = 32) -> int:
    """Held-out evaluation prompts: chat prompts from HELD-OUT modules, evenly spread."""
    _, heldout = split_modules()
    total = sum(len(chat_examples(m)) for m in heldout)
    return write_prompts_jsonl(heldout, path, limit=limit, stride=max(1, total // limit))


def long_context_prompts(
    modules: list[Module],
    limit: int,
    min_chars: int = 2_000,
    max_chars: int = 6_000,
    seed: int = 0,
) -> list[dict]:
    """Chat prompts with a long context: part of a module's source, then a request to write one
    of its functions (the shape of a chat that pastes a file and asks for code).

    The source is cut at a line boundary to ``min_chars..max_chars`` characters (about
    500-1,700 tokens), ending before the requested function."""
    import random

    rng = random.Random(seed)
    pool = [(m, ex) for m in modules for ex in chat_examples(m) if len(m.source) > min_chars]
    rng.shuffle(pool)
    out = []
    for mod, ex in pool:
        line = int(ex.id.rsplit(":", 1)[1])
        lines = mod.source.splitlines()
        before = "\n".join(lines[: line - 1])
        if len(before) < min_chars:
            before = "\n".join(lines)
        want = rng.randint(min_chars, max_chars)
        ctx = before[-want:]
        ctx = ctx[ctx.find("\n") + 1 :] if "\n" in ctx else ctx
        user = f"Here is part of the Python module `{mod.name}`:\n\n{ctx}\n\n{ex.user}"
        out.append(
            {
                "id": f"long:{ex.id}",
                "module": mod.name,
                "messages": [{"role": "user", "content": user}],
            }
        )
        if len(out) >= limit:
            break
    return out


def write_jsonl(path: Path, rows: list[dict]) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return len(rows)
