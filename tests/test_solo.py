"""A lone request in the batch engine runs as alone (`batching.scheduler.Solo`): the one-request
loop's cycles on its own state, handed back to the batch at a cycle boundary when another
arrives."""

from __future__ import annotations

from dataclasses import replace

import pytest
from helpers.lossy import accepting_every_draft
from helpers.oracle import OracleDrafter, with_drafter
from test_batch import CHUNK, PROMPTS, V_TINY, alone, batched, config, on_thread  # noqa: F401
from test_sampling import PROMPT, chi_square_p, exact_joint, small_pair  # noqa: F401

from dflash_mac.api import make_config
from dflash_mac.batching.scheduler import BatchEngine
from dflash_mac.engine import drafts
from dflash_mac.engine.verify import SamplingParams
from dflash_mac.sizing.choice import BlockChoice
from dflash_mac.sizing.tuning import AutoTuning


def test_a_lone_request_runs_alone_then_shares_the_batch_and_stays_exact(tiny_pair, on_thread):  # noqa: F811
    """Request 0 starts alone (`auto`, the one-request loop), request 1 arrives after a few
    steps: 0 is handed back and both decode batched; once 1 ends, 0 runs alone again. Each
    gets exactly its tokens alone, one last event each, and its caches end at prompt + output."""

    def run():
        pair = tiny_pair
        ids = [pair.tokenizer.encode(p) for p in PROMPTS[:2]]
        jobs = [(ids[0], config(60, block=BlockChoice(8, auto=True))), (ids[1], config(12))]
        refs = [alone(pair, i, config(c.max_tokens, block=BlockChoice(3))) for i, c in jobs]
        engine = BatchEngine(pair, 4, 3, auto=False, solo=AutoTuning())
        got = batched(pair, jobs, engine, late={1: 4})
        return refs, got, engine.stats.as_dict()

    refs, got, stats = on_thread(run)
    assert [r["tokens"] for r in got] == refs
    assert [r["reason"] for r in got] == ["length", "length"]
    assert stats["handed_back"] == 1 and stats["cycles"] > 0  # batched while both were in
    assert stats["solo_cycles"] >= 4  # before request 1 came and after it left
    lone = got[0]["req"]
    assert len(lone.row.rec.sizes) == stats["solo_cycles"] + stats["cycles"]  # every cycle counted
    assert lone.state.ids == lone.ids + refs[0][:-1]  # the last token is committed, not cached
    assert lone.state.target_cache[0].offset == len(lone.state.ids)


def test_the_batch_learns_the_drafters_acceptance_from_a_lone_request(tiny_pair, on_thread):  # noqa: F811
    """Chains drafted alone teach the batch's rule (prior 0.5 per position): an oracle that
    is always right raises it, a random drafter lowers it, with no batched cycle at all."""

    def run():
        ids = tiny_pair.tokenizer.encode(PROMPTS[1])
        ref = alone(tiny_pair, ids, config(30, block=BlockChoice(4)))
        right = with_drafter(tiny_pair, OracleDrafter(tiny_pair.drafter, ids + ref, V_TINY))
        alphas = []
        for pair in (right, tiny_pair):
            engine = BatchEngine(pair, 4, 4, auto=False, solo=AutoTuning())
            got = batched(pair, [(ids, config(30, block=BlockChoice(4)))], engine)[0]
            assert got["tokens"] == ref and engine.stats.cycles == 0
            alphas.append(engine.rule.alpha)
        return alphas

    right, random = on_thread(run)
    assert right > 0.7 and random < 0.2  # from 0.5, each cycle moving it by a tenth


def test_a_seeded_lone_request_samples_the_text_it_samples_alone(tiny_pair, on_thread):  # noqa: F811
    """Its keys come from one sequence of its seed, the first token's (drawn by the batch)
    included: the sampled text is the one `speculative_stream` samples with that seed."""

    def run():
        pair = tiny_pair
        ids = pair.tokenizer.encode(PROMPTS[3])
        sp = SamplingParams(temperature=0.9)
        out = []
        for block in (BlockChoice(3), BlockChoice(8, auto=True)):
            cfg = config(40, block=block, sampling=sp, seed=11)
            ref = alone(pair, ids, cfg)
            engine = BatchEngine(pair, 4, 8, auto=False, solo=AutoTuning())
            got = batched(pair, [(ids, cfg)], engine)[0]["tokens"]
            other = alone(pair, ids, replace(cfg, seed=12))
            out.append((ref, got, other, engine.stats.solo_cycles))
        return out

    for ref, got, other, solo in on_thread(run):
        assert solo > 0 and got == ref
        assert other != ref  # the seed decides the text


