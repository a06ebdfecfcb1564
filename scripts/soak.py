"""A bounded soak run of `dflash-mac serve` (docs/editors.md, "Soak test").

Starts the installed `dflash-mac serve` on a pair (`--pair`, default the tiny `tiny-code`) in a
fresh subprocess on a free loopback port (offline, its data directory in a temporary folder;
`--lives K`: K servers one after another on that folder, each stopped by SIGTERM, the prefix
cache kept on disk between them) and, for `--minutes` in all, sends it
rounds of traffic from a few client threads: streaming and non-streaming OpenAI chat and
completions, Ollama /api/chat and /api/generate, clients that disconnect mid-stream, malformed
bodies, prompts over the context, and bursts past `--max-queue` (429). Anthropic Messages
requests, streaming and not, and disconnects from its stream are sent only when the server has
a /v1/messages route.

It passes when every well-formed request got its right status, nothing answered 5xx, the
server's log and stderr hold no traceback, the RSS after the run is within 10 % (at least 32 MB)
of the RSS after warm-up, /health is ok, and the request counts of /v1/dflash/stats, /metrics
and /health add up to what was sent. The summary (requests, errors by kind, RSS, p50/p95
latency by kind) is printed and written to OUT.json and OUT.md; the exit status is 0 on a
pass, 1 otherwise.

    .venv/bin/python scripts/soak.py --minutes 3 --out build/soak     # what `make soak` runs
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import httpx

MAX_QUEUE = 3  # the server's --max-queue: CLIENTS never overflow it, a burst always does
BURST = 10
CLIENTS = 3  # concurrent client threads in a traffic round
PER_ROUND = 2  # requests of each client thread in a round (and a disconnect every third)
SERVER_MAX_TOKENS = 256
REQUEST_TIMEOUT_S = 60.0
START_TIMEOUT_S = 240.0  # loading on a slow, busy machine
RSS_TOLERANCE = 0.10
RSS_FLOOR = 32 * 2**20  # a small process's bounded caches and allocator pools still filling
PROMPTS = [
    "Write a Python function that reverses a string.",
    "What does a hash map do?",
    "def fibonacci(n):",
    "Explain recursion in one sentence.",
    "import os\nfor name in os.listdir('.'):",
]
DISK_BYTES = 256 * 2**20  # with several lives: prefixes on disk, read back after a restart
MALFORMED = [  # (route, raw body): refused by validation, before the queue
    ("/v1/chat/completions", b"{not json"),
    ("/v1/chat/completions", b'{"messages": "hello"}'),
    (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}',
    ),
    (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}',
    ),
    ("/v1/completions", b'{"prompt": 42}'),
    ("/v1/completions", b"[1, 2, 3]"),
    ("/api/chat", b'{"model": "dflash-mac", "messages": "hi"}'),  # (no messages: a 200 "load")
    (
        "/api/chat",
        b'{"model": "dflash-mac", "messages": [{"role": "user", "content": "hi"}], "options": 1}',
    ),
    ("/api/generate", b"\xff\xfe not utf-8"),
    ("/api/generate", b'{"model": "dflash-mac", "prompt": "hi", "options": {"num_predict": "x"}}'),
]
WELL_FORMED = (
    "openai.chat",
    "openai.chat.stream",
    "openai.completions",
    "openai.completions.stream",
    "ollama.chat",
    "ollama.chat.stream",
    "ollama.generate",
    "ollama.generate.stream",
)


@dataclass
class Outcome:
    """One request: its kind, HTTP status (0: no answer), seconds, whether it was right."""

    kind: str
    status: int
    seconds: float
    ok: bool
    note: str = ""


class Tally:
    """Every outcome, from every client thread; the well-formed kinds taken in turn, so that
    even a short run sends each of them."""

    def __init__(self, kinds: list[str]) -> None:
        self.lock = threading.Lock()
        self.outcomes: list[Outcome] = []
        self.kinds = kinds
        self.turns: Counter = Counter()

    def add(self, o: Outcome) -> None:
        with self.lock:
            self.outcomes.append(o)

    def next(self, items: list, name: str):
        """The next of `items` in turn (a well-formed kind, a malformed body)."""
        with self.lock:
            self.turns[name] += 1
            return items[(self.turns[name] - 1) % len(items)]


# -- the server -------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def installed_command() -> str:
    found = shutil.which("dflash-mac", path=str(Path(sys.executable).parent))
    if not found:
        sys.exit("error: no dflash-mac next to this Python; run `make install` first.")
    return found


def rss_bytes(pid: int) -> int:
    """Resident memory of `pid`: /proc (Linux), else psutil, else `ps` (macOS)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil

        return psutil.Process(pid).memory_info().rss
    except ImportError:
        out = subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True)
        return int(out.stdout.strip() or 0) * 1024


