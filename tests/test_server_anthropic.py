"""The Anthropic Messages API, driven by the official `anthropic` client: the same answers as
the OpenAI route, streamed events that add up, stop reasons, tools and tool results, token
counts, and errors in Anthropic's shape."""

from __future__ import annotations

from types import SimpleNamespace

import anthropic
import httpx
import openai
import pytest
from helpers.tiny import build_tiny_pair, set_chat_template
from servers import running
from test_server_tools import CALL_TEXT, CHATML_TOOLS, pieces_of, scripted  # noqa: F401

from dflash_mac.loading.loader import load
from dflash_mac.serve.anthropic import apply_thinking
from dflash_mac.serve.app import create_app
from dflash_mac.serve.schema import GenRequest

WEATHER = {
    "name": "get_weather",
    "description": "Weather of a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"],
    },
}
CLOCK = {
    "name": "get_time",
    "description": "Local time of a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}
SYSTEM = "You are terse."
QUESTION = "Write a Python function that adds two numbers."


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tdir, ddir = build_tiny_pair(tmp_path_factory.mktemp("anthropic"), seed=0, target_layers=2)
    set_chat_template(tdir, CHATML_TOOLS)
    pair = load(tdir, ddir)
    app = create_app(pair, max_tokens=64, api_key="secret")
    with running(app) as root:
        yield {"root": root, "app": app, "pair": pair}


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server["root"], api_key="secret", max_retries=0)


def ask(client, **kw):
    args = {"model": "dflash", "max_tokens": 12}  # the server's default temperature: greedy
    args.setdefault("messages", [{"role": "user", "content": QUESTION}])
    return client.messages.create(**{**args, **kw})


def test_answer_equals_the_openai_route(server, client):
    oa = openai.OpenAI(base_url=server["root"] + "/v1", api_key="secret", max_retries=0)
    want = oa.chat.completions.create(
        model="dflash",
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
        max_tokens=12,
        temperature=0,
    )
    for system in (SYSTEM, [{"type": "text", "text": SYSTEM}]):
        r = ask(client, system=system)
        assert r.type == "message" and r.role == "assistant" and r.id.startswith("msg_")
        assert [b.type for b in r.content] == ["text"]
        assert r.content[0].text == want.choices[0].message.content
        assert r.stop_reason == "max_tokens" and r.stop_sequence is None
        u = r.usage
        assert u.input_tokens + u.cache_read_input_tokens == want.usage.prompt_tokens
        assert u.output_tokens == want.usage.completion_tokens
    # the second ask repeated the first's prompt: read from the prompt cache, and said so
    assert r.usage.cache_read_input_tokens > 0


def test_stream_adds_up_to_the_whole_answer(client):
    whole = ask(client, system=SYSTEM)
    with client.messages.stream(
        model="dflash",
        max_tokens=12,
        system=SYSTEM,
        messages=[{"role": "user", "content": QUESTION}],
    ) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_delta" in kinds and "message_delta" in kinds
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_stop_sequences(client):
    text = ask(client).content[0].text
    stop = text[3:5]
    r = ask(client, stop_sequences=[stop, "never-seen"])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    assert r.content[0].text == text[: text.index(stop)]


def test_tool_use_blocks(client, scripted):  # noqa: F811
    scripted(pieces_of(CALL_TEXT, 7))
    r = ask(client, tools=[WEATHER], max_tokens=32)
    assert r.stop_reason == "tool_use"
    assert [b.type for b in r.content] == ["thinking", "text", "tool_use", "tool_use"]
    assert r.content[1].text == "Checking."
    calls = [b for b in r.content if b.type == "tool_use"]
    assert [(c.name, c.input) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 2}),
        ("get_weather", {"city": "Rome"}),
    ]
    assert all(c.id.startswith("toolu_") for c in calls) and calls[0].id != calls[1].id
    scripted(pieces_of(CALL_TEXT, 5))
    with client.messages.stream(
        model="dflash", max_tokens=32, tools=[WEATHER], messages=[{"role": "user", "content": "?"}]
    ) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert {"thinking_delta", "text_delta", "input_json_delta"} == set(deltas)
    got = [(b.name, b.input) for b in final.content if b.type == "tool_use"]
    assert got == [(c.name, c.input) for c in calls] and final.stop_reason == "tool_use"
    assert [b.type for b in final.content] == [b.type for b in r.content]


def rendered_with_weather(tok, messages: list[dict]) -> str:
    """The chat template's text of OpenAI-shaped `messages` with the weather tool."""
    fn = {"name": WEATHER["name"], "description": WEATHER["description"]}
    tools = [{"type": "function", "function": fn | {"parameters": WEATHER["input_schema"]}}]
    return tok.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False
    )


def test_tool_result_round_trip_reaches_the_template(server, client):
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Checking."},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "Paris"},
                },
            ],
        },  # fmt: skip
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 21 C"}
            ],
        },
    ]
    counted = client.messages.count_tokens(model="dflash", messages=messages, tools=[WEATHER])
    r = ask(client, messages=messages, tools=[WEATHER], max_tokens=3)
    assert counted.input_tokens == r.usage.input_tokens + r.usage.cache_read_input_tokens
    rendered = [
        messages[0],
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather",
                                              "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny, 21 C"},
    ]  # fmt: skip
    tok = server["pair"].tokenizer
    text = rendered_with_weather(tok, rendered)
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text
    assert counted.input_tokens == len(tok.encode(text, add_special_tokens=False))


