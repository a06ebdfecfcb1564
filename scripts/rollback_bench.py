"""Rollback strategies for hybrid targets, measured per decode cycle (docs/rollback.md).

    python scripts/rollback_bench.py [--hidden 512] [--layers 8] [--tokens 160]

Builds a random qwen3_5 target (GatedDeltaNet + attention) in memory, decodes with a drafter
that knows the target's greedy text but is wrong 30% of the time (so rejections happen), and
times the rollback of each strategy: `replay` (recurrence over the accepted steps from the
saved state) and `rerun` (the accepted inputs through the whole layer again). The rollback is
evaluated on its own (one extra sync) so that its cost is not hidden in the next verify.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import generate_step

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from dflash_mac.models.config import DraftConfig
from dflash_mac.models.dflash import DFlashDraftModel
from helpers.oracle import OracleDrafter  # noqa: E402
from helpers.tiny import draft_config  # noqa: E402
from helpers.tiny_hybrid import build_hybrid_target, hybrid_text_config  # noqa: E402

from dflash_mac.engine.decode import DecodeState, GenerationConfig, speculative_stream
from dflash_mac.loading.loader import LoadedPair
from dflash_mac.sizing.choice import BlockChoice
from dflash_mac.target.rollback import TargetRollback
from dflash_mac.target.structure import target_head


@dataclass
class Timing:
    rollback: list[float] = field(default_factory=list)  # seconds, cycles with a rejection
    cycle: list[float] = field(default_factory=list)  # seconds, every cycle (rollback included)


class TimedRollback(TargetRollback):
    def __init__(self, *args, timing: Timing, **kw):
        super().__init__(*args, **kw)
        self.timing = timing

    def rollback(self, n_rejected: int, acc: int) -> None:
        t0 = time.perf_counter()
        super().rollback(n_rejected, acc)
        if n_rejected:
            mx.eval([c.state for c in self.cache])
            self.timing.rollback.append(time.perf_counter() - t0)


def build_pair(hidden: int, layers: int, vocab: int) -> LoadedPair:
    mx.random.seed(0)
    text = hybrid_text_config(
        vocab=vocab,
        hidden=hidden,
        layers=layers,
        interval=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=hidden // 8,
        linear_num_key_heads=hidden // 128,
        linear_key_head_dim=128,
        linear_num_value_heads=hidden // 64,
        linear_value_head_dim=64,
        intermediate_size=3 * hidden,
    )
    cfg = {"model_type": "qwen3_5", "text_config": text, "tie_word_embeddings": True}
    target = build_hybrid_target(cfg, weight_scale=2.0)
    dcfg = draft_config(dict(text, rope_theta=1e4), vocab - 1, layer_ids=[1, layers // 2])
    drafter = DFlashDraftModel(DraftConfig.from_dict(dcfg))
    drafter.bind(target_head(target))
    return LoadedPair(target, drafter, None, "bench-hybrid", "bench-draft", 16, cfg)


def measure(pair: LoadedPair, ids: list[int], ref: list[int], strategy: str, bs: int) -> Timing:
    timing = Timing()
    drafter = OracleDrafter(pair.drafter, ids + ref, pair.drafter.config.vocab_size, 0.3, seed=bs)
    oracle = LoadedPair(pair.target, drafter, _Tok(), "", "", bs, pair.target_config)
    state = DecodeState(oracle)
    state.rollback = TimedRollback(pair.target, state.target_cache, strategy, timing=timing)
    cfg = GenerationConfig(max_tokens=len(ref), block=BlockChoice(bs), use_eos=False, copy=False)
    tokens, t0 = [], None
    for ev in speculative_stream(oracle, ids, cfg, state=state):
        tokens += ev.tokens
        if t0 is not None:
            timing.cycle.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
    assert tokens == ref, "the benchmark decode diverged from the target's greedy output"
    return timing


class _Detok:
    text = ""

    def add_token(self, token: int) -> None:
        pass

    def finalize(self) -> None:
        pass


class _Tok:
    """No text: the benchmark only needs token ids."""

    eos_token_ids: list[int] = []

    @property
    def detokenizer(self) -> _Detok:
        return _Detok()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--block-sizes", default="5,16")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    pair = build_pair(args.hidden, args.layers, args.vocab)
    ids = [(7 * i + 3) % (args.vocab - 1) for i in range(64)]
    ref = [t for t, _ in generate_step(mx.array(ids), pair.target, max_tokens=args.tokens)]
    n_gdn = sum(1 for c in pair.target.make_cache() if not c.is_trimmable())
    print(
        f"qwen3_5 random target: hidden {args.hidden}, {args.layers} layers ({n_gdn} "
        f"GatedDeltaNet), {mx.default_device()}, {args.tokens} tokens, drafter 30% wrong"
    )
    print("medians over all cycles of all repeats (strategies interleaved)\n")
    print(
        "| block | strategy | rollback ms (rejected cycle) | cycles rejected | "
        "rollback ms per cycle | cycle ms | share of cycle |"
    )
    print("|---|---|---|---|---|---|---|")
    for bs in (int(b) for b in args.block_sizes.split(",")):
        runs: dict[str, Timing] = {s: Timing() for s in ("replay", "rerun")}
        for strategy in runs:
            measure(pair, ids, ref[:24], strategy, bs)  # warm up
        for _ in range(args.repeats):
            for strategy, total in runs.items():
                t = measure(pair, ids, ref, strategy, bs)
                total.rollback += t.rollback
                total.cycle += t.cycle
        for strategy, t in runs.items():
            rej = len(t.rollback) / len(t.cycle)
            per_rej = 1e3 * statistics.median(t.rollback)
            cycle = 1e3 * statistics.median(t.cycle)
            print(
                f"| {bs} | {strategy} | {per_rej:.2f} | {100 * rej:.0f}% | "
                f"{per_rej * rej:.2f} | {cycle:.1f} | {100 * per_rej * rej / cycle:.1f}% |"
            )


if __name__ == "__main__":
    main()
