"""A scripted fake engine for the chat app tests: same `stream(...)` interface as Session."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace

from dflash_mac.app.backend import Backend, EngineInfo

from dflash_mac.engine.decode import GenerationEvent
from dflash_mac.engine.stats import DecodeStats

ANSWER = [
    ("Here is a function:\n\n", 0),
    ("```python\ndef reverse(s: str) -> str:\n", 5),
    ('    """Reverse a string."""\n', 3),
    ("    return s[::-1]\n```\n\n", 6),
    ("It slices with a step of **-1**.", 2),
]


@dataclass(frozen=True)
class FakeStats(DecodeStats):
    """DecodeStats with a fixed memory figure and a fixed 80 tok/s decode speed."""

    @property
    def peak_memory_gb(self) -> float:
        return 0.42

    @property
    def decode_tps(self) -> float:
        return 80.0 if self.generation_tokens else 0.0


class FakeSession:
    """Yields one GenerationEvent per scripted (text, accepted) chunk, like the engine: the
    first chunk is the prefill token, every later one a decode cycle. `hold_at=n` waits after
    the n-th event until `release` is set or `should_stop()` turns true (to test Esc)."""

    def __init__(self, script=None, block_size: int = 8, hold_at: int | None = None):
        self.script = list(script or ANSWER)
        self.block_size = block_size
        self.hold_at = hold_at
        self.release = threading.Event()
        self.held = threading.Event()
        self.prompts: list = []
        self.cached = 0

    def stream(self, prompt, should_stop=None, **kwargs):
        self.prompts.append(prompt)
        if prompt and isinstance(prompt[0], int):  # a Backend with a tokenizer
            n_prompt = len(prompt)
        else:
            n_prompt = sum(len(m["content"]) // 4 + 4 for m in prompt)
        self.max_tokens = kwargs.get("max_tokens")
        stats = FakeStats(
            self.block_size, prompt_tokens=n_prompt, cached_tokens=min(self.cached, n_prompt - 1)
        )
        finish = None
        for i, (text, accepted) in enumerate(self.script):
            if i and should_stop and should_stop():
                finish = "cancelled"
                break
            lengths = stats.acceptance_lengths + ((accepted,) if accepted else ())
            stats = replace(
                stats,
                acceptance_lengths=lengths,
                generation_tokens=stats.generation_tokens + max(accepted, 1),
            )
            last = i == len(self.script) - 1
            yield GenerationEvent(
                text, [1] * max(accepted, 1), accepted, stats, "stop" if last else None
            )
            if self.hold_at == i + 1:
                self.held.set()
                deadline = time.monotonic() + 10
                while not self.release.is_set() and not (should_stop and should_stop()):
                    if time.monotonic() > deadline:
                        raise TimeoutError("the test never released the fake engine")
                    time.sleep(0.005)
        if finish == "cancelled":
            yield GenerationEvent("", [], 0, stats, "cancelled")
        self.cached = n_prompt + stats.generation_tokens - 1


def fake_backend(session: FakeSession | None = None, reasoning: bool = False) -> Backend:
    info = EngineInfo(
        model="fake",
        kind="DFlash",
        block_size=8,
        kernels="reference",
        reasoning=reasoning,
    )
    return Backend(session or FakeSession(), info)
