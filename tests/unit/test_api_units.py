"""The API's details without a server: tool-call formats and parsers, the grammar mask on SmolLM2's
tokenizer, logit_bias and penalties, logprobs, model ids, JSON log lines."""
from __future__ import annotations

import json
import logging

import pytest
import torch

from layerline.model.sampling import adjust_logits, logprobs, mask_logits, sample
from layerline.server import tools
from layerline.server.tools import HERMES, LLAMA3, MISTRAL, StreamParser, parse

QWEN_LIKE = "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools> <tool_call>{% endif %}"
LLAMA31_LIKE = ("<|start_header_id|>{% if tools %}Respond in the format {\"name\": function name, \"parameters\": "
                "dictionary of argument name and its value}{% endif %}<|python_tag|>")


def test_the_format_is_read_off_the_template():
    assert tools.tool_format(QWEN_LIKE) == HERMES
    assert tools.tool_format(LLAMA31_LIKE) == LLAMA3
    assert tools.tool_format("{{ '[TOOL_CALLS]' }}{{ tools }}") == MISTRAL
    assert tools.tool_format("{% for m in messages %}{{ m.content }}{% endfor %}") == HERMES  # told by a system message
    assert tools.template_takes_tools(QWEN_LIKE) and not tools.template_takes_tools("{{ messages }}")


@pytest.mark.parametrize("fmt,text,content,calls", [
    (HERMES, 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>', "Sure.", [("f", {"a": 1})]),
    (HERMES, '<tool_call>{"name": "f", "arguments": "{\\"a\\": 2}"}</tool_call><tool_call>{"name": "g", '
             '"arguments": {}}</tool_call>', None, [("f", {"a": 2}), ("g", {})]),
    (HERMES, '<tool_call>{"name": "f", "arguments": {"a": 1}}', None, [("f", {"a": 1})]),   # eos before the tag
    (LLAMA3, '{"name": "f", "parameters": {"x": ";"}}; {"name": "g", "parameters": {}}', None,
     [("f", {"x": ";"}), ("g", {})]),
    (MISTRAL, '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}]', None, [("f", {"a": 1})]),
])
def test_calls_parse(fmt, text, content, calls):
    got_content, got = parse(fmt, text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls and all(c.id.startswith("call_") for c in got)


@pytest.mark.parametrize("fmt,text", [
    (HERMES, "<tool_call>{not json}</tool_call>"), (HERMES, '<tool_call>{"arguments": {}}</tool_call>'),
    (HERMES, "plain words"), (LLAMA3, "{broken"), (LLAMA3, '{"name": "f", "parameters": [1]}'),
    (MISTRAL, "[TOOL_CALLS] [oops"), (LLAMA3, "Hello there")])
def test_what_does_not_parse_is_content(fmt, text):
    assert parse(fmt, text) == (text, [])


def _stream(fmt: str, text: str, step: int):
    p, content, calls = StreamParser(fmt), "", []
    for i in range(0, len(text), step):
        c, k = p.feed(text[i:i + step])
        content += c
        calls += k
    c, k = p.end()
    return content + c, calls + k


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_stream_parser_gives_what_the_whole_parse_gives(step):
    text = 'Let me look. <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    content, calls = _stream(HERMES, text, step)
    assert content.strip() == "Let me look." and [(c.name, c.arguments) for c in calls] == [("f", '{"a": 1}')]
    content, calls = _stream(LLAMA3, '{"name": "f", "parameters": {"b": 2}}', step)
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("f", '{"b": 2}')]
    # a held tail that never became a call is content after all
    assert _stream(HERMES, "x <tool_c", step) == ("x <tool_c", [])
    assert _stream(HERMES, "<tool_call>{bad}</tool_call> ok", step) == ("<tool_call>{bad}</tool_call> ok", [])
    assert _stream(LLAMA3, "{nope", step) == ("{nope", [])


# --- the grammar on SmolLM2's own tokenizer ---------------------------------------------------------------

@pytest.fixture(scope="module")
def smol_tok():
    from layerline.checkpoint import open_checkpoint
    from layerline.cli import packaged_smollm2
    from layerline.model.grammar import GrammarTokenizer
    ck = open_checkpoint(packaged_smollm2())
    return GrammarTokenizer(ck.tokenizer, tuple(ck.special_tokens["eos_ids"]))


def _greedy_under(tok, grammar: str, prefer: list[int], steps: int = 64) -> list[int]:
    """Decode with random logits under the grammar (preferring `prefer` where allowed) until it ends."""
    from layerline.model.grammar import Constraint
    c = Constraint(tok, grammar)
    g = torch.Generator().manual_seed(0)
    out = []
    vocab = tok.tokenizer.get_vocab_size()
    for _ in range(steps):
        logits = torch.randn(1, vocab, generator=g)
        logits[0, prefer] += 5
        t = int(sample(logits, 1.0, 1.0, g, allowed=c.allowed(vocab).unsqueeze(0))[0])
        assert c.accept(t)
        out.append(t)
        if c.finished:
            break
    return out


def test_json_schema_grammar_forces_a_valid_document(smol_tok):
    import jsonschema
    from layerline.model.grammar import json_schema_grammar
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                               "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    ids = _greedy_under(smol_tok, json_schema_grammar(schema), prefer=[])
    jsonschema.validate(json.loads(smol_tok.tokenizer.decode(ids, skip_special_tokens=True)), schema)


def test_tool_grammar_forces_a_parsable_call(smol_tok):
    from layerline.model.grammar import lark_grammar
    fn = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
        "additionalProperties": False}}}
    for fmt in (HERMES, LLAMA3):
        ids = _greedy_under(smol_tok, lark_grammar(tools.tool_grammar(fmt, [fn], "required")), prefer=[])
        content, calls = parse(fmt, smol_tok.tokenizer.decode(ids, skip_special_tokens=True))
        assert content is None and [c.name for c in calls] == ["get_weather"], (fmt, content)
        assert isinstance(json.loads(calls[0].arguments)["city"], str)


