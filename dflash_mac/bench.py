"""`dflash-mac bench`: same-process baseline vs DFlash, warmed up, lossless-checked (SPEC §9).

For every prompt (seeded shuffle per trial) the runner measures plain target decoding
(`mlx_lm.generate.generate_step` on `pair.target`, no hooks) and DFlash
(`dflash_mac.generate.stream_generate`) for each block size, alternating which goes first.
Both are timed identically by the runner:

- TTFT: from the call to the first token on the host (prefill + first sample);
- decode tok/s: tokens after the first ÷ time from the first token to the last one;
- peak memory: `mx.reset_peak_memory()` before the run, `mx.get_peak_memory()` after.

The aggregation functions (`summarize`, `trial_tps`, `best_block_size`) are pure and work on
plain records, so they are tested on synthetic data.
"""

from __future__ import annotations

import gc
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import typer

from .generate import PromptError
from .stats import histogram, mean_std, position_acceptance, survival

SUITES = ("code", "math", "chat")
SUITE_DIR = Path(__file__).resolve().parent / "data" / "suites"
FORMATS = ("md", "json", "jsonl", "csv")


class BenchError(PromptError):
    """A bench option or prompt file that cannot be used; one sentence for the user."""


# -- prompts ------------------------------------------------------------------------------


@dataclass
class BenchPrompt:
    """One benchmark prompt: chat messages or raw text."""

    id: str
    suite: str
    prompt: str | list[dict]


def code_suite_path() -> Path:
    """The bundled pair's held-out prompts (the `code` suite)."""
    from .loading import PACKAGE_MODELS

    return PACKAGE_MODELS / "bundled" / "eval_prompts.jsonl"


def read_prompts(path: str | Path, suite: str | None = None) -> list[BenchPrompt]:
    """Prompts from a JSONL file: lines with `messages` (chat) or `prompt` (text), optional
    `id`."""
    path = Path(path)
    suite = suite or path.stem
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        raise BenchError(f"prompts file {path} does not exist.")
    except (OSError, UnicodeDecodeError) as e:
        raise BenchError(f"prompts file {path} cannot be read ({e}).")
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise BenchError(f"{path} line {n} is not valid JSON ({e.msg}).")
        prompt = item.get("messages", item.get("prompt")) if isinstance(item, dict) else None
        valid_chat = isinstance(prompt, list) and prompt and all(
            isinstance(m, dict) and "role" in m and "content" in m for m in prompt)
        if not (valid_chat or (isinstance(prompt, str) and prompt)):
            raise BenchError(f"{path} line {n} needs a non-empty \"messages\" list "
                             "or \"prompt\" string.")
        out.append(BenchPrompt(str(item.get("id", f"{suite}-{n}")), suite, prompt))
    if not out:
        raise BenchError(f"prompts file {path} holds no prompts.")
    return out


def suite_prompts(name: str, warn: Callable[[str], Any] = print) -> list[BenchPrompt]:
    """Prompts of a shipped suite (`code`, `math`, `chat` or `all`)."""
    if name not in (*SUITES, "all"):
        raise BenchError(f"--suite must be one of {', '.join(SUITES)}, all (got {name!r}).")
    out = []
    for suite in SUITES if name == "all" else (name,):
        path = code_suite_path() if suite == "code" else SUITE_DIR / f"{suite}.jsonl"
        if suite == "code" and not path.exists():
            fallback = "the math and chat suites only" if name == "all" else "the math suite"
            warn(f"the code suite ({path}) is missing; benchmarking {fallback} instead.")
            if name == "code":
                out += read_prompts(SUITE_DIR / "math.jsonl", "math")
            continue
        out += read_prompts(path, suite)
    return out


