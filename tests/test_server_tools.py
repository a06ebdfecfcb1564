"""Tool calling: the parsers on each family's template output, and tool requests through the
server with the real `openai` client (a tiny pair whose chat template takes tools)."""

from __future__ import annotations

import dataclasses
import json

import httpx
import openai
import pytest
from helpers.tiny import (
    CHATML,
    CHATML_TOOLS,
    build_tiny_pair,
    set_chat_template,
    write_byte_tokenizer,
)
from mlx_lm.tokenizer_utils import load as load_tokenizer
from servers import running

from dflash_mac.loading.loader import load
from dflash_mac.serve.app import create_app
from dflash_mac.serve.tools import ToolStream, ToolSupport

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
CALLS = [
    {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}},
    {"name": "get_weather", "arguments": {"city": "Rome", "days": 1}},
]

# Each family's way of writing calls (the same markers and layout as its model's template):
# Qwen3.5 / Qwen3-Coder: XML-ish <function=…><parameter=…>; Llama 3.x: bare JSON, one call.
QWEN35 = (
    "{%- set nl = '\\n' %}{% if tools %}{{ '<|im_start|>system' + nl + '<tools>' }}"
    "{% for t in tools %}{{ nl + t | tojson }}{% endfor %}{{ nl + '</tools><|im_end|>' + nl }}"
    "{% endif %}{% for m in messages %}{{ '<|im_start|>' + m.role + nl + m.content }}"
    "{% for call in m.tool_calls or [] %}{% set tool_call = call.function %}"
    "{{ ('' if loop.first else nl) + '<tool_call>\\n<function=' + tool_call.name + '>' + nl }}"
    "{% for k, v in tool_call.arguments | items %}"
    "{{ '<parameter=' + k + '>' + nl + v | string + nl + '</parameter>' + nl }}{% endfor %}"
    "{{ '</function>' + nl + '</tool_call>' }}{% endfor %}{{ '<|im_end|>' + nl }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant' + nl }}{% endif %}"
)
LLAMA3 = (
    "{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}"
    "{{ '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' }}"
    "{% if m.tool_calls %}{% set tool_call = m.tool_calls[0].function %}"
    '{{ \'{"name": "\' + tool_call.name + \'", "parameters": \' }}'
    "{{ tool_call.arguments | tojson }}{{ '}' }}{% else %}{{ m.content }}{% endif %}"
    "{{ '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
FAMILIES = {  # template, parser mlx-lm (or we) pick, end of an assistant turn, calls per turn
    "qwen3": (CHATML_TOOLS, "json_tools", "<|im_end|>\n", 2),
    "qwen3.5": (QWEN35, "qwen3_coder", "<|im_end|>\n", 2),
    "llama3": (LLAMA3, "llama3_json", "<|eot_id|>", 1),
}


def tokenizer_with(tmp_path, template: str):
    write_byte_tokenizer(tmp_path)
    set_chat_template(tmp_path, template)
    return load_tokenizer(tmp_path)


def history(calls: list[dict], content: str = "") -> list[dict]:
    return [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": content,
            "tool_calls": [{"type": "function", "function": c} for c in calls],
        },
    ]


def assistant_text(tok, messages: list[dict], end: str) -> str:
    """What the model writes for the last (assistant) message, as its template renders it."""
    head = tok.apply_chat_template(
        messages[:-1], tools=[WEATHER], add_generation_prompt=True, tokenize=False
    )
    whole = tok.apply_chat_template(messages, tools=[WEATHER], tokenize=False)
    assert whole.startswith(head) and whole.endswith(end)
    return whole[len(head) : -len(end)]


def run_stream(stream: ToolStream, text: str, step: int) -> tuple[str, list[dict]]:
    content, calls = "", []
    pieces = [text[i : i + step] for i in range(0, len(text), step)] or [""]
    for i, piece in enumerate(pieces):
        c, new = stream.feed(piece, final=i == len(pieces) - 1)
        content, calls = content + c, calls + new
    return content, calls


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_parser_on_each_family_template_output(tmp_path, family, step):
    template, parser, end, n = FAMILIES[family]
    tok = tokenizer_with(tmp_path, template)
    support = ToolSupport.of(tok)
    assert support.takes_tools and support.problem() is None
    assert support.format.name == parser
    text = assistant_text(tok, history(CALLS[:n]), end)
    assert "Paris" in text
    content, calls = run_stream(ToolStream(support.format, [WEATHER]), text, step)
    assert content == "" and calls == CALLS[:n]