class Server:
    """`dflash-mac serve` in a fresh process on loopback, stopped by its PID."""

    def __init__(self, home: Path, extra: list[str], pair: str = "tiny-code"):
        self.port = free_port()
        self.root = f"http://127.0.0.1:{self.port}"
        self.log, self.out = home / "serve.log", home / "serve.out"
        env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_MAC_")}
        env.update(DFLASH_MAC_HOME=str(home), HF_HUB_OFFLINE="1", NO_COLOR="1")
        # `auto`'s cost curve is measured once per machine (~25 s here), not what a soak is for
        env.update(DFLASH_MAC_CALIBRATE="0")
        self.command = [
            installed_command(),
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--max-queue",
            str(MAX_QUEUE),
            "--max-tokens",
            str(SERVER_MAX_TOKENS),
            "--log-file",
            str(self.log),
            "--model",
            pair,
            *extra,
        ]
        with self.out.open("w") as out:
            self.proc = subprocess.Popen(
                self.command,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        self.started = time.monotonic()

    def wait_healthy(self) -> float:
        deadline = self.started + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.root + "/health", timeout=2).status_code == 200:
                    [card] = httpx.get(self.root + "/v1/models", timeout=5).json()["data"]
                    # a prompt longer than this model's context: refused with a 400
                    self.oversize = "word " * (card["context_length"] + 64)
                    return time.monotonic() - self.started
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"serve did not answer /health in {START_TIMEOUT_S:.0f} s")

    def wait_idle(self, seconds: float = 60) -> None:
        """Until nothing runs or waits (cancelled generations end at their next cycle)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            h = httpx.get(self.root + "/health", timeout=5).json()
            if not h["busy"] and not h["queued"]:
                return
            time.sleep(0.2)

    def rss(self) -> int:
        return rss_bytes(self.proc.pid)

    def output(self) -> str:
        logs = [p.read_text(errors="replace") for p in (self.log, self.out) if p.exists()]
        return "\n".join(logs)

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


# -- the clients ------------------------------------------------------------------------------


def body_for(kind: str, rng: random.Random, max_tokens: int) -> tuple[str, dict]:
    """(route, JSON body) of a well-formed request of `kind`."""
    prompt, stream = rng.choice(PROMPTS), kind.endswith(".stream")
    temp = rng.choice([0.0, 0.0, 0.7])
    messages = [{"role": "user", "content": prompt}]
    if rng.random() < 0.3:  # a follow-up turn: the server reuses the cached prefix
        messages += [
            {"role": "assistant", "content": "Sure."},
            {"role": "user", "content": "More."},
        ]
    if kind.startswith("openai."):
        body = {"model": "dflash-mac", "max_tokens": max_tokens, "temperature": temp, "seed": 7}
        if kind.startswith("openai.chat"):
            return "/v1/chat/completions", {**body, "messages": messages, "stream": stream}
        return "/v1/completions", {**body, "prompt": prompt, "stream": stream}
    options = {"num_predict": max_tokens, "temperature": temp, "seed": 7}
    body = {"model": "dflash-mac", "stream": stream, "options": options}
    if kind.startswith("ollama.chat"):
        return "/api/chat", {**body, "messages": messages}
    return "/api/generate", {**body, "prompt": prompt}


def check_answer(kind: str, r: httpx.Response, lines: list[str]) -> str:
    """What is wrong with a 200 answer ("" when nothing)."""
    if kind.startswith("openai.") and kind.endswith(".stream"):
        data = [ln[6:] for ln in lines if ln.startswith("data: ")]
        if not data or data[-1] != "[DONE]":
            return "the SSE stream did not end with [DONE]"
        if any('"error"' in d for d in data):
            return "the SSE stream carried an error"
        finish = [c["finish_reason"] for d in data[:-1] for c in json.loads(d).get("choices", [])]
        return "" if {"stop", "length"} & set(finish) else "no finish_reason"
    if kind.startswith("ollama.") and kind.endswith(".stream"):
        objs = [json.loads(ln) for ln in lines if ln.strip()]
        return "" if objs and objs[-1].get("done") is True else "the NDJSON stream never said done"
    if kind == "anthropic.messages.stream":  # named SSE events, message_stop last
        events = [ln[7:] for ln in lines if ln.startswith("event: ")]
        if "error" in events:
            return "the event stream carried an error"
        return "" if events and events[-1] == "message_stop" else "no message_stop event"
    data = r.json()
    if kind.startswith("openai."):
        return "" if data["choices"][0]["finish_reason"] in ("stop", "length") else "bad finish"
    if kind == "anthropic.messages":
        return "" if data.get("type") == "message" else "not a message object"
    return "" if data.get("done") is True else "not done"


def send(client: httpx.Client, root: str, kind: str, route: str, body: dict) -> Outcome:
    """One well-formed request, read to its end."""
    t = time.monotonic()
    try:
        if kind.endswith(".stream"):
            with client.stream("POST", root + route, json=body) as r:
                if r.status_code == 200:
                    lines = list(r.iter_lines())
                else:
                    lines = [r.read().decode(errors="replace")]
        else:
            r, lines = client.post(root + route, json=body), []
    except httpx.HTTPError as e:
        return Outcome(kind, 0, time.monotonic() - t, False, f"{type(e).__name__}: {e}")
    seconds = time.monotonic() - t
    if r.status_code == 429:  # right only in a burst, and only with Retry-After
        return Outcome(kind, 429, seconds, False, f"Retry-After: {r.headers.get('retry-after')}")
    if r.status_code != 200:
        return Outcome(kind, r.status_code, seconds, False, r.text[:200])
    problem = check_answer(kind, r, lines)
    return Outcome(kind, 200, seconds, not problem, problem)


def disconnect(root: str, rng: random.Random, anthropic: bool = False) -> Outcome:
    """A streaming chat whose client goes away after its first chunks: OpenAI's, or where the
    server has the route, as often Anthropic's."""
    if anthropic and rng.random() < 0.5:
        route, body = "/v1/messages", anthropic_body(rng, True, SERVER_MAX_TOKENS)
    else:
        route, body = body_for("openai.chat.stream", rng, SERVER_MAX_TOKENS)
    t = time.monotonic()
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:  # its own connection, closed early
        try:
            with client.stream("POST", root + route, json=body) as r:
                status, chunks = r.status_code, 0
                for _ in r.iter_lines():
                    chunks += 1
                    if chunks >= 3:
                        break
        except httpx.HTTPError as e:
            return Outcome("disconnect", 0, time.monotonic() - t, False, str(e))
    return Outcome("disconnect", status, time.monotonic() - t, status == 200)