def test_a_lone_request_cancelled_ends_once_with_its_caches_trimmed(tiny_pair, on_thread):  # noqa: F811
    def run():
        pair = tiny_pair
        ids = pair.tokenizer.encode(PROMPTS[2])
        ref = alone(pair, ids, config(40, block=BlockChoice(4)))
        engine = BatchEngine(pair, 4, 4, auto=False, solo=AutoTuning())
        got = batched(pair, [(ids, config(40, block=BlockChoice(4)))], engine, stop_after={0: 9})
        return ref, got[0], engine.stats.as_dict()

    ref, got, stats = on_thread(run)
    assert stats["solo_cycles"] > 0 and stats["decoding"] == 0
    assert got["reason"] == "cancelled" and 9 <= len(got["tokens"]) < 40
    assert got["tokens"] == ref[: len(got["tokens"])]
    state = got["req"].state
    assert len(state.ids) <= len(got["req"].ids) + len(got["tokens"])
    assert state.target_cache[0].offset == len(state.ids)


def test_a_lone_row_under_a_grammar_drafts_as_alone(tiny_pair, on_thread):  # noqa: F811
    """In a batch a grammar's row takes plain steps (test_batch); alone it drafts under the
    grammar as `generate` does, with an oracle drafter's right drafts accepted."""

    def run():
        ids = tiny_pair.tokenizer.encode(PROMPTS[0])
        obj = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
        schema = make_config(40, json_schema=obj, copy=False)
        cfg = replace(schema, prefill_step_size=CHUNK, use_eos=False, block=BlockChoice(5))
        ref = alone(tiny_pair, ids, cfg)
        pair = with_drafter(tiny_pair, OracleDrafter(tiny_pair.drafter, ids + ref, V_TINY))
        out = {}
        for solo in (None, AutoTuning()):
            engine = BatchEngine(pair, 3, 5, auto=False, solo=solo)
            got = batched(pair, [(ids, cfg)], engine)[0]
            out[solo is not None] = got["tokens"], set(got["req"].row.rec.sizes), got["reason"]
        return ref, out

    ref, out = on_thread(run)
    text = tiny_pair.tokenizer.decode(ref)
    assert text.replace(" ", "").startswith('{"name":"')  # held to the schema
    assert out[False][0] == ref and out[False][1] == {1}  # batched: plain steps
    assert out[True][0] == ref and max(out[True][1]) == 5  # alone: blocks of 5
    assert out[True][2] == out[False][2] == "length"  # a long string: cut at 40 tokens


def staggered_samples(pair, sp: SamplingParams, n: int) -> tuple[list[tuple], dict]:
    """n seeded requests of 3 tokens; request k arrives at step 3k: it runs alone until the
    next one arrives and is handed back to the batch mid-request."""
    engine = BatchEngine(pair, 8, 4, auto=False, solo=AutoTuning())
    jobs = [(PROMPT, config(3, sampling=sp, seed=s, block=BlockChoice(3))) for s in range(n)]
    got = batched(pair, jobs, engine, late={k: 3 * k for k in range(1, n)})
    return [tuple(r["tokens"]) for r in got], engine.stats.as_dict()


@pytest.mark.slow
def test_sampling_alone_and_handed_back_is_the_targets_distribution(small_pair, on_thread):  # noqa: F811
    sp = SamplingParams(temperature=1.0)
    joint = exact_joint(small_pair, sp)
    samples, stats = on_thread(lambda: staggered_samples(small_pair, sp, 1200))
    assert stats["solo_cycles"] > 600 and stats["handed_back"] > 300 and stats["cycles"] > 300
    assert chi_square_p(samples, joint) > 0.001


@pytest.mark.slow
def test_a_lossy_rule_alone_is_detected(small_pair, on_thread, monkeypatch):  # noqa: F811
    """The check sees the cycles run alone: accepting every draft there (the one-request
    loop's rule; the batch's is untouched) fails it."""
    sp = SamplingParams(temperature=1.0)
    joint = exact_joint(small_pair, sp)
    real = drafts.accept_sampled
    accept_all = accepting_every_draft(real)

    monkeypatch.setattr(drafts, "accept_sampled", accept_all)
    samples, _ = on_thread(lambda: staggered_samples(small_pair, sp, 500))
    assert chi_square_p(samples, joint) < 1e-6
