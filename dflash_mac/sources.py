"""Where models come from: the package's own folder, local folders and the Hugging Face Hub.

Kept free of MLX so that `dflash-mac models` and `pull` start in a fraction of a second."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from . import models as _models_pkg
from .errors import LoadError

PACKAGE_MODELS = Path(_models_pkg.__file__).resolve().parent
BUNDLED_TARGET = PACKAGE_MODELS / "bundled" / "target"
BUNDLED_DRAFT = PACKAGE_MODELS / "bundled" / "dflash2"  # the default drafter (MODEL_CARD.md)
DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]


def missing_folder(name: str | os.PathLike) -> None:
    """Raise when `name` is written as a path (not a Hub id `org/name`) that does not exist."""
    text = str(name)
    pathlike = (
        isinstance(name, os.PathLike)
        or text.startswith(("/", ".", "~"))
        or (text.count("/") > 1 or "\\" in text)
    )
    if pathlike and not Path(text).expanduser().exists():
        raise LoadError(f"the folder {text} does not exist.")


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
