"""The doctor's self-test: a pair loaded on this thread decodes greedily on a worker thread, as
`serve` and the chat app decode, and must match mlx-lm's own greedy output token for token."""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Callable

from .checks import FAIL, PASS, WARN, Check

# A request like those the bundled pair was trained on (chat template, a standard-library
# function), so τ says something about the pair; raw text makes it fall back to plain steps.
SELFTEST_PROMPT = (
    "In the Python module `textwrap`, write the function `dedent(text)`: "
    "Remove any common leading whitespace from every line in text."
)
SELFTEST_TOKENS = 24
ADVICE = "reinstall dflash-mac; report it with `dflash-mac doctor --json` if it persists."


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
    from dflash_mac.engine.decode import GenerationConfig, speculative_stream
    from dflash_mac.sizing.choice import BlockChoice

    cfg = GenerationConfig(max_tokens=n, block=BlockChoice(pair.block_size), use_eos=False)
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

    from dflash_mac.loading.loader import BUNDLED_DRAFT, BUNDLED_TARGET, load

    if (BUNDLED_DRAFT / "config.json").exists():
        return load(BUNDLED_TARGET, BUNDLED_DRAFT, dtype=mx.float32), True
    from dflash_mac.loading.random_pair import build_random_pair

    return load(*build_random_pair(tmp, seed=0, target_layers=4), dtype=mx.float32), False


def check_selftest(
    loader: Callable[[str], tuple[object, bool]] = load_selftest_pair, n: int = SELFTEST_TOKENS
) -> Check:
    """Load the bundled pair on this thread, decode on a worker thread (as `serve` and the chat
    app do) and check greedy DFlash output == mlx-lm greedy output."""
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            pair, bundled = loader(tmp)
            ids = selftest_ids(pair)
        except Exception as e:  # any failure here is the finding
            return Check("self-test", FAIL, f"the self-test pair could not load ({e})", ADVICE)
        try:
            got, tau = on_worker_thread(lambda: dflash_tokens(pair, ids, n))
            ref = on_worker_thread(lambda: reference_tokens(pair, ids, n))
        except Exception as e:
            return Check(
                "self-test",
                FAIL,
                f"decoding on a worker thread failed ({e}); "
                "`serve` and `chat` would fail the same way",
                ADVICE,
            )
    return verdict(got, ref, tau, n, time.perf_counter() - t0, bundled)


def verdict(
    got: list[int], ref: list[int], tau: float, n: int, secs: float, bundled: bool
) -> Check:
    """The self-test's line once both decodings ran: lossless or the first differing token."""
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
    if not bundled:
        return Check(
            "self-test",
            WARN,
            msg,
            "build the bundled pair (python -m dflash_mac.bundle.build) or reinstall.",
        )
    from dflash_mac.loading.loader import BUNDLED_DRAFT
    from dflash_mac.models.config import training_note

    if note := training_note(BUNDLED_DRAFT):
        msg += f"; drafter trained for {note}"
    return Check("self-test", PASS, msg)
