"""`serve --max-batch`: concurrent clients decode together, each answer as it is alone."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from servers import running

from dflash_mac.serve.app import create_app

QUESTIONS = ["def add(a, b):", "import os", "class Stack:", "hello", "x = [1, 2", "while True:"]


def ask(root: str, i: int, **kw) -> str:
    client = openai.OpenAI(base_url=root + "/v1", api_key="x", max_retries=0)
    q = QUESTIONS[i % len(QUESTIONS)]
    if kw.pop("stream", False):
        parts = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": q}], stream=True, **kw
        )
        return "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": q}], **kw)
    return r.choices[0].message.content


def answers(root: str, n: int, concurrent: bool) -> list[str]:
    kw = {"max_tokens": 24, "temperature": 0, "extra_body": {"ignore_eos": True}}
    if not concurrent:
        return [ask(root, i, **kw) for i in range(n)]
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda i: ask(root, i, stream=i % 2 == 1, **kw), range(n)))


@pytest.fixture(scope="module")
def solo(tiny_pair):
    with running(create_app(tiny_pair, max_tokens=64)) as root:
        return answers(root, 6, concurrent=False)


def test_concurrent_clients_decode_together_and_answer_as_alone(tiny_pair, solo):
    app = create_app(tiny_pair, max_tokens=64, max_batch=4, max_queue=8)
    with running(app) as root:
        got = answers(root, 6, concurrent=True)
        stats = httpx.get(root + "/v1/dflash/stats", timeout=10).json()
    assert got == solo
    batch = stats["batch"]
    assert batch["max_batch"] == 4 and batch["mean_occupancy"] > 1.0
    assert sum(batch["block_mix"].values()) == batch["cycles"]
    assert stats["totals"]["requests"] == 6 and not stats["busy"]


def test_one_client_at_a_time_runs_alone_in_a_batching_server(tiny_pair, solo):
    """A lone request runs the one-request loop (its controller, trees, drafts under a
    grammar): the same answers, no batched cycle, and the stats say so."""
    with running(create_app(tiny_pair, max_tokens=64, max_batch=4)) as root:
        got = answers(root, 3, concurrent=False)
        batch = httpx.get(root + "/v1/dflash/stats", timeout=10).json()["batch"]
    assert got == solo[:3]
    assert batch["cycles"] == 0 and batch["solo_cycles"] >= 3 and batch["handed_back"] == 0


def test_structured_output_joins_the_batch_and_answers_as_alone(tiny_pair, solo):
    app = create_app(tiny_pair, max_tokens=64)
    kw = {"max_tokens": 24, "temperature": 0, "response_format": {"type": "json_object"}}
    with running(app) as root:
        shaped_alone = ask(root, 2, **kw)
    app = create_app(tiny_pair, max_tokens=64, max_batch=4)
    with running(app) as root:
        plain_kw = {"max_tokens": 24, "temperature": 0, "extra_body": {"ignore_eos": True}}
        with ThreadPoolExecutor(3) as pool:
            plain = [pool.submit(ask, root, i, **plain_kw) for i in (0, 1)]
            shaped = pool.submit(ask, root, 2, **kw)
            assert [f.result() for f in plain] == solo[:2]
            assert shaped.result() == shaped_alone and shaped_alone.lstrip().startswith("{")
        batch = httpx.get(root + "/v1/dflash/stats", timeout=10).json()["batch"]
    assert batch["mean_occupancy"] > 1.0


def logprobs_of(root: str, i: int, **kw) -> list[tuple]:
    client = openai.OpenAI(base_url=root + "/v1", api_key="x", max_retries=0)
    q = QUESTIONS[i % len(QUESTIONS)]
    r = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": q}], logprobs=True, top_logprobs=3, **kw
    )
    return [
        (t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs])
        for t in r.choices[0].logprobs.content
    ]


def test_logprobs_requests_batch_and_equal_their_answers_alone(tiny_pair):
    kw = {"max_tokens": 20, "temperature": 0, "extra_body": {"ignore_eos": True}}
    with running(create_app(tiny_pair, max_tokens=64)) as root:
        alone = [logprobs_of(root, i, **kw) for i in range(3)]
    with running(create_app(tiny_pair, max_tokens=64, max_batch=4)) as root:
        with ThreadPoolExecutor(3) as pool:
            got = list(pool.map(lambda i: logprobs_of(root, i, **kw), range(3)))
        batch = httpx.get(root + "/v1/dflash/stats", timeout=10).json()["batch"]
    assert batch["mean_occupancy"] > 1.0  # they decoded together
    assert len(got[0]) == 20
    for a, b in zip(got, alone):  # the same tokens, their log-probabilities to rounding
        assert [t for t, *_ in a] == [t for t, *_ in b]
        assert [lp for _, lp, _ in a] == pytest.approx([lp for _, lp, _ in b], abs=1e-4)
        assert [[t for t, _ in top] for *_, top in a] == [[t for t, _ in top] for *_, top in b]


def test_a_cancelled_stream_leaves_the_batch_and_the_others_finish(tiny_pair, solo):
    app = create_app(tiny_pair, max_tokens=400, max_batch=4)
    worker = app.state.worker
    with running(app) as root:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 400}
        body |= {"stream": True, "ignore_eos": True}
        with ThreadPoolExecutor(2) as pool:
            other = pool.submit(answers, root, 2, True)
            with httpx.stream("POST", root + "/v1/chat/completions", json=body, timeout=60) as r:
                for _ in zip(r.iter_lines(), range(4)):  # a few chunks, then hang up
                    pass
            assert other.result() == solo[:2]
        deadline = time.time() + 20
        while worker.busy and time.time() < deadline:
            time.sleep(0.05)
        stats = httpx.get(root + "/v1/dflash/stats", timeout=10).json()
    assert not stats["busy"] and stats["batch"]["decoding"] == 0
    assert stats["totals"]["cancelled"] >= 1


def test_requests_keep_their_own_block_sizes_in_one_batch(tiny_pair, solo):
    """`block_size` per request: rows of sizes 1, 3 and auto share the batch, each answers as
    alone and reports its size; past the drafter's trained block is a 400."""
    app = create_app(tiny_pair, max_tokens=64, max_batch=4)
    sizes = [1, 3, "auto"]

    def run(i: int) -> dict:
        body = {"messages": [{"role": "user", "content": QUESTIONS[i]}], "max_tokens": 24}
        body |= {"temperature": 0, "ignore_eos": True, "block_size": sizes[i]}
        return httpx.post(root + "/v1/chat/completions", json=body, timeout=120).json()

    with running(app) as root:
        with ThreadPoolExecutor(3) as pool:
            got = list(pool.map(run, range(3)))
        batch = httpx.get(root + "/v1/dflash/stats", timeout=10).json()["batch"]
        body = {"messages": [{"role": "user", "content": "hi"}], "block_size": 99}
        refused = httpx.post(root + "/v1/chat/completions", json=body, timeout=60)
    assert [g["choices"][0]["message"]["content"] for g in got] == solo[:3]
    assert batch["mean_occupancy"] > 1.0
    trained = tiny_pair.drafter.config.block_size
    assert [g["dflash"]["block_size"] for g in got] == [1, 3, trained]
    assert got[0]["dflash"]["draft_cycles"] == 0 and got[1]["dflash"]["draft_cycles"] > 0
    assert refused.status_code == 400 and "block_size" in refused.json()["error"]["message"]