def parse_block_sizes(text: str | None) -> list[int] | None:
    """`"5"` or `"2,3,4,5,8"` → sorted unique ints ≥ 1; None when not given."""
    if text is None or not str(text).strip():
        return None
    try:
        sizes = [int(p) for p in str(text).split(",")]
    except ValueError:
        raise BenchError(f"--block-size must be an integer or a comma-separated list such as "
                         f"2,3,4,5,8 (got {text!r}).")
    if any(s < 1 for s in sizes):
        raise BenchError(f"every --block-size must be at least 1 (got {text!r}).")
    return sorted(set(sizes))


def check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise BenchError(f"--format must be one of {', '.join(FORMATS)} (got {fmt!r}).")
    return fmt


# -- measuring ----------------------------------------------------------------------------


@dataclass
class BenchConfig:
    """What to measure."""

    block_sizes: list[int]
    max_tokens: int = 128
    trials: int = 2
    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int = 0
    use_eos: bool = True
    cooldown: float = 0.0
    warmup_tokens: int = 16

    @property
    def greedy(self) -> bool:
        return self.temp <= 0.0


@dataclass
class Run:
    """One measured generation (baseline when `block_size` is None)."""

    tokens: list[int]
    prompt_tokens: int
    ttft: float
    decode_time: float
    peak_memory: int
    finish_reason: str
    block_size: int | None = None
    acceptance_lengths: list[int] = field(default_factory=list)

    @property
    def decode_tokens(self) -> int:
        """Tokens after the first (the first one is part of TTFT)."""
        return max(len(self.tokens) - 1, 0)

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / self.decode_time if self.decode_time > 0 else 0.0

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.ttft if self.ttft > 0 else 0.0

    @property
    def tau(self) -> float:
        a = self.acceptance_lengths
        return sum(a) / len(a) if a else 0.0

    def as_dict(self) -> dict:
        d = {
            "generation_tokens": len(self.tokens),
            "decode_tokens": self.decode_tokens,
            "decode_time_s": self.decode_time,
            "decode_tps": self.decode_tps,
            "ttft_s": self.ttft,
            "prefill_tps": self.prefill_tps,
            "peak_memory_bytes": self.peak_memory,
            "finish_reason": self.finish_reason,
            "tokens": list(self.tokens),
        }
        if self.block_size is not None:
            bs = self.block_size
            d.update(block_size=bs, tau=self.tau, cycles=len(self.acceptance_lengths),
                     acceptance_lengths=list(self.acceptance_lengths),
                     histogram=histogram(self.acceptance_lengths, bs))
        return d


class Clock:
    """First/last token times of one run, relative to its start."""

    def __init__(self) -> None:
        gc.collect()
        import mlx.core as mx

        mx.reset_peak_memory()
        self.t0 = time.perf_counter()
        self.first: float | None = None
        self.last: float | None = None

    def tick(self, kept: bool = True) -> None:
        now = time.perf_counter() - self.t0
        if self.first is None:
            self.first = now
        if kept:
            self.last = now

    def result(self, tokens: list[int], prompt_tokens: int, reason: str, **kw) -> Run:
        import mlx.core as mx

        first = self.first or 0.0
        return Run(list(tokens), prompt_tokens, first, max((self.last or first) - first, 0.0),
                   mx.get_peak_memory(), reason, **kw)


