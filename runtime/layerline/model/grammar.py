"""Constrained decoding: a grammar (a JSON schema, or a Lark grammar) as a mask over the next token.

Built on llguidance (Microsoft's guidance engine in Rust, the grammar library vLLM, SGLang and
llama.cpp use): it reads the `tokenizers` JSON the checkpoint's tokenizer already is (BPE and
SentencePiece alike), compiles a JSON schema or Lark grammar in about a millisecond, and computes
each step's mask lazily (no per-schema precompilation over the vocabulary). One `Constraint`
per sequence: `allowed(vocab)` before the token is chosen, `accept(token)` after.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


class GrammarError(ValueError):
    """A schema or grammar llguidance cannot compile; the message says why."""


class GrammarUnavailable(RuntimeError):
    """The grammar library is not installed in this interpreter (a server host set up by hand)."""


def _llg():
    try:
        import llguidance
    except ImportError:
        raise GrammarUnavailable("constrained output needs the llguidance package in the server's interpreter "
                                 "(pip install llguidance; `make setup` installs it)") from None
    return llguidance


@dataclass
class GrammarTokenizer:
    """The checkpoint's tokenizer as llguidance sees it (built once: about 0.2 s for a 49k vocabulary)."""
    tokenizer: Any                 # tokenizers.Tokenizer
    eos_ids: tuple[int, ...]
    _ll: Any = field(default=None, repr=False)

    @property
    def ll(self):
        if self._ll is None:
            llg = _llg()
            self._ll = llg.LLTokenizer(self.tokenizer.to_str(), eos_token=list(self.eos_ids) or None)
        return self._ll


# JSON as a small model writes it best: no free whitespace between items (an unconstrained run of
# newlines is the usual way a small model never closes an object)
_JSON_OPTIONS = {"whitespace_flexible": False}


def json_schema_grammar(schema: dict) -> str:
    """The llguidance grammar of documents valid against `schema` (a JSON object)."""
    if not isinstance(schema, dict):
        raise GrammarError("the schema must be a JSON object")
    try:
        return _llg().LLMatcher.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)
    except ValueError as e:
        raise GrammarError(str(e)) from None


def lark_grammar(lark: str) -> str:
    return _llg().LLMatcher.grammar_from_lark(lark)


def lark_json(schema: dict) -> str:
    """A Lark rule body for a JSON value valid against schema (llguidance's %json extension)."""
    s = dict(schema)
    s.setdefault("x-guidance", _JSON_OPTIONS)
    return "%json " + json.dumps(s)


def check_grammar(tok: GrammarTokenizer, grammar: str) -> None:
    """GrammarError naming what is wrong, or nothing."""
    err = _llg().LLMatcher.validate_grammar(grammar, tok.ll)
    if err:
        raise GrammarError(err)


class Constraint:
    """One sequence's grammar state. Not thread-safe: the engine's thread alone uses it."""

    def __init__(self, tok: GrammarTokenizer, grammar: str):
        llg = _llg()
        self.tok = tok
        self.matcher = llg.LLMatcher(tok.ll, grammar, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(self.matcher.get_error())

    @property
    def finished(self) -> bool:
        """The grammar is complete and takes no more tokens (its end-of-sequence was consumed)."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None

    def allowed(self, vocab: int) -> torch.Tensor:
        """A bool mask [vocab] of the tokens the grammar allows next (ids past the tokenizer's: never)."""
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        if bits.size < vocab:   # the model's rows past the tokenizer's last id (padding): never chosen
            bits = np.concatenate([bits, np.zeros(vocab - bits.size, dtype=np.uint8)])
        return torch.from_numpy(bits[:vocab].view(np.bool_))

    def accept(self, token: int) -> bool:
        """Advance past the chosen token; False when the grammar refuses it (the matcher is then in error)."""
        return self.matcher.consume_token(int(token))
