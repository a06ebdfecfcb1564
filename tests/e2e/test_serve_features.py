"""What serving users expect from `dflash-mac serve`, each checked on the installed command:
browser preflights (CORS), a terminal line per request and `--log-level`, `--chat-template`,
Ollama's `show` for the name the docs use, and `dflash-mac ps` / `stop`."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import httpx
import ollama
import openai
import pytest

from .conftest import Cli, Server, installed_command, start_serve, user_env

pytestmark = pytest.mark.slow  # starts the installed command in subprocesses

# Not the bundled model's own template: "[user] hi\n[assistant] " for one message.
TEMPLATE = (
    "{%- for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{%- if add_generation_prompt %}[assistant] {% endif %}"
)
RENDERED = "[user] hi\n[assistant] "
LINE = re.compile(r"(\w+) (\S+) (\d{3}) · (\d+) tok · [\d.]+ tok/s · τ [\d.]+ · [\d.]+ s")


@pytest.fixture(scope="module")
def template_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("template") / "chat.jinja"
    path.write_text(TEMPLATE)
    return path


@pytest.fixture(scope="module")
def custom(tmp_path_factory, template_file):
    """A second server, in its own data directory: warnings only on its terminal, one allowed
    browser origin, our chat template."""
    home = tmp_path_factory.mktemp("custom-home")
    cli = Cli(installed_command(), user_env(home))
    out = tmp_path_factory.mktemp("custom") / "serve.out"
    args = ["--log-level", "warning", "--cors-origins", "https://app.example"]
    args += ["--chat-template", str(template_file), "--max-tokens", "16"]
    srv = start_serve(cli, out, *args)
    try:
        srv.wait_healthy(90)
        yield srv, cli
    finally:
        srv.stop()


def wait_for_line(srv: Server, pattern: str, since: int = 0, seconds: float = 10) -> str:
    """The server output written after offset `since` once it holds `pattern` (the line is
    written when the response ends, so a shared server may still show an earlier request's)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if re.search(pattern, text := srv.output()[since:]):
            return text
        time.sleep(0.1)
    pytest.fail(f"no line matching {pattern!r} in:\n{srv.output()[since:]}")


def preflight(root: str, origin: str) -> httpx.Response:
    """What a browser sends before a cross-origin JSON POST with a key."""
    return httpx.options(
        root + "/v1/chat/completions",
        headers={
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
        timeout=10,
    )


# ---- the default server ----


def test_ollama_show_takes_the_documented_name_and_tags_the_real_dtype(server):
    client = ollama.Client(host=server.root, timeout=60)
    shown = client.show("dflash-mac")  # Aider's `ollama_chat/dflash-mac` asks for this name
    assert shown.modelinfo["general.architecture"] == shown.details.family
    assert shown.capabilities == ["completion"]
    # MLX's CPU backend decodes the bundled fp16 weights in fp32 (loading/loader.py), Metal in fp16.
    dtype = "F16" if sys.platform == "darwin" else "F32"
    assert shown.details.quantization_level == dtype
    assert client.list().models[0].details.quantization_level == dtype


def test_default_cors_lets_loopback_pages_in_and_no_one_else(server):
    for origin in ("http://localhost:5173", "http://127.0.0.1:8000", "http://localhost"):
        r = preflight(server.root, origin)
        assert r.status_code == 200, (origin, r.text)
        assert r.headers["access-control-allow-origin"] == origin
        assert "POST" in r.headers["access-control-allow-methods"]
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
    refused = preflight(server.root, "https://evil.example")
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
    # Every route answers a loopback page with the header, errors included.
    page = {"Origin": "http://localhost:5173"}
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for r in (
        httpx.post(server.root + "/v1/chat/completions", json=body, headers=page, timeout=60),
        httpx.get(server.root + "/api/tags", headers=page, timeout=10),
        httpx.get(server.root + "/health", headers=page, timeout=10),
        httpx.get(server.root + "/v1/models/nosuch", headers=page, timeout=10),
    ):
        assert r.headers.get("access-control-allow-origin") == page["Origin"], r.url


def test_one_terminal_line_per_request(server):
    oa = openai.OpenAI(base_url=server.root + "/v1", api_key="x", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "Count to ten."}]
    mark = len(server.output())
    r = oa.chat.completions.create(model="m", messages=messages, max_tokens=5, temperature=0)
    text = wait_for_line(server, r"POST /v1/chat/completions 200 · ", since=mark)
    lines = [m for m in LINE.finditer(text) if m.group(2) == "/v1/chat/completions"]
    assert int(lines[-1].group(4)) == r.usage.completion_tokens
    stream = oa.chat.completions.create(
        model="m", messages=messages, max_tokens=3, stream=True, temperature=0
    )
    assert list(stream)
    ollama.Client(host=server.root, timeout=60).generate(
        model="dflash-mac", prompt="hi", options={"num_predict": 2}
    )
    text = wait_for_line(server, r"POST /api/generate 200 · \d+ tok", since=mark)
    assert len([m for m in LINE.finditer(text) if m.group(2) == "/v1/chat/completions"]) >= 2
    httpx.get(server.root + "/health", timeout=10)  # polled by launchers: not at info
    mark = len(server.output())
    httpx.post(server.root + "/v1/chat/completions", content=b"{", timeout=10)
    text = wait_for_line(server, r"POST /v1/chat/completions 400 · [\d.]+ s", since=mark)
    assert "GET /health" not in text and "Traceback" not in text


# ---- a server with options ----


def test_log_level_warning_shows_only_failed_requests(custom):
    srv, _ = custom
    ok = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert httpx.post(srv.root + "/v1/chat/completions", json=ok, timeout=60).status_code == 200
    bad = {"messages": "hi"}
    assert httpx.post(srv.root + "/v1/chat/completions", json=bad, timeout=60).status_code == 400
    text = wait_for_line(srv, r"POST /v1/chat/completions 400")
    assert " 200 · " not in text


def test_cors_origins_replace_the_default(custom):
    srv, _ = custom
    r = preflight(srv.root, "https://app.example")
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "https://app.example"
    assert preflight(srv.root, "http://localhost:5173").status_code == 400


def test_chat_template_file_replaces_the_models(custom, template_file, cli):
    srv, _ = custom
    shown = ollama.Client(host=srv.root, timeout=60).show("dflash-mac")
    assert shown.template == TEMPLATE
    oa = openai.OpenAI(base_url=srv.root + "/v1", api_key="x", max_retries=0, timeout=60)
    chat = oa.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
    )
    # `generate` with the same file, and the raw text the template renders: the same prompt.
    args = ["-n", "4", "--temp", "0", "--json"]
    templated = cli("generate", "hi", "--chat-template", str(template_file), *args)
    raw = cli("generate", RENDERED, "--ignore-chat-template", *args)
    default = cli("generate", "hi", *args)
    for r in (templated, raw, default):
        assert r.returncode == 0, r.stderr
    templated, raw, default = (json.loads(r.stdout) for r in (templated, raw, default))
    assert templated["prompt_tokens"] == raw["prompt_tokens"] == chat.usage.prompt_tokens
    assert templated["text"] == raw["text"] == chat.choices[0].message.content
    assert default["prompt_tokens"] != templated["prompt_tokens"]


