"""The one generation thread behind `dflash-mac serve`, its jobs and its metrics.

All MLX work (tokenizing, prefill, decode) runs on this thread, in arrival order; request
handlers talk to it through `Job` queues on the event loop. With `max_batch` > 1 (and a pair
that batches, `batching.ragged.batch_reason`) up to that many requests decode together in one
`batching.scheduler.BatchEngine` (structured output included: its rows take plain steps)."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from dflash_mac.api import PromptError, fit_max_tokens, make_config
from dflash_mac.batching.ragged import batch_reason
from dflash_mac.batching.scheduler import BatchEngine, BatchRequest
from dflash_mac.distributed.group import lost_peer_message
from dflash_mac.engine.think import prompt_opens_think
from dflash_mac.models.penalties import check_bias_token
from dflash_mac.session import Session
from dflash_mac.settings import AUTO
from dflash_mac.sizing.choice import BlockChoice, block_size_for
from dflash_mac.sizing.files import save_acceptance

from .logprobs import entries
from .metrics import Metrics, summary
from .schema import APIError, GenRequest, field_name

log = logging.getLogger("dflash_mac.serve")


@dataclass
class Ready:
    """Sent once the prompt is tokenized and fits: the response can start."""

    prompt_tokens: int
    think_open: bool


class QueueFull(APIError):
    """429: more requests are waiting than the server queues (`serve --max-queue`)."""

    def __init__(self, waiting: int, retry_after: int):
        super().__init__(
            429,
            f"the server is busy: {waiting} requests are already waiting; retry in "
            f"{retry_after} s.",
            code="queue_full",
            kind="rate_limit_error",
        )
        self.headers = {"Retry-After": str(retry_after)}


class Job:
    """One request's link to the worker: a cancel flag and a queue of (kind, payload) items.

    Kinds: "ready" (Ready), "logprobs" (the next text's `logprobs.entries`, when asked),
    "text" ((text, finish_reason)), "done" (summary dict), "error" (APIError), then always
    "end"."""

    def __init__(self, req: GenRequest, loop: asyncio.AbstractEventLoop):
        self.req = req
        self.loop = loop
        self.items: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.checked = time.monotonic()  # last client-disconnect check (event loop side)
        self.started = self.queued_at = time.monotonic()
        self.position = 0  # requests ahead of this one when it was queued (0: ran at once)
        self.result: dict | None = None  # the "done" summary (the server's request line)

    def emit(self, kind: str, payload: Any = None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.items.put_nowait, (kind, payload))
        except RuntimeError:  # the event loop is gone (server shut down)
            self.cancelled.set()

    def cancel(self) -> None:
        self.cancelled.set()


class Worker:
    """Runs jobs on one thread against one `Session` (prefix reuse across requests)."""

    def __init__(
        self,
        session: Session,
        block: BlockChoice | None = None,
        max_queue: int = 8,
        copy: bool | None = None,
        tree: int | None = None,
        max_batch: int = 1,
        suffix: bool | None = None,
    ):
        self.session = session
        self.suffix = suffix  # suffix drafting (`serve --suffix off` turns it off)
        self.block = block  # None: `auto` up to the pair's default size
        self.copy = copy  # copy drafting (`serve --no-copy` turns it off)
        self.tree = tree  # tree drafting (`serve --tree-budget`; None: `auto` weighs trees)
        self.max_queue = max_queue  # requests that may wait behind the running one
        self._submit_lock = threading.Lock()
        self._durations: list[float] = []  # seconds of the last few requests (Retry-After)
        self.metrics = Metrics()
        self.current: Job | None = None  # the job running alone
        self.engine = self._engine(max_batch)  # None: one request at a time
        self.running: dict[int, Job] = {}  # jobs in the batch engine, by id
        self.batch_off: str | None = None  # why --max-batch > 1 does not batch
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._stopping = threading.Event()
        self._idle = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="dflash-generate", daemon=True)
        self._thread.start()

    @property
    def queued(self) -> int:
        return self._jobs.qsize()

    @property
    def busy(self) -> bool:
        return self.current is not None or bool(self.running)

    def _engine(self, max_batch: int) -> BatchEngine | None:
        if max_batch <= 1:
            return None
        pair = self.session.pair
        why = batch_reason(pair, self.session.cache.fresh())
        if why is not None:
            self.batch_off = why
            log.warning("--max-batch %d: requests run one at a time (%s).", max_batch, why)
            return None
        block = self.block.size if self.block else pair.block_size
        auto = self.block is None or self.block.auto
        # a lone request runs alone with it (`batching.scheduler.Solo`)
        tuning = self.session.tuning
        return BatchEngine(pair, max_batch, block, auto=auto, prior=tuning.batch_prior, solo=tuning)

    def batch_stats(self) -> dict | None:
        """The batch's occupancy for /v1/dflash/stats (None: no batching)."""
        return None if self.engine is None else self.engine.stats.as_dict()

    def submit(self, job: Job) -> None:
        if self._stopping.is_set():
            raise APIError(503, "the server is shutting down.", kind="server_error")
        with self._submit_lock:
            waiting = self._jobs.qsize()
            if waiting >= self.max_queue:
                self.metrics.count("rejected")
                raise QueueFull(waiting, self.retry_after(waiting))
            self.metrics.count("requests")
            job.position = waiting + (1 if self.busy else 0)
            job.queued_at = time.monotonic()
            self._jobs.put(job)

    def retry_after(self, waiting: int) -> int:
        """Seconds until a queue slot is likely free: the recent mean request time."""
        recent = self._durations[-8:]
        mean = sum(recent) / len(recent) if recent else 5.0
        return max(1, min(120, math.ceil(mean * max(1, waiting - self.max_queue + 1))))

    def stop(self) -> None:
        """Cancel the running job at its next cycle and refuse queued ones."""
        self._stopping.set()
        if job := self.current:
            job.cancel()
        for job in list(self.running.values()):
            job.cancel()

    def close(self, timeout: float = 10.0) -> None:
        """Stop taking jobs; wait (bounded) until the running one has ended."""
        self.stop()
        self._jobs.put(None)
        self._idle.wait(timeout)

    def _loop(self) -> None:
        if self.engine is not None:
            self._batch_loop()
        else:
            while (job := self._jobs.get()) is not None:
                self._alone(job)
        while not self._jobs.empty():  # refuse what is still queued
            if (job := self._jobs.get_nowait()) is not None:
                job.emit(
                    "error", APIError(503, "the server is shutting down.", kind="server_error")
                )
                job.emit("end")
        self._idle.set()
        # Park instead of returning: MLX aborts the process at exit ("terminate called without
        # an active exception") when a thread that ran mx.compile'd functions has ended.
        threading.Event().wait()

    def _alone(self, job: Job) -> None:
        """Run one job by itself (the one-at-a-time path)."""
        self.current = job
        began = time.monotonic()
        try:
            self._run(job)
        finally:
            self.current = None
            self._durations = [*self._durations[-7:], time.monotonic() - began]
            job.emit("end")

    def _batch_loop(self) -> None:
        """Take jobs while the batch has room, step the engine while it has work."""
        while True:
            engine = self.engine  # a new one after a failure (`_step`)
            while engine.in_flight + len(engine.waiting) < engine.max_batch:
                idle = not engine.busy
                try:
                    job = self._jobs.get(block=idle)
                except queue.Empty:
                    break
                if job is None:
                    self._stopping.set()
                    while engine.busy:  # cancelled by stop(): each ends at its next step
                        self._step(engine)
                    return
                self._join(job)
            if engine.busy:
                self._step(engine)

    def _join(self, job: Job) -> None:
        """Prepare a job and hand it to the batch engine (or end it with its error)."""
        if self._should_stop(job):
            self.metrics.count("cancelled")
            job.emit("error", self.cut_short("cancelled before it started."))
            job.emit("end")
            return
        req, pair = job.req, self.session.pair
        job.started = time.monotonic()
        try:
            ids = self._prepare(req)
            budget = fit_max_tokens(self.context_of(req), len(ids), req.max_tokens).max_tokens
            cfg = make_config(
                max_tokens=budget,
                block_size=self.block_of(req),
                copy=self.copy,
                tree=self.tree,
                suffix=self.suffix,
                **req.sampling,
            )
        except (APIError, PromptError) as e:
            self.metrics.count("invalid")
            job.emit("error", e if isinstance(e, APIError) else APIError(400, str(e)))
            job.emit("end")
            return
        tail = pair.tokenizer.decode(ids[-16:]) if req.kind == "chat" else ""
        job.emit("ready", Ready(len(ids), prompt_opens_think(tail)))
        state, _ = self.session.cache.take(ids)
        last: list = [None]

        def emit(ev) -> None:
            if ev.logprobs is not None:  # before the text they belong to
                job.emit("logprobs", entries(pair, ev.logprobs))
            job.emit("text", (ev.text, ev.finish_reason))
            last[0] = ev

        def done(r: BatchRequest) -> None:
            self.running.pop(id(job), None)
            self.session.cache.put(r.state)
            self._durations = [*self._durations[-7:], time.monotonic() - job.started]
            if last[0] is None:
                self.metrics.count("cancelled")
                job.emit("error", self.cut_short("cancelled before it started."))
            else:
                save_acceptance(pair, self.session.tuning)  # what a lone request's loop learnt
                self._finish(job, last[0])
            job.emit("end")

        self.running[id(job)] = job
        stop = lambda: self._should_stop(job)  # noqa: E731
        self.engine.add(BatchRequest(ids, cfg, state, emit, stop, done))

    def _step(self, engine: BatchEngine) -> None:
        """One engine step; a failure ends every job in it with a 500 and starts clean."""
        try:
            engine.step()
        except Exception as e:  # a bug: keep serving, from a clean state
            log.exception("batched generation failed")
            self.metrics.fail(f"generation failed: {e}")
            for job in list(self.running.values()):
                job.emit("error", APIError(500, f"generation failed: {e}", kind="server_error"))
                job.emit("end")
            self.running.clear()
            self.session.reset()
            self.engine = BatchEngine(
                engine.pair,
                engine.max_batch,
                engine.rule.bs_max,
                not engine.rule.fixed,
                prior=engine.rule.prior,
                solo=engine.tuning,
            )

    def _should_stop(self, job: Job) -> bool:
        return job.cancelled.is_set() or self._stopping.is_set()

    def cut_short(self, why: str) -> APIError:
        """The error that ends a cancelled request: 503 when the server is shutting down
        (SIGTERM), else 499 (the client went away)."""
        if self._stopping.is_set():
            return APIError(503, "the server is shutting down.", kind="server_error")
        return APIError(499, why)

    def block_of(self, req: GenRequest) -> BlockChoice | None:
        """The request's own block size where it asks for one, else the server's; a size the
        drafter was not trained for is a 400, not a silent clamp."""
        if req.block_size is None:
            return self.block
        trained = self.session.pair.drafter.config.block_size
        if req.block_size != AUTO and req.block_size > trained:
            raise APIError(
                400,
                f"'block_size' must be at most {trained}, the drafter's trained block "
                f"(got {req.block_size}).",
                param="block_size",
            )
        return block_size_for(self.session.pair, req.block_size)

    def context_of(self, req: GenRequest) -> int:
        """The model's context, or less when the request caps it (Ollama's num_ctx)."""
        return min(self.session.pair.context_length, req.context_cap or 1 << 62)

    def _prepare(self, req: GenRequest) -> list[int]:
        pair = self.session.pair
        try:
            ids = self.session.tokenize(req.prompt, **req.template)
        except PromptError as e:
            raise APIError(400, str(e))
        except Exception as e:  # template errors: the request's messages don't fit the template
            raise APIError(400, f"could not build the prompt: {e}")
        vocab = pair.target_config.get("text_config", pair.target_config).get("vocab_size")
        if vocab and any(not 0 <= t < vocab for t in ids):
            raise APIError(400, f"prompt token ids must be in [0, {vocab}).", param="prompt")
        for tok in req.sampling.get("logit_bias") or {}:
            try:
                check_bias_token(tok, vocab, field_name)
            except ValueError as e:
                raise APIError(400, str(e), param="logit_bias")
        try:
            fit_max_tokens(self.context_of(req), len(ids), 1)
        except PromptError as e:
            raise APIError(400, str(e), code="context_length_exceeded")
        return ids

    def _run(self, job: Job) -> None:
        if self._should_stop(job):
            self.metrics.count("cancelled")
            job.emit("error", self.cut_short("cancelled before it started."))
            return
        req, pair = job.req, self.session.pair
        job.started = time.monotonic()
        try:
            ids = self._prepare(req)
            tail = pair.tokenizer.decode(ids[-16:]) if req.kind == "chat" else ""
            job.emit("ready", Ready(len(ids), prompt_opens_think(tail)))
            budget = fit_max_tokens(self.context_of(req), len(ids), req.max_tokens).max_tokens
            last = None
            for ev in self.session.stream(
                ids,
                should_stop=lambda: self._should_stop(job),
                max_tokens=budget,
                block_size=self.block_of(req),
                copy=self.copy,
                tree=self.tree,
                suffix=self.suffix,
                **req.sampling,
            ):
                if ev.logprobs is not None:  # before the text they belong to
                    job.emit("logprobs", entries(pair, ev.logprobs))
                job.emit("text", (ev.text, ev.finish_reason))
                last = ev
        except APIError as e:  # the request's own fault (a 400): not the server's failure
            self.metrics.count("invalid")
            job.emit("error", e)
            return
        except PromptError as e:
            self.metrics.count("invalid")
            job.emit("error", APIError(400, str(e)))
            return
        except Exception as e:  # a bug: keep serving, from a clean state
            if lost := lost_peer_message(e):  # a distributed job lost a rank: nothing to serve
                log.error(lost)
                print(f"error: {lost}", file=sys.stderr, flush=True)
                os._exit(1)
            log.exception("generation failed")
            self.metrics.fail(f"generation failed: {e}")
            self.session.reset()
            job.emit("error", APIError(500, f"generation failed: {e}", kind="server_error"))
            return
        save_acceptance(pair, self.session.tuning)  # a restarted server starts from it
        self._finish(job, last)

    def _finish(self, job: Job, last) -> None:
        """The request's summary, metrics and last items (its last event is `last`)."""
        req = job.req
        result = summary(last, req.kind)
        result["dflash"]["queue_position"] = job.position
        result["dflash"]["queue_wait_s"] = round(job.started - job.queued_at, 4)
        self.metrics.record(result)
        job.result = result
        if result["finish_reason"] == "cancelled":  # not an OpenAI finish reason: an error ends it
            job.emit("error", self.cut_short("the request was cancelled."))
        else:
            job.emit("done", result)
        u, d = result["usage"], result["dflash"]
        log.info(
            "%s: prompt %d tok (%d cached), %d tok out, %.1f tok/s, tau %.2f, %s",
            req.kind,
            u["prompt_tokens"],
            u["prompt_tokens_details"]["cached_tokens"],
            u["completion_tokens"],
            d["decode_tps"],
            d["tau"],
            result["finish_reason"],
        )
