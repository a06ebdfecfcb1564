"""Structured output: a request's JSON schema as a token mask on the target's p and the drafter's
q alike, at every block position given the drafts before it (docs/design.md §7: rejection
sampling stays lossless for the constrained target when both see the same transform).

The grammar engine is llguidance (maintained, Rust, no dependencies; docs/editors.md
"Structured output" has the measurement it was chosen by). `json_grammar` compiles and checks a
schema once, without a model; `JsonGrammar.start(pair)` gives the request's `Constraint`: a
matcher over the pair's tokenizer, advanced on the host by each draft and each committed token
and rolled back past the rejected drafts."""

from __future__ import annotations

import json
import weakref
from copy import copy
from dataclasses import dataclass
from typing import Any, Protocol

import llguidance
import mlx.core as mx
import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from ..errors import PromptError

# compact JSON: no free whitespace, which a small model can loop on until max_tokens
JSON_OPTIONS = {"whitespace_flexible": False}
ANY_OBJECT: dict = {"type": "object"}  # OpenAI's json_object and Ollama's "json"


class Constraint(Protocol):
    """One request's constraint, stateful on the host: which tokens may come next."""

    def mask(self) -> mx.array:
        """Allowed next tokens, bool [V] (never all False)."""
        ...

    def consume(self, token: int) -> None: ...

    def rollback(self, n: int) -> None: ...

    @property
    def ended(self) -> bool:
        """The constrained text is complete (an end-of-sequence token was consumed)."""
        ...


class Grammar(Protocol):
    def start(self, pair: Any) -> Constraint: ...


@dataclass(frozen=True)
class JsonGrammar:
    """A checked JSON schema and its llguidance grammar."""

    schema: str  # the schema as JSON text
    grammar: str  # llguidance's grammar for it

    def start(self, pair: Any) -> JsonConstraint:
        """The request's matcher over `pair`'s tokenizer (PromptError when it cannot end)."""
        eos = sorted(pair.eos_ids)
        if not eos:
            raise PromptError("this model has no end-of-sequence token; JSON output needs one.")
        tok = grammar_tokenizer(pair)
        matcher = llguidance.LLMatcher(tok, self.grammar, log_level=0)
        if matcher.is_error():
            raise PromptError(f"the JSON schema cannot be used: {first_line(matcher.get_error())}")
        return JsonConstraint(matcher, tok.vocab_size, eos)


def json_grammar(schema: Any) -> JsonGrammar:
    """Compile and check a JSON schema (a dict); ValueError with one sentence when it is not
    a schema llguidance can enforce."""
    if not isinstance(schema, dict):
        raise ValueError("the JSON schema must be a JSON object.")
    try:
        text = json.dumps(schema)  # key order kept: it is the properties' order
        grammar = llguidance.LLMatcher.grammar_from_json_schema(text, overrides=JSON_OPTIONS)
    except (TypeError, ValueError) as e:
        raise ValueError(f"the JSON schema is not valid: {first_line(str(e))}")
    problem = llguidance.LLMatcher.validate_grammar(grammar)
    if problem:
        raise ValueError(f"the JSON schema is not valid: {first_line(problem)}")
    return JsonGrammar(text, grammar)


def first_line(message: str) -> str:
    """One sentence out of llguidance's (sometimes multi-line) messages."""
    lines = [s.strip() for s in message.splitlines() if s.strip()] or ["unknown error"]
    line = lines[0]
    if line.endswith(":") and len(lines) > 1:  # "regex parse error:" … "error: unclosed group"
        line = f"{line} {lines[-1].removeprefix('error: ')}"
    return line if line.endswith(".") else line + "."


class JsonConstraint:
    """An llguidance matcher: masks from its bitmask, tokens consumed and rolled back."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab: int, eos: list[int]):
        self.matcher, self.vocab, self.eos = matcher, vocab, eos
        self.bits = allocate_token_bitmask(1, vocab)
        self.done: list[bool] = []  # per consumed token: an end-of-sequence token

    def mask(self) -> mx.array:
        fill_next_token_bitmask(self.matcher, self.bits)
        allowed = np.unpackbits(self.bits.view(np.uint8), bitorder="little")[: self.vocab]
        if not allowed.any():  # past the end: a row never emitted, kept a distribution
            allowed[self.eos] = 1
        return mx.array(allowed.astype(np.bool_))

    def consume(self, token: int) -> None:
        # an end-of-sequence token stays out of the matcher: its rollback does not count it
        if token not in self.eos and not self.matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused token {token}: {self.matcher.get_error()}")
        self.done.append(token in self.eos)

    def rollback(self, n: int) -> None:
        if n > 0:
            undone, self.done = self.done[-n:], self.done[:-n]
            self.matcher.rollback(undone.count(False))

    @property
    def ended(self) -> bool:
        return any(self.done[-1:])


_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def grammar_tokenizer(pair: Any) -> llguidance.LLTokenizer:
    """llguidance's view of the pair's tokenizer over the model's vocabulary (built once per
    tokenizer: about a second for a 150k vocabulary)."""
    wrapper = pair.tokenizer
    vocab = int(pair.drafter.config.vocab_size)
    key = (vocab, tuple(sorted(pair.eos_ids)))
    cached = _TOKENIZERS.get(wrapper)
    if cached is not None and cached[0] == key:
        return cached[1]
    backend = copy(getattr(wrapper, "_tokenizer", wrapper).backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    tok = llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab, eos_token=list(key[1]) or None)
    _TOKENIZERS[wrapper] = (key, tok)
    return tok


def token_bytes(pair: Any, ids: list[int]) -> list[bytes]:
    """Each token's own bytes (a token may hold part of a UTF-8 character; special tokens are
    their text)."""
    tok = grammar_tokenizer(pair)
    return [tok.decode_bytes([t]) for t in ids]
