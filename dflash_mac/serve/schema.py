"""OpenAI request validation for `dflash-mac serve`: JSON bodies -> `GenRequest`, or `APIError`.

Everything a request asks for is either honoured or refused with a 400 that says why; nothing
is silently dropped (unknown, harmless fields such as `user` or `metadata` are ignored)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from dflash_mac.engine.constraints import ANY_OBJECT, JsonGrammar, json_grammar
from dflash_mac.models.penalties import LIMITS
from dflash_mac.settings import MAX_TOP_LOGPROBS

ROLES = {"system", "developer", "user", "assistant", "tool"}
REASONING_EFFORT = {
    "none": "off",
    "minimal": "off",
    "low": "low",
    "medium": "medium",
    "high": "high",
}


class APIError(Exception):
    """An HTTP error with an OpenAI-shaped body."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = (
            status,
            message,
            param,
            code,
            kind,
        )

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


def bad(param: str, message: str) -> APIError:
    return APIError(400, message, param=param)


@dataclass
class GenRequest:
    """A validated generation request (chat or completion)."""

    kind: str  # "chat" | "completion"
    prompt: str | list[dict] | list[int]
    stream: bool = False
    include_usage: bool = False
    max_tokens: int = 0
    model: str | None = None
    sampling: dict = field(default_factory=dict)  # make_config's: temp .. logprobs, json_schema
    template: dict = field(default_factory=dict)  # reasoning, chat_template_args, ...
    tools: list[dict] | None = None  # function tools the template was given (chat)
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    context_cap: int | None = None  # a smaller context than the model's (Ollama's num_ctx)
    block_size: int | str | None = None  # this request's block size or "auto" (None: the server's)


def number(
    body: dict,
    name: str,
    default: float,
    lo: float,
    hi: float,
    lo_open: bool = False,
    hi_open: bool = False,
) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad(name, f"'{name}' must be a number.")
    if value < lo or value > hi or (lo_open and value == lo) or (hi_open and value == hi):
        low = f"> {lo}" if lo_open else f">= {lo}"
        high = f"< {hi}" if hi_open else f"<= {hi}"
        raise bad(name, f"'{name}' must be {low} and {high} (got {value}).")
    return float(value)


