"""Log-probabilities in OpenAI's shapes: the chat `content` entries and the completions'
parallel lists (docs/serve.md "Log-probabilities")."""

from __future__ import annotations

from typing import Any

from dflash_mac.engine.constraints import token_bytes
from dflash_mac.engine.verify import TokenLogprob


def entries(pair: Any, lps: list[TokenLogprob]) -> list[dict]:
    """Chat's `logprobs.content` entries: token text, log-probability, bytes, top tokens."""
    ids = sorted({t for lp in lps for t in (lp.token, *(i for i, _ in lp.top))})
    raw = dict(zip(ids, token_bytes(pair, ids)))

    def one(token: int, logprob: float) -> dict:
        b = raw[token]
        return {"token": b.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(b)}

    return [
        {**one(lp.token, lp.logprob), "top_logprobs": [one(i, v) for i, v in lp.top]} for lp in lps
    ]


def completion_logprobs(content: list[dict], offset: int = 0) -> dict[str, Any]:
    """The completions API's shape of the same entries; `offset`: where their text starts."""
    offsets = []
    for e in content:
        offsets.append(offset)
        offset += len(e["token"])
    return {
        "tokens": [e["token"] for e in content],
        "token_logprobs": [e["logprob"] for e in content],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in content],
        "text_offset": offsets,
    }