def test_content_around_calls_and_broken_calls(tmp_path):
    fmt = ToolSupport.of(tokenizer_with(tmp_path, CHATML_TOOLS)).format
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
    content, calls = run_stream(ToolStream(fmt), text + "</tool_call>", 2)
    assert content == "Let me look."
    assert calls == [{"name": "get_weather", "arguments": {"city": "Oslo"}}]
    # Cut off before the end marker: still parsed at the end of the answer.
    assert run_stream(ToolStream(fmt), text, 4)[1] == calls
    # Not JSON: given back as content, markers included.
    bad = "<tool_call>\nnot json\n</tool_call> done"
    assert run_stream(ToolStream(fmt), bad, 5) == (bad, [])
    # Text that only looks like the start of a marker is content.
    assert run_stream(ToolStream(fmt), "a <tool b", 1) == ("a <tool b", [])
    # parallel_tool_calls=false keeps the first call.
    two = text + "</tool_call>" + text + "</tool_call>"
    assert len(run_stream(ToolStream(fmt, parallel=False), two, 7)[1]) == 1


def test_llama3_plain_answers_stay_content(tmp_path):
    fmt = ToolSupport.of(tokenizer_with(tmp_path, LLAMA3)).format
    for text in ("Hello there.", '{"answer": 42}', "  {not json", ""):
        assert run_stream(ToolStream(fmt), text, 2) == (text, [])
    call = '<|python_tag|>{"name": "f", "parameters": {"x": 1}}'
    assert run_stream(ToolStream(fmt), call, 3)[1] == [{"name": "f", "arguments": {"x": 1}}]


def test_template_without_tools(tmp_path):
    support = ToolSupport.of(tokenizer_with(tmp_path, CHATML))
    assert not support.takes_tools
    assert "does not take tools" in support.problem()


# -- through the server ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def tools_pair(tmp_path_factory):
    tdir, ddir = build_tiny_pair(tmp_path_factory.mktemp("tools"), seed=0, target_layers=2)
    set_chat_template(tdir, CHATML_TOOLS)
    return load(tdir, ddir)


@pytest.fixture(scope="module")
def server(tools_pair):
    app = create_app(tools_pair, max_tokens=64)
    with running(app) as root:
        yield {"root": root, "app": app, "pair": tools_pair}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server["root"] + "/v1", api_key="x", max_retries=0, timeout=60)


@pytest.fixture
def scripted(server, monkeypatch):
    """Make the engine 'write' the given pieces: the real decode runs (stats, worker thread),
    only the text of its events is replaced."""
    session = server["app"].state.session
    real = session.stream

    def script(pieces: list[str]) -> None:
        def stream(ids, **kw):
            events = list(real(ids, **{**kw, "max_tokens": 4, "use_eos": False}))
            for i, piece in enumerate(pieces):
                last = i == len(pieces) - 1
                yield dataclasses.replace(
                    events[-1], text=piece, finish_reason="stop" if last else None
                )

        monkeypatch.setattr(session, "stream", stream)

    return script


CALL_TEXT = (
    "<think>\nThe user wants weather.\n</think>\n\nChecking.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n'
    "</tool_call>"
)


def pieces_of(text: str, n: int) -> list[str]:
    return [text[i : i + n] for i in range(0, len(text), n)]


def ask(client, **kw):
    return client.chat.completions.create(
        model="dflash",
        messages=[{"role": "user", "content": "Weather in Paris and Rome?"}],
        tools=[WEATHER],
        **kw,
    )


def test_tools_reach_the_template(server, client):
    pair = server["pair"]
    messages = [{"role": "user", "content": "Weather?"}]
    want = pair.tokenizer.apply_chat_template(messages, tools=[WEATHER], add_generation_prompt=True)
    r = client.chat.completions.create(
        model="dflash", messages=messages, tools=[WEATHER], max_tokens=3, tool_choice="auto"
    )
    assert r.usage.prompt_tokens == len(want)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_tool_calls_returned(client, scripted):
    scripted(pieces_of(CALL_TEXT, 7))
    r = ask(client, max_tokens=32)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    assert choice.message.model_extra["reasoning_content"] == "\nThe user wants weather.\n"
    calls = choice.message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 2}),
        ("get_weather", {"city": "Rome"}),
    ]
    assert all(c.type == "function" and c.id.startswith("call_") for c in calls)
    assert len({c.id for c in calls}) == 2


