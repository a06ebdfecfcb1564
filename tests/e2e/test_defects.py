"""Issue 37's defects, each met as a user meets it: the installed `dflash-mac` in a fresh
process (servers on loopback, driven by the real `openai` and `ollama` clients)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import httpx
import ollama
import openai
import pytest

from .conftest import Cli, Server, free_port, one_error, start_serve

pytestmark = pytest.mark.slow  # starts the installed command in subprocesses

NO_SWITCH = "this model's chat template has no thinking switch; --reasoning on is not supported."


def start_server(cli: Cli, log: Path, *extra: str) -> Server:
    """`dflash-mac serve` on a free loopback port, healthy."""
    srv = start_serve(cli, log, *extra)
    srv.wait_healthy(90)
    return srv


@pytest.fixture
def own_server(cli, tmp_path):
    """A server of this test alone (it gets SIGTERM), with the default --max-tokens."""
    started: list[Server] = []

    def start() -> Server:
        started.append(start_server(cli, tmp_path / f"serve{len(started)}.out"))
        return started[-1]

    yield start
    for srv in started:
        srv.kill()


# -- 1: serve's address ---------------------------------------------------------------------------


@pytest.mark.parametrize("port", ["99999", "-1", "0"])
def test_serve_port_out_of_range_is_one_sentence(cli, port):
    said = one_error(cli("serve", "--port", port))
    assert said == f"--port must be between 1 and 65535 (got {port})."


def test_serve_unknown_host_names_the_host_not_the_port(cli):
    said = one_error(cli("serve", "--host", "nonexistent.invalid", "--port", str(free_port())))
    assert said.startswith("cannot listen on nonexistent.invalid (")
    assert said.endswith("; pass another --host.") and "--port" not in said


# -- 2: chat checks the model before the screen ---------------------------------------------------


def test_chat_with_an_unknown_model_fails_before_the_screen(cli):
    """The sentence `generate` prints, whole, and exit 1: no screen drawn on stdout."""
    want = one_error(cli("generate", "hi", "-m", "nosuch/model"))
    try:
        res = cli("chat", "-m", "nosuch/model", timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("chat opened its screen instead of failing on the unknown model")
    assert one_error(res) == want and want.startswith("no known DFlash drafter for target")
    assert res.stdout == ""


# -- 3: launch needs -- before the command --------------------------------------------------------


def test_launch_without_separator_is_refused_before_any_rank_starts(cli):
    res = cli("launch", "-n", "2", "generate", "hi", "-n", "5", timeout=60)
    assert one_error(res) == (
        "put -- before the command to run, e.g. launch -n 2 -- generate ...; without it, "
        "the command's own options (such as -n) are taken as launch's."
    )
    assert "[rank" not in res.stderr + res.stdout


# -- 4: train takes pair names and keeps an existing drafter -------------------------------------


def test_train_takes_a_pair_name_and_refuses_to_overwrite_without_force(cli, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"Write a function number {i}."}) + "\n" for i in range(2))
    )
    out = tmp_path / "drafter"
    args = ["train", "-m", "bundled", "--data", str(data), "--out", str(out), "--steps", "1"]
    args += ["--block-size", "4", "--gen-max-tokens", "16", "--batch-size", "2"]
    args += ["--anchors", "4", "--cache-dir", str(tmp_path / "cache")]
    first = cli(*args, timeout=300)
    assert first.returncode == 0, first.stderr + first.stdout
    assert "--model bundled --draft" in first.stdout  # the hint names the pair as typed
    weights = (out / "model.safetensors").stat().st_mtime_ns
    said = one_error(cli(*args))
    assert said == (
        f"--out {out} already exists and is not empty; pass --force to overwrite it, "
        "or another folder."
    )
    assert (out / "model.safetensors").stat().st_mtime_ns == weights  # left alone
    again = cli(*args, "--force", timeout=300)
    assert again.returncode == 0, again.stderr + again.stdout
    assert (out / "model.safetensors").stat().st_mtime_ns != weights


# -- 5: thinking on a template without a switch ---------------------------------------------------


def test_generate_reasoning_on_without_a_switch_is_only_the_error(cli):
    assert one_error(cli("generate", "hi", "--reasoning", "on")) == NO_SWITCH  # no warning first


def test_ollama_think_true_without_a_switch_is_the_cli_sentence(server):
    client = ollama.Client(host=server.root, timeout=60)
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="dflash-mac", messages=messages, think=True)
    assert e.value.status_code == 400 and e.value.error == NO_SWITCH
    with pytest.raises(ollama.ResponseError) as e:
        list(client.chat(model="dflash-mac", messages=messages, think=True, stream=True))
    assert e.value.status_code == 400 and e.value.error == NO_SWITCH
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model="dflash-mac", prompt="hi", think=True)
    assert e.value.status_code == 400 and e.value.error == NO_SWITCH
    # false asks for no thinking, which such a template never does: answered (as Ollama does)
    answer = client.chat(model="dflash-mac", messages=messages, think=False)
    assert answer.done and answer.message.role == "assistant"


# -- 7: a stream cut by SIGTERM ends with an error, not finish_reason "cancelled" ---------------

LONG = {"max_tokens": 1900, "temperature": 0, "extra_body": {"ignore_eos": True}}


def test_sigterm_ends_an_openai_stream_with_an_error(own_server):
    srv = own_server()
    client = openai.OpenAI(base_url=srv.root + "/v1", api_key="x", max_retries=0, timeout=60)
    stream = client.chat.completions.create(
        model="dflash-mac", messages=[{"role": "user", "content": "Count."}], stream=True, **LONG
    )
    finishes = []
    with pytest.raises(openai.APIError) as e:
        for i, chunk in enumerate(stream):
            finishes += [c.finish_reason for c in chunk.choices if c.finish_reason]
            if i == 3:
                srv.proc.terminate()  # SIGTERM, as a launcher stops it
    assert e.value.message == "the server is shutting down."
    assert finishes == []  # never "cancelled" (not an OpenAI value)
    assert srv.proc.wait(30) == 0


def test_sigterm_ends_an_ollama_stream_with_an_error(own_server):
    srv = own_server()
    client = ollama.Client(host=srv.root, timeout=60)
    stream = client.chat(
        model="dflash-mac",
        messages=[{"role": "user", "content": "Count."}],
        stream=True,
        options={"num_predict": 1900, "temperature": 0},
    )
    reasons = []
    with pytest.raises(ollama.ResponseError) as e:
        for i, part in enumerate(stream):
            reasons += [part.done_reason] if part.done else []
            if i == 3:
                srv.proc.terminate()
    assert e.value.error == "the server is shutting down." and reasons == []
    assert srv.proc.wait(30) == 0


# -- 9: help, doctor, one penalty rule, /health -------------------------------------------------


def test_bench_help_lists_every_suite(cli):
    res = cli("bench", "--help")
    assert res.returncode == 0, res.stderr
    text = " ".join(res.stdout.replace("│", " ").split())  # the help box may wrap lines
    said = (
        "Prompt suite: code, math, chat, long, edit, agent, agent-loop, or all (code, math, chat)."
    )
    assert said in text


def test_doctor_sizes_memory_at_most_at_the_models_context(cli):
    def memory(*extra: str) -> str:
        res = cli("doctor", "--no-selftest", "--json", *extra)
        [check] = [c for c in json.loads(res.stdout)["checks"] if c["name"] == "memory"]
        return check["message"]

    assert " at 2048 tokens, the model's whole context (" in memory()  # default 4096, model 2048
    assert " at 1024 tokens " in memory("--context", "1024")


def rule(sentence: str) -> str:
    """A range sentence without the name of the setting and the value given."""
    return re.sub(r"^\S+ (.*) \(got [^)]*\)\.$", r"\1", sentence)


@pytest.mark.parametrize(
    "flag, field, value",
    [
        ("--repetition-penalty", "repetition_penalty", 0),
        ("--presence-penalty", "presence_penalty", 5),
    ],
)
def test_cli_and_server_share_one_penalty_rule(cli, server, flag, field, value):
    said = one_error(cli("generate", "hi", flag, str(value)))
    assert said.startswith(f"{flag} must be ")
    client = openai.OpenAI(base_url=server.root + "/v1", api_key="x", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="dflash-mac",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=2,
            extra_body={field: value},
        )
    message = e.value.body["message"]
    assert message.startswith(f"'{field}' must be ") and rule(message) == rule(said)


def test_server_logit_bias_error_names_the_field_not_the_flag(cli, server):
    bias = {"99999999": 1}
    said = one_error(cli("generate", "hi", "--logit-bias", json.dumps(bias)))
    client = openai.OpenAI(base_url=server.root + "/v1", api_key="x", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="dflash-mac", messages=[{"role": "user", "content": "hi"}], logit_bias=bias
        )
    message = e.value.body["message"]
    assert "--logit-bias" not in message and message.startswith("'logit_bias' token 99999999 ")
    assert message.removeprefix("'logit_bias'") == said.removeprefix("--logit-bias")


def test_health_counts_only_the_servers_own_failures(server):
    """A request refused with a 400 once queued (here: thinking on a template without a
    switch) is the client's fault: counted as invalid, /health stays ok with no failure."""
    before = httpx.get(server.root + "/health", timeout=10).json()
    client = openai.OpenAI(base_url=server.root + "/v1", api_key="x", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model="dflash-mac",
            messages=[{"role": "user", "content": "hi"}],
            reasoning_effort="high",
        )
    client.chat.completions.create(
        model="dflash-mac", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    after = httpx.get(server.root + "/health", timeout=10).json()
    assert after["status"] == "ok" and after["failed"] == before["failed"]
    assert after["invalid"] == before["invalid"] + 1
    assert after["requests"] == before["requests"] + 2
    assert after["completed"] == before["completed"] + 1
