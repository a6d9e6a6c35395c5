"""The checkpoint's text side: tokenizer.json, the chat template, stop tokens, incremental detokenizing.

The chat template is rendered the way Hugging Face renders it: jinja2's sandboxed, immutable
environment with trim_blocks and lstrip_blocks, `raise_exception`, the bos/eos tokens, and
add_generation_prompt=True.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..errors import LayerlineError


class TemplateError(LayerlineError):
    """A chat request this checkpoint cannot render (no template, or the template refused it)."""


@dataclass
class TextSide:
    """What the server needs from a checkpoint dir besides the weights."""
    tokenizer: object | None = None          # tokenizers.Tokenizer
    template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    eos_ids: frozenset = frozenset()
    context: int | None = None               # max_position_embeddings
    vocab_size: int | None = None
    _compiled: object | None = field(default=None, repr=False)
    _grammar_tok: object | None = field(default=None, repr=False)

    @classmethod
    def load(cls, checkpoint: str | None) -> "TextSide":
        """From a Hugging Face dir or a .gguf file (layerline.checkpoint opens both alike)."""
        if not checkpoint:
            return cls()
        from ..checkpoint import CheckpointError, open_checkpoint
        if not os.path.exists(checkpoint):
            raise LayerlineError(f"--checkpoint {checkpoint}: no such directory or .gguf file")
        ck = open_checkpoint(checkpoint)
        try:
            cfg = ck.config
        except CheckpointError:
            cfg = {}
        try:
            tok = ck.tokenizer
        except CheckpointError:
            tok = None  # prompts must then come as token ids
        sp = ck.special_tokens
        ctx, vocab = cfg.get("max_position_embeddings"), cfg.get("vocab_size")
        return cls(tok, ck.chat_template, sp["bos"]["text"], sp["eos"]["text"], frozenset(sp["eos_ids"]),
                   ctx if isinstance(ctx, int) else None, vocab if isinstance(vocab, int) else None)

    # -- prompts

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of text. add_special_tokens: what the tokenizer's post-processor adds (BOS where
        the checkpoint asks for it) — a completion's prompt, as vLLM and llama-server encode it; a
        rendered chat template carries its own BOS text, so chat prompts go without."""
        if self.tokenizer is None:
            raise TemplateError("this checkpoint has no tokenizer.json: send the prompt as a list of token ids")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def render(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The chat template applied to messages, with the generation prompt (and `tools`, as Hugging
        Face's apply_chat_template hands them to the template)."""
        if self.template is None:
            raise TemplateError("this checkpoint has no chat template (tokenizer_config.json has no "
                                "chat_template); use /v1/completions with a prompt instead")
        if self._compiled is None:
            from jinja2 import TemplateError as JinjaError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message):
                raise TemplateError(f"chat template: {message}")
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            try:
                self._compiled = env.from_string(self.template)
            except JinjaError as e:
                raise TemplateError(f"chat template does not compile: {e}") from None
        from jinja2 import TemplateError as JinjaError
        try:
            extra = {"tools": tools} if tools else {}
            return self._compiled.render(messages=messages, bos_token=self.bos_token or "",
                                         eos_token=self.eos_token or "", add_generation_prompt=True, **extra)
        except JinjaError as e:
            raise TemplateError(f"chat template: {e}") from None

    def chat_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        return self.encode(self.render(messages, tools))

    def grammar_tokenizer(self):
        """The tokenizer as the grammar library reads it (layerline.model.grammar), built once."""
        if self.tokenizer is None:
            raise TemplateError("this checkpoint has no tokenizer: constrained output (response_format, "
                                "tool_choice) needs one")
        if self._grammar_tok is None:
            from ..model.grammar import GrammarTokenizer
            self._grammar_tok = GrammarTokenizer(self.tokenizer, tuple(sorted(self.eos_ids)))
        return self._grammar_tok

    def token_text(self, tok: int) -> str:
        """One token's own text (special tokens included), as logprobs name it."""
        if self.tokenizer is None:
            return f" {tok}"
        return self.tokenizer.decode([tok], skip_special_tokens=False)

    # -- output

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return "".join(f" {i}" for i in ids)
        return self.tokenizer.decode(ids, skip_special_tokens=True)


class Detokenizer:
    """Text of a growing list of token ids, handed out as deltas.

    Decodes a short window (the tokens since the last whole piece of text, with the piece
    before as context, as Hugging Face's and vLLM's incremental detokenizers do), so a long
    generation costs the same per token; a trailing replacement character waits until its
    bytes are complete. Stop strings end the text before their first occurrence, and a tail
    that may grow into one is held back.
    """

    def __init__(self, side: TextSide, stop: list[str] | None = None):
        self.side = side
        self.stop = [s for s in (stop or []) if s]
        self.ids: list[int] = []
        self.prefix = 0          # window start: context for the tokens being decoded
        self.read = 0            # tokens whose text is in self.text
        self.text = ""           # text decoded so far
        self.sent = 0            # characters of it handed out
        self.stopped = False

    def add(self, tok: int | None, final: bool = False) -> str:
        """The new text after token tok ('' while it is not yet whole or may start a stop string)."""
        if tok is not None:
            self.ids.append(tok)
        if self.stopped:
            return ""
        before = self.side.decode(self.ids[self.prefix:self.read])
        after = self.side.decode(self.ids[self.prefix:])
        if len(after) > len(before) and (final or not after.endswith("\ufffd")) and after.startswith(before):
            self.text += after[len(before):]
            self.prefix, self.read = self.read, len(self.ids)
        elif final and after != before:
            self.text += after[len(before):] if after.startswith(before) else ""
        return self._out(final)

    def flush(self) -> str:
        return self.add(None, final=True)

    def _out(self, final: bool) -> str:
        text, start = self.text, self.sent
        for s in self.stop:
            i = text.find(s, max(0, start - len(s) + 1))
            if i >= 0:
                self.stopped = True
                out = text[start:i] if i >= start else ""
                self.sent = max(start, i)
                return out
        hold = 0
        if not final:
            for s in self.stop:
                for k in range(min(len(s) - 1, len(text) - start), 0, -1):
                    if text.endswith(s[:k]):
                        hold = max(hold, k)
                        break
        upto = len(text) - hold
        if upto <= start:
            return ""
        self.sent = upto
        return text[start:upto]