def run_baseline(pair: Any, ids: list[int], cfg: BenchConfig, seed: int,
                 max_tokens: int | None = None) -> Run:
    """Plain target decoding with mlx-lm's `generate_step` (no hooks, same weights)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    from .adapter import is_hooked

    assert not is_hooked(pair.target), "the baseline must run on an unhooked target"
    max_tokens = max_tokens or cfg.max_tokens
    sampler = None if cfg.greedy else make_sampler(cfg.temp, cfg.top_p, cfg.min_p,
                                                   top_k=cfg.top_k)
    eos = pair.eos_ids if cfg.use_eos else set()
    mx.random.seed(seed)
    tokens, reason = [], "length"
    clock = Clock()
    steps = generate_step(mx.array(ids), pair.target, max_tokens=max_tokens, sampler=sampler)
    for tok, _ in steps:
        if tok in eos:
            clock.tick(kept=False)
            reason = "stop"
            break
        tokens.append(tok)
        clock.tick()
    steps.close()
    return clock.result(tokens, len(ids), reason)


def run_dflash(pair: Any, ids: list[int], cfg: BenchConfig, block_size: int, seed: int,
               on_cycle: Callable[[int], Any] | None = None,
               max_tokens: int | None = None) -> Run:
    """DFlash through `stream_generate`, timed like the baseline; `on_cycle(accepted)`."""
    from .generate import stream_generate

    tokens, last = [], None
    clock = Clock()
    for ev in stream_generate(pair, ids, max_tokens=max_tokens or cfg.max_tokens,
                              block_size=block_size, temp=cfg.temp, top_p=cfg.top_p,
                              top_k=cfg.top_k, min_p=cfg.min_p, seed=seed,
                              use_eos=cfg.use_eos):
        clock.tick(kept=bool(ev.tokens))
        tokens += ev.tokens
        last = ev
        if ev.accepted and on_cycle:
            on_cycle(ev.accepted)
    return clock.result(tokens, len(ids), last.finish_reason, block_size=block_size,
                        acceptance_lengths=list(last.stats.acceptance_lengths))


def first_diff(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (None when equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


class Observer:
    """Callbacks of a bench run (the live view implements them); all optional."""

    def start(self, bp: BenchPrompt, trial: int, index: int, bs: int | None) -> None:
        """A run begins (`bs` None: the baseline)."""

    def cycle(self, bs: int, accepted: int) -> None:
        """A DFlash cycle committed `accepted` tokens."""

    def done(self, run: Run) -> None:
        """A run finished."""

    def checked(self, record: dict, greedy: bool) -> None:
        """All runs of one (trial, prompt) finished."""


def run_bench(pair: Any, prompts: list[BenchPrompt], ids: list[list[int]], cfg: BenchConfig,
              observer: Observer | None = None) -> list[dict]:
    """Warm up, then measure every (trial, prompt): baseline and DFlash per block size.

    Returns one record per (trial, prompt) with the baseline run and the DFlash runs."""
    obs = observer or Observer()
    # Warm-up: one short run of each kind (and block size) before anything is timed.
    w = min(cfg.warmup_tokens, cfg.max_tokens)
    run_baseline(pair, ids[0], cfg, cfg.seed, max_tokens=w)
    for bs in cfg.block_sizes:
        run_dflash(pair, ids[0], cfg, bs, cfg.seed, max_tokens=w)

    records = []
    for trial in range(cfg.trials):
        order = list(range(len(prompts)))
        random.Random(cfg.seed * 1_000_003 + trial).shuffle(order)
        for pos, i in enumerate(order):
            bp, seed = prompts[i], cfg.seed + 7919 * trial + i
            rec = {"id": bp.id, "suite": bp.suite, "trial": trial, "position": pos,
                   "prompt_tokens": len(ids[i]), "baseline": None, "dflash": {}}
            jobs: list[int | None] = [None, *cfg.block_sizes]
            if (trial + pos) % 2:  # alternate which kind runs first
                jobs = jobs[1:] + jobs[:1]
            for bs in jobs:
                if cfg.cooldown > 0:
                    time.sleep(cfg.cooldown)
                obs.start(bp, trial, pos, bs)
                if bs is None:
                    run = rec["baseline"] = run_baseline(pair, ids[i], cfg, seed)
                else:
                    run = rec["dflash"][bs] = run_dflash(
                        pair, ids[i], cfg, bs, seed, on_cycle=lambda a, b=bs: obs.cycle(b, a))
                obs.done(run)
            obs.checked(rec, cfg.greedy)
            records.append(rec)
    return records


# -- aggregation (pure) -------------------------------------------------------------------


def trial_tps(runs: list[Run]) -> float:
    """Decode tok/s of a set of runs: Σ decode tokens ÷ Σ decode time (token-weighted)."""
    t = sum(r.decode_time for r in runs)
    return sum(r.decode_tokens for r in runs) / t if t > 0 else 0.0


def summarize(records: list[dict], block_size: int, suite: str, greedy: bool) -> dict:
    """One report row: the records' baseline vs DFlash at `block_size`.

    Speeds are token-weighted per trial, then mean ± sample std over trials; speedup is
    DFlash ÷ baseline per trial. τ is the mean per request, then the mean over requests. The
    histogram, survival and per-position acceptance pool all cycles."""
    trials = sorted({r["trial"] for r in records})
    base_t, dfl_t, speed_t = [], [], []
    for t in trials:
        rs = [r for r in records if r["trial"] == t]
        b = trial_tps([r["baseline"] for r in rs])
        d = trial_tps([r["dflash"][block_size] for r in rs])
        base_t.append(b)
        dfl_t.append(d)
        speed_t.append(d / b if b > 0 else 0.0)
    base = [r["baseline"] for r in records]
    dfl = [r["dflash"][block_size] for r in records]
    lengths = [a for r in dfl for a in r.acceptance_lengths]
    taus = [r.tau for r in dfl if r.acceptance_lengths]
    checks = [r["dflash"][block_size].tokens == r["baseline"].tokens for r in records]
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
    return {
        "block_size": block_size,
        "suite": suite,
        "prompts": len({r["id"] for r in records}),
        "trials": len(trials),
        "runs": len(records),
        "baseline_tps": list(mean_std(base_t)),
        "dflash_tps": list(mean_std(dfl_t)),
        "speedup": list(mean_std(speed_t)),
        "tau": list(mean_std(taus)),
        "cycles": len(lengths),
        "histogram": histogram(lengths, block_size),
        "survival": survival(lengths, block_size),
        "position_acceptance": position_acceptance(lengths, block_size),
        "baseline_prefill_tps": mean([r.prefill_tps for r in base]),
        "dflash_prefill_tps": mean([r.prefill_tps for r in dfl]),
        "baseline_ttft_ms": 1000 * mean([r.ttft for r in base]),
        "dflash_ttft_ms": 1000 * mean([r.ttft for r in dfl]),
        "baseline_peak_bytes": max((r.peak_memory for r in base), default=0),
        "dflash_peak_bytes": max((r.peak_memory for r in dfl), default=0),
        "baseline_tokens": sum(len(r.tokens) for r in base),
        "dflash_tokens": sum(len(r.tokens) for r in dfl),
        "lossless_equal": sum(checks) if greedy else None,
        "lossless_checked": len(checks) if greedy else None,
    }


def summary_rows(records: list[dict], block_sizes: list[int], greedy: bool) -> list[dict]:
    """Rows per block size: one per suite, plus `all` when several suites ran."""
    suites = list(dict.fromkeys(r["suite"] for r in records))
    groups = [(s, [r for r in records if r["suite"] == s]) for s in suites]
    if len(suites) > 1:
        groups.append(("all", records))
    return [summarize(rs, bs, s, greedy) for bs in block_sizes for s, rs in groups]


def best_block_size(rows: list[dict]) -> int | None:
    """The block size with the highest DFlash decode tok/s over all prompts."""
    pool = [r for r in rows if r["suite"] == "all"] or rows
    return max(pool, key=lambda r: r["dflash_tps"][0])["block_size"] if pool else None


def mismatches(records: list[dict]) -> list[dict]:
    """Greedy lossless failures: (prompt, trial, block size, first differing index)."""
    out = []
    for r in records:
        for bs, run in r["dflash"].items():
            i = first_diff(run.tokens, r["baseline"].tokens)
            if i is not None:
                out.append({"id": r["id"], "trial": r["trial"], "block_size": bs,
                            "first_diff": i})
    return out


# -- report header and command ------------------------------------------------------------


def display_id(name: str) -> str:
    """Model id for reports: bundled folders by their short name, others as given."""
    from .loading import PACKAGE_MODELS

    try:
        rel = Path(name).resolve().relative_to(PACKAGE_MODELS / "bundled")
        return f"bundled/{rel}"
    except ValueError:
        return str(name)


def _quant(q: dict | None) -> str:
    return f"{q.get('bits', 4)}-bit g{q.get('group_size', 64)}" if q else "none"



def header(pair: Any) -> dict:
    """Machine, software and model facts for the report."""
    import datetime

    import mlx.core as mx
    from mlx.utils import tree_flatten

    from . import __version__
    from .platform import cpu_name, machine_summary

    def nbytes(model: Any) -> int:
        return sum(v.nbytes for _, v in tree_flatten(model.parameters()))

    floats = [v.dtype for _, v in tree_flatten(pair.target.parameters())
              if mx.issubdtype(v.dtype, mx.floating)]
    return {
        **machine_summary(),
        "cpu": cpu_name(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "dflash_mac": __version__,
        "target": display_id(pair.model_id),
        "draft": display_id(pair.draft_id),
        "drafter_kind": pair.kind,
        "target_quantization": _quant(pair.target_config.get("quantization")),
        "draft_quantization": _quant(pair.drafter.config.quantization),
        "dtype": str(floats[0]).replace("mlx.core.", "") if floats else "?",
        "target_weight_bytes": nbytes(pair.target),
        "drafter_weight_bytes": nbytes(pair.drafter),
    }


def load_average() -> float | None:
    """1-minute load average (None where the OS has none)."""
    import os

    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def busy_warning(warn: Callable[[str], Any]) -> float | None:
    """Warn when other processes already keep the CPUs busy; return the load average."""
    import os

    load, cpus = load_average(), os.cpu_count() or 1
    if load is not None and load > 0.5 * cpus:
        warn(f"the machine is busy (load average {load:.1f} on {cpus} CPUs); timings will be "
             "slower and noisier than on an idle machine.")
    return load


def limit_per_suite(prompts: list[BenchPrompt], limit: int | None) -> list[BenchPrompt]:
    """The first `limit` prompts of each suite (all when None)."""
    if not limit:
        return prompts
    seen: dict[str, int] = {}
    out = []
    for p in prompts:
        seen[p.suite] = seen.get(p.suite, 0) + 1
        if seen[p.suite] <= limit:
            out.append(p)
    return out


def bench_command(
    model: str | None = typer.Option(None, "--model", "-m", help="Target model (default: the "
                                     "bundled pair)."),
    draft: str | None = typer.Option(None, "--draft", "-d", help="DFlash drafter (default: "
                                     "the bundled pair)."),
    suite: str = typer.Option("code", "--suite", "-s", help="Prompt suite: code, math, chat "
                              "or all."),
    prompts_file: Path | None = typer.Option(None, "--prompts", help="JSONL prompts "
                                             "({\"id\", \"messages\"|\"prompt\"}) instead "
                                             "of a suite."),
    limit: int | None = typer.Option(None, "--limit", help="Use the first K prompts of "
                                     "each suite."),
    trials: int = typer.Option(2, "--trials", "-t", help="Measured passes over the prompts."),
    max_tokens: int = typer.Option(128, "--max-tokens", "-n",
                                   help="Tokens per generation at most."),
    block_size: str | None = typer.Option(None, "--block-size", "-b", help="Block size, or a "
                                          "comma-separated sweep such as 2,3,4,5,8."),
    temp: float = typer.Option(0.0, "--temp", help="Sampling temperature (0 = greedy, "
                               "lossless-checked)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass."),
    top_k: int = typer.Option(0, "--top-k", help="Keep the k most likely tokens (0 = all)."),
    min_p: float = typer.Option(0.0, "--min-p", help="Drop tokens below min_p * max prob."),
    seed: int = typer.Option(0, "--seed", help="Seed of the prompt shuffle and sampling."),
    draft_bits: int | None = typer.Option(None, "--draft-bits", help="Quantize the drafter "
                                          "to 4 or 8 bits."),
    reasoning: str | None = typer.Option(None, "--reasoning", help="Thinking mode for chat "
                                         "templates: on, off, low, medium, high, xhigh."),
    no_eos: bool = typer.Option(False, "--no-eos", help="Ignore EOS: always generate "
                                "--max-tokens tokens."),
    fmt: str = typer.Option("md", "--format", "-f", help="Report format on stdout: md, json, "
                            "jsonl or csv."),
    out: Path | None = typer.Option(None, "--out", help="Append the full report as one JSON "
                                    "line to FILE."),
    cooldown: float = typer.Option(0.0, "--cooldown", help="Seconds to sleep before each "
                                   "measured run."),
    strict: bool = typer.Option(False, "--strict", help="Exit non-zero if any greedy DFlash "
                                "output differs from the baseline."),
    live: bool | None = typer.Option(None, "--live/--no-live", help="Live view (default: "
                                     "when stderr is a terminal)."),
) -> None:
    """Benchmark DFlash against plain decoding of the same target, in one process."""
    from rich.console import Console

    from .bench_report import append_jsonl, build_report, render
    from .bench_view import BenchView, print_acceptance
    from .frontends import block_size_policy, load_pair
    from .generate import check_context, make_config, prompt_ids

    err = Console(stderr=True)
    check_format(fmt)
    sizes = parse_block_sizes(block_size)
    if trials < 1:
        raise BenchError(f"--trials must be at least 1 (got {trials}).")
    if cooldown < 0:
        raise BenchError(f"--cooldown must be >= 0 (got {cooldown}).")
    make_config(max_tokens=max_tokens, temp=temp, top_p=top_p, top_k=top_k, min_p=min_p)
    warn = lambda m: err.print(f"[yellow]warning:[/] {m}", highlight=False)  # noqa: E731
    prompts = read_prompts(prompts_file) if prompts_file else suite_prompts(suite, warn)
    prompts = limit_per_suite(prompts, limit)
    pair = load_pair(model, draft, draft_bits=draft_bits, reasoning=reasoning)
    sizes = list(dict.fromkeys(block_size_policy(pair, s, warn=err.print)
                               for s in sizes or [pair.block_size]))
    ids = [prompt_ids(pair.tokenizer, p.prompt, reasoning=reasoning) for p in prompts]
    for i in ids:
        check_context(pair, i, max_tokens)
    cfg = BenchConfig(sizes, max_tokens, trials, temp, top_p, top_k, min_p, seed, not no_eos,
                      cooldown)
    load_start = busy_warning(warn)
    with BenchView(err, len(prompts) * trials, sizes, live) as view:
        records = run_bench(pair, prompts, ids, cfg, view)
    config = {"suite": None if prompts_file else suite, "prompts_file":
              str(prompts_file) if prompts_file else None, "limit": limit, "trials": trials,
              "max_tokens": max_tokens, "block_sizes": sizes, "temp": temp, "top_p": top_p,
              "top_k": top_k, "min_p": min_p, "seed": seed, "use_eos": not no_eos,
              "reasoning": reasoning, "draft_bits": draft_bits, "cooldown_s": cooldown}
    load = [load_start, load_average()]
    doc = build_report(header(pair) | {"load_avg": load}, config, records, sizes, cfg.greedy)
    print_acceptance(err, doc)
    typer.echo(render(doc, fmt), nl=False)
    if out:
        append_jsonl(out, doc)
    bad, checked = doc["lossless"]["mismatches"], doc["lossless"]["checked"]
    if strict and not cfg.greedy:
        warn("--strict checks greedy runs only; nothing was checked at --temp > 0.")
    if bad:
        first = bad[0]
        msg = (f"lossless check failed: {len(bad)} of {checked} DFlash runs differ from the "
               f"baseline (first: {first['id']}, block {first['block_size']}, at token "
               f"{first['first_diff']}).")
        if strict:
            err.print(f"[bold red]error:[/] {msg}", highlight=False)
            raise typer.Exit(1)
        warn(msg)