def malformed(client: httpx.Client, root: str, tally: Tally) -> Outcome:
    route, raw = tally.next(MALFORMED, "malformed")
    t = time.monotonic()
    headers = {"content-type": "application/json"}
    try:
        r = client.post(root + route, content=raw, headers=headers)
    except httpx.HTTPError as e:
        return Outcome("malformed", 0, time.monotonic() - t, False, str(e))
    return Outcome("malformed", r.status_code, time.monotonic() - t, r.status_code == 400, route)


def oversize(client: httpx.Client, root: str, rng: random.Random, text: str) -> Outcome:
    kind = rng.choice(["openai.chat", "openai.completions.stream", "ollama.generate"])
    route, body = body_for(kind, rng, 16)
    if "messages" in body:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    t = time.monotonic()
    try:
        r = client.post(root + route, json=body)
    except httpx.HTTPError as e:
        return Outcome("oversize", 0, time.monotonic() - t, False, str(e))
    return Outcome("oversize", r.status_code, time.monotonic() - t, r.status_code == 400, kind)


def burst(root: str, rng: random.Random, tally: Tally) -> None:
    """BURST requests at once: those past the queue get 429 with Retry-After, the rest 200."""
    seeds = [rng.random() for _ in range(BURST)]

    def one(seed: float) -> None:
        local = random.Random(seed)
        kind = local.choice(WELL_FORMED)
        route, body = body_for(kind, local, 32)
        with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
            o = send(client, root, kind, route, body)
        if o.status == 429:
            tally.add(Outcome("burst.429", 429, o.seconds, o.note != "Retry-After: None", o.note))
        else:
            tally.add(Outcome("burst." + kind, o.status, o.seconds, o.ok, o.note))

    run_threads([guarded(lambda s=s: one(s), tally) for s in seeds], REQUEST_TIMEOUT_S + 30)