def test_errors_in_anthropic_shape(server, client):
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(
            base_url=server["root"], api_key="wrong", max_retries=0
        ).messages.create(
            model="dflash", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
    r = httpx.post(
        server["root"] + "/v1/messages",
        headers={"x-api-key": "secret"},
        json={"model": "dflash", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert r.status_code == 400
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
    with pytest.raises(anthropic.BadRequestError, match="image blocks are not supported"):
        ask(client, messages=[{"role": "user", "content": [image]}])
    r = httpx.get(server["root"] + "/v1/messages", headers={"x-api-key": "secret"})
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(server["root"] + "/v1/chat/completions", headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"  # OpenAI's


@pytest.mark.parametrize("script", ["", "<think>\nHm.\n</think>\n\n"])
def test_empty_answer_has_the_same_blocks_streamed(client, scripted, script):  # noqa: F811
    scripted([script])
    whole = ask(client)
    scripted([script])
    with client.messages.stream(
        model="dflash", max_tokens=12, messages=[{"role": "user", "content": QUESTION}]
    ) as stream:
        final = stream.get_final_message()
    kinds = ["thinking", "text"] if script else ["text"]
    assert [b.type for b in whole.content] == [b.type for b in final.content] == kinds
    assert whole.content[-1].text == final.content[-1].text == ""
    assert whole.stop_reason == final.stop_reason == "end_turn"


def count(client, **kw) -> int:
    messages = [{"role": "user", "content": "Weather?"}]
    return client.messages.count_tokens(model="dflash", messages=messages, **kw).input_tokens


def test_tool_choice(client):
    plain, one = count(client), count(client, tools=[WEATHER])
    assert count(client, tools=[WEATHER, CLOCK]) > one > plain
    # a named tool: the template sees that tool only; none: no tools at all
    named = {"type": "tool", "name": "get_weather"}
    assert count(client, tools=[WEATHER, CLOCK], tool_choice=named) == one
    assert count(client, tools=[WEATHER], tool_choice={"type": "none"}) == plain
    assert count(client, tools=[WEATHER], tool_choice={"type": "auto"}) == one
    # any = OpenAI's required, which this template cannot enforce: a 400 that says so
    with pytest.raises(anthropic.BadRequestError, match="cannot be enforced"):
        count(client, tools=[WEATHER], tool_choice={"type": "any"})
    with pytest.raises(anthropic.BadRequestError, match="must name one of the given tools"):
        count(client, tools=[WEATHER], tool_choice={"type": "tool", "name": "nope"})


def test_failed_tool_result_as_text_blocks(server, client):
    messages = [
        {"role": "user", "content": "Weather in Atlantis?"},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_9", "name": "get_weather",
             "input": {"city": "Atlantis"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_9", "is_error": True,
             "content": [{"type": "text", "text": "no such "}, {"type": "text", "text": "city"}]},
            {"type": "text", "text": "Try again."}]},
    ]  # fmt: skip
    rendered = [
        messages[0],
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather",
                                              "arguments": {"city": "Atlantis"}}}]},
        {"role": "tool", "content": "Error: no such city"},
        {"role": "user", "content": "Try again."},
    ]  # fmt: skip
    tok = server["pair"].tokenizer
    text = rendered_with_weather(tok, rendered)
    assert "<tool_response>\nError: no such city\n</tool_response>" in text
    got = client.messages.count_tokens(model="dflash", messages=messages, tools=[WEATHER])
    assert got.input_tokens == len(tok.encode(text, add_special_tokens=False))


def test_thinking(client):
    """A template without a thinking mode answers either way (Claude Code may ask any model to
    think); one with a switch gets the CLI's --reasoning on / the switch off."""
    enabled = {"type": "enabled", "budget_tokens": 1024}
    for thinking in (enabled, {"type": "disabled"}):
        assert count(client, thinking=thinking) == count(client)
        assert ask(client, thinking=thinking, max_tokens=2).stop_reason == "max_tokens"
    switch = SimpleNamespace(chat_template="{% if enable_thinking %}<think>{% endif %}")
    for thinking, template in (
        (enabled, {"reasoning": "on"}),
        ({"type": "adaptive"}, {"reasoning": "on"}),
        ({"type": "disabled"}, {"chat_template_args": {"enable_thinking": False}}),
    ):
        req = GenRequest("chat", [])
        apply_thinking(req, thinking, switch)
        assert req.template == template
    req = GenRequest("chat", [])
    apply_thinking(req, enabled, SimpleNamespace(chat_template="{{ messages }}"))
    assert req.template == {}
    with pytest.raises(anthropic.BadRequestError, match="thinking"):
        ask(client, extra_body={"thinking": {"type": "sometimes"}})


def test_busy_server_is_a_rate_limit_error(server, client, monkeypatch):
    monkeypatch.setattr(server["app"].state.worker, "max_queue", 0)  # every request waits too long
    with pytest.raises(anthropic.RateLimitError) as e:
        ask(client)
    assert e.value.response.headers["retry-after"]
    assert e.value.body["error"]["type"] == "rate_limit_error"
