"""The package's import graph: no cycles, and dependencies point one way.

Layers, bottom up: metal_kernels (imports nothing of ours) → models (may use metal_kernels) →
the engine (dflash_mac's own folders and the modules at its top) → distributed (plugs into the
engine from above, through `pair.Mirror`) → front ends (cli, serve, bench, app, train, bundle).
Every import counts, including those inside functions.

Inside the engine layer the folders have floors of their own (docs/architecture.md): the leaves
at the top of dflash_mac (pair, settings, errors, host) under everything, target/ (the mlx-lm
target's parts, hooks, captures, rollback) under loading/ and drafting/, those under sizing/
(no MLX of its own), sizing/ under engine/ (the decode loop), engine/ under batching/ and
prefix/, and those under the modules at the top that front ends call (api, session, prepare,
calibrate, ...). Collapsed to folders (each module at the top its own node) the graph has no
cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {
    "dflash_mac": "dflash_mac",
    "models": "dflash_mac.models",
    "metal_kernels": "dflash_mac.metal_kernels",
    "app": "dflash_mac.app",
}
FRONT_ENDS = ("__main__", "entry", "cli", "serve", "bench", "app", "train", "bundle")
# what each engine folder may not reach, directly or through other modules: what sits above it
# (or beside it: loading and drafting know nothing of each other, nor batching and prefix), and
# the modules at the top of dflash_mac that front ends call (`TOP`)
ABOVE = {
    "target": ("loading", "drafting", "sizing", "engine", "batching", "prefix"),
    "loading": ("drafting", "sizing", "engine", "batching", "prefix"),
    "drafting": ("loading", "sizing", "engine", "batching", "prefix"),
    "sizing": ("target", "engine", "batching", "prefix"),
    "engine": ("batching", "prefix"),
    "batching": ("prefix",),
    "prefix": ("batching",),
}
TOP = ("api", "session", "prepare", "calibrate", "draft_vocab", "answers", "prompts")
# the modules at the top that every folder may use: they import only each other and models/
LEAVES = ("pair", "settings", "errors", "host")


def modules() -> dict[str, Path]:
    """Module name → file, for every .py file under the four installed folders."""
    out = {}
    for folder, namespace in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([namespace, *parts])] = path
    return out


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ours that `name` imports, at module level or inside functions."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                head = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(head + ([base] if base else []))
            # `from pkg import submodule` imports the submodule; otherwise the module itself
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known]
            targets = subs or [base]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import a.b.c` of a name: nearest module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def external_imports(path: Path) -> set[str]:
    """The absolute modules a file imports (ours and others'), at any depth of its code."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module)
    return found


def layer(name: str) -> int:
    parts = name.split(".")
    if parts[1:2] == ["metal_kernels"]:
        return 0
    if parts[1:2] == ["models"]:
        return 1
    if parts[1:2] == ["distributed"]:
        return 3
    if len(parts) > 1 and parts[1] in FRONT_ENDS:
        return 4
    return 2  # the engine: dflash_mac's own folders (target, loading, sizing, ...) and top


LAYER_NAMES = ["metal_kernels", "models", "the engine", "distributed", "a front end"]
# what loading may not reach, directly or through another module: the decode loop and above
NOT_FROM_LOADING = (
    "dflash_mac.target.capture",
    "dflash_mac.engine.decode",
    "dflash_mac.sizing.choice",
    "dflash_mac.sizing.controller",
    "dflash_mac.calibrate",
    "dflash_mac.session",
    "dflash_mac.api",
)


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path of module names, or None."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycles(graph):
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " → ".join(cycle)


def test_dependencies_point_down(graph):
    upward = [
        f"{src} ({LAYER_NAMES[layer(src)]}) imports {dst} ({LAYER_NAMES[layer(dst)]})"
        for src, dsts in graph.items()
        for dst in dsts
        if layer(dst) > layer(src)
    ]
    assert upward == []


def test_kernels_import_nothing_of_ours(graph):
    assert {
        src: sorted(d for d in dsts if not d.startswith("dflash_mac.metal_kernels"))
        for src, dsts in graph.items()
        if src.startswith("dflash_mac.metal_kernels")
    } == {src: [] for src in graph if src.startswith("dflash_mac.metal_kernels")}


def test_product_code_imports_nothing_of_the_tests():
    """Test helpers are not the product: they live in tests/helpers, and no installed module
    imports them (nor anything else of tests/)."""
    found = {
        name: sorted(m for m in external_imports(path) if m.split(".")[0] in ("helpers", "tests"))
        for name, path in modules().items()
    }
    assert {name: ms for name, ms in found.items() if ms} == {}
    assert not (ROOT / "dflash_mac" / "testing").exists()


def test_engine_imports_nothing_of_distributed(graph):
    """Distribution plugs in from above (`pair.mirror`): no engine module imports it."""
    found = [
        f"{src} imports {dst}"
        for src, dsts in sorted(graph.items())
        if layer(src) == 2
        for dst in sorted(dsts)
        if layer(dst) == 3
    ]
    assert found == []


def reachable(graph: dict[str, set[str]], src: str) -> set[str]:
    """Every module `src` imports, directly or through others."""
    seen: set[str] = set()
    todo = [src]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen - {src}


def import_path(graph: dict[str, set[str]], src: str, dst: str) -> list[str] | None:
    """The shortest chain of imports from `src` to `dst`, or None."""
    came: dict[str, str] = {src: ""}
    todo = [src]
    while todo:
        node = todo.pop(0)
        if node == dst:
            path = [dst]
            while came[path[-1]]:
                path.append(came[path[-1]])
            return path[::-1]
        for nxt in sorted(graph.get(node, ())):
            if nxt not in came:
                came[nxt] = node
                todo.append(nxt)
    return None


def in_folder(name: str, folder: str) -> bool:
    return name.startswith(f"dflash_mac.{folder}.")


def test_loading_imports_nothing_of_the_decode_loop(graph):
    """Loading a pair needs none of the decode loop, directly or through another module."""
    found = [
        " → ".join(path)
        for src in sorted(graph)
        if in_folder(src, "loading")
        for dst in NOT_FROM_LOADING
        if (path := import_path(graph, src, dst))
    ]
    assert found == []


def test_engine_folders_reach_nothing_above_them(graph):
    """Each engine folder reaches nothing of the folders above it (`ABOVE`), directly or
    through another module: loading/ none of the loop, sizing/ none of the engine that consults
    it (the calibration that drives the loop lives above both: dflash_mac/calibrate.py)."""
    found = []
    top = {f"dflash_mac.{m}" for m in TOP}
    for folder, above in ABOVE.items():
        for src in sorted(n for n in graph if in_folder(n, folder)):
            reach = reachable(graph, src)
            hits = sorted(d for d in reach if any(in_folder(d, a) for a in above) or d in top)
            found += [" → ".join(import_path(graph, src, d)) for d in hits[:1]]
    assert found == []


def test_leaves_import_only_leaves_and_models(graph):
    """pair, settings, errors and host sit under every folder: they import nothing else of ours
    but models/ (settings takes `SamplingParams` from models/distribution.py, not the engine)."""
    leaves = {f"dflash_mac.{m}" for m in LEAVES}
    found = [
        f"{src} imports {dst}"
        for src in sorted(leaves)
        for dst in sorted(graph[src])
        if dst not in leaves and not dst.startswith("dflash_mac.models")
    ]
    assert found == []


def test_sizing_imports_no_mlx_itself(graph):
    """sizing/ decides from numbers: none of its modules imports MLX or mlx-lm itself."""
    found = [
        f"{src} imports {ext}"
        for src, path in sorted(modules().items())
        if in_folder(src, "sizing")
        for ext in sorted(external_imports(path))
        if ext.split(".")[0] in ("mlx", "mlx_lm")
    ]
    assert found == []


def test_the_engine_reads_no_file_of_sizing(graph):
    """`auto`'s files (sizing/files.py) are the front ends' to load and save: nothing in the
    decode loop or the batch scheduler reaches them (the engine reads no file while it
    decodes)."""
    found = [
        " → ".join(import_path(graph, src, "dflash_mac.sizing.files"))
        for src in sorted(graph)
        if in_folder(src, "engine") or in_folder(src, "batching")
        if "dflash_mac.sizing.files" in reachable(graph, src)
    ]
    assert found == []


def folder_of(name: str) -> str:
    """A module's folder below dflash_mac (`dflash_mac.engine`, `dflash_mac.models`, ...); a
    module at the top of dflash_mac is its own node."""
    return ".".join(name.split(".")[:2])


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The import graph collapsed to folders (`folder_of`), without self-edges."""
    out: dict[str, set[str]] = {}
    for src, dsts in graph.items():
        a = folder_of(src)
        out.setdefault(a, set())
        out[a] |= {b for d in dsts if (b := folder_of(d)) != a}
    return out


def test_folders_form_no_cycle(graph):
    """Issue 54: folders that show the design. No two folders (nor a folder and a module at the
    top) import each other, even through different modules: the engine consults sizing/, so
    the calibration that drives the engine is no part of sizing/; prefix/ builds on the
    engine, so the engine types the prompt cache's recorder itself (`state.Recorder`)."""
    cycle = find_cycle(folder_graph(graph))
    assert cycle is None, "folder cycle: " + " → ".join(cycle)


def test_the_checker_sees_cycles_and_upward_imports():
    """Negative control: a planted cycle and an upward import are reported."""
    planted = {"dflash_mac.a": {"dflash_mac.b"}, "dflash_mac.b": {"dflash_mac.a"}}
    assert find_cycle(planted) == ["dflash_mac.a", "dflash_mac.b", "dflash_mac.a"]
    assert (
        layer("dflash_mac.models.dflash")
        < layer("dflash_mac.engine.verify")
        < layer("dflash_mac.distributed.leader")
        < layer("dflash_mac.serve.app")
    )
    loader, decode = "dflash_mac.loading.loader", "dflash_mac.engine.decode"
    chain = {loader: {"dflash_mac.x"}, "dflash_mac.x": {decode}}
    assert import_path(chain, loader, decode) == [loader, "dflash_mac.x", decode]
    assert reachable(chain, loader) == {"dflash_mac.x", decode}
    # modules that form no cycle, in folders that do
    split = {
        "dflash_mac.engine.decode": {"dflash_mac.sizing.choice"},
        "dflash_mac.sizing.calibrate": {"dflash_mac.engine.cycle"},
    }
    assert find_cycle(split) is None
    assert find_cycle(folder_graph(split)) == [
        "dflash_mac.engine",
        "dflash_mac.sizing",
        "dflash_mac.engine",
    ]


def test_function_level_imports_count(tmp_path):
    """An import hidden in a function body is an edge like any other."""
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from dflash_mac.serve import app\n")
    known = {"dflash_mac.m": src, "dflash_mac.serve": src, "dflash_mac.serve.app": src}
    assert imports_of("dflash_mac.m", src, known) == {"dflash_mac.serve.app"}


def front_end_of(name: str) -> str | None:
    parts = name.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 and parts[1] in FRONT_ENDS else None


def test_front_end_packages_import_each_other_one_way(graph):
    """Issue 54: `cli/servers.py` imported `serve.command` while `serve/command.py` imported
    `cli`, a cycle between the two packages that no module-level check sees. Collapsed to
    their packages, the front ends form no cycle (`serve`, `bench`, `app`, `train` use `cli`'s
    shared helpers; `cli` names the others' commands only as strings, imported when run)."""
    packages: dict[str, set[str]] = {}
    for src, dsts in graph.items():
        if (a := front_end_of(src)) is None:
            continue
        packages.setdefault(a, set())
        packages[a] |= {b for d in dsts if (b := front_end_of(d)) not in (None, a)}
    cycle = find_cycle(packages)
    assert cycle is None, "front-end package cycle: " + " → ".join(cycle)


def test_scripts_import_names_that_exist():
    """Every `from dflash_mac… import name` in scripts/ resolves: a module moved or a name
    renamed must take the scripts along (cpu_costs.py and compare_drafters.py kept importing
    `propose` from the module it left)."""
    import importlib

    missing = []
    for path in sorted((ROOT / "scripts").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dflash_mac"):
                module = importlib.import_module(node.module)
                for alias in node.names:
                    found = hasattr(module, alias.name)
                    try:
                        found = found or bool(
                            importlib.import_module(f"{node.module}.{alias.name}")
                        )
                    except ImportError:
                        pass
                    if not found:
                        missing.append(f"{path.name}: {node.module}.{alias.name}")
    assert not missing, missing
