"""The server's earlier answers (suffix drafting, `drafting/suffix.py`) kept across restarts beside
the prompt cache's disk tier: read at start, written at shutdown. Without a disk tier they
live as long as the process, and the start-up note says so."""

from __future__ import annotations

import logging

from dflash_mac.drafting.suffix import SuffixMemory
from dflash_mac.prefix.disk import DiskTier

FILE = "answers.jsonl"
log = logging.getLogger("dflash_mac.serve")


class KeptAnswers:
    """Where a session's `SuffixMemory` is kept (None: nowhere, `why_not` says why)."""

    def __init__(self, memory: SuffixMemory, disk: DiskTier | None):
        self.memory = memory
        usable = disk is not None and not disk.broken
        self.path = disk.folder / FILE if usable else None
        self.key = disk.key if usable else ""
        self.why_not = (
            None
            if usable
            else "kept in memory only: the prompt cache has no disk tier "
            "(--prompt-cache-disk-bytes 0, or its folder is not writable)"
        )

    def restore(self) -> str:
        """Read what an earlier server kept; one line on what happened (for the log)."""
        if self.path is None:
            return f"suffix drafting: earlier answers {self.why_not}"
        if not self.path.exists():
            return f"suffix drafting: no earlier answers yet ({self.path})"
        try:
            n = self.memory.read(self.path, self.key)
        except (OSError, ValueError) as e:
            return f"suffix drafting: earlier answers not read: {e}"
        return (
            f"suffix drafting: {n} earlier answers ({self.memory.tokens:,} tokens) from {self.path}"
        )

    def save(self) -> None:
        """Write them for the next server (a failure is logged, never raised: shutdown goes on)."""
        if self.path is None or not self.memory.answers:
            return
        try:
            self.memory.save(self.path, self.key)
        except OSError as e:
            log.warning("suffix drafting: earlier answers not kept: %s", e)
