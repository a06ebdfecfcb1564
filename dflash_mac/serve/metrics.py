"""Server metrics: per-request summaries, totals, memory, and the Prometheus text form."""

from __future__ import annotations

import resource
import sys
import threading
import time
from typing import Any


def memory() -> dict:
    import mlx.core as mx

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "active_bytes": mx.get_active_memory(),
        "peak_bytes": mx.get_peak_memory(),
        "cache_bytes": mx.get_cache_memory(),
        "max_rss_bytes": rss if sys.platform == "darwin" else rss * 1024,
    }


def summary(ev: Any, kind: str) -> dict:
    """Usage + dflash extension of a finished generation (computed on the worker thread)."""
    s = ev.stats
    return {
        "kind": kind,
        "finish_reason": ev.finish_reason,
        "stop_sequence": getattr(ev, "stop", None),  # which stop string ended it, if one did
        "usage": {
            "prompt_tokens": s.prompt_tokens,
            "completion_tokens": s.generation_tokens,
            "total_tokens": s.prompt_tokens + s.generation_tokens,
            "prompt_tokens_details": {"cached_tokens": s.cached_tokens},
        },
        "dflash": {
            "tau": round(s.tau, 4),
            "cycles": s.cycles,
            "draft_cycles": s.draft_cycles,
            "acceptance_histogram": s.histogram,
            "block_size": s.block_size,
            "decode_tps": round(s.decode_tps, 2),
            "prefill_tps": round(s.prefill_tps, 2),
            "ttft_s": round(s.ttft, 4),
            "copy_cycles": s.copy_cycles,
            "copy_tokens": s.copy_tokens,
            "suffix_cycles": s.suffix_cycles,
            "suffix_tokens": s.suffix_tokens,
            "tree_cycles": s.tree_cycles,
            "tree_tau": round(s.tree_tau, 4),
            "tree_budgets": s.tree_mix,
        },
    }


class Metrics:
    """Totals since start and the last request's numbers (for /metrics and the menu bar)."""

    FIELDS = (
        "requests",
        "completed",
        "cancelled",
        "failed",  # the server's own failures (a 500): /health is degraded
        "invalid",  # requests refused with a 400 once queued (the client's fault)
        "rejected",
        "prompt_tokens",
        "cached_tokens",
        "completion_tokens",
        "cycles",
        "copy_cycles",  # cycles that copied the request's own text
        "suffix_cycles",  # cycles that drafted from earlier answers (suffix drafting)
        "suffix_tokens",
    )

    def __init__(self) -> None:
        self.started = time.time()
        self.lock = threading.Lock()
        self.totals = dict.fromkeys(self.FIELDS, 0)
        self.last: dict | None = None
        self.last_error: dict | None = None  # the last server-side failure, until a success
        self.memory: dict = {}

    def count(self, name: str, n: int = 1) -> None:
        with self.lock:
            self.totals[name] += n

    def fail(self, message: str) -> None:
        """A generation failed on the server's side (not a bad request): health is degraded
        until the next generation succeeds."""
        with self.lock:
            self.totals["failed"] += 1
            self.last_error = {"time": time.time(), "message": message}

    def record(self, result: dict) -> None:
        u, d = result["usage"], result["dflash"]
        with self.lock:
            self.last_error = None
            cancelled = result["finish_reason"] == "cancelled"
            self.totals["cancelled" if cancelled else "completed"] += 1
            self.totals["prompt_tokens"] += u["prompt_tokens"]
            self.totals["cached_tokens"] += u["prompt_tokens_details"]["cached_tokens"]
            self.totals["completion_tokens"] += u["completion_tokens"]
            self.totals["cycles"] += d["cycles"]
            for key in ("copy_cycles", "suffix_cycles", "suffix_tokens"):
                self.totals[key] += d.get(key, 0)
            self.last = {
                "time": time.time(),
                "kind": result["kind"],
                "finish_reason": result["finish_reason"],
                "prompt_tokens": u["prompt_tokens"],
                "cached_tokens": u["prompt_tokens_details"]["cached_tokens"],
                "completion_tokens": u["completion_tokens"],
                **d,
            }
            self.memory = memory()

    def snapshot(self) -> dict:
        with self.lock:
            return {
                "uptime_s": round(time.time() - self.started, 1),
                "totals": dict(self.totals),
                "last": dict(self.last or {}) or None,
                "last_error": dict(self.last_error or {}) or None,
                "memory": dict(self.memory),
            }

    def health(self) -> dict:
        """/health: "ok", or "degraded" with the last error while the last generation failed;
        request counts for launchers (the menu bar): `failed` counts only the server's own
        failures, `invalid` the clients' bad requests."""
        with self.lock:
            err = self.last_error
            counts = {k: self.totals[k] for k in ("requests", "completed", "failed", "invalid")}
        return {
            "status": "degraded" if err else "ok",
            **({"last_error": err["message"]} if err else {}),
            **counts,
        }


def label(value: Any) -> str:
    text = str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{text}"'


def prometheus(stats: dict) -> str:
    """/metrics?format=prometheus: one `name value` line per number (easy to read from sh)."""
    lines = [
        f"dflash_info{{model={label(stats['model'])},model_id={label(stats['model_id'])},"
        f"draft={label(stats['draft_id'])},drafter={label(stats['drafter'])}}} 1",
        f"dflash_block_size {stats['block_size']}",
        f"dflash_context_length {stats['context_length']}",
        f"dflash_busy {int(stats['busy'])}",
        f"dflash_queued {stats['queued']}",
        f"dflash_session_cached_tokens {stats['cached_tokens']}",
        f"dflash_uptime_seconds {stats['uptime_s']}",
    ]
    lines += [f"dflash_{k}_total {v}" for k, v in stats["totals"].items()]
    lines.append(f"dflash_degraded {int(bool(stats.get('last_error')))}")
    last = stats.get("last") or {}
    for key in (
        "decode_tps",
        "prefill_tps",
        "tau",
        "cycles",
        "ttft_s",
        "prompt_tokens",
        "cached_tokens",
        "completion_tokens",
    ):
        if key in last:
            lines.append(f"dflash_last_{key} {last[key]}")
    if last:
        lines.append(f"dflash_last_cancelled {int(last['finish_reason'] == 'cancelled')}")
    for i, n in enumerate(last.get("acceptance_histogram", []), 1):
        lines.append(f'dflash_last_acceptance_histogram{{length="{i}"}} {n}')
    lines += [f"dflash_memory_{k} {v}" for k, v in stats.get("memory", {}).items()]
    lines += [f"dflash_suffix_memory_{k} {v}" for k, v in stats.get("suffix_memory", {}).items()]
    cache = stats.get("prompt_cache", {})
    lines += [f"dflash_prompt_cache_{k} {v}" for k, v in cache.items() if isinstance(v, int)]
    return "\n".join(lines) + "\n"