def test_streamed_tool_call_deltas_reassemble(client, scripted):
    scripted(pieces_of(CALL_TEXT, 5))
    chunks = list(ask(client, max_tokens=32, stream=True))
    calls: dict[int, dict] = {}
    for c in chunks:
        for d in c.choices[0].delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = call["id"] or d.id
            call["name"] += (d.function.name or "") if d.function else ""
            call["arguments"] += (d.function.arguments or "") if d.function else ""
    assert [json.loads(calls[i]["arguments"]) for i in sorted(calls)] == [
        {"city": "Paris", "days": 2},
        {"city": "Rome"},
    ]
    assert all(c["name"] == "get_weather" and c["id"] for c in calls.values())
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == "Checking."
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == [
        "tool_calls"
    ]
    # The client's own reassembly (the stream helper) agrees.
    scripted(pieces_of(CALL_TEXT, 3))
    with client.chat.completions.stream(
        model="dflash",
        messages=[{"role": "user", "content": "Weather?"}],
        tools=[WEATHER],
        max_tokens=32,
    ) as stream:
        final = stream.get_final_completion()
    got = final.choices[0].message.tool_calls
    assert [json.loads(c.function.arguments)["city"] for c in got] == ["Paris", "Rome"]
    assert final.choices[0].finish_reason == "tool_calls"


def test_tool_history_round_trip(server, client):
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    r = client.chat.completions.create(
        model="dflash", messages=messages, tools=[WEATHER], max_tokens=3
    )
    rendered = [
        messages[0],
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "content": "sunny, 21 C"},
    ]
    tok = server["pair"].tokenizer
    text = tok.apply_chat_template(
        rendered, tools=[WEATHER], add_generation_prompt=True, tokenize=False
    )
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text
    assert r.usage.prompt_tokens == len(tok.encode(text, add_special_tokens=False))


def test_tool_requests_refused_clearly(server, tiny_pair):
    root = server["root"] + "/v1/chat/completions"
    user = [{"role": "user", "content": "x"}]
    for body, param, words in (
        ({"tools": [WEATHER], "tool_choice": "required"}, "tool_choice", "cannot be enforced"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "one of the given tools",
        ),
        ({"tools": [{"type": "function"}]}, "tools", "must be a list"),
        ({"functions": [{"name": "f"}]}, "functions", "send 'tools'"),
    ):
        r = httpx.post(root, json={"messages": user, **body}, timeout=30)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param and words in r.json()["error"]["message"]
    app = create_app(tiny_pair, max_tokens=8)  # a ChatML template without tools
    with running(app) as other:
        c = openai.OpenAI(base_url=other + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="does not take tools"):
            c.chat.completions.create(model="m", messages=user, tools=[WEATHER])


def test_ollama_client_tool_calls(server, scripted):
    import ollama

    client = ollama.Client(host=server["root"], timeout=60)
    name = server["app"].state.model_name
    assert "tools" in client.show(name).capabilities
    messages = [{"role": "user", "content": "Weather in Paris and Rome?"}]
    scripted(pieces_of(CALL_TEXT, 6))
    r = client.chat(model=name, messages=messages, tools=[WEATHER])
    assert r.message.content == "Checking." and r.message.thinking == "\nThe user wants weather.\n"
    got = [(c.function.name, dict(c.function.arguments)) for c in r.message.tool_calls]
    assert got == [("get_weather", {"city": "Paris", "days": 2}), ("get_weather", {"city": "Rome"})]
    scripted(pieces_of(CALL_TEXT, 4))
    parts = list(client.chat(model=name, messages=messages, tools=[WEATHER], stream=True))
    streamed = [c.function.arguments["city"] for p in parts for c in p.message.tool_calls or []]
    assert streamed == ["Paris", "Rome"] and parts[-1].done
    # The calls and the tool's answer go back as history.
    history = [
        *messages,
        {"role": "assistant", "content": "", "tool_calls": [dict(c) for c in r.message.tool_calls]},
        {"role": "tool", "content": "sunny", "tool_name": "get_weather"},
    ]
    assert client.chat(
        model=name, messages=history, tools=[WEATHER], options={"num_predict": 2}
    ).done
