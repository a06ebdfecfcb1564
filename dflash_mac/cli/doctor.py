"""`dflash-mac doctor`: is this machine ready for DFlash? Each check passes, warns or fails with
one line of advice; the command exits non-zero when any check fails."""

from __future__ import annotations

import json
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import typer
from rich.console import Console

from dflash_mac.platform import cpu_name
from dflash_mac.registry import PairEntry, load_registry

PASS, WARN, FAIL = "pass", "warn", "fail"
MIN_MLX_LM = (0, 30)
OVERHEAD_GB = 0.5  # runtime, activations of a verify block, Metal buffers
# A request like those the bundled pair was trained on (chat template, a standard-library
# function), so τ says something about the pair; raw text makes it fall back to plain steps.
SELFTEST_PROMPT = (
    "In the Python module `textwrap`, write the function `dedent(text)`: "
    "Remove any common leading whitespace from every line in text."
)
SELFTEST_TOKENS = 24
out = Console()


@dataclass
class Check:
    """One doctor line: a status, what was found, and what to do about it."""

    name: str
    status: str
    message: str
    advice: str = ""


@dataclass
class Facts:
    """What the checks look at, gathered once (tests build their own)."""

    system: str
    machine: str
    chip: str
    macos: str
    mlx: str
    mlx_lm: str
    metal: bool
    kernels: str
    kernels_error: str
    blas: str
    memory_bytes: int
    budget_bytes: int
    hf_cache: Path
    offline: bool


