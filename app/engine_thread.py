"""The one thread that runs all of the chat app's MLX work (loading, warm-up, turns).

MLX arrays belong to the stream of the thread that made them, and MLX aborts the process at
exit when a thread that ran mx.compile'd code has ended; so the chat app uses one long-lived
thread for every engine job, in order, and parks it (never lets it end) once it is closed.
See docs/chat.md."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger("dflash_mac.chat")


class EngineThread:
    """A queue of jobs run one at a time on one daemon thread."""

    def __init__(self) -> None:
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._idle = threading.Event()
        self.closed = False
        self._thread = threading.Thread(target=self._loop, name="dflash-chat-engine", daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        if not self.closed:
            self._jobs.put(job)

    def close(self, timeout: float = 10.0) -> bool:
        """Take no more jobs, drop queued ones, wait (bounded) for the running one to end;
        True when the thread is idle."""
        if not self.closed:
            self.closed = True
            while not self._jobs.empty():
                self._jobs.get_nowait()
            self._jobs.put(None)
        return self._idle.wait(timeout)

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                job()
            except Exception:  # jobs report their own errors; never let the thread end
                log.exception("chat engine job failed")
        self._idle.set()
        threading.Event().wait()  # park: see the module docstring
