"""Which browser origins may call the server (CORS): `serve --cors-origins`, loopback pages by
default, answered by Starlette's `CORSMiddleware` (preflights included) on every route."""

from __future__ import annotations

import re

from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware

from dflash_mac.errors import UserError

# Pages served from this machine (a local web UI on any port); `:*` is any port or none.
LOOPBACK_ORIGINS = ("http://localhost:*", "http://127.0.0.1:*", "http://[::1]:*")
ORIGIN = re.compile(r"https?://[^/\s]+")


class OriginError(UserError, ValueError):
    """A `--cors-origins` entry that is not an origin."""


def parse_origins(text: str | None) -> tuple[str, ...]:
    """`--cors-origins`: comma-separated origins (`*` matches any run of characters in the
    host, `:*` any port or none), `*` for every origin, `none` for no CORS; None: loopback."""
    if text is None:
        return LOOPBACK_ORIGINS
    entries = tuple(e.strip().rstrip("/") for e in text.split(",") if e.strip())
    if entries in ((), ("none",)):
        return ()
    for entry in entries:
        if entry != "*" and not ORIGIN.fullmatch(entry):
            raise OriginError(
                f"--cors-origins: {entry!r} is not an origin like http://localhost:3000 "
                "(or *, or none)."
            )
    return entries


def origin_pattern(origins: tuple[str, ...]) -> str:
    """One regular expression for the origins (with their wildcards)."""

    def one(origin: str) -> str:
        escaped = re.escape(origin).replace(r":\*", r"(?::\d+)?")
        return escaped.replace(r"\*", r"[^/]*")

    return "|".join(one(o) for o in origins)


def cors(origins: tuple[str, ...]) -> list[Middleware]:
    """The middleware for these origins ([] for none): any method and header, and the
    `Retry-After` of a 429 readable by the page."""
    if not origins:
        return []
    every = "*" in origins
    return [
        Middleware(
            CORSMiddleware,
            allow_origins=["*"] if every else [],
            allow_origin_regex=None if every else origin_pattern(origins),
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=["Retry-After"],
        )
    ]
