"""Where a decode cycle's time goes on this machine: the ops a wide verify and the drafter pass
add over a one-token step, timed one by one (docs/bench.md, "Where a cycle's time goes").

    LD_PRELOAD=<libopenblas.so.0> .venv/bin/python scripts/cpu_costs.py [MODEL DRAFT]

Medians of synchronous runs (build + eval), in µs; run it on an idle machine.
"""

from __future__ import annotations

import io
import re
import statistics
import time
from collections.abc import Callable

import mlx.core as mx

from dflash_mac.engine.decode import DecodeState, prefill
from dflash_mac.engine.drafts import propose
from dflash_mac.engine.verify import SamplingParams
from dflash_mac.loading.loader import load
from dflash_mac.target.capture import FeatureCapture


def us(f: Callable[[], object], reps: int = 300) -> float:
    """Median µs of `mx.eval(f())` after a warm-up."""
    times = []
    for i in range(reps + 20):
        t = time.perf_counter()
        mx.eval(f())
        if i >= 20:
            times.append(time.perf_counter() - t)
    return 1e6 * statistics.median(times)


def primitives(outputs) -> int:
    """MLX primitives in the (unevaluated) graph of `outputs`."""
    dot = io.StringIO()
    mx.export_to_dot(dot, outputs)
    return len(re.findall(r'label ?="([A-Za-z]+)', dot.getvalue()))


def per_primitive() -> None:
    x = mx.ones((8,))
    mx.eval(x)

    def chain():
        y = x
        for _ in range(1000):
            y = y + 1
        return y

    print(f"  1,000 adds on 8 floats: {us(chain, 100) / 1000:.1f} µs per primitive")


def elementwise() -> None:
    x = mx.random.normal((1 << 16,))
    mx.eval(x)
    n = x.size
    for name, f in [("add", lambda: x + 1.0), ("exp", lambda: mx.exp(x)), ("sigmoid", None)]:
        f = f or (lambda: mx.sigmoid(x))
        print(f"  {name:<8} {1000 * us(f) / n:6.2f} ns per element")


def rows(hidden: int = 256, inter: int = 768, vocab: int = 4096) -> None:
    w_up, w_head = mx.random.normal((inter, hidden)), mx.random.normal((vocab, hidden))
    mx.eval(w_up, w_head)
    for n in (1, 8):
        x, y = mx.random.normal((1, n, hidden)), mx.random.normal((1, n, inter))
        mx.eval(x, y)
        up = us(lambda x=x: x @ w_up.T)
        head = us(lambda x=x: x @ w_head.T)
        silu = us(lambda y=y: y * mx.sigmoid(y))
        print(
            f"  {n} row(s): {hidden}→{inter} matmul {up:5.0f} µs · "
            f"LM head {head:5.0f} µs · SiLU on {inter} {silu:5.0f} µs"
        )


def attention(heads: int = 4, kv_heads: int = 2, head_dim: int = 64) -> None:
    cache = mx.random.normal((1, kv_heads, 2048, head_dim))
    mx.eval(cache)
    for keys in (128, 1500):
        k = v = cache[:, :, :keys]
        cells = []
        for n in (1, 8):
            q = mx.random.normal((1, heads, n, head_dim))
            mx.eval(q)
            mask = "causal" if n > 1 else None

            def sdpa(q=q, k=k, v=v, mask=mask):
                return mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)

            cells.append(f"{n} quer{'y' if n == 1 else 'ies'} {us(sdpa):5.0f} µs")
        print(f"  {keys:>4} keys: " + " · ".join(cells))


def cycle_parts(model: str | None = None, draft: str | None = None) -> None:
    pair = load(model, draft)
    vocab = pair.drafter.config.vocab_size
    ids = [(7919 * i + 11) % vocab for i in range(128)]
    state, sp, key = DecodeState(pair), SamplingParams(0.0), mx.random.key(0)
    with FeatureCapture(pair.target, pair.layer_ids) as cap:
        prefill(pair, state, ids, cap, 2048)

        def forward(n: int) -> float:
            t = time.perf_counter()
            mx.eval(pair.target(mx.array([ids[-n:]]), cache=state.target_cache))
            seconds = time.perf_counter() - t
            for c in state.target_cache:
                c.trim(n)
            return seconds

        times: dict[int, list[float]] = {1: [], 8: []}
        for i in range(400):  # alternating, so both see the same stretches of the host
            for n in times:
                seconds = forward(n)
                if i >= 50:
                    times[n].append(seconds)
        step, wide = (1e6 * statistics.median(times[n]) for n in (1, 8))
        one = pair.target(mx.array([ids[-1:]]), cache=state.target_cache)
        print(
            f"  target, 1 token: {step:.0f} µs ({primitives(one)} primitives); "
            f"8 tokens: {wide / step:.2f}×"
        )
        for c in state.target_cache:
            c.trim(1)
        d = pair.drafter
        for bs in (2, 8):
            block = mx.array([ids[-1]] + [d.config.mask_token_id] * (bs - 1))
            draft = us(lambda b=block: propose(pair, b, state.draft_cache, sp, key)[0], 100)
            n = primitives(propose(pair, block, state.draft_cache, sp, key)[0])
            print(
                f"  drafter pass at block {bs}: {draft:.0f} µs = {draft / step:.2f} steps"
                f" ({n} primitives)"
            )
        block = mx.array([ids[-1]] + [d.config.mask_token_id] * 7)  # block 8's parts
        hidden = d.hidden(block[None], state.draft_cache)[:, 1:]
        logits = d.draft_logits(hidden)  # the draft vocabulary's rows, when it has one
        mx.eval(hidden, logits)
        vocab = d.get("draft_vocab")
        layers = us(lambda: d.hidden(block[None], state.draft_cache), 100)
        head = us(lambda: d.draft_logits(hidden), 100)
        sel = d.candidate_selector
        top = us(lambda: sel.candidates(logits, vocab), 100)
        walk = us(lambda: sel.walk(hidden, logits, block[:1], vocab=vocab)[0], 100)
        feats = mx.random.normal((1, 3, len(pair.layer_ids) * d.config.hidden_size))
        attn = d.layers[0].self_attn
        ctx = us(lambda: attn.keys_values(d.project_context(feats), 0), 100)
        rows = logits.shape[-1]
        print(
            f"    of it at block 8: layers {layers:.0f} µs · LM head over {rows:,} rows "
            f"{head:.0f} µs · top-{d.config.selector_top_k} {top:.0f} µs · the walk with "
            f"its top-k {walk:.0f} µs; after a cycle, 3 rows of context {ctx:.0f} µs"
        )


if __name__ == "__main__":
    import sys

    if len(sys.argv) == 3:  # `cpu_costs.py MODEL DRAFT`: that pair's cycle parts only
        print(f"{sys.argv[1]} with {sys.argv[2]}:")
        cycle_parts(sys.argv[1], sys.argv[2])
        raise SystemExit
    print("per primitive (MLX CPU):")
    per_primitive()
    print("element-wise ops (MLX CPU):")
    elementwise()
    print("a wide verify's rows (bundled target's sizes):")
    rows()
    print("attention, 4 heads over 2 KV heads of 64:")
    attention()
    print("the bundled pair:")
    cycle_parts()
