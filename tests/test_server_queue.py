"""Back-pressure: a bounded queue, 429 + Retry-After beyond it, queue positions in `dflash`."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from servers import running

from dflash_mac.serve.app import create_app


@pytest.fixture
def server(tiny_pair):
    app = create_app(tiny_pair, max_tokens=8, max_queue=1)
    with running(app) as root:
        yield app, root


def wait_until(predicate, seconds: float = 20) -> None:
    deadline = time.time() + seconds
    while not predicate():
        assert time.time() < deadline, "timed out"
        time.sleep(0.02)


def test_queue_full_gets_429_with_retry_after(server, monkeypatch):
    app, root = server
    session, worker = app.state.session, app.state.worker
    real, gate = session.stream, threading.Event()

    def held(*args, **kwargs):  # the first request holds the worker until the gate opens
        gate.wait(30)
        yield from real(*args, **kwargs)

    monkeypatch.setattr(session, "stream", held)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "ignore_eos": True}
    url = root + "/v1/chat/completions"
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(httpx.post, url, json=body, timeout=60)
        wait_until(lambda: worker.busy)
        second = pool.submit(httpx.post, url, json={**body, "stream": True}, timeout=60)
        wait_until(lambda: worker.queued == 1)
        r = httpx.post(url, json=body, timeout=10)
        assert r.status_code == 429
        assert int(r.headers["retry-after"]) >= 1
        err = r.json()["error"]
        assert err["code"] == "queue_full" and "busy" in err["message"]
        client = openai.OpenAI(base_url=root + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.RateLimitError):
            client.chat.completions.create(model="m", messages=body["messages"], max_tokens=1)
        gate.set()
        one, two = first.result(), second.result()
    assert one.json()["dflash"]["queue_position"] == 0
    finals = [line for line in two.text.splitlines() if '"finish_reason": "length"' in line]
    assert '"queue_position": 1' in finals[0]
    stats = httpx.get(root + "/v1/dflash/stats", timeout=10).json()
    assert stats["totals"]["rejected"] == 2 and stats["max_queue"] == 1
    assert stats["last"]["queue_wait_s"] > 0
