"""`bench --concurrency 1,2,4,8`: N streams arriving together, three ways on the same weights.

Every level serves the same P = max(N) requests (the suite's first P prompts), in waves of N
that arrive together, a wave when the one before it has finished, so the rows compare the same
work (with one prompt for N = 1 that row measured one answer):

- batched DFlash: each wave through the engine `serve --max-batch N` runs
  (`batching.scheduler.BatchEngine`, one engine for the whole bench, its block rule learning per N);
- DFlash one at a time: the P requests served in turn (`speculative_stream`, `auto`), as
  `--max-batch 1` serves them; one run per setting, its first-token times read per wave (a
  request's first token waits for the ones before it in its wave);
- plain batched decoding: each wave through mlx-lm's `batch_generate` (its `BatchGenerator`,
  what mlx-lm's server batches with), no drafter.

Per N and sampling setting: aggregate tok/s (all tokens over the summed wall time), mean
per-request decode tok/s (after its first token), time to first token (median and max from
its wave's arrival), and for greedy how many batched answers equal their one-at-a-time ones.
Each N is warmed up first (graphs compiled, the block rule timed) with short runs."""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from dflash_mac.batching.scheduler import BatchEngine, BatchRequest
from dflash_mac.engine.decode import DecodeState, GenerationConfig, speculative_stream
from dflash_mac.engine.verify import SamplingParams
from dflash_mac.pair import Pair
from dflash_mac.sizing.choice import BlockChoice
from dflash_mac.sizing.tuning import AutoTuning

WARMUP_TOKENS = 24


@dataclass
class Stream:
    """One request's timeline, from the common arrival (seconds)."""

    tokens: list[int] = field(default_factory=list)
    ttft: float | None = None
    end: float = 0.0
    start: float = 0.0  # served one at a time: when its turn came

    @property
    def decode_tps(self) -> float:
        span = self.end - (self.ttft or 0.0)
        return (len(self.tokens) - 1) / span if span > 0 and len(self.tokens) > 1 else 0.0


@dataclass
class Way:
    """One way of serving the N streams."""

    name: str
    wall: float
    streams: list[Stream]

    @property
    def tokens(self) -> int:
        return sum(len(s.tokens) for s in self.streams)

    def summary(self) -> dict:
        ttfts = [s.ttft for s in self.streams if s.ttft is not None]
        per = [s.decode_tps for s in self.streams if s.ttft is not None]
        return {
            "way": self.name,
            "tokens": self.tokens,
            "wall_s": round(self.wall, 3),
            "aggregate_tps": round(self.tokens / self.wall, 2) if self.wall else 0.0,
            "per_request_tps": round(statistics.mean(per), 2) if per else None,
            "ttft_median_s": round(statistics.median(ttfts), 3) if ttfts else None,
            "ttft_max_s": round(max(ttfts), 3) if ttfts else None,
        }


def in_waves(n: int, count: int) -> list[range]:
    """Requests 0..count-1 in waves of n arriving together (the last one may be smaller)."""
    return [range(i, min(i + n, count)) for i in range(0, count, n)]


def one_after_another(name: str, runs: list[Way]) -> Way:
    """Waves served one after the other: their walls add up, each keeps its own clock."""
    return Way(name, sum(w.wall for w in runs), [s for w in runs for s in w.streams])


def as_waves(way: Way, n: int) -> Way:
    """A one-at-a-time run read as waves of n requests that arrive together: each request's
    times from its wave's first turn (the requests before it in its wave are waited for)."""
    streams = []
    for wave in in_waves(n, len(way.streams)):
        base = way.streams[wave.start].start
        for s in (way.streams[k] for k in wave):
            ttft = None if s.ttft is None else s.ttft - base
            streams.append(Stream(s.tokens, ttft, s.end - base, s.start - base))
    return Way(way.name, way.wall, streams)


def config(sp: SamplingParams, max_tokens: int, seed: int, use_eos: bool) -> GenerationConfig:
    seed_ = None if sp.greedy else seed
    # no suffix drafting: every way and level repeats the same prompts, whose earlier answers
    # it would copy whole (the agent-loop suite measures it)
    cfg = GenerationConfig(max_tokens, sampling=sp, seed=seed_, use_eos=use_eos, suffix=False)
    return cfg


