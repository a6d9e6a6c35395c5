"""Tool calls: which format a model writes them in, the grammar that enforces one, and the parsers
that turn its text back into OpenAI `tool_calls` (whole, or as stream deltas).

The format is read off the checkpoint's chat template (the one place it is decided, `tool_format`):

  hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>, one block per call
               (Qwen2/2.5/3, Hermes, SmolLM3: templates that write `<tool_call>`)
  llama3_json  {"name": ..., "parameters": {...}} as the whole answer, calls joined by ";"
               (Llama 3.1/3.2/3.3: `<|python_tag|>` / "parameters" in a header-style template)
  mistral      [TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]

A template that does not take `tools` at all (SmolLM2, Gemma 3) gets them as a system message that
asks for the hermes format. Text that does not parse as a call stays the answer's content: a
model's malformed call is never a 500.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

HERMES, LLAMA3, MISTRAL = "hermes", "llama3_json", "mistral"


def tool_format(template: str | None) -> str:
    t = template or ""
    if "<tool_call>" in t:
        return HERMES
    if "[TOOL_CALLS]" in t:
        return MISTRAL
    if "<|python_tag|>" in t or ("<|start_header_id|>" in t and "parameters" in t and "tools" in t):
        return LLAMA3
    return HERMES


def template_takes_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template


def tools_system_prompt(tools: list[dict]) -> str:
    """What a template without tool support is told (as the start of its system message)."""
    lines = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
    return (f"You can call these functions:\n<tools>\n{lines}\n</tools>\n"
            "To call one, answer <tool_call>\n{\"name\": NAME, \"arguments\": {ARGS}}\n</tool_call>")


@dataclass
class ToolCall:
    name: str
    arguments: str                 # a JSON text, as the OpenAI API carries it
    id: str = ""

    def __post_init__(self):
        if not self.id:
            self.id = f"call_{uuid.uuid4().hex[:24]}"

    def dump(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _call(obj, args_key: str = "arguments") -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):
        try:
            json.loads(args)
        except ValueError:
            return None
        text = args
    elif isinstance(args, dict):
        text = json.dumps(args, ensure_ascii=False)
    else:
        return None
    return ToolCall(obj["name"], text)


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def parse(fmt: str, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole answer; no calls and the text as content when it does not parse."""
    if fmt == HERMES:
        if "<tool_call>" not in text:
            return text, []
        calls: list[ToolCall] = []
        for m in _HERMES.finditer(text):
            try:
                c = _call(json.loads(m.group(1)))
            except ValueError:
                return text, []
            if c is None:
                return text, []
            calls.append(c)
        rest = _HERMES.sub("", text).strip()
        return (rest or None), calls
    if fmt == LLAMA3:
        body = text.strip()
        if body.startswith("<|python_tag|>"):
            body = body[len("<|python_tag|>"):]
        if not body.startswith("{"):
            return text, []
        calls = []
        for part in _split_json(body, ";"):
            try:
                c = _call(json.loads(part), "parameters")
            except ValueError:
                return text, []
            if c is None:
                return text, []
            calls.append(c)
        return None, calls
    if fmt == MISTRAL:
        body = text.strip()
        if body.startswith("[TOOL_CALLS]"):
            body = body[len("[TOOL_CALLS]"):].strip()
        if not body.startswith("["):
            return text, []
        try:
            arr = json.loads(body)
        except ValueError:
            return text, []
        calls = [_call(o) for o in arr] if isinstance(arr, list) else [None]
        if not calls or any(c is None for c in calls):
            return text, []
        return None, calls
    raise ValueError(f"unknown tool-call format {fmt!r}")


def _split_json(body: str, sep: str) -> list[str]:
    """Top-level JSON objects separated by sep (a ; inside a string or object does not split)."""
    dec = json.JSONDecoder()
    out, i = [], 0
    while i < len(body):
        try:
            _, end = dec.raw_decode(body, i)
        except ValueError:
            return [body]
        out.append(body[i:end])
        i = end
        while i < len(body) and (body[i].isspace() or body[i] == sep):
            i += 1
    return out


class StreamParser:
    """Tool calls out of a streamed answer: `feed(delta)` gives (content delta, finished calls), `end()`
    what is left. Content before a call streams as it comes; a call's text is held until it is whole
    (hermes: its closing tag; the JSON formats: the end of the answer) and then sent as one tool-call
    delta; held text that does not parse is sent as content."""

    def __init__(self, fmt: str):
        self.fmt = fmt
        self.buf = ""          # held text
        self.mode = "text"     # text | call (inside a call's text) | whole (the answer is a call: hold all)
        self.started = False   # some non-space text has been seen
        self.calls = 0

    def _opener(self) -> str:
        return "<tool_call>" if self.fmt == HERMES else ("[TOOL_CALLS]" if self.fmt == MISTRAL else "<|python_tag|>")

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self.buf += delta
        out, calls = "", []
        while True:
            if self.mode == "whole":
                return out, calls
            if self.mode == "text":
                if self.fmt != HERMES and not self.started:
                    s = self.buf.lstrip()
                    if not s:
                        return out, calls
                    self.started = True
                    if s[0] in "{[" or self._opener().startswith(s[:len(self._opener())]):
                        self.mode = "whole"
                        continue
                if self.fmt != HERMES:
                    out, self.buf = out + self.buf, ""
                    return out, calls
                i = self.buf.find("<tool_call>")
                if i < 0:   # hold a tail that may grow into the opener
                    keep = next((k for k in range(min(len(self.buf), 10), 0, -1)
                                 if "<tool_call>".startswith(self.buf[-k:])), 0)
                    out += self.buf[:len(self.buf) - keep]
                    self.buf = self.buf[len(self.buf) - keep:]
                    return out, calls
                out += self.buf[:i]
                self.buf = self.buf[i:]
                self.mode = "call"
            if self.mode == "call":
                j = self.buf.find("</tool_call>")
                if j < 0:
                    return out, calls
                block, self.buf = self.buf[:j + len("</tool_call>")], self.buf[j + len("</tool_call>"):]
                content, got = parse(HERMES, block)
                if got:
                    calls += got
                    self.calls += len(got)
                else:
                    out += block
                self.mode = "text"

    def end(self) -> tuple[str, list[ToolCall]]:
        buf, self.buf = self.buf, ""
        if not buf:
            return "", []
        if self.mode == "whole" or self.mode == "call":
            content, calls = parse(self.fmt, buf)
            self.calls += len(calls)
            return (content or "") if calls else buf, calls
        return buf, []


def tool_grammar(fmt: str, tools: list[dict], choice) -> str | None:
    """A Lark grammar that makes the answer call a tool: any of `tools` (tool_choice "required") or the
    named one ({"type": "function", "function": {"name": ...}}); None for "auto" and "none"."""
    from ..model.grammar import lark_json
    if choice in (None, "auto", "none"):
        return None
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        fns = [t["function"] for t in tools if t["function"]["name"] == name]
    else:
        fns = [t["function"] for t in tools]
    key = "parameters" if fmt == LLAMA3 else "arguments"

    def schema(fn: dict) -> dict:
        params = fn.get("parameters") or {"type": "object"}
        return {"type": "object", "properties": {"name": {"const": fn["name"]}, key: params},
                "required": ["name", key], "additionalProperties": False}
    one = {"anyOf": [schema(f) for f in fns]} if len(fns) > 1 else schema(fns[0])
    call = lark_json(one)
    if fmt == HERMES:
        return f'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: {call}\n'
    if fmt == MISTRAL:
        return f'start: "[" call "]"\ncall: {call}\n'
    return f"start: call\ncall: {call}\n"
