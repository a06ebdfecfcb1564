"""Request validation and the <think> splitter of `dflash-mac serve` (no model needed)."""

from __future__ import annotations

import pytest

from dflash_mac.engine.think import ThinkSplitter, prompt_opens_think
from dflash_mac.serve.schema import APIError, parse_chat, parse_completion

MSG = [{"role": "user", "content": "hi"}]


def test_chat_fields_map_to_engine_options():
    req = parse_chat(
        {
            "messages": [
                {
                    "role": "developer",
                    "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}],
                }
            ]
            + MSG,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": -1,
            "min_p": 0.05,
            "seed": -1,
            "stop": "END",
            "max_completion_tokens": 99999,
            "stream": True,
            "stream_options": {"include_usage": True},
            "reasoning_effort": "high",
            "chat_template_kwargs": {"enable_thinking": False},
            "user": "ignored",
        },
        512,
        1024,
    )
    assert req.prompt[0] == {"role": "system", "content": "be brief"}
    assert req.max_tokens == 1024 and req.stream and req.include_usage
    assert req.sampling == {
        "temp": 0.7,
        "top_p": 0.9,
        "top_k": 0,
        "min_p": 0.05,
        "seed": 2**32 - 1,
        "stop": ["END"],
        "use_eos": True,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": None,
        "logit_bias": None,
        "logprobs": None,
        "json_schema": None,
    }
    assert req.template == {"reasoning": "high", "chat_template_args": {"enable_thinking": False}}


def test_defaults_and_harmless_zero_values():
    req = parse_chat(
        {
            "messages": MSG,
            "n": 1,
            "logprobs": False,
            "presence_penalty": 0,
            "tools": [],
            "tool_choice": "none",
            "response_format": {"type": "text"},
            "stream_options": {"include_usage": True},
        },
        256,
        4096,
        default_temp=0.0,
    )
    assert req.max_tokens == 256 and req.sampling["temp"] == 0.0
    assert not req.include_usage  # only with stream=true
    assert req.block_size is None  # the server's block size


@pytest.mark.parametrize("value", [1, 5, "auto"])
def test_a_request_may_ask_its_own_block_size(value):
    assert parse_chat({"messages": MSG, "block_size": value}, 16, 16).block_size == value
    assert parse_completion({"prompt": "x", "block_size": value}, 16, 16).block_size == value


@pytest.mark.parametrize(
    "body",
    [
        {"messages": MSG, "min_p": 1.0},
        {"messages": MSG, "seed": 1.5},
        {"messages": MSG, "temperature": True},
        {"messages": MSG, "stream": "yes"},
        {"messages": MSG, "functions": [{"name": "f"}]},
        {"messages": MSG, "tool_choice": "required"},
        {"messages": [{"role": "tool", "content": "x", "tool_call_id": 3}]},
        {"messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}]},
        {"messages": MSG, "reasoning_effort": "max"},
        {"messages": [{"role": "bot", "content": ""}]},
        {"messages": MSG, "logit_bias": {"1": 500}},
        {"messages": MSG, "stop": ["a"] * 17},
        {"messages": MSG, "block_size": 0},
        {"messages": MSG, "block_size": "8"},
        {"messages": MSG, "block_size": True},
    ],
)
def test_refused(body):
    with pytest.raises(APIError) as e:
        parse_chat(body, 16, 16)
    assert e.value.status == 400 and e.value.body()["error"]["message"]


def test_penalties_are_accepted_and_checked():
    req = parse_chat(
        {
            "messages": MSG,
            "presence_penalty": 0.5,
            "frequency_penalty": -1,
            "repetition_penalty": 1.1,
            "logit_bias": {"42": -100, "7": 2.5},
        },
        16,
        16,
    )
    s = req.sampling
    assert (s["presence_penalty"], s["frequency_penalty"], s["repetition_penalty"]) == (
        0.5,
        -1.0,
        1.1,
    )
    assert s["logit_bias"] == {42: -100.0, 7: 2.5}
    for body, message in [
        ({"presence_penalty": 2.5}, "'presence_penalty' must be >= -2.0 and <= 2.0 (got 2.5)."),
        ({"frequency_penalty": "x"}, "'frequency_penalty' must be a number."),
        ({"repetition_penalty": 0}, "'repetition_penalty' must be > 0.0 and <= 10.0 (got 0)."),
        ({"logit_bias": [1]}, "'logit_bias' must be an object mapping token ids to numbers."),
        ({"logit_bias": {"a": 1}}, "'logit_bias' keys must be token ids (got 'a')."),
        ({"logit_bias": {"1": 101}}, "'logit_bias' must be >= -100.0 and <= 100.0 (got 101)."),
    ]:
        with pytest.raises(APIError) as e:
            parse_chat({"messages": MSG, **body}, 16, 16)
        assert e.value.status == 400 and e.value.body()["error"]["message"] == message


def test_completion_prompts():
    assert parse_completion({"prompt": ["abc"]}, 8, 8).prompt == "abc"
    assert parse_completion({"prompt": [[1, 2, 3]]}, 8, 8).prompt == [1, 2, 3]
    assert parse_completion({"prompt": "x"}, 8, 8).template == {"ignore_chat_template": True}


def run(splitter: ThinkSplitter, pieces: list[str]) -> tuple[str, str]:
    r = c = ""
    for p in pieces:
        a, b = splitter.feed(p)
        r, c = r + a, c + b
    a, b = splitter.flush()
    return r + a, c + b


def test_think_split_streamed_in_pieces():
    text = "\n<think>\nplan it</think>\n\nanswer </thinking> here"
    for size in (1, 2, 3, 7, 100):
        pieces = [text[i : i + size] for i in range(0, len(text), size)]
        assert run(ThinkSplitter(), pieces) == ("\nplan it", "answer </thinking> here")


def test_think_opened_by_prompt_and_plain_text():
    assert prompt_opens_think("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_think("<think>\n\n</think>\n\n")
    assert run(ThinkSplitter(True), ["reason", "ing</th", "ink>done"]) == ("reasoning", "done")
    assert run(ThinkSplitter(), ["<th", "is is not a tag"]) == ("", "<this is not a tag")
    assert run(ThinkSplitter(), ["plain <think>x</think>"]) == ("", "plain <think>x</think>")
    assert run(ThinkSplitter(True), ["unfinished"]) == ("unfinished", "")


def test_responder_puts_reasoning_in_reasoning_content():
    from dflash_mac.serve.responses import Responder
    from dflash_mac.serve.worker import Ready

    req = parse_chat({"messages": MSG, "stream": True}, 8, 8)
    out = Responder(req, "m", Ready(3, think_open=True))
    chunks = out.deltas("step 1</think>\n\nresult", final=True)
    assert [c["choices"][0]["delta"] for c in chunks] == [
        {"reasoning_content": "step 1"},
        {"content": "result"},
    ]
    whole = Responder(parse_chat({"messages": MSG}, 8, 8), "m", Ready(3, think_open=False))
    r, c = whole.parts("<think>why</think>because", final=True)
    result = {"finish_reason": "stop", "usage": {}, "dflash": {}}
    msg = whole.whole(r, c, result)["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": "because", "reasoning_content": "why"}
