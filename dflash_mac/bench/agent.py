"""`bench --suite agent`: multi-turn agent transcripts replayed through the engine the server
uses (a `Session` with its prompt cache and disk tier), greedy.

Conversations share one long system prompt (rules, tool schemas, repository files) and take
turns in interleaved order, each turn appending the model's answer and the next tool result.
Per turn: time to first token cold (a fresh session), warm (the running session's memory), and
after a restart (a fresh session over the disk files earlier turns wrote), decode tok/s with
DFlash and with plain steps, the tokens reused, and whether all four answers are identical."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from dflash_mac.api import prompt_ids
from dflash_mac.pair import Pair
from dflash_mac.prefix.disk import DiskTier, fingerprint
from dflash_mac.session import Session
from dflash_mac.sizing.tuning import AutoTuning


@dataclass
class Run:
    tokens: list[int]
    text: str
    ttft: float  # seconds to the first token
    decode_tps: float
    reused: int
    tau: float


@dataclass
class AgentTurn:
    conversation: str
    turn: int
    prompt_tokens: int
    reused_warm: int
    reused_disk: int
    ttft_cold_s: float
    ttft_warm_s: float
    ttft_disk_s: float
    decode_tps_dflash: float
    decode_tps_plain: float
    tau: float
    identical: bool  # cold, warm, disk and plain answers token-identical


def timed(session: Session, ids: list[int], max_tokens: int, block) -> Run:
    t0 = time.perf_counter()
    ttft, tokens, text, last = None, [], [], None
    # no suffix drafting: each turn runs in several sessions that share `auto`'s memory, and a
    # later one would copy the earlier one's answer whole (the agent-loop suite measures it)
    kw = dict(max_tokens=max_tokens, temp=0.0, block_size=block, suffix=False)
    for ev in session.stream(ids, **kw):
        ttft = ttft if ttft is not None else time.perf_counter() - t0
        tokens += ev.tokens
        text.append(ev.text)
        last = ev
    s = last.stats
    tps = (s.generation_tokens - 1) / s.decode_time if s.decode_time > 0 else 0.0
    return Run(tokens, "".join(text), ttft or 0.0, tps, s.cached_tokens, s.tau)


def run_agent_bench(
    pair: Pair,
    doc: dict,
    max_tokens: int,
    block,
    tuning: AutoTuning,
    limit: int | None = None,
    progress: Callable[[str], None] = lambda line: None,
) -> list[AgentTurn]:
    """Replay the conversations (the first `limit`), turn by turn, interleaved."""
    convs = doc["conversations"][:limit] if limit else doc["conversations"]
    folder = Path(tempfile.mkdtemp(prefix="dflash-agent-bench-"))  # not the user's cache
    key, room = fingerprint(pair), 1 << 40

    def disk() -> DiskTier:
        return DiskTier(folder, key, room)

    try:
        return replay(pair, doc["system"], convs, max_tokens, block, tuning, disk, progress)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def replay(pair, system, convs, max_tokens, block, tuning, disk, progress) -> list[AgentTurn]:
    warm = Session(pair, cache_size=len(convs) + 1, tuning=tuning, disk=disk())
    plain = Session(pair, cache_size=len(convs) + 1, tuning=tuning)
    history: dict[str, list[dict]] = {c["id"]: [] for c in convs}
    out: list[AgentTurn] = []
    for r in range(max(len(c["turns"]) for c in convs)):
        for conv in convs:
            if r >= len(conv["turns"]):
                continue
            messages = history[conv["id"]] + [{"role": "user", "content": conv["turns"][r]}]
            ids = prompt_ids(pair.tokenizer, messages, system=system)
            progress(f"{conv['id']} turn {r + 1}: {len(ids)} prompt tokens")
            cold = timed(Session(pair, tuning=tuning), ids, max_tokens, block)
            warm.cache.disk.flush()  # what earlier turns wrote; then a "restarted" process
            restarted = timed(Session(pair, tuning=tuning, disk=disk()), ids, max_tokens, block)
            w = timed(warm, ids, max_tokens, block)
            p = timed(plain, ids, max_tokens, 1)
            same = cold.tokens == w.tokens == restarted.tokens == p.tokens
            out.append(
                AgentTurn(
                    conv["id"], r + 1, len(ids), w.reused, restarted.reused, cold.ttft, w.ttft,
                    restarted.ttft, w.decode_tps, p.decode_tps, w.tau, same,
                )
            )  # fmt: skip
            history[conv["id"]] = messages + [{"role": "assistant", "content": w.text}]
    warm.cache.close()
    return out


def agent_report(turns: list[AgentTurn], header: dict, config: dict) -> dict:
    """The report document: header, config, per-turn rows and the totals."""
    later = [t for t in turns if t.reused_warm > 0] or turns
    total = {
        "turns": len(turns),
        "identical": sum(t.identical for t in turns),
        "ttft_cold_s": sum(t.ttft_cold_s for t in turns),
        "ttft_warm_s": sum(t.ttft_warm_s for t in turns),
        "ttft_disk_s": sum(t.ttft_disk_s for t in turns),
        "warm_share": sum(t.ttft_warm_s for t in later) / sum(t.ttft_cold_s for t in later),
        "disk_share": sum(t.ttft_disk_s for t in later) / sum(t.ttft_cold_s for t in later),
        "reused_warm": sum(t.reused_warm for t in turns),
        "prompt_tokens": sum(t.prompt_tokens for t in turns),
    }
    return {
        "kind": "agent",
        "header": header,
        "config": config,
        "turns": [asdict(t) for t in turns],
        "total": total,
    }


def validate(doc: dict) -> list[str]:
    """Problems of an agent report document ([] when none)."""
    problems = [f"missing {k!r}" for k in ("header", "config", "turns", "total") if k not in doc]
    fields = set(AgentTurn.__dataclass_fields__)
    for i, row in enumerate(doc.get("turns", [])):
        if set(row) != fields:
            problems.append(f"turns[{i}]: fields {sorted(set(row) ^ fields)}")
    if doc.get("total", {}).get("turns") != len(doc.get("turns", [])):
        problems.append("total.turns does not count the turns")
    return problems


def agent_markdown(doc: dict) -> str:
    h, t = doc["header"], doc["total"]
    lines = [
        f"# Agent bench: {h.get('target', '?')} + {h.get('draft', '?')}",
        "",
        f"{h.get('cpu', '')}, {h.get('dtype', '')}, {h.get('date', '')}",
        "",
        f"{t['turns']} turns, greedy, {doc['config']['max_tokens']} new tokens each; "
        f"time to first token from memory {100 * t['warm_share']:.1f} % of a cold prefill, "
        f"from disk after a restart {100 * t['disk_share']:.1f} % (turns that reuse a "
        f"prefix); answers identical in {t['identical']} of {t['turns']} turns.",
        "",
        "| conversation | turn | prompt | reused (RAM) | reused (disk) | TTFT cold | TTFT RAM "
        "| TTFT disk | tok/s DFlash | tok/s plain | τ | identical |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in doc["turns"]:
        lines.append(
            f"| {r['conversation']} | {r['turn']} | {r['prompt_tokens']} | {r['reused_warm']} "
            f"| {r['reused_disk']} | {r['ttft_cold_s']:.2f} s | {r['ttft_warm_s']:.3f} s "
            f"| {r['ttft_disk_s']:.3f} s | {r['decode_tps_dflash']:.1f} "
            f"| {r['decode_tps_plain']:.1f} | {r['tau']:.2f} "
            f"| {'yes' if r['identical'] else 'NO'} |"
        )
    return "\n".join(lines) + "\n"