def batched(engine: BatchEngine, prompts: list[list[int]], cfgs: list[GenerationConfig]) -> Way:
    streams = [Stream() for _ in prompts]
    t0 = time.perf_counter()

    def request(k: int) -> BatchRequest:
        s = streams[k]

        def emit(ev) -> None:
            if s.ttft is None:
                s.ttft = time.perf_counter() - t0
            s.tokens += ev.tokens

        def done(_) -> None:
            s.end = time.perf_counter() - t0

        return BatchRequest(prompts[k], cfgs[k], DecodeState(engine.pair), emit, done=done)

    for k in range(len(prompts)):
        engine.add(request(k))
    engine.run()
    return Way("dflash-batched", time.perf_counter() - t0, streams)


def one_at_a_time(
    pair: Pair, prompts: list[list[int]], cfgs: list[GenerationConfig], tuning: AutoTuning
) -> Way:
    streams = [Stream() for _ in prompts]
    t0 = time.perf_counter()
    for ids, cfg, s in zip(prompts, cfgs, streams):
        s.start = time.perf_counter() - t0
        for ev in speculative_stream(pair, ids, cfg, tuning=tuning):
            if s.ttft is None:
                s.ttft = time.perf_counter() - t0
            s.tokens += ev.tokens
        s.end = time.perf_counter() - t0
    return Way("dflash-one-at-a-time", time.perf_counter() - t0, streams)


def plain_batched(pair: Pair, prompts: list[list[int]], sp: SamplingParams, max_tokens: int) -> Way:
    """mlx-lm's batched plain decoding (no drafter); no per-request first-token times."""
    from mlx_lm.generate import batch_generate
    from mlx_lm.sample_utils import make_sampler

    sampler = make_sampler(sp.temperature, sp.top_p, top_k=sp.top_k, min_p=sp.min_p)
    t0 = time.perf_counter()
    r = batch_generate(
        pair.target, pair.tokenizer, prompts, max_tokens=max_tokens, sampler=sampler,
        return_token_ids=True,
    )  # fmt: skip
    wall = time.perf_counter() - t0
    return Way("mlx-lm-batched-plain", wall, [Stream(list(t), None, wall) for t in r.token_ids])


def measure_concurrency(
    pair: Pair,
    ids: list[list[int]],
    levels: list[int],
    settings: list[tuple[str, SamplingParams]],
    max_tokens: int,
    block: BlockChoice,
    tuning: AutoTuning,
    seed: int = 0,
    use_eos: bool = True,
    progress: Callable[[str], None] = lambda line: None,
) -> list[dict]:
    """One row per (setting, N): the three ways' summaries and the ratios."""
    # a lone request runs alone, as in the server (`Solo`), on a copy of what `auto` knows: the
    # one-at-a-time way's controllers are not trained by the batched way's lone cycles
    solo, prior = copy.deepcopy(tuning), tuning.batch_prior
    engine = BatchEngine(pair, max(levels), block.size, block.auto, prior=prior, solo=solo)
    rows = []
    count = max(levels)
    prompts = [ids[k % len(ids)] for k in range(count)]
    for label, sp in settings:
        cfgs = [config(sp, max_tokens, seed + k, use_eos) for k in range(count)]
        warm = [config(sp, WARMUP_TOKENS, seed + k, use_eos) for k in range(count)]
        one_at_a_time(pair, prompts[:1], warm[:1], tuning)
        alone = one_at_a_time(pair, prompts, cfgs, tuning)
        for n in levels:
            waves = in_waves(n, count)
            batched(engine, prompts[:n], warm[:n])  # compile and time this batch size's shapes
            plain_batched(pair, prompts[:n], sp, WARMUP_TOKENS)
            before = dict(engine.stats.blocks)
            copies_before = engine.stats.copy_cycles, engine.stats.copied
            solo_before = engine.stats.solo_cycles
            ways = [
                one_after_another(
                    "dflash-batched",
                    [batched(engine, [prompts[k] for k in w], [cfgs[k] for k in w]) for w in waves],
                ),
                as_waves(alone, n),
                one_after_another(
                    "mlx-lm-batched-plain",
                    [plain_batched(pair, [prompts[k] for k in w], sp, max_tokens) for w in waves],
                ),
            ]
            summ = [w.summary() for w in ways]
            agg = [s["aggregate_tps"] for s in summ]
            row = {"setting": label, "concurrency": n, "waves": len(waves), "ways": summ}
            row["batch_blocks"] = {  # the measured batched run's cycles by block size
                str(b): c - before.get(b, 0)
                for b, c in sorted(engine.stats.blocks.items())
                if c > before.get(b, 0)
            }
            row["batch_copies"] = {  # the measured batched run's copy cycles, copied tokens
                "cycles": engine.stats.copy_cycles - copies_before[0],
                "tokens": engine.stats.copied - copies_before[1],
            }
            row["solo_cycles"] = engine.stats.solo_cycles - solo_before  # a lone request's
            row["batched_vs_alone"] = round(agg[0] / agg[1], 3) if agg[1] else None
            row["batched_vs_plain"] = round(agg[0] / agg[2], 3) if agg[2] else None
            if sp.greedy:
                same = sum(a.tokens == b.tokens for a, b in zip(ways[0].streams, ways[1].streams))
                row["identical"] = f"{same}/{count}"
            rows.append(row)
            progress(
                f"{label}, {n} stream(s): batched {agg[0]:.1f} tok/s, one at a time "
                f"{agg[1]:.1f}, mlx-lm batched plain {agg[2]:.1f}"
            )
    return rows


