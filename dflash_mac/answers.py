"""The target's own answers by plain batched decoding (mlx-lm's `BatchGenerator`): what a
drafter trains on (`train/data.py`) and what a draft vocabulary is counted on
(`draft_vocab.py`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx


def regenerate(
    target: Any,
    tokenizer: Any,
    prompts: list[list[int]],
    max_tokens: int,
    temp: float = 0.0,
    seed: int = 0,
    batch_size: int = 32,
    on_done: Callable[[int, list[int]], None] | None = None,
) -> list[list[int]]:
    """The target's responses (plain decoding, batched). A response keeps its EOS token."""
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.sample_utils import make_sampler

    mx.random.seed(seed)
    eos = list(tokenizer.eos_token_ids)
    gen = BatchGenerator(
        target,
        stop_tokens=[[t] for t in eos],
        sampler=make_sampler(temp) if temp > 0 else None,
        completion_batch_size=batch_size,
        prefill_batch_size=min(8, batch_size),
    )
    # shortest prompts first: a batch of similar lengths does not decode every row at the
    # length of its longest prompt
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    uids = gen.insert([prompts[i] for i in order], [max_tokens] * len(prompts))
    index = {u: i for u, i in zip(uids, order)}
    results: list[list[int]] = [[] for _ in prompts]
    try:
        while responses := gen.next_generated():
            for r in responses:
                i = index[r.uid]
                results[i].append(int(r.token))  # the stop token is kept (drafter learns EOS)
                if r.finish_reason is not None and on_done:
                    on_done(i, results[i])
    finally:
        gen.close()
    return results