def _version_tuple(v: str) -> tuple[int, ...]:
    parts = []
    for p in v.split("."):
        digits = "".join(c for c in p if c.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def _device_info() -> dict:
    import mlx.core as mx

    for get in (getattr(mx, "device_info", None), getattr(mx.metal, "device_info", None)):
        try:
            if get is not None:
                return dict(get())
        except Exception:
            continue
    return {}


def _chip(info: dict) -> str:
    if name := info.get("device_name"):
        return str(name)
    return cpu_name()


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _kernels() -> tuple[str, str]:
    from dflash_mac.metal_kernels import kernels_in_use

    try:
        return kernels_in_use(), ""
    except ValueError as e:  # e.g. an invalid DFLASH_MAC_KERNELS
        return "error", str(e)


def gather_facts() -> Facts:
    """Look at this machine once."""
    import mlx.core as mx

    from dflash_mac.platform import blas_in_use

    from .models import hf_cache_dir

    try:
        from importlib.metadata import version

        mlx_lm = version("mlx-lm")
    except Exception:
        mlx_lm = "missing"
    try:
        metal = bool(mx.metal.is_available())
    except Exception:
        metal = False
    info = _device_info()
    memory = int(info.get("memory_size") or _physical_memory())
    budget = int(info.get("max_recommended_working_set_size") or 0.75 * memory)
    kernels, kernels_error = _kernels()
    return Facts(
        system=sys.platform,
        machine=platform.machine(),
        chip=_chip(info),
        macos=platform.mac_ver()[0],
        mlx=mx.__version__,
        mlx_lm=mlx_lm,
        metal=metal,
        kernels=kernels,
        kernels_error=kernels_error,
        blas=blas_in_use(),
        memory_bytes=memory,
        budget_bytes=budget,
        hf_cache=hf_cache_dir(),
        offline=os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"),
    )


def check_platform(f: Facts) -> Check:
    """Apple Silicon and a recent macOS; Linux runs on the CPU only."""
    if f.system == "darwin":
        if f.machine != "arm64":
            return Check(
                "platform",
                FAIL,
                f"Intel Mac ({f.chip}), macOS {f.macos}",
                "MLX needs Apple Silicon (M1 or later); run natively, not under Rosetta.",
            )
        v = _version_tuple(f.macos)
        if v < (13, 5):
            return Check(
                "platform",
                FAIL,
                f"{f.chip}, macOS {f.macos}",
                "MLX needs macOS 13.5 or later; update macOS.",
            )
        if v < (14,):
            return Check(
                "platform",
                WARN,
                f"{f.chip}, macOS {f.macos}",
                "update to macOS 14 or later for faster Metal kernels.",
            )
        return Check("platform", PASS, f"{f.chip}, macOS {f.macos}")
    if f.system.startswith("linux"):
        return Check(
            "platform",
            WARN,
            f"Linux {f.machine} ({f.chip}): MLX on the CPU only",
            "fine for tests and tiny pairs; real models need an Apple Silicon Mac.",
        )
    return Check(
        "platform",
        FAIL,
        f"{f.system} {f.machine} is not supported",
        "use an Apple Silicon Mac (or Linux for CPU tests).",
    )


def check_mlx(f: Facts) -> Check:
    """MLX and a new enough mlx-lm."""
    msg = f"mlx {f.mlx}, mlx-lm {f.mlx_lm}"
    if f.mlx_lm == "missing" or _version_tuple(f.mlx_lm) < MIN_MLX_LM:
        need = ".".join(map(str, MIN_MLX_LM))
        return Check("mlx", FAIL, msg, f"install mlx-lm >= {need}: pip install -U mlx-lm")
    return Check("mlx", PASS, msg)


def check_metal(f: Facts) -> Check:
    """The Metal GPU backend."""
    if f.metal:
        return Check("metal", PASS, "Metal available: MLX runs on the GPU")
    if f.system == "darwin":
        return Check(
            "metal",
            FAIL,
            "Metal not available",
            "run a native arm64 Python (not under Rosetta) with the `mlx` wheel.",
        )
    return Check(
        "metal",
        WARN,
        "no Metal on this OS: MLX runs on the CPU",
        "expected off macOS; decoding is much slower than on a Mac GPU.",
    )


def check_kernels(f: Facts) -> Check:
    """Which DFlash 2 kernels run: the Metal ones or the exact MLX reference ops."""
    if f.kernels == "error":
        return Check(
            "kernels",
            FAIL,
            f.kernels_error,
            "unset DFLASH_MAC_KERNELS or set it to auto, metal or reference.",
        )
    if f.kernels == "metal":
        return Check("kernels", PASS, "DFlash 2 kernels: Metal")
    if f.metal:
        return Check(
            "kernels",
            WARN,
            "DFlash 2 kernels: reference although Metal is available",
            "unset DFLASH_MAC_KERNELS=reference for the faster Metal kernels.",
        )
    return Check("kernels", PASS, "DFlash 2 kernels: reference (exact MLX ops; no Metal)")


def check_blas(f: Facts) -> Check:
    """The CPU BLAS behind MLX's matmuls (Linux: OpenBLAS preloaded by the CLI)."""
    if f.system == "darwin" or f.blas in ("Accelerate", "OpenBLAS"):
        return Check("blas", PASS, f"CPU BLAS: {f.blas}")
    return Check(
        "blas",
        WARN,
        f"CPU BLAS: {f.blas} (fp32 matmuls ~30x slower)",
        "install OpenBLAS (apt install libopenblas0); the dflash-mac command preloads "
        "it unless DFLASH_MAC_BLAS=reference.",
    )


def memory_need_gb(entry: PairEntry, context: int, full: bool = False) -> dict[str, float]:
    """Estimated memory of a pair: weights (4-bit target unless `full`), drafter, KV cache at
    `context` tokens, and a fixed runtime overhead, in GB."""
    target = entry.target_gb if full or entry.mlx_4bit_gb is None else entry.mlx_4bit_gb
    kv = entry.kv_kib_per_token * 1024 * context / 1e9
    parts = {"target": target, "drafter": entry.draft_gb, "kv": kv, "overhead": OVERHEAD_GB}
    parts["total"] = sum(parts.values())
    return parts


def memory_per_rank_gb(entry: PairEntry, context: int, ranks: int) -> dict[str, float]:
    """A target sharded over `ranks` Macs (tensor parallel: weights and KV heads split
    evenly), the drafter on rank 0 only: what rank 0 and each other rank need, in GB."""
    need = memory_need_gb(entry, context)
    share = (need["target"] + need["kv"]) / ranks + need["overhead"]
    return {"rank0": share + need["drafter"], "worker": share, "total": need["total"]}


def check_memory(f: Facts, entry: PairEntry, context: int, ranks: int = 1) -> Check:
    """Unified memory vs what the chosen pair needs at the chosen context (per rank when the
    target is sharded over `ranks` Macs: `dflash-mac launch`)."""
    from .models import fmt_size

    need = memory_need_gb(entry, context)
    have, budget = f.memory_bytes / 1e9, f.budget_bytes / 1e9
    msg = (
        f"'{entry.name}' needs ≈{need['total']:.1f} GB at {context} tokens (weights "
        f"{fmt_size((need['target'] + need['drafter']) * 1e9)} + KV "
        f"{fmt_size(need['kv'] * 1e9)}); {have:.1f} GB memory, {budget:.1f} GB usable "
        "for models"
    )
    if ranks > 1:
        per = memory_per_rank_gb(entry, context, ranks)
        need = {"total": per["rank0"]}
        msg = (
            f"'{entry.name}' over {ranks} Macs needs ≈{per['rank0']:.1f} GB on rank 0 (its "
            f"share of the target and KV + the drafter) and ≈{per['worker']:.1f} GB on each "
            f"other rank at {context} tokens; this Mac has {have:.1f} GB, {budget:.1f} GB "
            "usable for models"
        )
    if not have:
        return Check("memory", WARN, msg, "could not read this machine's memory size.")
    if need["total"] <= budget:
        return Check("memory", PASS, msg)
    if need["total"] <= have:
        return Check(
            "memory",
            WARN,
            msg,
            "tight: close other apps, use a shorter --context, or a smaller pair.",
        )
    return Check(
        "memory",
        FAIL,
        msg,
        "does not fit: choose a smaller pair (`dflash-mac models`) or a 4-bit target.",
    )


def _existing_parent(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_hf_cache(f: Facts, entry: PairEntry | None = None) -> Check:
    """The Hugging Face cache: where, writable, and room for the chosen pair."""
    from .models import fmt_size, pair_cache, pair_ready, scan_cache

    base = _existing_parent(f.hf_cache)
    if not os.access(base, os.W_OK):
        return Check(
            "hf cache",
            FAIL,
            f"{f.hf_cache} is not writable",
            "set HF_HOME (or HF_HUB_CACHE) to a writable folder.",
        )
    try:
        cache = scan_cache(f.hf_cache)
    except Exception as e:  # a corrupted cache must not break the doctor
        return Check(
            "hf cache",
            WARN,
            f"{f.hf_cache} could not be scanned ({e})",
            "inspect it with `hf cache scan` and delete broken repos.",
        )
    free = shutil.disk_usage(base).free
    used = fmt_size(sum(r.size_bytes for r in cache.values()))
    msg = f"{f.hf_cache}: {len(cache)} models, {used}, {fmt_size(free)} free" + (
        " (offline: HF_HUB_OFFLINE)" if f.offline else ""
    )
    if entry is not None and not entry.local and not pair_ready(entry, pair_cache(entry, cache)):
        need = entry.download_gb() * 1e9
        if f.offline:
            return Check(
                "hf cache",
                WARN,
                msg + f"; '{entry.name}' is not cached",
                f"go online and run `dflash-mac pull {entry.name}`.",
            )
        if free < need:
            return Check(
                "hf cache",
                WARN,
                msg + f"; '{entry.name}' needs ≈{fmt_size(need)}",
                "free disk space or point HF_HOME at a larger disk.",
            )
    return Check("hf cache", PASS, msg)


def reference_tokens(pair, ids: list[int], n: int) -> list[int]:
    """mlx-lm's own greedy decoding of the target (no hooks): the lossless reference."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    return [int(t) for t, _ in generate_step(mx.array(ids), pair.target, max_tokens=n)]


def dflash_tokens(pair, ids: list[int], n: int) -> tuple[list[int], float]:
    """Greedy DFlash decoding at the pair's block size; the token ids and τ. A fixed size, not
    `auto`: τ then tells how well the drafter predicts, whatever this machine's cost curve says
    drafting is worth (with a curve that prices it out, `auto` decodes plain steps, τ ≈ 1), and
    the self-test leaves no acceptance memory behind."""
    from dflash_mac.decode import GenerationConfig, speculative_stream

    cfg = GenerationConfig(max_tokens=n, block_size=pair.block_size, use_eos=False)
    events = list(speculative_stream(pair, ids, cfg))
    return [t for e in events for t in e.tokens], events[-1].stats.tau


def selftest_ids(pair) -> list[int]:
    """The self-test prompt as the front ends build it (chat template when there is one)."""
    from dflash_mac.api import prompt_ids

    return prompt_ids(pair.tokenizer, SELFTEST_PROMPT)


def on_worker_thread(fn: Callable[[], object]) -> object:
    """`fn()` on a fresh thread, as `serve` and the chat app decode: a pair whose weights were
    left lazy at load fails there (MLX arrays belong to the thread that made them)."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except Exception as e:  # handed to the caller
            box["error"] = e

    thread = threading.Thread(target=run, name="dflash-selftest", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]


def load_selftest_pair(tmp: str) -> tuple[object, bool]:
    """The bundled pair in fp32 (exact), or a tiny random pair when it is not built yet."""
    import mlx.core as mx

    from dflash_mac.loading import BUNDLED_DRAFT, BUNDLED_TARGET, load

    if (BUNDLED_DRAFT / "config.json").exists():
        return load(BUNDLED_TARGET, BUNDLED_DRAFT, dtype=mx.float32), True
    from dflash_mac.testing.tiny import build_tiny_pair

    return load(*build_tiny_pair(tmp, seed=0, target_layers=4), dtype=mx.float32), False


def check_selftest(
    loader: Callable[[str], tuple[object, bool]] = load_selftest_pair, n: int = SELFTEST_TOKENS
) -> Check:
    """Load the bundled pair on this thread, decode on a worker thread (as `serve` and the chat
    app do) and check greedy DFlash output == mlx-lm greedy output."""
    t0 = time.perf_counter()
    advice = "reinstall dflash-mac; report it with `dflash-mac doctor --json` if it persists."
    with tempfile.TemporaryDirectory() as tmp:
        try:
            pair, bundled = loader(tmp)
            ids = selftest_ids(pair)
        except Exception as e:  # any failure here is the finding
            return Check("self-test", FAIL, f"the self-test pair could not load ({e})", advice)
        try:
            got, tau = on_worker_thread(lambda: dflash_tokens(pair, ids, n))
            ref = on_worker_thread(lambda: reference_tokens(pair, ids, n))
        except Exception as e:
            return Check(
                "self-test",
                FAIL,
                f"decoding on a worker thread failed ({e}); "
                "`serve` and `chat` would fail the same way",
                advice,
            )
    secs = time.perf_counter() - t0
    what = "bundled pair" if bundled else "tiny random pair (bundled pair missing)"
    if got != ref:
        k = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
        return Check(
            "self-test",
            FAIL,
            f"{what}: DFlash output differs from mlx-lm at token {k}",
            "DFlash is not lossless here; report a bug with `dflash-mac doctor --json`.",
        )
    msg = (
        f"{what} decodes losslessly on a worker thread: {n} tokens == mlx-lm greedy "
        f"(τ {tau:.2f}, {secs:.1f} s)"
    )
    if bundled:
        from dflash_mac.loading import BUNDLED_DRAFT
        from dflash_mac.models.config import training_note

        if note := training_note(BUNDLED_DRAFT):
            msg += f"; drafter trained for {note}"
    if not bundled:
        return Check(
            "self-test",
            WARN,
            msg,
            "build the bundled pair (python -m dflash_mac.bundle.build) or reinstall.",
        )
    return Check("self-test", PASS, msg)


def run_checks(
    pair: str | None = None,
    context: int = 4096,
    selftest: bool = True,
    facts: Facts | None = None,
    hosts: int = 1,
) -> list[Check]:
    """All checks, in display order."""
    reg = load_registry()
    entry = reg.get(pair) if pair else reg.default_pair
    if entry is None:
        entry = reg.find_target(pair)
    f = facts or gather_facts()
    checks = [check_platform(f), check_mlx(f), check_metal(f), check_kernels(f), check_blas(f)]
    if entry is None:
        checks.append(
            Check("memory", FAIL, f"unknown pair '{pair}'", "pick a name from `dflash-mac models`.")
        )
    else:
        checks.append(check_memory(f, entry, context, hosts))
    checks.append(check_hf_cache(f, entry))
    if selftest:
        checks.append(check_selftest())
    return checks


MARK = {PASS: "[green]✓[/]", WARN: "[yellow]![/]", FAIL: "[red]✗[/]"}


def print_checks(checks: list[Check], console: Console = out) -> None:
    for c in checks:
        console.print(f"{MARK[c.status]} [bold]{c.name:<9}[/] {c.message}", highlight=False)
        if c.advice and c.status != PASS:
            console.print(f"  [dim]→ {c.advice}[/]", highlight=False)
    counts = {s: sum(c.status == s for c in checks) for s in (PASS, WARN, FAIL)}
    console.print(f"{counts[PASS]} passed, {counts[WARN]} warnings, {counts[FAIL]} failed")


def doctor_command(
    pair: str | None = typer.Option(
        None, "--pair", help="Pair to size memory for (default: the registry default)."
    ),
    context: int = typer.Option(
        4096, "--context", min=1, help="Context length (tokens) for the KV estimate."
    ),
    selftest: bool = typer.Option(
        True, "--selftest/--no-selftest", help="Run the lossless decode self-test."
    ),
    hosts: int = typer.Option(
        1, "--hosts", min=1, help="Macs the target is sharded over (memory per rank)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of lines."),
) -> None:
    """Check this machine: platform, MLX, Metal, kernels, BLAS, memory, cache, self-test."""
    facts = gather_facts()
    checks = run_checks(pair, context, selftest, facts, hosts)
    if as_json:
        ok = all(c.status != FAIL for c in checks)
        report = {"ok": ok, "checks": [asdict(c) for c in checks], "facts": asdict(facts)}
        typer.echo(json.dumps(report, indent=1, default=str))
    else:
        print_checks(checks)
    if any(c.status == FAIL for c in checks):
        raise typer.Exit(1)