def integer(body: dict, name: str, default: int | None, lo: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(name, f"'{name}' must be an integer.")
    if lo is not None and value < lo:
        raise bad(name, f"'{name}' must be at least {lo} (got {value}).")
    return value


def flag(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(name, f"'{name}' must be true or false.")
    return value


def block_size(body: dict) -> int | str | None:
    """The request's own block size (an extension field): an integer >= 1 or "auto"."""
    return "auto" if body.get("block_size") == "auto" else integer(body, "block_size", None, lo=1)


def stop_strings(body: dict) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(s, str) for s in values):
        raise bad("stop", "'stop' must be a string or a list of strings.")
    if len(values) > 16:
        raise bad("stop", "'stop' takes at most 16 strings.")
    return [s for s in values if s]


def unsupported(body: dict) -> None:
    """400 for features this server does not implement, when a request actually asks for them."""

    def refuse(name: str, what: str) -> None:
        raise bad(name, f"'{name}' is not supported by dflash-mac serve ({what}).")

    if body.get("n") not in (None, 1):
        refuse("n", "one choice per request; send n=1 or leave it out")
    if body.get("best_of") not in (None, 1):
        refuse("best_of", "one choice per request")
    if body.get("functions"):
        refuse("functions", "the legacy form; send 'tools' instead")
    if body.get("function_call") not in (None, "none"):
        refuse("function_call", "the legacy form; send 'tool_choice' instead")
    if body.get("modalities") not in (None, ["text"]):
        refuse("modalities", "text only")
    for name in ("audio", "prediction", "web_search_options"):
        if body.get(name):
            refuse(name, "not implemented")


def field_name(field: str) -> str:
    """How the server names a request field in its messages: `'presence_penalty'`."""
    return f"'{field}'"


def penalty(body: dict, name: str, default: float | None) -> float | None:
    """A penalty (or one logit bias) within the engine's range, the CLI's rule and wording."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad(name, f"'{name}' must be a number.")
    try:
        LIMITS[name].check(field_name(name), value)
    except ValueError as e:
        raise bad(name, str(e))
    return float(value)


def logit_bias(body: dict) -> dict[int, float] | None:
    """OpenAI's `logit_bias`: {token id (as a string): bias in [-100, 100]}."""
    value = body.get("logit_bias")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad("logit_bias", "'logit_bias' must be an object mapping token ids to numbers.")
    out = {}
    for k, v in value.items():
        try:
            tok = int(k)
        except (TypeError, ValueError):
            raise bad("logit_bias", f"'logit_bias' keys must be token ids (got {k!r}).")
        out[tok] = penalty({"logit_bias": v}, "logit_bias", 0.0)
    return out


def penalties(body: dict) -> dict:
    """Presence, frequency and repetition penalties and logit bias (lossless: the engine
    applies them to the target and the drafter alike)."""
    return {
        "presence_penalty": penalty(body, "presence_penalty", 0.0),
        "frequency_penalty": penalty(body, "frequency_penalty", 0.0),
        "repetition_penalty": penalty(body, "repetition_penalty", None),
        "logit_bias": logit_bias(body),
    }


def logprobs(body: dict, kind: str) -> int | None:
    """How many top log-probabilities per token (0: the chosen token's only), or None. Chat:
    `logprobs` true and `top_logprobs`; completions: `logprobs` as a number."""
    name = "logprobs" if kind == "completion" else "top_logprobs"
    n = None if body.get(name) is False else integer(body, name, None, lo=0)
    if n is not None and n > MAX_TOP_LOGPROBS:
        raise bad(name, f"'{name}' must be at most {MAX_TOP_LOGPROBS} (got {n}).")
    if kind == "completion":
        return n
    if flag(body, "logprobs"):
        return n or 0
    if n:
        raise bad("top_logprobs", "'top_logprobs' needs 'logprobs': true.")
    return None


def response_format(body: dict) -> JsonGrammar | None:
    """OpenAI's `response_format`: text (None), json_object or json_schema, compiled here so
    that a schema the grammar engine cannot enforce is a 400 before anything runs."""
    fmt = body.get("response_format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        schema = ANY_OBJECT
    elif kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise bad("response_format", "'json_schema' must have a 'schema' object.")
    else:
        raise bad(
            "response_format", "'response_format' type must be text, json_object or json_schema."
        )
    try:
        return json_grammar(schema)
    except ValueError as e:
        raise bad("response_format", str(e))


def common(
    body: dict, kind: str, prompt: Any, default_max: int, cap: int, default_temp: float
) -> GenRequest:
    """The fields chat and completion requests share."""
    unsupported(body)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", "'model' must be a string.")
    stream = flag(body, "stream")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise bad("stream_options", "'stream_options' must be an object.")
    include_usage = flag(opts or {}, "include_usage")
    max_tokens = integer(body, "max_completion_tokens", None, lo=1)
    max_tokens = integer(body, "max_tokens", max_tokens, lo=1)
    max_tokens = min(max_tokens or default_max, cap)
    top_k = integer(body, "top_k", 0, lo=-1)
    sampling = {
        "temp": number(body, "temperature", default_temp, 0.0, 2.0),
        "top_p": number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        "top_k": max(top_k, 0),  # -1 means "off" in vLLM-style clients
        "min_p": number(body, "min_p", 0.0, 0.0, 1.0, hi_open=True),
        "seed": integer(body, "seed", None),
        "stop": stop_strings(body),
        "use_eos": not flag(body, "ignore_eos"),
        **penalties(body),
        "logprobs": logprobs(body, kind),
        "json_schema": response_format(body),
    }
    if sampling["seed"] is not None:
        sampling["seed"] %= 2**32
    req = GenRequest(kind, prompt, stream, stream and include_usage, max_tokens, model, sampling)
    req.block_size = block_size(body)
    return req


def message_text(i: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise bad(
                    f"messages[{i}].content",
                    "only text content parts are supported (no images or audio).",
                )
            parts.append(part["text"])
        return "".join(parts)
    raise bad(f"messages[{i}].content", "message content must be a string or a list of text parts.")


def chat_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "'messages' must be a non-empty list.")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}]", "each message must be an object.")
        role = m.get("role")
        if role == "function" or m.get("function_call"):
            raise bad(f"messages[{i}]", "legacy function messages are not supported; use tools.")
        if role not in ROLES:
            raise bad(
                f"messages[{i}].role",
                f"unknown role {role!r}; use system, developer, user, assistant or tool.",
            )
        content = m.get("content")
        text = "" if content is None and role == "assistant" else message_text(i, content)
        msg = {"role": "system" if role == "developer" else role, "content": text}
        if role == "assistant" and m.get("tool_calls") is not None:
            msg["tool_calls"] = history_calls(i, m["tool_calls"])
        if role == "tool":
            call_id = m.get("tool_call_id")
            if call_id is not None and not isinstance(call_id, str):
                raise bad(f"messages[{i}].tool_call_id", "'tool_call_id' must be a string.")
            msg.update({k: m[k] for k in ("tool_call_id", "name") if isinstance(m.get(k), str)})
        out.append(msg)
    return out