def concurrency_markdown(doc: dict) -> str:
    """The report as markdown tables, one per sampling setting."""
    h = doc["header"]
    lines = [
        f"# Concurrency: {h.get('target', '')} + {h.get('draft', '')} ({h.get('cpu', '')})",
        "",
    ]
    cfg = doc["config"]
    served = cfg.get("requests", cfg["prompts"])
    what = f"{served} requests from {cfg['prompts']}" if served != cfg["prompts"] else served
    lines.append(
        f"{what} prompts of the `{cfg['suite']}` suite, up to {cfg['max_tokens']} "
        f"tokens each, block {cfg['block']}; at N streams they arrive in waves of N (a wave "
        "when the one before it has finished); first-token times from a wave's arrival."
    )
    for label in dict.fromkeys(r["setting"] for r in doc["rows"]):
        lines += ["", f"## {label}", ""]
        lines.append(
            "| N | batched DFlash tok/s | per request | TTFT median / max | one at a time "
            "tok/s | TTFT median / max | mlx-lm batched plain tok/s | vs one at a time | "
            "vs plain batched | greedy identical |"
        )
        lines.append("|" + "---|" * 10)
        for r in doc["rows"]:
            if r["setting"] != label:
                continue
            b, a, p = r["ways"]
            lines.append(
                f"| {r['concurrency']} | {b['aggregate_tps']:.1f} | {b['per_request_tps']:.1f} "
                f"| {b['ttft_median_s']:.2f} / {b['ttft_max_s']:.2f} s | "
                f"{a['aggregate_tps']:.1f} | {a['ttft_median_s']:.2f} / {a['ttft_max_s']:.2f} s "
                f"| {p['aggregate_tps']:.1f} | {r['batched_vs_alone']:.2f}x | "
                f"{r['batched_vs_plain']:.2f}x | {r.get('identical', '-')} |"
            )
        mix = [
            f"N {r['concurrency']}: " + " ".join(f"{b}×{c}" for b, c in r["batch_blocks"].items())
            for r in doc["rows"]
            if r["setting"] == label and r.get("batch_blocks")
        ]
        if mix:
            lines += ["", "Batched cycles by block size (size×cycles): " + "; ".join(mix) + "."]
        copies = [
            f"N {r['concurrency']}: {c['cycles']} cycles, {c['tokens']} tokens"
            for r in doc["rows"]
            if r["setting"] == label and (c := r.get("batch_copies")) and c["cycles"]
        ]
        if copies:
            lines += ["", "Batched cycles with copies, copied tokens taken: " + "; ".join(copies)]
        solo = [
            f"N {r['concurrency']}: {r['solo_cycles']}"
            for r in doc["rows"]
            if r["setting"] == label and r.get("solo_cycles")
        ]
        if solo:
            lines += ["", "Cycles of a request left alone, run as alone: " + "; ".join(solo) + "."]
    return "\n".join(lines) + "\n"


WAYS = ("dflash-batched", "dflash-one-at-a-time", "mlx-lm-batched-plain")


def validate(doc: dict) -> list[str]:
    """What is wrong with a `--concurrency` document (empty: nothing)."""
    bad = []
    if doc.get("kind") != "concurrency":
        bad.append("kind is not 'concurrency'")
    for key in ("config", "rows", "header"):
        if not isinstance(doc.get(key), (dict, list)):
            bad.append(f"no {key}")
    for i, row in enumerate(doc.get("rows") or []):
        ways = row.get("ways") or []
        if [w.get("way") for w in ways] != list(WAYS):
            bad.append(f"rows[{i}]: the ways are not {', '.join(WAYS)}")
        if not isinstance(row.get("concurrency"), int) or row["concurrency"] < 1:
            bad.append(f"rows[{i}]: concurrency is not a positive integer")
        for w in ways:
            if not isinstance(w.get("aggregate_tps"), (int, float)) or w["aggregate_tps"] < 0:
                bad.append(f"rows[{i}]: {w.get('way')} has no aggregate_tps")
    return bad