def test_bad_chat_template_and_server_options_are_one_sentence(tmp_path):
    cli = Cli(installed_command(), user_env(tmp_path / "home"))  # no server runs here
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")  # no endfor
    cases = [
        (
            ["generate", "hi", "--chat-template", str(tmp_path / "no.jinja")],
            f"--chat-template {tmp_path / 'no.jinja'} does not exist; pass a Jinja template file.",
        ),
        (
            ["chat", "--chat-template", str(tmp_path)],  # refused before the screen starts
            f"--chat-template {tmp_path} is a folder; pass a Jinja template file.",
        ),
        (
            ["serve", "--log-level", "loud"],
            "--log-level must be one of debug, info, warning, error (got 'loud').",
        ),
        (
            ["serve", "--cors-origins", "localhost:3000"],
            "--cors-origins: 'localhost:3000' is not an origin like http://localhost:3000 "
            "(or *, or none).",
        ),
        (["stop", "1"], "no dflash-mac server is running on port 1."),
    ]
    for args, message in cases:
        r = cli(*args)
        assert (r.returncode, r.stderr) == (1, f"error: {message}\n"), args
    r = cli("generate", "hi", "--chat-template", str(broken), "-n", "2")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.startswith("error: the --chat-template file does not render a chat (")


# ---- ps and stop (last: stops the custom server) ----


def test_ps_lists_the_server_and_stop_ends_it(custom):
    srv, cli = custom
    port = srv.root.rsplit(":", 1)[1]
    stale = srv.home / "serve-1.pid"
    stale.write_text("999999\n")  # a server that crashed: no such process
    (srv.home / "serve-1.url").write_text("http://127.0.0.1:1/v1\n")
    listed = cli("ps")
    assert listed.returncode == 0, listed.stderr
    header, *rows = listed.stdout.splitlines()
    assert header.split() == ["PORT", "PID", "STATUS", "MODEL", "URL", "UPTIME"]
    assert [r.split()[:5] for r in rows] == [
        [port, str(srv.proc.pid), "ok", "dflash-mac-bundled", srv.root + "/v1"]
    ]
    assert re.fullmatch(r"\d+[smhd]( \d+[smh])?", rows[0].split(None, 5)[5])
    assert "no longer run (port 1)" in listed.stderr
    assert not stale.exists() and not (srv.home / "serve-1.url").exists()
    stopped = cli("stop", port)
    assert stopped.returncode == 0, stopped.stderr
    assert stopped.stdout == f"stopped the server on port {port} (PID {srv.proc.pid}).\n"
    assert srv.proc.wait(5) == 0  # a clean SIGTERM exit
    assert not (srv.home / f"serve-{port}.pid").exists()
    assert not (srv.home / f"serve-{port}.url").exists()
    for args in (["ps"], ["stop"], ["stop", "--all"]):
        r = cli(*args)
        assert (r.returncode, r.stdout) == (0, "no dflash-mac server is running.\n"), args