def guarded(job, tally: Tally):
    """A client job whose crash is an outcome, not a lost request."""

    def run() -> None:
        try:
            job()
        except Exception as e:  # a client bug or a broken answer: counted as wrong
            tally.add(Outcome("client-error", 0, 0.0, False, f"{type(e).__name__}: {e}"))

    return run


def run_threads(jobs: list, timeout: float) -> None:
    threads = [threading.Thread(target=job, daemon=True) for job in jobs]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))


def client_loop(srv: Server, seed: int, tally: Tally, hang_up: bool) -> None:
    """One client thread's share of a round: well-formed requests of every kind, now and then
    a malformed body or an oversize prompt, and with `hang_up` a disconnect at the end (its
    request may still wait in the server's queue: nothing else from this client follows)."""
    rng, root = random.Random(seed), srv.root
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
        for _ in range(PER_ROUND):
            roll = rng.random()
            if roll < 0.1:
                tally.add(malformed(client, root, tally))
            elif roll < 0.17:
                tally.add(oversize(client, root, rng, srv.oversize))
            else:
                kind = tally.next(tally.kinds, "kind")
                if kind.startswith("anthropic.messages"):
                    route, body = "/v1/messages", anthropic_body(rng, kind.endswith(".stream"))
                else:
                    route, body = body_for(kind, rng, rng.choice([8, 16, 32]))
                tally.add(send(client, root, kind, route, body))
    if hang_up:
        tally.add(disconnect(root, rng, "anthropic.messages" in tally.kinds))


def anthropic_body(rng: random.Random, stream: bool = False, max_tokens: int = 32) -> dict:
    content = rng.choice(PROMPTS)
    return {
        "model": "dflash-mac",
        "max_tokens": max_tokens,
        "stream": stream,
        "messages": [{"role": "user", "content": content}],
    }


def has_messages_route(root: str) -> bool:
    """Whether the server speaks Anthropic's Messages API (a 404 / 405 says it does not)."""
    r = httpx.post(root + "/v1/messages", content=b"{}", timeout=10)
    return r.status_code not in (404, 405)


def traffic(srv: Server, seconds: float, rng: random.Random, tally: Tally, whole: bool) -> int:
    """Rounds until `seconds` have passed, at least one (`whole`: a multiple of three), in
    turn: client traffic, a burst, client traffic ending in disconnects (then the server is
    let go idle, so that no abandoned request holds a queue slot in the next round). Returns
    how many rounds ran."""
    end, rounds = time.monotonic() + seconds, 0
    while rounds == 0 or (whole and rounds % 3) or time.monotonic() < end:
        if rounds % 3 == 1:
            burst(srv.root, rng, tally)
        else:
            hang_up = rounds % 3 == 2
            seeds = [rng.randrange(1 << 30) for _ in range(CLIENTS)]
            jobs = [
                guarded(lambda s=s, h=hang_up: client_loop(srv, s, tally, h), tally) for s in seeds
            ]
            run_threads(jobs, (PER_ROUND + 1) * (REQUEST_TIMEOUT_S + 5))
            if hang_up:
                srv.wait_idle()
        rounds += 1
    return rounds


# -- the verdict ------------------------------------------------------------------------------