def test_a_bad_schema_is_a_grammar_error(smol_tok):
    from layerline.model.grammar import GrammarError, check_grammar, json_schema_grammar
    with pytest.raises(GrammarError, match="foo"):
        check_grammar(smol_tok, json_schema_grammar({"type": "foo"}))


# --- sampling's adjustments ---------------------------------------------------------------------------------

def test_bias_and_penalties_as_openai_defines_them():
    logits = torch.zeros(6)
    out = adjust_logits(logits, {1: 2.0, 9: 5.0}, generated=[3, 3, 4], presence=0.5, frequency=0.25)
    assert out.tolist() == [0.0, 2.0, 0.0, -1.0, -0.75, 0.0] and logits.abs().sum() == 0   # a new tensor


def test_mask_and_logprobs():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    allowed = torch.tensor([[True, False, True]])
    assert sample(logits, 0.0, allowed=allowed).tolist() == [2]
    assert mask_logits(logits, allowed)[0, 1] == float("-inf")
    with pytest.raises(ValueError, match="no next token"):
        mask_logits(logits, torch.zeros_like(allowed))
    lp, top = logprobs(logits[0], 2, 2)
    want = torch.log_softmax(logits[0], -1)
    assert lp == pytest.approx(float(want[2])) and [i for i, _ in top] == [1, 2]


# --- model ids, logs ----------------------------------------------------------------------------------------

def test_model_id_drops_the_gguf_suffix(tmp_path):
    from layerline.cli import packaged_smollm2
    from layerline.server.cli import model_names
    name, aliases = model_names(packaged_smollm2(), None)
    assert name == "SmolLM2-135M-Instruct.Q4_1" and "SmolLM2-135M-Instruct.Q4_1.gguf" in aliases
    assert len(aliases) == 2   # and the GGUF's general.name
    assert model_names(str(tmp_path / "my-model"), None) == ("my-model", ())
    assert model_names(packaged_smollm2(), "chat")[0] == "chat"


def test_json_log_lines():
    from layerline.server.app import JsonFormatter
    rec = logging.LogRecord("layerline.server", logging.INFO, "x", 1, "GET /x", (), None)
    rec.request = {"path": "/v1/models", "status": 200, "model": "m"}
    out = json.loads(JsonFormatter().format(rec))
    assert out["path"] == "/v1/models" and out["status"] == 200 and out["level"] == "info" and "time" in out
    plain = json.loads(JsonFormatter().format(logging.LogRecord("l", logging.WARNING, "x", 1, "a %s", ("b",), None)))
    assert plain["message"] == "a b"


# --- tools into the chat template ---------------------------------------------------------------------------

def _serving(template: str):
    from layerline.server.chat import TextSide
    from layerline.server.serving import OpenAIServing, ServerConfig
    return OpenAIServing(None, TextSide(template=template, eos_token="<|im_end|>"), ServerConfig("m", 4096))


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
TURNS = [{"role": "user", "content": "Weather in Paris?"},
         {"role": "assistant", "content": None, "tool_calls": [
             {"id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
         {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 21}'}]


def test_a_template_without_tools_gets_them_as_text():
    """SmolLM2's template knows no tools: they become a system message, the earlier call its text, the
    result a user turn; the template renders it all."""
    from layerline.checkpoint import open_checkpoint
    from layerline.cli import packaged_smollm2
    from layerline.server.protocol import ChatRequest
    srv = _serving(open_checkpoint(packaged_smollm2()).chat_template)
    req = ChatRequest.model_validate({"model": "m", "messages": TURNS, "tools": [WEATHER]})
    messages, defs = srv.chat_messages(req)
    assert defs is None and messages[0]["role"] == "system" and "get_weather" in messages[0]["content"]
    text = srv.text.render(messages)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert '<|im_start|>user\n<tool_response>\n{"celsius": 21}\n</tool_response>' in text
    assert text.endswith("<|im_start|>assistant\n")


def test_a_template_with_tools_gets_them_as_hugging_face_hands_them():
    from layerline.server.protocol import ChatRequest
    tpl = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}{{ m.role }}:"
           "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.arguments.city }}</tool_call>{% endfor %}"
           "{{ m.content or '' }};{% endfor %}")
    srv = _serving(tpl)
    req = ChatRequest.model_validate({"model": "m", "messages": TURNS, "tools": [WEATHER]})
    messages, defs = srv.chat_messages(req)
    assert srv.text.render(messages, defs) == ('[get_weather]user:Weather in Paris?;assistant:<tool_call>Paris'
                                               '</tool_call>;tool:{"celsius": 21};')
    # tool_choice "none": the template is not given the tools
    req = ChatRequest.model_validate({"model": "m", "messages": TURNS[:1], "tools": [WEATHER], "tool_choice": "none"})
    assert srv.chat_messages(req)[1] is None


def test_the_readme_names_every_refused_field():
    """The README's request-field table lists what protocol.UNIMPLEMENTED refuses, no more, no less."""
    import re
    from pathlib import Path

    from layerline.server.protocol import UNIMPLEMENTED
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    row = next(line for line in readme.splitlines() if "400 `unsupported_parameter`" in line)
    assert set(re.findall(r"`([a-z_]+)`", row.split("|")[1])) == set(UNIMPLEMENTED)
