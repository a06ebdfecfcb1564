"""`dflash-mac serve` as Claude Code and other Anthropic clients reach it: the official
`anthropic` client, an API key in `x-api-key`, one message streamed and the same one whole."""

from __future__ import annotations

import anthropic
import pytest

from .conftest import start_serve

pytestmark = pytest.mark.slow  # starts the installed command in a subprocess


def test_anthropic_client_streams_a_message(cli, tmp_path):
    srv = start_serve(cli, tmp_path / "serve.out", "--api-key", "k", "--max-tokens", "64")
    try:
        srv.wait_healthy(60)
        client = anthropic.Anthropic(base_url=srv.root, api_key="k", max_retries=0, timeout=60)
        ask = {"model": "dflash-mac", "max_tokens": 16, "system": "Be brief."}
        ask["messages"] = [{"role": "user", "content": "Write a Python function that adds."}]
        with client.messages.stream(**ask) as stream:
            streamed = "".join(stream.text_stream)
            final = stream.get_final_message()
        whole = client.messages.create(**ask)
        assert streamed and streamed == final.content[0].text == whole.content[0].text
        assert whole.stop_reason in ("max_tokens", "end_turn")
        assert whole.usage.cache_read_input_tokens > 0  # the same prompt, from the cache
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=srv.root, api_key="no", max_retries=0).messages.create(
                **ask
            )
    finally:
        srv.terminate()
    assert "Traceback" not in srv.output()