def percentile(values: list[float], p: float) -> float:
    values = sorted(values)
    if not values:
        return 0.0
    k = (len(values) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def prometheus_value(text: str, name: str) -> float | None:
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def verdict(outcomes: list[Outcome], server: dict, rss: dict, log: str) -> list[dict]:
    """The pass conditions, each with what was seen."""
    by = Counter(o.kind for o in outcomes)
    wrong = [o for o in outcomes if not o.ok]
    five = [o for o in outcomes if o.status >= 500]
    totals, health = server["stats"]["totals"], server["health"]
    accepted = sum(1 for o in outcomes if o.status == 200)
    rejected = sum(1 for o in outcomes if o.status == 429)
    over = by["oversize"]
    checks = [
        (
            "every well-formed request got its right status",
            not wrong,
            "; ".join(f"{o.kind} {o.status} {o.note}" for o in wrong[:5])
            or f"{len(outcomes)} requests",
        ),
        ("no 5xx", not five, f"{len(five)} answers >= 500"),
        (
            "no traceback in the server's log or stderr",
            "Traceback" not in log,
            "clean" if "Traceback" not in log else log[log.find("Traceback") :][:400],
        ),
        (
            f"RSS after the run within {RSS_TOLERANCE:.0%} (at least {RSS_FLOOR >> 20} MB) "
            "of RSS after warm-up",
            abs(rss["after"] - rss["warm"]) <= max(RSS_TOLERANCE * rss["warm"], RSS_FLOOR),
            f"{rss['change']:+.1%}, {(rss['after'] - rss['warm']) / 2**20:+.0f} MB",
        ),
        (
            "/health ok",
            health.get("status") == "ok" and health.get("failed") == 0,
            json.dumps(health),
        ),
        (
            "queued requests = 200s + oversize 400s (queued, then refused)",
            totals["requests"] == accepted + over,
            f"{totals['requests']} = {accepted} + {over}",
        ),
        (
            "completed + cancelled = 200s (disconnects may complete or be cancelled)",
            totals["completed"] + totals["cancelled"] == accepted,
            f"{totals['completed']} + {totals['cancelled']} = {accepted}",
        ),
        (
            "invalid = oversize prompts; rejected = 429s; failed = 0",
            (totals["invalid"], totals["rejected"], totals["failed"]) == (over, rejected, 0),
            f"invalid {totals['invalid']}/{over}, rejected {totals['rejected']}/{rejected}, "
            f"failed {totals['failed']}",
        ),
        (
            "/metrics, its Prometheus form and /health count alike",
            server["metrics"]["totals"] == totals
            and prometheus_value(server["prometheus"], "dflash_requests_total")
            == totals["requests"]
            and prometheus_value(server["prometheus"], "dflash_rejected_total")
            == totals["rejected"]
            and health.get("requests") == totals["requests"],
            "same totals",
        ),
        ("429s came (the queue overflowed at least once)", rejected > 0, f"{rejected} × 429"),
    ]
    return [{"check": c, "ok": bool(ok), "seen": seen} for c, ok, seen in checks]


def summarize(args, outcomes: list[Outcome], server: dict, rss: dict, checks, facts) -> dict:
    kinds = defaultdict(list)
    for o in outcomes:
        kinds[o.kind].append(o)
    latency = {
        k: {
            "n": len(v),
            "statuses": dict(Counter(str(o.status) for o in v)),
            "p50_s": round(percentile([o.seconds for o in v], 50), 4),
            "p95_s": round(percentile([o.seconds for o in v], 95), 4),
        }
        for k, v in sorted(kinds.items())
    }
    errors = Counter()
    for o in outcomes:
        if o.kind == "malformed":
            errors["malformed body (400)"] += 1
        elif o.kind == "oversize":
            errors["prompt over the context (400)"] += 1
        elif o.status == 429:
            errors["queue full (429)"] += 1
        elif o.kind == "disconnect":
            errors["client disconnected mid-stream"] += 1
        if not o.ok:
            errors["wrong answer"] += 1
        if o.status >= 500:
            errors["5xx"] += 1
    return {
        "tool": "scripts/soak.py",
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "minutes": args.minutes,
        "seed": args.seed,
        "machine": facts,
        "server": server["about"],
        "requests": len(outcomes),
        "rounds": server["rounds"],
        "pair": args.pair,
        "lives": server.get("lives", []),
        "errors_by_kind": dict(sorted(errors.items())),
        "skipped": server["skipped"],
        "rss_mb": {k: round(v / 2**20, 1) for k, v in rss.items() if k != "change"}
        | {"change_pct": round(100 * rss["change"], 2)},
        "server_totals": server["stats"]["totals"],
        "health": server["health"],
        "latency_by_kind": latency,
        "checks": checks,
        "pass": all(c["ok"] for c in checks),
    }


def markdown(s: dict) -> str:
    rows = [
        f"| {k} | {v['n']} | {', '.join(f'{a}×{b}' for a, b in v['statuses'].items())} | "
        f"{v['p50_s'] * 1000:.0f} | {v['p95_s'] * 1000:.0f} |"
        for k, v in s["latency_by_kind"].items()
    ]
    checks = [f"- {'✓' if c['ok'] else '✗'} {c['check']} ({c['seen']})" for c in s["checks"]]
    errors = [f"- {k}: {v}" for k, v in s["errors_by_kind"].items()] or ["- none"]
    m = s["machine"]
    return "\n".join(
        [
            f"# Soak run: {'PASS' if s['pass'] else 'FAIL'}",
            "",
            f"{s['date']}, {s['minutes']} min, seed {s['seed']}, code {m['code']}; {m['cpu']} "
            f"({m['cores']} cores, {m['system']}, 1-minute load {m['load_1min']} at the end); "
            f"`{' '.join(s['server']['command'])}`, started in {s['server']['startup_s']:.1f} s.",
            "",
            f"{s['requests']} requests in {s['rounds']} rounds ({CLIENTS} client threads; the "
            f"second of every three rounds a burst of {BURST} against --max-queue {MAX_QUEUE}, "
            "the third ends in disconnects). "
            f"RSS {s['rss_mb']['warm']:.0f} MB after warm-up, {s['rss_mb']['after']:.0f} MB after "
            f"the run ({s['rss_mb']['change_pct']:+.1f} %"
            + (", the largest drift of any life)." if len(s["lives"]) > 1 else ")."),
            *(
                [
                    "",
                    f"{len(s['lives'])} lives of the server on one data directory (SIGTERM, then "
                    "a fresh process; cached prefixes on disk between them):",
                    "",
                    *(
                        f"- life {i + 1}: started in {x['startup_s']} s, {x['requests']} "
                        f"requests, RSS {x['rss_mb'][0]:.0f} → {x['rss_mb'][1]:.0f} MB, exit "
                        f"{x['exit']}"
                        for i, x in enumerate(s["lives"])
                    ),
                ]
                if len(s["lives"]) > 1
                else []
            ),
            *([""] + [f"Skipped: {x}" for x in s["skipped"]] if s["skipped"] else []),
            "",
            "| kind | requests | statuses | p50 ms | p95 ms |",
            "| --- | ---: | --- | ---: | ---: |",
            *rows,
            "",
            "Errors by kind (expected ones included):",
            "",
            *errors,
            "",
            "Checks:",
            "",
            *checks,
            "",
        ]
    )


def machine_facts() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    git = ["git", "-C", str(Path(__file__).parent), "rev-parse", "--short", "HEAD"]
    code = subprocess.run(git, capture_output=True, text=True).stdout.strip()
    return {
        "system": f"{platform.system()} {platform.machine()}",
        "cpu": cpu,
        "cores": os.cpu_count(),
        "code": code or "unknown",  # the commit (the working tree may differ)
        "load_1min": round(os.getloadavg()[0], 2),  # other work on the machine, at the end
    }


def server_state(root: str) -> dict:
    get = lambda path: httpx.get(root + path, timeout=10)  # noqa: E731
    return {
        "stats": get("/v1/dflash/stats").json(),
        "metrics": get("/metrics").json(),
        "prometheus": get("/metrics?format=prometheus").text,
        "health": get("/health").json(),
    }


def life(home: Path, args, rng: random.Random, minutes: float) -> dict:
    """One server's life in `home`: warm-up traffic of every kind, then `minutes` in all of
    mixed traffic, then SIGTERM; its outcomes, state, RSS and checks."""
    extra = [*args.serve_arg, *(["--prompt-cache-disk-bytes", str(DISK_BYTES)] * (args.lives > 1))]
    srv = Server(home, extra, args.pair)
    try:
        startup = srv.wait_healthy()
        anthropic = has_messages_route(srv.root)
        skipped = [] if anthropic else ["Anthropic-shaped requests: no /v1/messages route"]
        routes = ["anthropic.messages", "anthropic.messages.stream"] if anthropic else []
        tally = Tally([*WELL_FORMED, *routes])
        end = time.monotonic() + minutes * 60
        rounds = traffic(srv, 0.2 * minutes * 60, rng, tally, whole=True)  # every kind
        srv.wait_idle()
        rss_warm = srv.rss()
        rounds += traffic(srv, end - time.monotonic(), rng, tally, whole=False)
        srv.wait_idle()
        rss_after = srv.rss()
        state = server_state(srv.root)
    finally:
        code = srv.stop()
    rss = {"warm": rss_warm, "after": rss_after, "change": rss_after / rss_warm - 1}
    command = ["DFLASH_MAC_CALIBRATE=0", "dflash-mac", *srv.command[1:]]
    state.update(about={"command": command, "startup_s": startup, "exit": code})
    state.update(rounds=rounds, skipped=skipped)
    checks = verdict(tally.outcomes, state, rss, srv.output())
    checks.append({"check": "the server exits 0 on SIGTERM", "ok": code == 0, "seen": str(code)})
    for name in ("serve.log", "serve.out"):  # the next life writes its own
        (home / name).replace(home / f"{name}.{time.monotonic_ns()}")
    return {"outcomes": tally.outcomes, "state": state, "rss": rss, "checks": checks}


def soak(args) -> dict:
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="dflash-soak-") as tmp:
        lives = [life(Path(tmp), args, rng, args.minutes / args.lives) for _ in range(args.lives)]
    outcomes = [o for one in lives for o in one["outcomes"]]
    checks = [
        {**c, "check": f"life {i + 1}: {c['check']}" if args.lives > 1 else c["check"]}
        for i, one in enumerate(lives)
        for c in one["checks"]
    ]
    state = lives[-1]["state"]
    state["rounds"] = sum(one["state"]["rounds"] for one in lives)
    state["lives"] = [
        {
            "startup_s": round(one["state"]["about"]["startup_s"], 1),
            "exit": one["state"]["about"]["exit"],
            "requests": len(one["outcomes"]),
            "rss_mb": [round(one["rss"][k] / 2**20, 1) for k in ("warm", "after")],
        }
        for one in lives
    ]
    rss = max((one["rss"] for one in lives), key=lambda r: abs(r["change"]))  # the worst drift
    return summarize(args, outcomes, state, rss, checks, machine_facts())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=3.0, help="How long to send traffic.")
    ap.add_argument(
        "--out", type=Path, default=Path("build/soak"), help="Writes OUT.json + OUT.md."
    )
    ap.add_argument("--seed", type=int, default=0, help="Seed of the traffic mix.")
    ap.add_argument("--pair", default="tiny-code", help="The pair `serve` loads (--model).")
    ap.add_argument(
        "--lives", type=int, default=1, help="Servers one after another (restarts), >= 1."
    )
    ap.add_argument(
        "--serve-arg", action="append", default=[], help="An extra `serve` argument (repeatable)."
    )
    args = ap.parse_args()
    if not 0 < args.minutes <= 120:
        sys.exit(f"error: --minutes must be in (0, 120] (got {args.minutes}).")
    if args.lives < 1:
        sys.exit(f"error: --lives must be at least 1 (got {args.lives}).")
    try:
        summary = soak(args)
    except RuntimeError as e:  # the server did not start
        sys.exit(f"error: {e}")
    out = args.out.with_suffix("") if args.out.suffix in (".json", ".md") else args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(summary, indent=1) + "\n")
    text = markdown(summary)
    Path(f"{out}.md").write_text(text)
    print(text)
    print(f"wrote {out}.json and {out}.md")
    sys.exit(0 if summary["pass"] else 1)


if __name__ == "__main__":
    main()