def history_calls(i: int, calls: Any) -> list[dict]:
    """An assistant message's `tool_calls`, arguments as objects (what templates render)."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise bad(where, "'tool_calls' must be a list.")
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad(where, "each tool call needs a function with a name.")
        args = fn.get("arguments") or {}
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                raise bad(where, f"the arguments of {fn['name']!r} are not valid JSON.")
        if not isinstance(args, dict):
            raise bad(where, f"the arguments of {fn['name']!r} must be a JSON object.")
        entry = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        out.append(entry)
    return out


def chat_tools(body: dict, req: GenRequest) -> None:
    """`tools`, `tool_choice` and `parallel_tool_calls` into `req` (the model's support for
    them is checked where the tokenizer is known: routes.py)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    req.parallel_tool_calls = flag(body, "parallel_tool_calls", True)
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise bad("tool_choice", "'tool_choice' needs 'tools'.")
        return
    if not isinstance(tools, list) or not all(
        isinstance(t, dict)
        and t.get("type", "function") == "function"
        and isinstance(t.get("function"), dict)
        and isinstance(t["function"].get("name"), str)
        for t in tools
    ):
        raise bad("tools", "'tools' must be a list of {type: function, function: {name, ...}}.")
    names = [t["function"]["name"] for t in tools]
    if isinstance(choice, dict):
        wanted = (choice.get("function") or {}).get("name")
        if choice.get("type") != "function" or wanted not in names:
            raise bad("tool_choice", "'tool_choice' must name one of the given tools.")
        tools = [t for t in tools if t["function"]["name"] == wanted]
    elif choice not in (None, "auto", "none", "required"):
        raise bad("tool_choice", "'tool_choice' must be none, auto, required or a function.")
    if choice == "none":
        return
    req.tools, req.tool_choice = tools, choice


def parse_chat(body: Any, default_max: int, cap: int, default_temp: float = 0.0) -> GenRequest:
    """Validate a /v1/chat/completions body."""
    if not isinstance(body, dict):
        raise bad("body", "the request body must be a JSON object.")
    req = common(body, "chat", chat_messages(body), default_max, cap, default_temp)
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in REASONING_EFFORT:
            raise bad(
                "reasoning_effort",
                f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORT)}.",
            )
        req.template["reasoning"] = REASONING_EFFORT[effort]
    chat_tools(body, req)
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            raise bad("chat_template_kwargs", "'chat_template_kwargs' must be an object.")
        req.template["chat_template_args"] = kwargs
    return req


def completion_prompt(value: Any) -> str | list[int]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # a batch of one
    if isinstance(value, str) and value:
        return value
    if (
        isinstance(value, list)
        and value
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)
    ):
        return value
    raise bad(
        "prompt",
        "'prompt' must be a non-empty string or list of token ids (one prompt per request).",
    )


def parse_completion(
    body: Any, default_max: int, cap: int, default_temp: float = 0.0
) -> GenRequest:
    """Validate a /v1/completions body (raw text, no chat template)."""
    if not isinstance(body, dict):
        raise bad("body", "the request body must be a JSON object.")
    if flag(body, "echo"):
        raise bad("echo", "'echo' is not supported by dflash-mac serve.")
    if body.get("suffix"):
        raise bad("suffix", "'suffix' (fill-in-the-middle) is not supported by dflash-mac serve.")
    prompt = completion_prompt(body.get("prompt"))
    req = common(body, "completion", prompt, default_max, cap, default_temp)
    req.template["ignore_chat_template"] = True
    return req
