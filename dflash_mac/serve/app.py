"""OpenAI-compatible HTTP server (Starlette) over one DFlash `Session`.

`create_app(pair_or_session, api_key=None, ...)` returns the ASGI app; `dflash-mac serve`
(command.py) runs it with uvicorn. Generation happens on one worker thread (worker.py); the
handlers (routes.py) only validate, queue and stream (responses.py)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from dflash_mac.loading.registry import BUNDLED_TARGET, load_registry
from dflash_mac.pair import Pair
from dflash_mac.prefix.disk import DiskTier
from dflash_mac.session import Session
from dflash_mac.sizing.choice import BlockChoice, block_size_for
from dflash_mac.sizing.tuning import AutoTuning

from .answers import KeptAnswers
from .anthropic import AnthropicRoutes, error_body
from .cors import LOOPBACK_ORIGINS, cors
from .ollama import OllamaRoutes
from .requestlog import RequestLog
from .routes import Routes, Settings
from .schema import APIError
from .worker import Worker


def model_name(pair: Pair) -> str:
    """The id clients see: a Hub id as is, a local folder by its name."""
    path = Path(str(pair.model_id))
    if path.resolve() == BUNDLED_TARGET.resolve():
        return "dflash-mac-bundled"
    if entry := load_registry().find_target(pair.model_id):
        return entry.name if entry.file_spec else str(pair.model_id)  # not a pypi: string
    return path.name if path.exists() else str(pair.model_id)


async def api_error(request: Request, exc: Exception) -> Response:
    """Errors as OpenAI error objects; under /v1/messages (a wrong method, say) as Anthropic's,
    which is all its clients parse."""
    if isinstance(exc, HTTPException):
        exc = APIError(exc.status_code, str(exc.detail), kind="invalid_request_error")
    assert isinstance(exc, APIError)
    body = error_body(exc) if request.url.path.startswith("/v1/messages") else exc.body()
    return JSONResponse(body, status_code=exc.status, headers=getattr(exc, "headers", None))


def create_app(
    pair_or_session: Pair | Session,
    api_key: str | None = None,
    max_tokens: int = 4096,
    block: BlockChoice | None = None,
    default_temp: float = 0.0,
    max_queue: int = 8,
    prompt_cache_size: int = 4,
    prompt_cache_bytes: int | None = None,
    tuning: AutoTuning | None = None,
    cors_origins: tuple[str, ...] = LOOPBACK_ORIGINS,
    max_kv_size: int | None = None,
    prompt_cache_disk_bytes: int = 0,
    copy: bool | None = None,
    tree: int | None = None,
    max_batch: int = 1,
    suffix: bool | None = None,
) -> Starlette:
    """The ASGI app (see `routes.Settings` for the settings). `max_queue` requests may wait
    behind the running one, more get a 429; a pair gets a session whose prompt cache keeps
    `prompt_cache_size` conversations (`prompt_cache_bytes` at most) and whose `auto` starts
    from `tuning` (else what is saved for the pair). `block`: the block-size choice (default:
    `auto` up to the pair's default size). Browser pages from `cors_origins` (`cors.py`) may
    call every route; each request gets its log line (`requestlog.py`). `max_kv_size`: each
    cached conversation keeps a rotating window of that many target positions;
    `prompt_cache_disk_bytes` > 0: cached prefixes also go to disk (`prefix/disk.py`) and are
    read back after a restart. `max_batch` > 1: up to that many requests decode together
    (continuous batching, `batching/scheduler.py`). `suffix`: drafts from earlier answers (None:
    wherever copies run), which a disk tier keeps across restarts (`answers.py`)."""
    if isinstance(pair_or_session, Session):
        session = pair_or_session
    else:
        pair = pair_or_session
        disk = DiskTier.for_pair(pair, prompt_cache_disk_bytes) if prompt_cache_disk_bytes else None
        session = Session(pair, prompt_cache_size, prompt_cache_bytes, tuning, max_kv_size, disk)
    block = block or block_size_for(session.pair, None)
    kept = KeptAnswers(session.tuning.answers, session.cache.disk)
    logging.getLogger("dflash_mac.serve").info(kept.restore())
    worker = Worker(session, block, max_queue, copy, tree, max_batch, suffix)
    name = model_name(session.pair)
    routes = Routes(session, worker, name, Settings(api_key, max_tokens, block, default_temp))

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        worker.close()
        session.cache.close()  # pending disk writes
        kept.save()

    app = Starlette(
        routes=routes.table() + OllamaRoutes(routes).table() + AnthropicRoutes(routes).table(),
        lifespan=lifespan,
        middleware=[Middleware(RequestLog), *cors(cors_origins)],
        exception_handlers={APIError: api_error, HTTPException: api_error},
    )
    app.state.worker, app.state.session, app.state.model_name = worker, session, name
    return app
